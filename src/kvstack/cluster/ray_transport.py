"""The ingress's `Transport` over a Ray Serve `DeploymentHandle` to the engine deployment.

Ray's failures become ours: a dead or unreachable replica (`ActorDiedError` reaches an
in-flight stream within ~0.1 s of the kill) is `ReplicaGoneError`, which the client retries
or reports; a full queue (`max_queued_requests`) is a 429; an error the replica raised on
purpose (a `KvstackError`) arrives as itself, not wrapped in Ray's traceback text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NoReturn

from ray.exceptions import NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from kvstack.cluster.wire import Control, ReplicaGoneError, ReplicaRequest
from kvstack.engine.async_llm import QueueFullError
from kvstack.errors import KvstackError
from kvstack.outputs import RequestOutput

_GONE = (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError)


class HandleTransport:
    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._generate = handle.options(method_name="generate", stream=True)
        self._methods: dict[str, DeploymentHandle] = {}

    async def stream(self, request: ReplicaRequest) -> AsyncIterator[str | RequestOutput]:
        response = self._generate.remote(request)
        finished = False
        try:
            async for item in response:  # type: ignore[union-attr]  # stream=True: a generator
                yield item
            finished = True
        except BaseException as err:  # mapped below or re-raised as is
            _reraise(err)
        finally:
            if not finished:
                response.cancel()  # the replica's generator is cancelled: it aborts there

    async def call(self, method: str, control: Control) -> Any:
        handle = self._methods.get(method)
        if handle is None:
            handle = self._methods[method] = self._handle.options(method_name=method)
        try:
            return await handle.remote(control)
        except BaseException as err:  # mapped below or re-raised as is
            _reraise(err)

    def close(self) -> None:
        return None  # the handle belongs to Serve; nothing to release


def _reraise(err: BaseException) -> NoReturn:
    if isinstance(err, _GONE):
        raise ReplicaGoneError(f"replica unreachable: {type(err).__name__}") from err
    if isinstance(err, BackPressureError):
        raise QueueFullError("every replica's queue is full; retry later") from err
    if isinstance(err, RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, KvstackError):
            raise cause from None
        if isinstance(cause, _GONE):
            raise ReplicaGoneError(f"replica unreachable: {type(cause).__name__}") from err
    raise err
