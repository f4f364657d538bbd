"""One engine request as the HTTP layer sees it: started, read, and always cleaned up.

`OutputStream` is what a response is written from: `Generation` (a model run) or a semantic
cache `Replay`; both hand out cumulative outputs until one is finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import Request

from kvstack.blend.params import BlendSpec
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.server.engine_client import EngineClient
from kvstack.server.errors import ClientGoneError
from kvstack.server.metrics import ServerMetrics

T = TypeVar("T")

# The event loop keeps only weak references to tasks; a pump must live until its abort is done.
_pumps: set[asyncio.Task[None]] = set()


class OutputStream(Protocol):
    @property
    def finished(self) -> bool: ...

    async def next(self) -> RequestOutput:
        """The next cumulative output; raises the request's error."""
        ...

    def close(self) -> None:
        """Stop (abort a model run) unless finished; safe to call more than once."""
        ...


async def final_output(stream: OutputStream, first: RequestOutput | None = None
                       ) -> RequestOutput:
    """Read `stream` to its finished output (`first`: one already read)."""
    out = first
    while out is None or not out.finished:
        out = await stream.next()
    return out


class Generation:
    """Drives an engine's `generate` (`EngineClient`: local or a cluster) in a task of its own.

    The HTTP side may stop reading at any point (client gone, response cancelled); `close()`
    then cancels that task, and the engine front end aborts the request and frees its blocks.
    A task of its own matters: Starlette cancels a streaming response through an anyio cancel
    scope, which would cancel an abort awaited inside that scope as well.
    """

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        cache_salt: str | None,
        draft_token_ids: Sequence[int] | None = None,
        blend: BlendSpec | None = None,
        snapshot_at: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._metrics = metrics
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(list(prompt_token_ids), sampling_params,
                                                    cache_salt, draft_token_ids, blend,
                                                    snapshot_at))
        _pumps.add(self._task)
        self._task.add_done_callback(_pumps.discard)

    async def _pump(self, prompt: list[int], sampling_params: SamplingParams,
                    cache_salt: str | None, draft_token_ids: Sequence[int] | None,
                    blend: BlendSpec | None, snapshot_at: Sequence[int]) -> None:
        try:
            async for out in self._engine.generate(prompt, sampling_params, self.request_id,
                                                   cache_salt, draft_token_ids, blend,
                                                   snapshot_at):
                self._queue.put_nowait(out)
        except asyncio.CancelledError:
            # Cancelled while the request was still being queued: make sure it goes too.
            await self._engine.abort(self.request_id)
            raise
        except Exception as err:  # handed to the reader, who raises it
            self._queue.put_nowait(err)

    async def next(self) -> RequestOutput:
        """The newest cumulative output; raises the request's error (a KvstackError).

        Outputs that queued up while the response was writing are folded into the newest
        (each includes the ones before it): one event for them, not one each behind the
        engine."""
        item = await self._queue.get()
        while not self._queue.empty() and not _is_last(item):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            self._metrics.observe(item)
        return item

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._metrics.observe_abort()
        if not self._task.done():
            self._task.cancel()


def _is_last(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, BaseException) or item.finished


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or raise ClientGoneError (cancelling it) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise ClientGoneError(f"the client left before {request.url.path} was answered")


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
