"""Everything an engine is made of, built from its config: weights, tokenizer, model, the KV
storage, the tiers below it and the KV manager over them."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.blend.blender import Blender, blend_state
from kvstack.blend.params import BlendSpec
from kvstack.clock import MONOTONIC, Clock
from kvstack.config import EngineConfig, ModelConfig
from kvstack.drafts.tracker import OPTION as DRAFTS_OPTION
from kvstack.drafts.tracker import DraftTracker
from kvstack.engine.hooks import NewRequest, OnAdd, StepHooks
from kvstack.engine.request import Request
from kvstack.engine.request_output import completion_output
from kvstack.engine.steps import GroupedSteps, PagedSteps, StepBuilder, WindowSteps
from kvstack.engine.tokenizer import check_token_ids, load_tokenizer
from kvstack.errors import InvalidRequestError
from kvstack.kv.coordinator import KVCacheCoordinator
from kvstack.kv.dtypes import resolve
from kvstack.kv.groups import KVLayout
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.mode import KVCacheMode
from kvstack.kv.no_cache import NoKVCache
from kvstack.kv.sizing import KVShape
from kvstack.kv.storage import KVCacheStorage, make_kv_storage, torch_dtype
from kvstack.kv.tiers.chain import TierChain, build_tiers
from kvstack.kv.tiers.codec import BlockFormat
from kvstack.kv.tiers.control import TierControl
from kvstack.kv.window import SlidingWindow
from kvstack.kv.window_mode import WindowModeKV
from kvstack.models import CausalLM, family_of
from kvstack.recurrent.budget import snapshot_every, split_budget
from kvstack.recurrent.codec import SnapshotFormat
from kvstack.recurrent.plan import RecurrentModel
from kvstack.recurrent.store import SNAPSHOT_OPTION, SnapshotPolicy, StateStore
from kvstack.recurrent.tiers import SnapshotTiers
from kvstack.samples.feature import ParallelSamples
from kvstack.scoring.prompt import PromptScores
from kvstack.scoring.store import ScoreStore
from kvstack.structured.feature import StructuredOutputs
from kvstack.weights import Checkpoint, load_checkpoint


@dataclass
class EngineParts:
    model_config: ModelConfig
    model: CausalLM
    tokenizer: Any | None  # a transformers tokenizer; None with skip_tokenizer_init
    fingerprint: str  # names weights, tokenizer, dtype, weight format, KV dtype and attention
    kv_cache_dtype: str  # resolved: never "auto"
    window: SlidingWindow | None
    kv_layout: KVLayout  # which layers share a block table (a hybrid model: several groups)
    kv_shape: KVShape | None = None
    kv_storage: KVCacheStorage | None = None
    kv_manager: KVCacheMode = field(default_factory=NoKVCache)  # no cache: a mode too
    kv_tiers: TierChain | None = None
    blender: Blender | None = None  # chunk cache, blending; None: no KV cache, window, int4
    steps: StepBuilder | None = None  # the KV mode's step builder (`engine/steps.py`)
    hooks: StepHooks = field(default_factory=StepHooks)  # optional features' hook points
    tier_control: TierControl | None = None  # pins, warming, flushing (`kv/tiers/control.py`)
    # Prompt scores beside the prefix cache's blocks; without one it keeps nothing.
    score_store: ScoreStore = field(default_factory=ScoreStore.inert)


def build_engine(config: EngineConfig, clock: Clock = MONOTONIC) -> EngineParts:
    """Everything an engine runs on; the KV tiers keep their deadlines on `clock`."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    ckpt = load_checkpoint(config.model, config.quantization)
    family = family_of(ckpt.config.architecture)
    cache = config.cache
    if cache.kv_window is not None and any(w is not None for w in ckpt.config.layer_windows()):
        raise InvalidRequestError(
            f"kv_window (approximate window mode) is not supported for {family.name} models, "
            "whose sliding-window layers are exact already; leave kv_window unset"
        )
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(ckpt)
    if tokenizer is not None and not tokenizer.chat_template and family.chat_template:
        tokenizer.chat_template = family.chat_template  # the file carries none (Gemma 3 GGUFs)
    model = family.create(
        ckpt.config, torch_dtype(config.dtype), config.quantization, config.kernels == "auto"
    )
    model.load_weights(ckpt.tensors, ckpt.blocks)
    if isinstance(model, RecurrentModel) and (not cache.use_kv_cache or cache.kv_window):
        raise InvalidRequestError(
            f"{family.name} has linear-attention layers, whose state lives beside the paged "
            "KV cache: keep use_kv_cache on and kv_window unset")
    kv_cache_dtype = resolve(cache.kv_cache_dtype, config.dtype)
    window = (SlidingWindow(cache.kv_window, cache.kv_sink_tokens, cache.block_size)
              if cache.kv_window is not None else None)
    if window is not None and window.window > ckpt.config.max_model_len:
        raise InvalidRequestError(
            f"kv_window {window.window} is longer than the model's context "
            f"({ckpt.config.max_model_len} tokens); give a smaller kv_window"
        )
    layout = KVLayout.of(ckpt.config.layer_windows(), kv_cache_dtype)
    parts = EngineParts(ckpt.config, model, tokenizer,
                        fingerprint(ckpt, config, kv_cache_dtype, window, layout), kv_cache_dtype,
                        window, layout)
    if cache.use_kv_cache:
        _build_kv(parts, config, clock)
    parts.steps = step_builder(parts)
    register_features(parts, config, clock)
    return parts


def register_features(parts: EngineParts, config: EngineConfig, clock: Clock) -> None:
    """The registration point of optional features: each joins the step's hook points
    (`on_add` hooks run in this order, so a request is refused as it always was)."""
    hooks = parts.hooks
    block_size = config.cache.block_size
    _register_samples(hooks, config, parts.kv_manager)
    parts.tier_control = TierControl(parts.kv_manager, parts.kv_tiers, clock)
    hooks.before_schedule.append(parts.tier_control.before_schedule)  # pins lapse first
    structured = StructuredOutputs(parts.tokenizer, parts.model_config.vocab_size,
                                   eos_token_ids(parts.model_config, parts.tokenizer))
    hooks.on_add.append(lambda new: structured.on_add(new.sampling_params))
    hooks.before_run.append(structured.before_run)
    hooks.on_finish.append(structured.on_finish)
    hooks.features["structured"] = structured
    # Blending refuses a spec it cannot run (no blender: window mode, int4, Gemma 3).
    hooks.on_add.append(_blend_setup(parts.blender))
    hooks.on_add.append(_scoring_setup(block_size, parts.tokenizer))
    # `snapshot_at`: prompt lengths a hybrid model keeps its recurrent state at (cache
    # breakpoints); accepted, and without meaning, for every other model
    hooks.options |= {"blend", "num_scored", SNAPSHOT_OPTION}
    vocab_size = parts.model_config.vocab_size
    drafts = DraftTracker(parts.kv_storage is not None and parts.kv_storage.lossy,
                          # a recurrent state cannot take back rejected draft tokens
                          parts.kv_manager.accepts_drafts
                          and not isinstance(parts.model, RecurrentModel),
                          lambda ids: check_token_ids(ids, vocab_size), config.drafts)
    hooks.features["drafts"] = drafts  # `LLMEngine.forget_drafts`
    hooks.on_add.append(drafts.on_add)  # after the others: it refused a request last
    hooks.options.add(DRAFTS_OPTION)
    hooks.extra_tokens = drafts.extra_tokens
    hooks.verify_drafts = drafts.verify
    hooks.after_sampling.append(drafts.after_sampling)
    hooks.fill_output.append(drafts.fill_output)
    hooks.after_output.append(drafts.after_output)
    hooks.on_finish.append(drafts.on_finish)
    hooks.stats.append(drafts.stats_fields)
    if parts.blender is not None:
        hooks.before_schedule.append(parts.blender.before_step)
        hooks.layer.append(parts.blender.plan_step)
        hooks.stats.append(parts.blender.stats_fields)
        hooks.features["blend"] = parts.blender  # `LLM.precompute_chunks`, `reset_chunk_cache`


def _register_samples(hooks: StepHooks, config: EngineConfig, kv_manager: KVCacheMode) -> None:
    """Parallel samples (`samples/`): a request with n or best_of > 1 runs as its samples,
    which share its prompt's blocks where the KV mode can fork them; it checks first that
    every request's sequences fit, all at once."""
    samples: ParallelSamples[Request] = ParallelSamples(config.scheduler, kv_manager,
                                                        completion_output)
    hooks.split.append(lambda new: samples.split(
        new.request_id, new.sampling_params, len(new.prompt_token_ids), new.max_tokens))

    def on_add(new: NewRequest) -> Callable[[Request], None] | None:
        if new.num_samples == 1:
            return None
        group: list[Request] = []

        def attach(request: Request) -> None:
            request.parent_request_id, request.sample_index = new.request_id, len(group)
            group.append(request)
            if len(group) < new.num_samples:
                return
            if kv_manager.can_fork:  # the first computes the prompt, the others fork it
                group[0].pending_forks = group[1:]
            samples.add(new.request_id, new.sampling_params, group)
        return attach
    hooks.on_add.append(on_add)
    hooks.on_abort.append(samples.on_abort)
    hooks.on_finish.append(samples.on_finish)
    hooks.take_outputs.append(samples.take_outputs)


def _num_scored(new: NewRequest) -> int:
    num_scored = new.options.get("num_scored") or 0
    if not isinstance(num_scored, int):
        raise InvalidRequestError(f"num_scored must be an integer, got {num_scored!r}")
    return min(max(num_scored, 0), len(new.prompt_token_ids))


def _blend_setup(blender: Blender | None) -> OnAdd:
    """Blending's `on_add`: a blended request's state (`blend=BlendSpec`), after its checks
    (BlendError), as the request's step plan."""
    def on_add(new: NewRequest) -> Callable[[Request], None] | None:
        spec = new.options.get("blend")
        if spec is not None and not isinstance(spec, BlendSpec):
            raise InvalidRequestError(f"blend must be a BlendSpec, got {type(spec).__name__}")
        state = blend_state(blender, spec, new.prompt_token_ids, new.cache_salt,
                            new.sampling_params, new.num_samples, _num_scored(new))
        if state is None:
            return None

        def attach(request: Request) -> None:
            request.step_plan = state
        return attach
    return on_add


def _scoring_setup(block_size: int, tokenizer: Any | None) -> OnAdd:
    """Scoring's `on_add`: the scored prompt positions (`num_scored`, `LLM.score`) and, with
    prompt_logprobs, each sample's prompt scores."""
    # A token's text alone (prompt logprobs show it for every alternative): decoded once.
    token_text: Callable[[int], str | None] = (
        functools.cache(lambda token_id: tokenizer.decode([token_id]))
        if tokenizer is not None else (lambda token_id: None))

    def on_add(new: NewRequest) -> Callable[[Request], None] | None:
        num_scored = _num_scored(new)
        scores_prompt = new.sampling_params.prompt_logprobs is not None
        if not num_scored and not scores_prompt:
            return None

        def attach(request: Request) -> None:
            request.num_scored = num_scored
            if scores_prompt:
                request.prompt_scores = PromptScores(new.prompt_token_ids, block_size,
                                                     token_text)
        return attach
    return on_add


def eos_token_ids(model_config: ModelConfig, tokenizer: Any | None) -> frozenset[int]:
    """The model's end-of-sequence ids and the tokenizer's own."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def step_builder(parts: EngineParts) -> StepBuilder:
    """The step builder of the engine's KV mode: the one place that tells the modes apart."""
    storage = parts.kv_storage
    if storage is not None and parts.window is not None:
        return WindowSteps(parts.model, storage, parts.window)
    if storage is not None and parts.kv_layout.is_hybrid:
        return GroupedSteps(parts.model, storage, parts.kv_layout)
    return PagedSteps(parts.model, storage)


def fingerprint(ckpt: Checkpoint, config: EngineConfig, kv_cache_dtype: str,
                window: SlidingWindow | None, layout: KVLayout | None = None) -> str:
    """Blocks are only shared between engines with the same weights, tokenizer, dtype and
    weight format (int8 weights give other K/V), KV dtype, attention (window mode) and KV
    layout (a hybrid page holds some layers only). The default KV dtype (the model's) keeps
    the fingerprint it always had."""
    text = f"{ckpt.fingerprint}|{config.dtype}"
    if config.quantization:
        text += f"|{config.quantization}"
    if kv_cache_dtype != config.dtype:
        text += f"|kv={kv_cache_dtype}"
    if window is not None:
        text += f"|window={window.window},{window.sink_tokens}"
    if layout is not None and layout.is_hybrid:
        text += f"|layout={layout.describe()}"
    return hashlib.sha256(text.encode()).hexdigest()


def _build_kv(parts: EngineParts, config: EngineConfig, clock: Clock) -> None:
    """The K/V storage sized to the budget, the tiers below it and the manager over both."""
    cache = config.cache
    shape = KVShape.of(parts.model_config, parts.kv_cache_dtype, parts.kv_layout,
                       block_size=cache.block_size,
                       model_dtype=config.dtype, window=cache.kv_window,
                       sink_tokens=cache.kv_sink_tokens)
    max_num_seqs = config.scheduler.max_num_seqs
    budget = cache.kv_cache_memory
    if isinstance(parts.model, RecurrentModel):  # live states and snapshots come first
        budget = split_budget(budget, parts.model.state_nbytes, max_num_seqs).kv_bytes
    num_blocks = shape.num_blocks_for_budget(budget, max_num_seqs=max_num_seqs)
    if num_blocks < 1:
        raise InvalidRequestError(
            f"kv_cache_memory {cache.kv_cache_memory} B holds no block of "
            f"{shape.bytes_per_block} B (plus {shape.window_pool_bytes(max_num_seqs)} B "
            "of int4 window); raise kv_cache_memory"
        )
    storage = make_kv_storage(parts.model_config, num_blocks, cache.block_size,
                              parts.kv_cache_dtype, torch_dtype(config.dtype), max_num_seqs,
                              shape.layers_per_block, use_kernels=config.kernels == "auto")
    block_format = BlockFormat(parts.fingerprint, parts.kv_cache_dtype, shape.layers_per_block,
                               shape.num_kv_heads, shape.head_dim, cache.block_size)
    parts.kv_shape = shape
    parts.kv_storage = storage
    parts.kv_tiers = build_tiers(cache, block_format, storage, clock)
    manager = KVCacheManager(
        num_blocks, cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching and parts.window is None,
        fingerprint=parts.fingerprint,
        max_pinned_blocks=int(num_blocks * cache.max_pinned_fraction), tiers=parts.kv_tiers,
        on_free=storage.release, on_copy=storage.copy_block)
    if parts.window is not None:
        parts.kv_manager = WindowModeKV(manager, parts.window)
    else:
        parts.kv_manager = KVCacheCoordinator(
            manager, parts.kv_layout, max_chunk_tokens=config.scheduler.max_num_batched_tokens)
    if manager.enable_prefix_caching:
        pool = manager.pool
        parts.score_store = ScoreStore(manager.block_hashes,
                                       lambda block_hash: pool.lookup(block_hash) is not None)
        pool.add_listener(parts.score_store)
        manager.score_run = parts.score_store.scored_run
    # int4 storage quantizes a block when its last slot is written in order; placing chunks
    # writes slots out of order. The blended step's row filter lives in the Llama layer loop:
    # models with sliding-window layers (Gemma 3) do not blend.
    if isinstance(parts.model, RecurrentModel):
        _register_states(parts, config, manager)
    elif (parts.window is None and parts.kv_cache_dtype != "int4"
            and all(w is None for w in parts.model.config.layer_windows())):
        parts.blender = Blender(parts.model, storage, parts.fingerprint, cache.chunk_cache_memory,
                                parts.kv_tiers, config.scheduler.max_num_batched_tokens)


def _register_states(parts: EngineParts, config: EngineConfig, manager: KVCacheManager) -> None:
    """A hybrid model's recurrent states (`recurrent/`): live per request, snapshots beside
    the blocks; a prefix hit ends at a snapshot. Requests whose state could not follow
    (parallel samples, drafts) are refused."""
    model = parts.model
    assert isinstance(model, RecurrentModel) and parts.kv_shape is not None
    cache, hooks = config.cache, parts.hooks
    split = split_budget(cache.kv_cache_memory, model.state_nbytes,
                         config.scheduler.max_num_seqs)
    policy = SnapshotPolicy(cache.block_size, snapshot_every(
        model.state_nbytes, parts.kv_shape.bytes_per_block, cache.state_snapshot_every))
    pool = manager.pool
    # kept snapshots go to the tiers the blocks go to (and come back from them)
    tiers = SnapshotTiers(SnapshotFormat(parts.fingerprint, model.new_states()), parts.kv_tiers)
    store = StateStore(model, policy, split.snapshot_bytes, manager.block_hashes,
                       lambda block_hash: pool.lookup(block_hash) is not None, tiers)
    pool.add_listener(store)
    if manager.enable_prefix_caching:
        manager.state_cut = store.state_cut
    else:
        manager.state_cut = lambda hashes, n: 0

    def on_add(new: NewRequest) -> Callable[[Request], None] | None:
        if new.num_samples > 1 or new.options.get(DRAFTS_OPTION):
            raise InvalidRequestError(
                f"{parts.model_config.architecture} keeps a recurrent state per sequence: "
                "parallel samples (n, best_of > 1) and draft tokens are not supported")
        points = new.options.get(SNAPSHOT_OPTION) or ()
        if not isinstance(points, (list, tuple)) or not all(isinstance(n, int) for n in points):
            raise InvalidRequestError(f"{SNAPSHOT_OPTION} must be a list of prompt lengths "
                                      f"(integers), got {points!r}")
        return (lambda request: store.keep_at(request.request_id, points)) if points else None
    hooks.on_add.append(on_add)
    hooks.before_run.append(store.before_run)
    hooks.after_step.append(store.after_step)
    hooks.on_finish.append(lambda request, reason: store.on_finish(request.request_id))
    hooks.stats.append(store.stats)
    hooks.features["recurrent"] = store
