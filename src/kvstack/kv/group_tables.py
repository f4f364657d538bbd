"""Block tables of a hybrid layout's groups past the first (`kv/groups.py`). Pure Python.

The KV manager keeps group 0's table itself (the classic table, whose hashes name prefixes).
This keeps, per request, one table for every other group: the block at each logical position,
or None once that block slid out of the group's window. A block that slid out is freed, and
stays cached under its hash until the pool evicts it, so a later prompt with the same prefix
still finds the last window before its hit point. A group's block hashes are group 0's
re-hashed with the group's index: the same tokens in two groups are two different blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockPool, KVBlock
from kvstack.kv.groups import first_live_block

# A group's rows of a prefix hit: per logical block, the block, or None before the window.
GroupRows = list[list[KVBlock | None]]
# The id a block table shows for a block that slid out: its slots are never read unmasked
# (window attention reads only the positions its window reaches), any valid id will do.
PLACEHOLDER_BLOCK_ID = 0


def group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The hash of group `group`'s block holding what group 0's `block_hash` names."""
    return hashlib.sha256(block_hash + b"\x00kvstack-group" + group.to_bytes(2, "little")).digest()


@dataclass
class _GroupTable:
    blocks: list[KVBlock | None] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # derived from group 0's, as needed
    num_slid: int = 0  # leading entries already None (freed or never held)


class GroupTables:
    """Per request, the tables of groups 1.. of a hybrid layout, over the shared pool."""

    def __init__(self, pool: BlockPool, block_size: int, windows: Sequence[int | None]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = tuple(windows)  # windows[i] is group i + 1's
        self._tables: dict[str, list[_GroupTable]] = {}

    def _of(self, request_id: str) -> list[_GroupTable]:
        tables = self._tables.get(request_id)
        if tables is None:
            tables = self._tables[request_id] = [_GroupTable() for _ in self.windows]
        return tables

    def _first_live(self, index: int, num_tokens: int) -> int:
        return first_live_block(num_tokens, self.windows[index], self.block_size)

    def _hashes(self, index: int, table: _GroupTable, hashes0: Sequence[BlockHash],
                num: int) -> list[BlockHash]:
        while len(table.hashes) < num:
            table.hashes.append(group_hash(hashes0[len(table.hashes)], index + 1))
        return table.hashes

    # -- prefix hits -------------------------------------------------------------------------

    def needed(self, num_blocks: int, hashes0: Sequence[BlockHash]
               ) -> list[tuple[int, int, BlockHash]]:
        """(group, logical block, hash) of every block a hit of `num_blocks` blocks needs in
        groups 1..: the blocks of each group's last window before the hit point."""
        out = []
        for i in range(len(self.windows)):
            for j in range(self._first_live(i, num_blocks * self.block_size), num_blocks):
                out.append((i + 1, j, group_hash(hashes0[j], i + 1)))
        return out

    def fit(self, num_blocks: int, hashes0: Sequence[BlockHash]) -> int:
        """The longest hit of at most `num_blocks` blocks whose window blocks every group has
        in the memory cache. A block missing at j rules out every hit past j whose window
        reaches j, and windows only reach further back for shorter hits, so the hit becomes j."""
        num = num_blocks
        changed = True
        while changed and num:
            changed = False
            for _group, j, block_hash in reversed(self.needed(num, hashes0)):
                if j < num and self.pool.lookup(block_hash) is None:
                    num, changed = j, True
        return num

    def hit_rows(self, num_blocks: int, hashes0: Sequence[BlockHash]) -> GroupRows:
        """Each group's blocks of a hit that `fit` allowed (None before its window)."""
        rows: GroupRows = []
        for i in range(len(self.windows)):
            first = self._first_live(i, num_blocks * self.block_size)
            row: list[KVBlock | None] = [None] * first
            for j in range(first, num_blocks):
                block = self.pool.lookup(group_hash(hashes0[j], i + 1))
                assert block is not None, "hit_rows after a fit that allowed it"
                row.append(block)
            rows.append(row)
        return rows

    # -- growth ------------------------------------------------------------------------------

    def _shared_tail(self, table: _GroupTable, num_computed: int,
                     num_new_tokens: int) -> int | None:
        """Index of the partly filled block this step writes into when a fork shares it."""
        if num_new_tokens <= 0 or num_computed % self.block_size == 0:
            return None
        index = num_computed // self.block_size
        block = table.blocks[index] if index < len(table.blocks) else None
        return index if block is not None and block.ref_cnt > 1 else None

    def demand(self, request_id: str, num_computed: int, num_new_tokens: int,
               rows: GroupRows | None) -> tuple[int, list[KVBlock]]:
        """Blocks the pool must hand out for this growth in groups 1.. (new ones, copies of
        shared tails, revived cached hit blocks), and the hit blocks to keep while it does."""
        tables = self._tables.get(request_id)
        num_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        need, keep = 0, []
        for i in range(len(self.windows)):
            held = len(tables[i].blocks) if tables else 0
            if rows is not None:
                hit = [b for b in rows[i] if b is not None]
                keep += hit
                need += sum(1 for b in hit if b.ref_cnt == 0)
                held += len(rows[i])
            elif tables and self._shared_tail(tables[i], num_computed, num_new_tokens) is not None:
                need += 1
            need += max(0, num_blocks - held)
        return need, keep

    def grow(self, request_id: str, num_computed: int, num_new_tokens: int,
             rows: GroupRows | None, on_copy: Callable[[int, int], None] | None) -> int:
        """Take what `demand` counted (the caller made room); returns the copies made. Every
        group's hit blocks are taken before any allocation: one may sit free at the head of
        the free queue, where an allocation would evict it."""
        num_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        copies = 0
        tables = self._of(request_id)
        for i, (table, row) in enumerate(zip(tables, rows or [], strict=False)):
            self.pool.touch([b for b in row if b is not None])
            table.blocks.extend(row)
            table.num_slid = self._first_live(i, len(row) * self.block_size)
        for table in tables:
            shared = self._shared_tail(table, num_computed, num_new_tokens)
            if shared is not None:
                source = table.blocks[shared]
                assert source is not None
                [copy] = self.pool.allocate(1)
                if on_copy is not None:
                    on_copy(source.block_id, copy.block_id)
                table.blocks[shared] = copy
                self.pool.free([source])
                copies += 1
            if num_blocks > len(table.blocks):
                table.blocks.extend(self.pool.allocate(num_blocks - len(table.blocks)))
        return copies

    # -- publication and release ---------------------------------------------------------

    def publish(self, request_id: str, num_full: int, hashes0: Sequence[BlockHash],
                publish: Callable[[KVBlock, int, list[BlockHash]], bool]
                ) -> list[tuple[int, BlockHash]]:
        """Publish each group's newly full blocks under its hashes; (block id, hash) of those
        published (for the tiers)."""
        out = []
        for i, table in enumerate(self._tables.get(request_id, [])):
            for j in range(table.num_slid, min(num_full, len(table.blocks))):
                block = table.blocks[j]
                if block is not None and block.block_hash is None:
                    hashes = self._hashes(i, table, hashes0, j + 1)
                    if publish(block, j, hashes):
                        out.append((block.block_id, hashes[j]))
        return out

    def slide(self, request_id: str, num_computed: int) -> list[KVBlock]:
        """Take out of the tables the blocks no query from `num_computed` on can read."""
        dead: list[KVBlock] = []
        for i, table in enumerate(self._tables.get(request_id, [])):
            first = min(self._first_live(i, num_computed), len(table.blocks))
            for j in range(table.num_slid, first):
                block = table.blocks[j]
                if block is not None:
                    dead.append(block)
                    table.blocks[j] = None
            table.num_slid = max(table.num_slid, first)
        return dead

    def trim(self, request_id: str, num_computed: int) -> list[KVBlock]:
        """Take out the blocks past `num_computed` tokens (rejected draft tokens)."""
        keep = -(-num_computed // self.block_size)
        extra: list[KVBlock] = []
        for table in self._tables.get(request_id, []):
            extra += [b for b in reversed(table.blocks[keep:]) if b is not None]
            del table.blocks[keep:]
        return extra

    def release(self, request_id: str, finished: bool) -> list[KVBlock]:
        """Take out every block, tail first; a preempted request keeps its hashes."""
        tables = self._tables.get(request_id, [])
        blocks = [b for t in tables for b in reversed(t.blocks) if b is not None]
        if finished:
            self._tables.pop(request_id, None)
        else:
            for table in tables:
                table.blocks, table.num_slid = [], 0
        return blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's tables share the parent's blocks by reference."""
        parents = self._tables.get(parent_id) or [_GroupTable() for _ in self.windows]
        children = self._of(child_id)
        for parent, child in zip(parents, children, strict=True):
            self.pool.touch([b for b in parent.blocks if b is not None])
            child.blocks, child.hashes = list(parent.blocks), list(parent.hashes)
            child.num_slid = parent.num_slid

    # -- views -------------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Each group's table as block ids (a placeholder where a block slid out)."""
        return [[PLACEHOLDER_BLOCK_ID if b is None else b.block_id for b in t.blocks]
                for t in self._tables.get(request_id, [])]

    def held(self, request_id: str) -> list[list[KVBlock]]:
        """The blocks each group's table holds now."""
        return [[b for b in t.blocks if b is not None] for t in self._tables.get(request_id, [])]

    def request_ids(self) -> list[str]:
        return list(self._tables)
