"""The one interface every KV mode implements, and the per-request blocks value it answers with.

The scheduler, the runner and the engine core hold a `KVCacheMode` and never ask which mode it
is: full attention with prefix caching and a hybrid model's window groups (`kv/coordinator.py`
over `kv/manager.py` and `kv/group_tables.py`), the approximate window mode
(`kv/window_mode.py`, over a manager without prefix caching) and no cache at all
(`kv/no_cache.py`). A new mode is one more class with these methods; what a step's tensors
need of it travels in `KVBlocks`, which only the mode's step builder (`engine/steps.py`) reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import BlockListener
from kvstack.kv.snapshot import KVSnapshot
from kvstack.kv.tiers.base import BlockTiers
from kvstack.kv.values import KVRequest, KVUsage, PrefixHit


@dataclass(frozen=True)
class KVBlocks:
    """A request's blocks as a step runs. Opaque to the scheduler: it hands them on."""

    block_ids: list[int] = field(default_factory=list)  # the (first group's) table
    # Window mode: logical blocks freed between the sink blocks and the rest of the table.
    num_dropped_blocks: int = 0
    # A hybrid layout: the tables of groups 1.. (a placeholder id where a block slid out).
    group_block_ids: list[list[int]] = field(default_factory=list)


class KVCacheMode(Protocol):
    """Which blocks each request holds, under one mode's rules. Never touches tensors.

    Contracts: `allocate` changes nothing when it answers False; `after_step` runs once per
    scheduled request after its computed count advanced; a request `free`d as finished is
    forgotten, one preempted (`finished=False`) keeps its hashes for its return.
    """

    block_size: int
    enable_prefix_caching: bool

    @property
    def num_blocks(self) -> int: ...
    @property
    def accepts_drafts(self) -> bool:
        """False where draft tokens cannot be verified in this mode's cache."""
        ...
    @property
    def can_fork(self) -> bool:
        """True when parallel samples can share a prompt's blocks (`fork`)."""
        ...
    @property
    def unbounded_context(self) -> bool:
        """True when a request may run past the model's context (window mode)."""
        ...
    @property
    def capacity_fix(self) -> str:
        """What to lower when a request alone needs more blocks than the pool holds."""
        ...

    def max_chunk(self, budget: int) -> int:
        """Most new tokens one request computes in a step of `budget` tokens."""
        ...
    def step_budget(self, budget: int) -> int:
        """The token budget of a step (no cache: unbounded, every step is whole)."""
        ...
    def num_kept_tokens(self, request: KVRequest) -> int:
        """The request's computed tokens whose K/V the cache still holds as a step begins."""
        ...
    def max_blocks_held(self, num_tokens: int) -> int: ...

    def match_prefix(self, request: KVRequest) -> PrefixHit: ...
    def allocate(self, request: KVRequest, num_new_tokens: int,
                 hit: PrefixHit | None = None) -> bool: ...
    def fork(self, parent_id: str, child_id: str) -> None: ...
    def record_query(self, request: KVRequest, hit: PrefixHit) -> None: ...
    def blocks_of(self, request_id: str) -> KVBlocks: ...
    def block_ids(self, request_id: str) -> list[int]: ...
    def block_hashes(self, request_id: str) -> list[BlockHash]: ...
    def after_step(self, request: KVRequest, max_tokens: int | None, rejected: bool) -> None:
        """Trim rejected drafts' blocks, publish newly full blocks (within `max_tokens`),
        free what slid out of a window."""
        ...
    def free(self, request_id: str, finished: bool = True) -> None: ...

    def reset_prefix_cache(self) -> int: ...
    def add_listener(self, listener: BlockListener) -> bool:
        """Add a listener to the prefix cache's blocks; False without a prefix cache."""
        ...
    def set_tiers(self, tiers: BlockTiers) -> bool:
        """Restore hits from, and write new blocks through to, `tiers`; False without a
        prefix cache."""
        ...
    def prefix_hashes(self, token_ids: Sequence[int],
                      cache_salt: str | None) -> list[BlockHash]: ...
    def cached_run(self, hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]: ...
    def pin_prefix(self, token_ids: list[int], cache_salt: str | None,
                   until: float) -> tuple[int, int]: ...
    def expire_pins(self, now: float) -> int: ...
    def usage(self) -> KVUsage | None: ...
    def snapshot(self) -> KVSnapshot | None: ...
    def check_integrity(self) -> None: ...
