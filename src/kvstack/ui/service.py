"""One app's live view: a ticker that reads the engine once per interval and fans the result
out to every open page over server-sent events.

Cost to the engine does not grow with the pages open: each tick takes `EngineStats` (always,
for the charts' history) and, only while a page is open, one `KVSnapshot` (a few plain copies
under the engine lock). Text decoding, the prefix tree, redaction and JSON happen once per
tick per distinct viewer, off the engine lock and off the event loop, and a page is sent the
pool map and the tree only when they changed since it last got them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from kvstack.engine.async_llm import AsyncLLM
from kvstack.engine.stats import EngineStats
from kvstack.kv.snapshot import KVSnapshot
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.ui.access import Viewer
from kvstack.ui.history import History, LatencyWindow, SemanticCounts
from kvstack.ui.views import TextCache, render

MIN_TICK_GAP_S = 0.2  # a page that connects gets its first snapshot early, but not faster


class OutputStream(Protocol):
    """A running request as the server hands it out (`server.generation.Generation`)."""

    @property
    def finished(self) -> bool: ...

    async def next(self) -> RequestOutput: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class UiHost:
    """What the server lends the view. The view never imports the server: it gets these."""

    engine: AsyncLLM
    model_name: str
    auth_required: bool  # the server has API keys (or an admin key)
    authorize: Callable[[Request], Viewer | None]  # None: no valid key presented
    labels: Mapping[str | None, str]  # cache salt -> tenant label, for the admin's view
    # (prompt ids, sampling params, request id, cache salt) -> a running request
    start: Callable[[list[int], SamplingParams, str, str | None], OutputStream]
    # (asked, prompt length, chat: refused in chat's words, else a completion's) -> allowed
    max_tokens: Callable[[int | None, int, bool], int | None]
    semantic_counts: Callable[[], SemanticCounts | None] = lambda: None


@dataclass
class Frame:
    """One tick: the stats, the history point and each subscribed viewer's JSON."""

    seq: int
    taken_at: float
    stats: EngineStats
    point: dict[str, Any]
    renders: dict[Viewer, tuple[str, str]] = field(default_factory=dict)  # pool, tree JSON
    head: str = ""  # the tick event's fields every page gets, as JSON

    def __post_init__(self) -> None:
        self.head = (f'"seq":{self.seq},"point":{_dumps(self.point)},'
                     f'"totals":{_dumps(_totals(self.stats))}')


def sse(event: str, payload: str) -> str:
    """One server-sent event whose data is already JSON (one line: json never breaks one)."""
    return f"event: {event}\ndata: {payload}\n\n"


class UiService:
    def __init__(self, host: UiHost, interval_s: float = 1.0) -> None:
        self.host = host
        self.interval_s = interval_s
        self.history = History(max_points=int(600 / interval_s))
        self.latency = LatencyWindow()
        tokenizer = host.engine.tokenizer
        self.texts = TextCache(lambda ids: tokenizer.decode(list(ids),
                                                            skip_special_tokens=False))
        self._viewers: Counter[Viewer] = Counter()
        self._frame: Frame | None = None
        self._cond: asyncio.Condition | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.num_snapshots = 0  # engine snapshots taken (the engine-side cost)
        self._last: tuple[KVSnapshot | None, dict[Viewer, tuple[str, str]]] = (None, {})

    # -- the ticker ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Tick until closed (the app's lifespan runs this as a task)."""
        self._loop = asyncio.get_running_loop()
        self._cond = asyncio.Condition()
        self._wake = asyncio.Event()
        while not self.closed:
            started = time.monotonic()
            await self._tick()
            self._wake.clear()
            rest = max(self.interval_s - (time.monotonic() - started), MIN_TICK_GAP_S)
            try:
                await asyncio.wait_for(self._wake.wait(), rest)
                await asyncio.sleep(MIN_TICK_GAP_S)
            except TimeoutError:
                pass

    async def _tick(self) -> None:
        viewers = list(self._viewers)
        stats, renders = await asyncio.to_thread(self._read, viewers)
        now = time.time()
        point = self.history.add(now, stats, self.host.semantic_counts(),
                                 self.latency.percentiles(now))
        last = self._frame
        if last is not None:  # unchanged JSON keeps its object: pages compare by identity
            for viewer, (pool, tree) in renders.items():
                old = last.renders.get(viewer)
                if old is not None:
                    renders[viewer] = (old[0] if old[0] == pool else pool,
                                       old[1] if old[1] == tree else tree)
        self._frame = Frame((last.seq if last else 0) + 1, now, stats, point, renders)
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    def _read(self, viewers: list[Viewer]) -> tuple[EngineStats, dict[Viewer, tuple[str, str]]]:
        """Worker thread: the engine's stats, and a snapshot only when someone looks."""
        engine = self.host.engine
        if not viewers:
            return engine.stats(), {}
        stats, snap = engine.stats_and_snapshot()
        self.num_snapshots += 1
        last_snap, last_renders = self._last
        if last_snap is None or snap is None or not same_content(snap, last_snap):
            last_renders = {}  # an idle pool is not rendered again
        renders = {v: last_renders.get(v) or self._render(snap, v) for v in viewers}
        self._last = (snap, renders)
        return stats, renders

    def _render(self, snap: KVSnapshot | None, viewer: Viewer) -> tuple[str, str]:
        if snap is None:
            return "null", "[]"
        pool, tree = render(snap, viewer, self.texts, self.host.labels)
        return _dumps(pool), _dumps(tree)

    def observe(self, out: RequestOutput) -> None:
        """A request finished (the server's metrics call this): its TTFT and TPOT."""
        self.latency.observe(out, time.time())

    def close(self) -> None:
        """End every event stream and the ticker (on the event loop's thread)."""
        self.closed = True
        if self._cond is not None and self._wake is not None:
            self._wake.set()
            asyncio.ensure_future(self._notify())

    def close_threadsafe(self) -> None:
        """`close` from another thread or a signal handler (a server shutting down: open
        pages would otherwise hold a graceful shutdown for ever)."""
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    async def _notify(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    # -- pages ------------------------------------------------------------------------------

    def hello(self, viewer: Viewer) -> dict[str, Any]:
        info = self.host.engine.info
        return {"viewer": viewer.public(), "model": self.host.model_name,
                "block_size": info.block_size, "num_blocks": info.num_kv_blocks,
                "interval_s": self.interval_s, "history": list(self.history.points)}

    async def events(self, viewer: Viewer) -> AsyncIterator[str]:
        """The page's event stream: `hello` (settings and the history so far), then one
        `tick` per interval with the new history point, and the pool map and prefix tree
        whenever they changed."""
        self._viewers[viewer] += 1
        if self._wake is not None:
            self._wake.set()  # a first snapshot now rather than at the next tick
        try:
            yield sse("hello", _dumps(self.hello(viewer)))
            seen, sent_pool, sent_tree = 0, None, None
            while not self.closed:
                frame = await self._next_frame(seen)
                if frame is None:
                    break
                seen = frame.seq
                parts = [frame.head]
                pool, tree = frame.renders.get(viewer, (None, None))
                if pool is not None and pool is not sent_pool:
                    parts.append(f'"pool":{pool}')
                    sent_pool = pool
                if tree is not None and tree is not sent_tree:
                    parts.append(f'"tree":{tree}')
                    sent_tree = tree
                yield sse("tick", "{" + ",".join(parts) + "}")
        finally:
            self._viewers[viewer] -= 1
            if self._viewers[viewer] <= 0:
                del self._viewers[viewer]

    async def _next_frame(self, seen: int) -> Frame | None:
        assert self._cond is not None, "the ticker is not running (app lifespan not started)"
        async with self._cond:
            await self._cond.wait_for(lambda: self.closed or (
                self._frame is not None and self._frame.seq > seen))
        return None if self.closed else self._frame

    async def state(self, viewer: Viewer) -> dict[str, Any]:
        """One picture now, for scripts and tests: stats, pool map and prefix tree."""
        stats, snap = await asyncio.to_thread(self.host.engine.stats_and_snapshot)
        pool, tree = await asyncio.to_thread(self._render, snap, viewer)
        return {"viewer": viewer.public(), "totals": _totals(stats), "pool": json.loads(pool),
                "tree": json.loads(tree)}


def same_content(a: KVSnapshot, b: KVSnapshot) -> bool:
    """Whether two snapshots would draw the same (published records are shared objects, so
    identity stands for equality there)."""
    return (a.states == b.states and a.holders == b.holders and a.uses == b.uses
            and a.tiers == b.tiers and a.request_salts == b.request_salts
            and a.published.keys() == b.published.keys()
            and all(block is b.published[i] for i, block in a.published.items()))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _totals(s: EngineStats) -> dict[str, Any]:
    """Counters since start, and the pool's counts as `EngineStats` reports them."""
    return {
        "requests_running": s.num_requests_running, "requests_waiting": s.num_requests_waiting,
        "prompt_tokens": s.num_prompt_tokens, "generation_tokens": s.num_generation_tokens,
        "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4),
        "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
        "tier_hit_tokens": s.tier_hit_tokens, "preemptions": s.num_preemptions,
        "draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens,
        "blocks": {"total": s.num_blocks_total, "free": s.num_blocks_free - s.num_blocks_cached,
                   "in_use": s.num_blocks_used - s.num_blocks_pinned,
                   "cached": s.num_blocks_cached, "pinned": s.num_blocks_pinned},
        "tiers": {t.name: {"hits": t.hits, "misses": t.misses, "stores": t.stores}
                  for t in s.tiers},
    }
