"""A typed snapshot of engine counters for the CLI, benchmarks and metrics."""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.kv.tiers.base import TierStats


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_bytes: int  # bytes of K/V storage allocated
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_draft_tokens: int = 0  # draft tokens verified (semantic cache, prompt lookup, given)
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with
    # Suffix drafts (`drafts/suffix.py`): outputs and tokens kept for tenants' later drafts,
    # and drafts taken from them rather than from the request's own text.
    suffix_cached_outputs: int = 0
    suffix_cached_tokens: int = 0
    suffix_global_drafts: int = 0
    # Hybrid models (`recurrent/`): recurrent-state snapshots kept beside the cached blocks.
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    # The KV manager's `KVUsage`, field for field (zero without a KV cache):
    block_size: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0  # allocatable now, cached-but-unused blocks included
    num_blocks_cached: int = 0  # free blocks still holding a reusable prefix
    num_blocks_used: int = 0  # held by running requests and pins
    num_blocks_pinned: int = 0  # held by prompt-cache pins (counted in num_blocks_used)
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    tier_hit_tokens: int = 0  # of prefix_cache_hit_tokens, loaded from disk or Redis tiers
    num_copied_blocks: int = 0  # copy-on-write copies of parallel samples' shared tail blocks
    tiers: tuple[TierStats, ...] = ()  # per tier below the memory pool: hits, faults, bytes
    # Blending (`blend/`): requests with a blended step, their chunks and tokens, and the
    # chunk cache (entries and bytes in memory; lookups answered by memory, by a tier, none).
    blend_requests: int = 0
    blend_chunks_hit: int = 0
    blend_chunks_missed: int = 0
    blend_reused_tokens: int = 0  # placed from chunk entries
    blend_recomputed_tokens: int = 0  # of those, recomputed in context
    chunk_cache_entries: int = 0
    chunk_cache_bytes: int = 0
    chunk_cache_hits: int = 0
    chunk_cache_tier_hits: int = 0
    chunk_cache_misses: int = 0
    chunk_cache_stores: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0
