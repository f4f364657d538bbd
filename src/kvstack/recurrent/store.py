"""Live recurrent states per request and snapshots beside the prefix cache's blocks.

A linear-attention layer's state at token 3,000 cannot be cut back to token 2,000, so a hybrid
model's prefix hit must end where a snapshot of the state was kept. A snapshot is keyed by the
chained hash of the block it ends (so it names its whole prefix, salt and model included),
lives only while the pool caches that block (the store listens to the pool: eviction drops
it) and under a byte cap (least recently used first). `state_cut` ends a hit at the last
block that has a snapshot whose checksum holds; a hit restores it into the request's live
state before the step runs. With tiers (`tiers.py`), a kept snapshot is written through beside
its block and one missing from memory is looked up there.

Which block boundaries keep one (`SnapshotPolicy`): every `every` blocks; the last boundary
of each prompt; the boundary at or before each of a request's cache breakpoints (`keep_at`);
the last boundary a sequence reached before it finished (a conversation's next turn resumes
there); and the end of the run of blocks the cache already held when a request was admitted
(where prefixes are shared: the next session hits all of it).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstack.kv.block_hash import BlockHash
from kvstack.recurrent.plan import LinearState, RecurrentModel, SequenceStep, StepStates
from kvstack.recurrent.tiers import SnapshotTiers

# `LLMEngine.add_request` keyword: prompt lengths to keep a snapshot at (`StateStore.keep_at`)
SNAPSHOT_OPTION = "snapshot_at"


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...


class _Scheduled(Protocol):
    @property
    def request(self) -> _Request: ...
    @property
    def num_new_tokens(self) -> int: ...


@dataclass(frozen=True)
class SnapshotPolicy:
    block_size: int
    every: int  # blocks between periodic snapshots

    def keeps(self, num_blocks: int, num_prompt_tokens: int, shared_run: int) -> bool:
        """Whether the boundary after `num_blocks` blocks keeps a snapshot."""
        return (num_blocks % self.every == 0 or num_blocks == num_prompt_tokens // self.block_size
                or num_blocks == shared_run)


@dataclass
class Snapshot:
    states: list[LinearState]
    checksum: int
    nbytes: int


def checksum(states: Sequence[LinearState]) -> int:
    crc = 0
    for st in states:
        for t in (st.conv, st.ssm):
            crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def _snapshot(states: Sequence[LinearState]) -> Snapshot:
    return Snapshot(list(states), checksum(states), sum(s.nbytes for s in states))


@dataclass
class _Live:
    position: int  # tokens the states have consumed
    states: list[LinearState]
    shared_run: int = 0  # cached blocks when admitted (a keep boundary)
    last: tuple[BlockHash, Snapshot] | None = None  # its latest boundary, kept at finish


class StateStore:
    """Request id -> live states; block hash -> `Snapshot` (a `BlockListener`)."""

    def __init__(self, model: RecurrentModel, policy: SnapshotPolicy, max_bytes: int,
                 block_hashes: Callable[[str], list[BlockHash]],
                 is_cached: Callable[[BlockHash], bool],
                 tiers: SnapshotTiers | None = None) -> None:
        self.model, self.policy, self.max_bytes = model, policy, max_bytes
        self.tiers = tiers  # where kept snapshots are written through and looked up
        self._block_hashes, self._is_cached = block_hashes, is_cached
        self._live: dict[str, _Live] = {}
        self._snaps: OrderedDict[BlockHash, Snapshot] = OrderedDict()
        self.nbytes = 0
        self.num_bad = 0  # snapshots dropped for a failed checksum
        self._cut: dict[BlockHash, Snapshot] = {}  # where this step's hits resume
        self._points: dict[str, frozenset[int]] = {}  # per request: block counts to keep
        # per scheduled request: (its id, (stop offset, block count, kept by the policy))
        self._pending: list[tuple[str, list[tuple[int, int, bool]]]] = []

    def __len__(self) -> int:
        return len(self._snaps)

    # -- the pool's listener -----------------------------------------------------------------
    def blocks_stored(self, hashes: Sequence[BlockHash]) -> None:
        return None

    def blocks_removed(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._drop(h)

    def _drop(self, h: BlockHash) -> None:
        if (snap := self._snaps.pop(h, None)) is not None:
            self.nbytes -= snap.nbytes

    # -- the KV manager's side ---------------------------------------------------------------
    def state_cut(self, hashes: Sequence[BlockHash], num: int) -> int:
        """The longest n <= num whose block n - 1 has a sound snapshot (0: from scratch);
        one not in memory is looked up in the tiers (the blocks up to it are cached)."""
        for n in range(num, 0, -1):
            snap = self._snaps.get(hashes[n - 1])
            if snap is None and self.tiers is not None and self.tiers.active:
                snap = self._restore(hashes[n - 1])
            if snap is None:
                continue
            if checksum(snap.states) != snap.checksum:
                self._drop(hashes[n - 1])  # a corrupt snapshot is a miss, never a wrong state
                self.num_bad += 1
                continue
            if hashes[n - 1] in self._snaps:
                self._snaps.move_to_end(hashes[n - 1])
            # held until the step ran: another admission's snapshot must not evict it first
            self._cut[hashes[n - 1]] = snap
            return n
        return 0

    def _restore(self, h: BlockHash) -> Snapshot | None:
        assert self.tiers is not None
        found = self.tiers.fetch(h)
        if found is None:
            return None
        states, crc = found
        snap = Snapshot(states, crc, sum(s.nbytes for s in states))
        self._keep(h, snap)
        return snap

    def put(self, h: BlockHash, states: Sequence[LinearState]) -> None:
        """Keep a snapshot taken at the end of block `h` (cached) and write it through."""
        if h in self._snaps or not self._is_cached(h):
            return
        snap = _snapshot(states)
        self._keep(h, snap)
        if self.tiers is not None:
            self.tiers.store(h, snap.states, snap.checksum)

    def _keep(self, h: BlockHash, snap: Snapshot) -> None:
        if snap.nbytes > self.max_bytes:
            return
        while self.nbytes + snap.nbytes > self.max_bytes:
            _, old = self._snaps.popitem(last=False)
            self.nbytes -= old.nbytes
        self._snaps[h] = snap
        self.nbytes += snap.nbytes

    # -- the engine's side -------------------------------------------------------------------
    def before_run(self, scheduled: Sequence[_Scheduled]) -> None:
        """Each scheduled sequence's live states (restored from a snapshot after a hit) and
        the boundaries to snapshot, handed to the model for this step."""
        bs, row = self.policy.block_size, 0
        steps: list[SequenceStep] = []
        self._pending = []
        for s in scheduled:
            r = s.request
            live = self._live_at(r.request_id, r.num_computed_tokens)
            start, n = r.num_computed_tokens, s.num_new_tokens
            crossed = list(range(start // bs + 1, (start + n) // bs + 1))
            points = self._points.get(r.request_id, frozenset())
            stops = [(b * bs - start, b, b in points or self.policy.keeps(
                b, r.num_prompt_tokens, live.shared_run)) for b in crossed]
            # the kept ones, and the last (a sequence's latest boundary, kept at its finish)
            stops = [st for i, st in enumerate(stops) if st[2] or i == len(stops) - 1]
            self._pending.append((r.request_id, stops))
            steps.append(SequenceStep(row, row + n, live.states, [st[0] for st in stops]))
            live.position = start + n
            row += n
        self.model.step_states = StepStates(steps)

    def _live_at(self, request_id: str, position: int) -> _Live:
        live = self._live.get(request_id)
        if live is not None and live.position == position:
            return live
        bs = self.policy.block_size
        hashes = self._block_hashes(request_id)
        shared = 0
        while shared < len(hashes) and self._is_cached(hashes[shared]):
            shared += 1
        if position == 0:
            states = self.model.new_states()
        else:  # admitted with a hit, which `state_cut` ended at a snapshot
            h = hashes[position // bs - 1]
            snap = self._cut.get(h) or self._snaps[h]
            states = [st.clone() for st in snap.states]
        live = self._live[request_id] = _Live(position, states, shared)
        return live

    def after_step(self, scheduled: Sequence[_Scheduled]) -> None:
        """Keep the snapshots the step took at the policy's boundaries (the blocks are
        published by now); remember each sequence's latest boundary."""
        steps = self.model.step_states
        self.model.step_states = None
        self._cut.clear()
        if steps is None:
            return
        for (rid, stops), seq in zip(self._pending, steps.sequences, strict=True):
            live = self._live.get(rid)
            hashes = self._block_hashes(rid)
            for i, (_, block, kept) in enumerate(stops):
                if block > len(hashes):  # not published (no prefix cache)
                    continue
                states = [per_layer[i] for per_layer in seq.taken]
                if kept:
                    self.put(hashes[block - 1], states)
                elif live is not None:
                    live.last = (hashes[block - 1], _snapshot(states))
        self._pending = []

    def keep_at(self, request_id: str, num_tokens: Sequence[int]) -> None:
        """Keep snapshots at the block boundary at or before each of these prompt lengths (a
        client's cache breakpoints: Anthropic `cache_control`), whatever the policy says."""
        blocks = frozenset(n // self.policy.block_size for n in num_tokens
                           if n >= self.policy.block_size)
        if blocks:
            self._points[request_id] = blocks

    def on_finish(self, request_id: str) -> None:
        self._points.pop(request_id, None)
        live = self._live.pop(request_id, None)
        if live is not None and live.last is not None:
            self.put(live.last[0], live.last[1].states)

    def stats(self) -> dict[str, int]:
        return {"state_snapshots": len(self._snaps), "state_snapshot_bytes": self.nbytes}
