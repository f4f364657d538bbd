"""The KV bookkeeping's invariants, checked by tests and debug runs (`check_integrity`)."""

from __future__ import annotations

from collections.abc import Iterable

from kvstack.kv.block_pool import BlockPool, KVBlock
from kvstack.kv.pins import PinRegistry


def check_holders(pool: BlockPool, pins: PinRegistry, tables: Iterable[list[KVBlock]]) -> None:
    """The pool's and the pins' invariants, and every block's reference count equal to its
    holders: one per table that lists it (forked tables share blocks) plus one if pinned.
    A table lists a block at most once."""
    pool.check_integrity()
    pins.check_integrity()
    holders = pins.held_counts()
    for blocks in tables:
        ids = [block.block_id for block in blocks]
        assert len(set(ids)) == len(ids), "a table lists a block twice"
        for block_id in ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), (
            f"block {block.block_id} has {block.ref_cnt} references but "
            f"{holders.get(block.block_id, 0)} holders")
