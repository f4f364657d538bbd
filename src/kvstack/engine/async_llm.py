"""An asyncio front end: the engine steps in its own thread so the event loop stays free.

`generate(...)` yields a request's cumulative outputs as tokens arrive; leaving the
iterator early (client gone, `break`, cancellation) aborts the request and frees its blocks.

The engine thread runs steps back to back and hands each step's outputs to an event loop in
one call (one wake-up per step, however many requests gained tokens). Each request has a
mailbox, not a queue: outputs are cumulative, so a reader that falls a step behind reads only
the newest one (its text and tokens include the unread ones) and sends one event for both,
instead of the loop's backlog growing while it competes with the engine for the CPU.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from kvstack.blend.params import BlendSpec
from kvstack.engine.core import LLMEngine
from kvstack.engine.embedding import embed
from kvstack.engine.info import ModelInfo
from kvstack.engine.stats import EngineStats
from kvstack.errors import KvstackError
from kvstack.kernels.openmp import release_pool
from kvstack.kv.snapshot import KVSnapshot
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams


class EngineDeadError(KvstackError):
    """The engine thread failed; the server should be restarted."""

    http_status = 503
    error_type = "api_error"


class QueueFullError(KvstackError):
    """Too many requests are waiting; retry later."""

    http_status = 429
    error_type = "rate_limit_error"


class FairLock:
    """A first-come, first-served lock.

    The engine thread takes the lock again right after every step; with a plain Lock a caller
    woken by the release rarely gets there first, so `generate`, `abort` or `stats` could
    wait for as long as the engine stays busy. Tickets hand the lock over in arrival order.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()  # tickets whose holder was interrupted while waiting

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            try:
                self._cond.wait_for(lambda: self._serving == ticket)
            except BaseException:  # e.g. Ctrl-C: give the turn up, or later callers hang
                if self._serving == ticket:
                    self._serving += 1
                else:
                    self._abandoned.add(ticket)
                self._hand_over()
                raise

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._hand_over()

    def _hand_over(self) -> None:
        while self._serving in self._abandoned:
            self._abandoned.remove(self._serving)
            self._serving += 1
        self._cond.notify_all()


class _Mailbox:
    """One request's outputs on their way from the engine thread to its event loop.

    The engine thread appends (a deque's append and popleft are atomic) and then wakes the
    loop; the reader takes the newest item and drops the older ones, which it supersedes. A
    finished output or an error is always the last item, so it is never dropped.
    """

    __slots__ = ("loop", "items", "ready")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[RequestOutput | BaseException] = deque()
        self.ready = asyncio.Event()  # set in the loop's thread only

    def newest(self) -> RequestOutput | BaseException | None:
        """The newest item, or None if the reader already took it."""
        item = None
        while self.items:
            item = self.items.popleft()
        return item


def _wake(boxes: list[_Mailbox]) -> None:
    """In the loop's thread: tell the readers of `boxes` that output arrived."""
    for box in boxes:
        box.ready.set()


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._lock = FairLock()  # guards every touch of `engine`
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, _Mailbox] = {}
        self._error: BaseException | None = None
        # Only the engine thread should keep OpenMP workers: the thread that built the model
        # hands its pool back, or every parallel region of a step pays a futex wake-up.
        release_pool()
        self._thread = threading.Thread(target=self._loop, name="kvstack-engine", daemon=True)
        self._thread.start()

    # -- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished()
                try:
                    outputs = self.engine.step() if busy else []
                except BaseException as err:  # every stream must hear of it
                    self._fail(err)
                    return
                self._deliver((out.request_id, out, out.finished) for out in outputs)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _deliver(self, items: Iterable[tuple[str, RequestOutput | BaseException, bool]]
                 ) -> None:
        """Post each (request id, item, last) to its mailbox, then wake each loop once."""
        woken: dict[asyncio.AbstractEventLoop, list[_Mailbox]] = {}
        for request_id, item, last in items:
            box = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
            if box is not None:
                box.items.append(item)
                woken.setdefault(box.loop, []).append(box)
        for loop, boxes in woken.items():
            try:
                loop.call_soon_threadsafe(_wake, boxes)
            except RuntimeError:  # the loop is closed: nobody is left to read its streams
                for request_id in [r for r, box in self._streams.items() if box.loop is loop]:
                    del self._streams[request_id]

    def _fail(self, err: BaseException) -> None:
        self._error = err
        dead = EngineDeadError(f"engine failed: {err!r}; restart the server")
        self._deliver((request_id, dead, True) for request_id in list(self._streams))

    # -- public API --------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        draft_token_ids: Sequence[int] | None = None,
        blend: BlendSpec | None = None,
        snapshot_at: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (validation errors raise here) and stream its outputs: each is
        cumulative, and one the reader was too slow to take is folded into the next."""
        box = _Mailbox(asyncio.get_running_loop())
        await asyncio.to_thread(self._add, prompt, sampling_params, request_id, cache_salt,
                                draft_token_ids, box, blend, snapshot_at)
        finished = False
        try:
            while not finished:
                await box.ready.wait()
                box.ready.clear()
                item = box.newest()
                if item is None:  # taken already, with an earlier wake-up
                    continue
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                await self.abort(request_id)

    def _add(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        cache_salt: str | None,
        draft_token_ids: Sequence[int] | None,
        box: _Mailbox,
        blend: BlendSpec | None = None,
        snapshot_at: Sequence[int] = (),
    ) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}; restart the server")
        with self._lock:
            if self.max_waiting is not None and self.engine.num_waiting() >= self.max_waiting:
                raise QueueFullError(
                    f"{self.max_waiting} requests are already waiting; retry later"
                )
            self.engine.add_request(prompt, sampling_params, request_id=request_id,
                                    cache_salt=cache_salt, draft_token_ids=draft_token_ids,
                                    blend=blend,
                                    **({"snapshot_at": list(snapshot_at)} if snapshot_at else {}))
            self._streams[request_id] = box
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks now."""
        await asyncio.to_thread(self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    async def pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, ttl_s: float
    ) -> tuple[int, int]:
        """`LLMEngine.pin_prefix` under the engine lock."""
        return await asyncio.to_thread(self._pin_prefix, token_ids, cache_salt, ttl_s)

    def _pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, ttl_s: float
    ) -> tuple[int, int]:
        with self._lock:
            return self.engine.pin_prefix(token_ids, cache_salt, ttl_s)

    async def embed(self, token_ids: Sequence[int]) -> list[float]:
        """`engine/embedding.py` `embed` of one sequence, run between steps under the engine
        lock (the model's kernels are not run from two threads at once)."""
        return await asyncio.to_thread(self._embed, token_ids)

    def _embed(self, token_ids: Sequence[int]) -> list[float]:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}; restart the server")
        with self._lock:
            try:
                return embed(self.engine.model, token_ids).tolist()
            finally:
                release_pool()  # this pool thread ran torch: keep the engine thread's pool alone

    @property
    def info(self) -> ModelInfo:
        """The model this engine serves (a frozen value: no lock needed)."""
        return self.engine.info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (transformers'), or None for a token-ids-only engine."""
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        """True once the engine thread has failed; every request then gets EngineDeadError."""
        return self._error is not None

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def cache_snapshot(self) -> KVSnapshot | None:
        """`LLMEngine.cache_snapshot` under the engine lock (blocking: call it off the event
        loop)."""
        with self._lock:
            return self.engine.cache_snapshot()

    def stats_and_snapshot(self) -> tuple[EngineStats, KVSnapshot | None]:
        """Stats and a snapshot of the same moment, in one turn of the engine lock (one
        hand-over instead of two). The live view takes this once a tick while pages are
        open, however many they are."""
        with self._lock:
            return self.engine.stats(), self.engine.cache_snapshot()

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self.engine.requests)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
