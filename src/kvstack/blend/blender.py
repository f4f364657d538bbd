"""The engine's blending service: checks blended requests, looks their chunks up, plans
blended steps, and computes missing chunk entries.

A chunk that misses is computed in context like any other prompt text (its request pays
nothing extra for the miss) and queued; its canonical entry is computed at the start of a later
step (up to `max_fill_tokens` tokens a step), so the next request that carries it hits.
`precompute` fills the cache ahead of time instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstack.blend.canonical import compute_entries
from kvstack.blend.chunk_cache import ChunkCache
from kvstack.blend.codec import ChunkFormat
from kvstack.blend.entry import chunk_key
from kvstack.blend.params import BlendError, BlendSpec, check_spans
from kvstack.blend.plan import BlendPlan, Region
from kvstack.blend.rotary import Rotary
from kvstack.blend.state import BlendState
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.tiers.chain import TierChain
from kvstack.layers.attention import AttentionMetadata, StepMetadata
from kvstack.models.base import CausalLM
from kvstack.outputs import BlendUsage
from kvstack.sampling_params import SamplingParams


class BlendRequest(Protocol):
    """What the blender reads of a request."""

    @property
    def step_plan(self) -> object: ...  # a blended request's: its BlendState
    cache_salt: str | None
    prompt_token_ids: list[int]
    num_computed_tokens: int


class Scheduled(Protocol):
    """What the blender reads of a request scheduled in a step."""

    @property
    def request(self) -> BlendRequest: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...


@dataclass
class BlendCounters:
    """Engine-wide totals, for stats and metrics."""

    requests: int = 0  # requests that had a blended step
    chunks_hit: int = 0
    chunks_missed: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    filled_chunks: int = 0  # entries computed after a miss or by precompute


def blend_state(blender: Blender | None, spec: BlendSpec | None, token_ids: Sequence[int],
                cache_salt: str | None, sampling_params: SamplingParams, num_sequences: int,
                num_scored: int = 0) -> BlendState | None:
    """A blended request's state, after every check (raises BlendError); None: no `spec`."""
    if spec is None:
        return None
    if num_sequences > 1:
        raise BlendError("blending runs one sample per request; use n=1 with blend")
    if blender is None:
        raise BlendError("blending needs the paged KV cache (not window mode nor int4 K/V) and "
                         "a model without sliding-window layers (not Gemma 3); turn the KV cache "
                         "on, drop kv_window, or pick another kv_cache_dtype or model")
    if sampling_params.prompt_logprobs is not None:
        raise BlendError("prompt_logprobs needs every prompt position computed; a blended "
                         "request reuses most of them: drop one or the other")
    return blender.request_state(spec, token_ids, cache_salt, num_scored)


class Blender:
    def __init__(self, model: CausalLM, kv_storage: KVCacheStorage, fingerprint: str,
                 max_bytes: int, tiers: TierChain | None, max_fill_tokens: int) -> None:
        c = model.config
        self.model = model
        self.kv_storage = kv_storage
        self.fingerprint = fingerprint
        self.rotary = Rotary(c)
        self.sink_ids = [c.bos_token_id] if c.bos_token_id is not None else []
        fmt = ChunkFormat(fingerprint, model.dtype, c.num_layers, c.num_kv_heads, c.head_dim)
        self.cache = ChunkCache(fmt, max_bytes, tiers)
        self.max_fill_tokens = max_fill_tokens
        self.counters = BlendCounters()
        self._pending: OrderedDict[bytes, list[int]] = OrderedDict()

    def reset_cache(self) -> int:
        """Drop the chunk entries held in memory (the tiers keep theirs); returns how many."""
        return self.cache.clear()

    # -- admission --------------------------------------------------------------------------

    def request_state(self, spec: BlendSpec, token_ids: Sequence[int], cache_salt: str | None,
                      num_scored: int = 0) -> BlendState:
        """Check a blended request; its state, chunks not looked up yet."""
        c = self.model.config
        check_spans(spec.chunks, len(token_ids))
        for start, end in spec.chunks:
            if end - start + len(self.sink_ids) > c.max_model_len:
                raise BlendError(f"a chunk of {end - start} tokens is longer than the model's "
                                 f"context ({c.max_model_len} tokens); split it")
        if spec.params.check_layer >= c.num_layers:
            raise BlendError(f"check_layer must be below the model's {c.num_layers} layers, "
                             f"got {spec.params.check_layer}")
        keys = [chunk_key(self.fingerprint, cache_salt, self.sink_ids, token_ids[s:e])
                for s, e in spec.chunks]
        return BlendState(spec, len(token_ids), keys, num_scored)

    def before_step(self, waiting: Iterable[BlendRequest]) -> None:
        """Compute queued chunk entries, then look up the chunks of new blended requests."""
        self.fill(self.max_fill_tokens)
        for request in waiting:
            state = request.step_plan
            if isinstance(state, BlendState) and not state.resolved:
                self._resolve(request, state)

    def _resolve(self, request: BlendRequest, state: BlendState) -> None:
        entries = []
        for key, (start, end) in zip(state.keys, state.chunks, strict=True):
            entry = self.cache.get(key)
            if entry is None and key not in self._pending:
                self._pending[key] = request.prompt_token_ids[start:end]
            entries.append(entry)
        state.entries = entries

    # -- the blended step -------------------------------------------------------------------

    def plan_step(self, scheduled: Sequence[Scheduled], positions: torch.Tensor,
                  meta: StepMetadata) -> BlendPlan | None:
        """The plan of this step's blended region (None: none runs), its K/V placed. Only
        a step over block tables blends (the engine builds a blender for no other mode)."""
        if not isinstance(meta, AttentionMetadata):
            return None
        row = 0
        for s in scheduled:
            r = s.request
            state = r.step_plan
            if isinstance(state, BlendState) and state.is_region_step(r.num_computed_tokens):
                plan = BlendPlan(state, self._region(state, s, row), meta, positions,
                                 self.rotary, self.model.config.num_layers, self._add_usage)
                plan.place(self.kv_storage)
                return plan
            row += s.num_new_tokens
        return None

    def _region(self, state: BlendState, s: Scheduled, row0: int) -> Region:
        start = s.request.num_computed_tokens
        end = start + s.num_new_tokens
        bs = self.kv_storage.block_size
        blocks = torch.tensor(s.block_ids, dtype=torch.int64)
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:end]
        placements = state.placements()
        placed = torch.cat([torch.arange(p.start, p.start + p.count) for p in placements])
        n = state.num_prompt_tokens
        always = n - max(state.num_scored, 1)  # sampled and scored rows are always computed
        question = torch.arange(max(state.question_start, start), n)
        return Region(row0, end - start, start, slots, placements, placed, placed >= always,
                      question, n - start)

    def _add_usage(self, usage: BlendUsage) -> None:
        c = self.counters
        c.requests += 1
        c.chunks_hit += usage.chunks_hit
        c.chunks_missed += usage.chunks_missed
        c.reused_tokens += usage.reused_tokens
        c.recomputed_tokens += usage.recomputed_tokens

    def stats_fields(self) -> dict[str, int]:
        """`EngineStats`' blending fields."""
        c, cache = self.counters, self.cache.stats()
        return {"blend_requests": c.requests, "blend_chunks_hit": c.chunks_hit,
                "blend_chunks_missed": c.chunks_missed,
                "blend_reused_tokens": c.reused_tokens,
                "blend_recomputed_tokens": c.recomputed_tokens,
                "chunk_cache_entries": cache.num_entries, "chunk_cache_bytes": cache.num_bytes,
                "chunk_cache_hits": cache.hits, "chunk_cache_tier_hits": cache.tier_hits,
                "chunk_cache_misses": cache.misses, "chunk_cache_stores": cache.stores}

    # -- filling the cache ------------------------------------------------------------------

    def fill(self, max_tokens: int, wait: bool = False) -> int:
        """Compute queued entries, up to about `max_tokens` tokens; returns how many
        (`wait`: block on a full tier write queue instead of dropping the write)."""
        batch: list[tuple[bytes, list[int]]] = []
        size = 0
        while self._pending:
            key, ids = next(iter(self._pending.items()))
            if batch and size + len(ids) > max_tokens:
                break
            del self._pending[key]
            if key not in self.cache:
                batch.append((key, ids))
                size += len(ids) + len(self.sink_ids)
        for entry in compute_entries(self.model, self.rotary, self.sink_ids, batch) if batch \
                else []:
            self.cache.put(entry, wait)
        self.counters.filled_chunks += len(batch)
        return len(batch)

    def precompute(self, chunks: Sequence[Sequence[int]], cache_salt: str | None,
                   wait: bool = True) -> int:
        """Make sure the cache holds these chunks' entries; returns how many were computed
        (the rest were held already, in memory or a tier)."""
        num = 0
        for ids in chunks:
            if not ids or len(ids) + len(self.sink_ids) > self.model.config.max_model_len:
                raise BlendError(f"cannot cache a chunk of {len(ids)} tokens: empty or longer "
                                 "than the model's context")
            key = chunk_key(self.fingerprint, cache_salt, self.sink_ids, ids)
            if self.cache.get(key) is None:
                self._pending[key] = list(ids)
                num += 1
        while self._pending:
            self.fill(self.max_fill_tokens, wait)
        if wait and self.cache.tiers is not None:
            self.cache.tiers.flush()
        return num
