"""The ingress side of a cluster: an `EngineClient` over many replicas, for the HTTP server.

`ClusterEngine` turns each request into a `ReplicaRequest` carrying the prompt's block keys
(hashed with the engine's own code, salted per tenant, so routing is exact and tenants never
steer by each other's blocks) and streams it from whichever replica the router picks, through
a `Transport` (Ray Serve's handle in production, an in-process one in tests). It also:
- retries once, on another replica, a request whose replica died before any output;
  after the first output the stream ends with `ReplicaLostError` (the API's error event);
- sends `cache_control` pins to the replica that served the prompt (or else holds it);
- keeps the router's view whole: fetches a snapshot from a replica whose batches it missed
  (a fresh ingress, a burst of lost updates), and polls each replica's `EngineStats` for
  /metrics and /v1/cluster.
Routing is only a hint: a replica serves whatever it gets, so no answer depends on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from kvstack.blend.params import BlendError, BlendSpec
from kvstack.cluster.events import BlockKey
from kvstack.cluster.router import request_keys
from kvstack.cluster.stats import cluster_summary, sum_stats
from kvstack.cluster.view import ClusterView
from kvstack.cluster.wire import (
    Control,
    ReplicaGoneError,
    ReplicaInfo,
    ReplicaLostError,
    ReplicaRequest,
)
from kvstack.engine.info import ModelInfo
from kvstack.engine.stats import EngineStats
from kvstack.errors import KvstackError
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams

logger = logging.getLogger("kvstack.cluster")

_SERVED_KEYS = 1 << 16  # block key -> replica that last served a prompt with it (for pins)


class Transport(Protocol):
    """How the ingress reaches replicas. Both raise `ReplicaGoneError` for a dead replica and
    the replica's own `KvstackError` for a refused request."""

    def stream(self, request: ReplicaRequest) -> AsyncIterator[str | RequestOutput]:
        """The serving replica's name, then the request's cumulative outputs."""
        ...

    async def call(self, method: str, control: Control) -> Any:
        """A replica method (`control.target`: that replica only)."""
        ...

    def close(self) -> None: ...


class ClusterEngine:
    def __init__(self, transport: Transport, view: ClusterView, info: ReplicaInfo, *,
                 send_text: bool = False, stats_period_s: float = 1.0,
                 heal_period_s: float = 0.25, call_timeout_s: float = 10.0) -> None:
        self.transport = transport
        self.view = view
        self.replica_info = info
        self.layout = info.layout
        self.send_text = send_text  # text-reading routers (Ray's prefix router) need the prompt
        self.stats_period_s = stats_period_s
        self.heal_period_s = heal_period_s
        self.call_timeout_s = call_timeout_s
        self.num_retries = 0
        self.num_lost_streams = 0
        self.num_snapshot_fetches = 0
        self.started = time.time()
        self._served: OrderedDict[BlockKey, str] = OrderedDict()
        self._stats: dict[str, EngineStats] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(cls, transport: Transport, view: ClusterView,
                      **kwargs: Any) -> ClusterEngine:
        """Ask any replica what it serves, then start the background loops."""
        info: ReplicaInfo = await transport.call("describe", Control())
        view.set_layout(info.layout)
        engine = cls(transport, view, info, **kwargs)
        engine.start()
        return engine

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._every(self.heal_period_s, self.heal)),
                       asyncio.create_task(self._every(self.stats_period_s, self.refresh_stats))]

    # --- EngineClient ----------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self.replica_info.model

    @property
    def tokenizer(self) -> Any:
        return self.replica_info.tokenizer

    @property
    def errored(self) -> bool:
        return False  # Serve replaces dead replicas; a request meanwhile waits in the router

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams,
                       request_id: str, cache_salt: str | None = None,
                       draft_token_ids: Sequence[int] | None = None,
                       blend: BlendSpec | None = None, snapshot_at: Sequence[int] = ()
                       ) -> AsyncIterator[RequestOutput]:
        if blend is not None:
            raise BlendError("blending is not available with --replicas yet; send the "
                             "documents without blend")
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        keys = tuple(request_keys(ids, self.layout, cache_salt))
        text = self.tokenizer.decode(ids) if self.send_text and self.tokenizer else None
        request = ReplicaRequest(request_id, ids, sampling_params, cache_salt, keys,
                                 list(draft_token_ids) if draft_token_ids else None, text,
                                 snapshot_at=tuple(snapshot_at))
        for attempt in (0, 1):
            replica: str | None = None
            sent = False
            try:
                async for item in self.transport.stream(request):
                    if isinstance(item, str):
                        replica = item
                        continue
                    if not sent and replica is not None:
                        self.view.outcome(request_id, replica, item.num_cached_tokens)
                        self._remember(keys, replica)
                    sent = True
                    yield dataclasses.replace(item, prompt_token_ids=ids)
                return
            except ReplicaGoneError as err:
                lost = replica or err.replica or self.view.routed_to(request_id)
                if sent or attempt:
                    self.num_lost_streams += 1
                    raise ReplicaLostError(f"replica {lost or '?'} died while serving this "
                                           "request; retry it") from err
                self.num_retries += 1
                logger.warning("replica %s died before answering %s; retrying elsewhere",
                               lost, request_id)
                request = dataclasses.replace(request, exclude=(lost,) if lost else ())

    async def abort(self, request_id: str) -> None:
        return None  # leaving `generate` cancels the replica's stream, which aborts there

    async def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None,
                         ttl_s: float) -> tuple[int, int]:
        keys = request_keys(list(token_ids), self.layout, cache_salt)
        target = self._home(keys) or self.view.holder(keys)
        if target is None:
            return 0, 0  # nobody holds a full block of it
        try:
            return await self._call("pin_prefix", Control(target, (list(token_ids), cache_salt,
                                                                   ttl_s)))
        except (ReplicaGoneError, KvstackError, TimeoutError):
            return 0, 0

    def stats(self) -> EngineStats:
        return sum_stats(list(self._stats.values()))

    def replica_stats(self) -> dict[str, EngineStats]:
        live = set(self.view.replicas)
        return {name: s for name, s in self._stats.items() if name in live}

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self.transport.close()

    # --- the view's upkeep -----------------------------------------------------------------

    async def heal(self) -> None:
        """Fetch a snapshot for every replica whose batches the view missed."""
        for name in self.view.needs_snapshot():
            with contextlib.suppress(ReplicaGoneError, KvstackError, TimeoutError):
                snapshot = await self._call("snapshot", Control(name))
                self.view.apply_snapshot(name, snapshot)
                self.num_snapshot_fetches += 1

    async def refresh_stats(self) -> None:
        names = self.view.replicas
        results = await asyncio.gather(*(self._call("stats", Control(n)) for n in names),
                                       return_exceptions=True)
        fresh = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, EngineStats)}
        self._stats = {n: s for n, s in (self._stats | fresh).items() if n in set(names)}

    def describe_cluster(self) -> dict[str, Any]:
        """The JSON of GET /v1/cluster."""
        header = {"model": self.info.name, "fingerprint": self.layout.fingerprint,
                  "block_size": self.layout.block_size, "kv_cache_dtype": self.layout.kv_dtype}
        ingress = {"retries": self.num_retries, "lost_streams": self.num_lost_streams,
                   "snapshot_fetches": self.num_snapshot_fetches,
                   "uptime_s": time.time() - self.started}
        return cluster_summary(header, self.view.summary(), self.replica_stats(), ingress)

    async def _call(self, method: str, control: Control) -> Any:
        return await asyncio.wait_for(self.transport.call(method, control), self.call_timeout_s)

    async def _every(self, period_s: float, job: Any) -> None:
        while True:
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:  # upkeep must outlive any one failure
                logger.exception("cluster upkeep (%s) failed", getattr(job, "__name__", job))
            await asyncio.sleep(period_s)

    # --- where prompts were served ---------------------------------------------------------

    def _remember(self, keys: Sequence[BlockKey], replica: str) -> None:
        for key in keys:
            self._served[key] = replica
            self._served.move_to_end(key)
        while len(self._served) > _SERVED_KEYS:
            self._served.popitem(last=False)

    def _home(self, keys: Sequence[BlockKey]) -> str | None:
        """The live replica that last served a prompt holding this prefix's deepest block."""
        live = set(self.view.replicas)
        for key in reversed(keys):
            replica = self._served.get(key)
            if replica is not None:
                return replica if replica in live else None
        return None
