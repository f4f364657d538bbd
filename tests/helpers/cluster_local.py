"""Ray Serve's part of a cluster, in process: engine replicas called directly, routed by the
same `ClusterView` the Ray request router uses, with replicas that can be killed.

Before each decision the transport polls every live replica's routing stats into the view, as
Ray's controller does every `request_routing_stats_period_s` (here: at once). A killed replica
leaves the view and every stream it was serving raises `ReplicaGoneError` at once, as Ray
raises `ActorDiedError` into an in-flight stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvstack.cluster.replica import EngineReplica
from kvstack.cluster.view import ClusterView
from kvstack.cluster.wire import Control, ReplicaGoneError, ReplicaRequest
from kvstack.outputs import RequestOutput


class LocalTransport:
    def __init__(self, replicas: dict[str, EngineReplica], view: ClusterView) -> None:
        self.replicas = replicas
        self.view = view
        self.live = set(replicas)
        self.routed: list[str] = []  # the replica each stream went to, in order
        self.publish = True  # False: replicas are polled but their reports never arrive
        self._dead: dict[str, asyncio.Event] = {}

    def poll(self) -> None:
        reports = {n: self.replicas[n].routing_stats() for n in sorted(self.live)}
        if self.publish:
            self.view.update(reports)

    def kill(self, name: str) -> None:
        self.live.discard(name)
        self.view.remove(name)
        self._dead.setdefault(name, asyncio.Event()).set()

    async def stream(self, request: ReplicaRequest) -> AsyncIterator[str | RequestOutput]:
        self.poll()
        ranks = self.view.choose(request, sorted(self.live))
        name = ranks[0][0]
        self.view.routed(request, name)
        self.routed.append(name)
        dead = self._dead.setdefault(name, asyncio.Event())
        items = self.replicas[name].generate(request).__aiter__()
        try:
            while True:
                step = asyncio.ensure_future(items.__anext__())
                died = asyncio.ensure_future(dead.wait())
                done, _ = await asyncio.wait({step, died}, return_when=asyncio.FIRST_COMPLETED)
                died.cancel()
                if step not in done:
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    raise ReplicaGoneError(f"replica {name} died", name)
                try:
                    yield step.result()
                except StopAsyncIteration:
                    return
        finally:
            await items.aclose()

    async def call(self, method: str, control: Control) -> Any:
        target = control.target if control.target in self.live else sorted(self.live)[0]
        result = getattr(self.replicas[target], method)(control)
        return await result if asyncio.iscoroutine(result) else result

    def close(self) -> None:
        return None
