"""Pinned prefix blocks: cached blocks held by a deadline instead of by a request.

Contracts:
- A pinned block holds exactly one extra reference in the pool, however often it is pinned,
  so LRU eviction and `reset_prefix_cache` pass it by; `check_integrity` stays true.
- A pin lapses at its deadline (on `expire`), when more than `max_blocks` blocks are pinned
  (least recently refreshed first), or when the pool must hand out blocks it no longer has
  (`release`): a pin never makes a request wait or be preempted.
- Lapsing drops the extra reference only; the block stays cached until the LRU evicts it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockPool, KVBlock


@dataclass
class _Pin:
    block: KVBlock
    until: float


class PinRegistry:
    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self._pins: OrderedDict[BlockHash, _Pin] = OrderedDict()  # least recently refreshed first
        self._next_deadline = float("inf")

    def __len__(self) -> int:
        return len(self._pins)

    def block_ids(self) -> set[int]:
        """Ids of the pinned blocks."""
        return {pin.block.block_id for pin in self._pins.values()}

    def pin(self, block_hashes: Sequence[BlockHash], until: float) -> tuple[int, int]:
        """Pin the cached chain `block_hashes` names, up to its first block not in the cache.

        A block already pinned keeps the later of its two deadlines. Returns how many blocks
        are now pinned that were not before, and how many were pinned already.
        """
        chain: list[tuple[BlockHash, KVBlock]] = []
        for block_hash in block_hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            chain.append((block_hash, block))
        new: list[BlockHash] = []
        num_refreshed = 0
        # Tail first: the head ends up most recently refreshed, so over the cap tails lapse first.
        for block_hash, block in reversed(chain):
            pin = self._pins.get(block_hash)
            if pin is None:
                self.pool.touch([block])
                self._pins[block_hash] = _Pin(block, until)
                new.append(block_hash)
            else:
                pin.until = max(pin.until, until)
                self._pins.move_to_end(block_hash)
                num_refreshed += 1
        self._next_deadline = min(self._next_deadline, until)
        while len(self._pins) > self.max_blocks:
            self._lapse(next(iter(self._pins)))
        return sum(1 for h in new if h in self._pins), num_refreshed

    def unpin(self, block_hashes: Sequence[BlockHash]) -> int:
        """Lapse the pins on these blocks now; returns how many were pinned."""
        found = [h for h in block_hashes if h in self._pins]
        for block_hash in found:
            self._lapse(block_hash)
        return len(found)

    def expire(self, now: float) -> int:
        """Lapse every pin whose deadline has passed; returns how many lapsed."""
        if now < self._next_deadline:
            return 0
        due = [h for h, pin in self._pins.items() if pin.until <= now]
        for block_hash in due:
            self._lapse(block_hash)
        self._next_deadline = min((p.until for p in self._pins.values()), default=float("inf"))
        return len(due)

    def release(self, num_blocks: int, keep: Collection[KVBlock] = ()) -> bool:
        """Return `num_blocks` blocks to the free queue by lapsing the oldest pins that alone
        hold a block not in `keep`; all or nothing, so no pin is lost in vain."""
        kept = {id(b) for b in keep}
        due = [h for h, pin in self._pins.items()
               if pin.block.ref_cnt == 1 and id(pin.block) not in kept][:num_blocks]
        if len(due) < num_blocks:
            return False
        for block_hash in due:
            self._lapse(block_hash)
        return True

    def _lapse(self, block_hash: BlockHash) -> None:
        pin = self._pins.pop(block_hash)
        self.pool.free([pin.block])

    def held_counts(self) -> dict[int, int]:
        """Block id -> references the pins hold on it (one per pinned block)."""
        return {pin.block.block_id: 1 for pin in self._pins.values()}

    def check_integrity(self) -> None:
        """Every pinned block is referenced and still carries the hash it was pinned under."""
        for block_hash, pin in self._pins.items():
            assert pin.block.ref_cnt >= 1, "pinned block without a reference"
            assert pin.block.block_hash == block_hash, "pinned block lost its hash"
        assert len(self._pins) <= self.max_blocks, "more pinned blocks than the cap"
