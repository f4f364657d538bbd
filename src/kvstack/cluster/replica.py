"""One engine replica, without Ray: the engine, what it publishes about its cache, its load.

`EngineReplica` wraps an `AsyncLLM` (engine steps in their own thread, so the replica's event
loop keeps answering health checks and stats polls during a long prefill) and adds:
- `PublishedResidency`, a block listener on the engine's pool: the step thread records each
  hash published or evicted (as a 64-bit key); the event loop drains them into numbered
  `BlockEvents` batches for the routing stats (the last few ride along in every report, so a
  router that missed some catches up) and answers snapshots;
- its load as the router scores it: prefill tokens queued (prompt minus what the replica holds
  of it when the request arrives) and requests queued or running.
The Ray deployment (`deployments.py`) is a thin shell around this class; tests drive it as is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from kvstack.cluster.events import BlockEvents, BlockKey, Snapshot, block_keys
from kvstack.cluster.residency import ResidencyLog
from kvstack.cluster.router import LoadReport
from kvstack.cluster.scoring import Layout, cacheable_blocks
from kvstack.cluster.wire import (
    Control,
    ReplicaInfo,
    ReplicaRequest,
    WrongReplicaError,
    encode_report,
)
from kvstack.engine.async_llm import AsyncLLM, EngineDeadError
from kvstack.engine.llm import LLM
from kvstack.engine.stats import EngineStats
from kvstack.kv.block_hash import BlockHash
from kvstack.outputs import RequestOutput

KEEP_BATCHES = 16  # batches repeated in every report: ~1.6 s of history at a 0.1 s poll


class PublishedResidency:
    """A `BlockListener`: the engine thread records, the replica's event loop publishes."""

    def __init__(self, keep_batches: int = KEEP_BATCHES) -> None:
        self._lock = threading.Lock()
        self._log = ResidencyLog()
        self._recent: deque[BlockEvents] = deque(maxlen=keep_batches)

    @property
    def epoch(self) -> str:
        return self._log.epoch

    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None:
        keys = block_keys(hashes)
        with self._lock:
            self._log.stored(keys)

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        keys = block_keys(hashes)
        with self._lock:
            self._log.removed(keys)

    def publish(self) -> tuple[BlockEvents, ...]:
        """Close the pending changes into the next batch; the last few batches, oldest first."""
        with self._lock:
            batch = self._log.drain()
            if batch is not None:
                self._recent.append(batch)
            return tuple(self._recent)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._log.snapshot()

    def held_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Leading `keys` resident here now."""
        with self._lock:
            resident = self._log.resident
            n = 0
            for key in keys:
                if key not in resident:
                    break
                n += 1
            return n


class _Load:
    """Requests on this replica: prefill still to compute (queued) or decoding (running)."""

    def __init__(self) -> None:
        self.queued: dict[str, int] = {}  # request id -> prefill tokens it still needs
        self.running: set[str] = set()

    def report(self) -> LoadReport:
        return LoadReport(float(sum(self.queued.values())), len(self.queued), len(self.running),
                          time.time())

    def arrived(self, request_id: str, prefill_tokens: int) -> None:
        self.queued[request_id] = prefill_tokens

    def started(self, request_id: str) -> None:
        if self.queued.pop(request_id, None) is not None:
            self.running.add(request_id)

    def left(self, request_id: str) -> None:
        self.queued.pop(request_id, None)
        self.running.discard(request_id)


class EngineReplica:
    def __init__(self, name: str, llm_kwargs: dict[str, Any], max_waiting: int | None = None,
                 keep_batches: int = KEEP_BATCHES) -> None:
        self.name = name
        llm = LLM(**llm_kwargs)
        self.residency = PublishedResidency(keep_batches)
        llm.engine.add_block_listener(self.residency)  # before any step: nothing is missed
        self.engine = AsyncLLM(llm.engine, max_waiting)
        info = self.engine.info
        self.layout = Layout(info.fingerprint, info.block_size, info.kv_cache_dtype)
        self.load = _Load()

    def describe(self, control: Control | None = None) -> ReplicaInfo:
        self._check_target(control)
        return ReplicaInfo(self.name, self.engine.info, self.engine.tokenizer, self.layout)

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[str | RequestOutput]:
        """Yields this replica's name, then the request's cumulative outputs (without the
        prompt's token ids: the ingress has them)."""
        bs = self.layout.block_size
        held = min(self.residency.held_prefix(request.keys),
                   cacheable_blocks(request.num_prompt_tokens, bs))
        rid = request.request_id
        self.load.arrived(rid, request.num_prompt_tokens - held * bs)
        yield self.name
        try:
            started = False
            async for out in self.engine.generate(request.prompt_token_ids,
                                                  request.sampling_params, rid,
                                                  request.cache_salt, request.draft_token_ids,
                                                  snapshot_at=request.snapshot_at):
                if not started:
                    started = True
                    self.load.started(rid)
                yield replace(out, prompt_token_ids=[], prompt=None)
        finally:
            self.load.left(rid)

    async def pin_prefix(self, control: Control) -> tuple[int, int]:
        self._check_target(control)
        token_ids, cache_salt, ttl_s = control.args
        return await self.engine.pin_prefix(token_ids, cache_salt, ttl_s)

    def routing_stats(self) -> dict[str, Any]:
        return encode_report(self.residency.epoch, self.layout, self.engine.info.num_kv_blocks,
                             self.residency.publish(), self.load.report())

    def snapshot(self, control: Control | None = None) -> Snapshot:
        self._check_target(control)
        return self.residency.snapshot()

    async def stats(self, control: Control | None = None) -> EngineStats:
        """The engine's counters (off the event loop: they wait for the current step)."""
        self._check_target(control)
        return await asyncio.to_thread(self.engine.stats)

    def check_health(self) -> None:
        if self.engine.errored:
            raise EngineDeadError(f"replica {self.name}: the engine thread failed")

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.engine.engine.close()

    def _check_target(self, control: Control | None) -> None:
        if control is not None and control.target not in (None, self.name):
            raise WrongReplicaError(f"call meant for replica {control.target} reached "
                                    f"{self.name}; that replica is gone")
