"""The small values the KV manager reads and answers with: what it reads of a request, a prefix
hit, and the pool's usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.block_pool import KVBlock


class KVRequest(Protocol):
    """What the manager reads of a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def scores_prompt(self) -> bool:
        """True when the request scores its prompt (prompt logprobs): its hit takes only
        blocks whose scores are kept beside them (`KVCacheManager.score_run`)."""
        ...

    def token_ids(self) -> list[int]: ...
    def tokens_between(self, start: int, end: int) -> list[int]: ...


@dataclass(frozen=True)
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int
    num_restored_tokens: int = 0  # of num_tokens, loaded from a tier below the memory pool
    # The request's full-block hashes, computed for the lookup; `allocate` keeps them.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # A hybrid layout's other KV groups (`kv/coordinator.py`): per group, per logical block of
    # the hit, its block, or None where the group's window no longer reaches.
    group_blocks: list[list[KVBlock | None]] = field(default_factory=list)


@dataclass(frozen=True)
class KVUsage:
    """The pool's state and the prefix cache's counters, as `EngineStats` reports them."""

    block_size: int
    num_blocks_total: int
    num_blocks_free: int  # allocatable now, cached-but-unused blocks included
    num_blocks_cached: int  # free blocks still holding a reusable prefix
    num_blocks_used: int  # held by requests or pins
    num_blocks_pinned: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    tier_hit_tokens: int  # of prefix_cache_hit_tokens, loaded from the tiers
    num_copied_blocks: int = 0  # copy-on-write copies of forks' shared tail blocks
