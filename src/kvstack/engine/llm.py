"""The offline API, shaped like vLLM's `LLM`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import torch

from kvstack.blend.blender import Blender
from kvstack.blend.params import BlendParams, BlendSpec, Chunk
from kvstack.blend.segments import (
    chat_segments,
    document_text,
    tokenize_segments,
    with_documents,
)
from kvstack.clock import MONOTONIC, Clock
from kvstack.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstack.engine.chat import Message, chat_token_ids
from kvstack.engine.core import LLMEngine
from kvstack.engine.info import ModelInfo
from kvstack.engine.request import Request
from kvstack.engine.stats import EngineStats
from kvstack.errors import InvalidRequestError
from kvstack.kernels.allocator import keep_freed_memory
from kvstack.kv.snapshot import KVSnapshot
from kvstack.kv.tiers.base import TierStats
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.units import parse_size

PromptType = str | dict[str, Any]
Document = Mapping[str, Any]  # {"title": ..., "text": ...}


@dataclass(frozen=True)
class ScoredPrompt:
    """`LLM.score`: a prompt's output and the log-probability rows of its last positions."""

    output: RequestOutput
    logprobs: torch.Tensor  # [num_positions, vocab]; row i predicts the token after
    #                         prompt position N - num_positions + i


class LLM:
    """Generate from a batch of prompts: `LLM(model="smollm2-135m").generate(prompts, params)`.

    With `kv_disk_dir` and/or `kv_redis_url`, prefix blocks are written through to a disk
    directory (capped at `kv_disk_size`) and a Redis server, and reused from there by later
    processes. `close()` (or leaving a `with` block) waits for pending writes.

    `dtype` is the activations' and weights' dtype; `quantization="int8"` holds the linear
    weights as int8 with per-channel scales (activations stay in `dtype`); `quantization="gguf"`
    (GGUF files only) runs the file's own quantized blocks as they are, decode-sized products
    with activations rounded to int8 per 32-value block (approximate; see docs/weights.md).
    `kernels="torch"` turns off the C decode kernels (the reference path). `max_parallel_samples`
    caps a request's n (best_of); its samples share the prompt's KV blocks (`samples/`).
    `clock` (default `time.monotonic`) keeps pin deadlines and the Redis tier's retry pause.

    Blending (APPROXIMATE, opt-in per call with `blend=BlendParams(...)`): a prompt given as
    `{"segments": ["text", Chunk(doc), ...]}` (or `chat(..., documents=[...])`) reuses each
    chunk's K/V from the chunk cache (`chunk_cache_memory` bytes in memory, plus the tiers)
    wherever it appears, and recomputes a share of its tokens in context (`blend/`).

    `kv_cache_dtype` stores K/V as "auto" (the model dtype), "float32", "bfloat16", "float16",
    "int8", "fp8" (e4m3) or "int4" (KIVI-style), quantized on write and dequantized on read.
    `kv_window=N` (with `kv_sink_tokens`, default 4) turns on the APPROXIMATE sliding-window
    mode (StreamingLLM): each token attends to the first sink tokens and the N - sinks most
    recent ones, older blocks are freed, and a conversation may run past the model's context
    (`max_tokens` is not capped by it) in constant memory; prefix caching is off in this mode.
    `speculative_config={"method": "suffix", ...}` (vLLM's keys) drafts every greedy request
    from suffix trees over its own text and its tenant's earlier outputs (`drafts/suffix.py`).
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        dtype: str = "float32",
        kv_cache_memory: int | str = "1GiB",
        block_size: int = 16,
        use_kv_cache: bool = True,
        enable_prefix_caching: bool = True,
        max_pinned_fraction: float = 0.5,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_parallel_samples: int = 16,
        num_threads: int | None = None,
        skip_tokenizer_init: bool = False,
        kv_disk_dir: str | os.PathLike[str] | None = None,
        kv_disk_size: int | str = "10GiB",
        kv_redis_url: str | None = None,
        kv_redis_ttl_s: int = 86400,
        kv_cache_dtype: str = "auto",
        kv_window: int | None = None,
        kv_sink_tokens: int = 4,
        chunk_cache_memory: int | str = "512MiB",
        state_snapshot_every: int = 0,
        quantization: str | None = None,
        kernels: str = "auto",
        speculative_config: dict[str, Any] | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=parse_size(kv_cache_memory),
                use_kv_cache=use_kv_cache,
                enable_prefix_caching=enable_prefix_caching,
                max_pinned_fraction=max_pinned_fraction,
                kv_disk_dir=os.fspath(kv_disk_dir) if kv_disk_dir is not None else None,
                kv_disk_bytes=parse_size(kv_disk_size),
                kv_redis_url=kv_redis_url,
                kv_redis_ttl_s=kv_redis_ttl_s,
                kv_cache_dtype=kv_cache_dtype,
                kv_window=kv_window,
                kv_sink_tokens=kv_sink_tokens,
                chunk_cache_memory=parse_size(chunk_cache_memory),
                state_snapshot_every=state_snapshot_every,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_parallel_samples=max_parallel_samples,
            ),
            num_threads=num_threads,
            skip_tokenizer_init=skip_tokenizer_init,
            quantization=quantization,
            kernels=kernels,
            drafts=DraftConfig.from_speculative_config(speculative_config),
        )
        keep_freed_memory()  # a step's large temporaries reuse freed memory (kernels/allocator.py)
        self.engine = LLMEngine(config, clock)

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def info(self) -> ModelInfo:
        """The model as this engine runs it: name, fingerprint, formats, KV layout, sizes."""
        return self.engine.info

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        blend: BlendParams | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion (batched); outputs come back in prompt order.

        A prompt is a string, `{"prompt_token_ids": [...]}` (optionally with "prompt") or
        `{"segments": [str | Chunk, ...]}` (each segment tokenized alone). A dict may also
        carry `"draft_token_ids"`: a guess at the output that the engine verifies in one step
        (greedy requests keep exactly their own tokens; see `drafts/`). With `blend`, the
        chunks of segmented prompts reuse cached K/V (APPROXIMATE, see the class docstring).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _broadcast(sampling_params, len(prompts))
        return [out for out, _ in self._run(prompts, params, cache_salt, blend)]

    def _run(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams],
             cache_salt: str | None, blend: BlendParams | None, num_scored: int = 0
             ) -> list[tuple[RequestOutput, torch.Tensor | None]]:
        requests = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids, spec = self._prompt_input(prompt, blend)
                requests.append(self.engine.add_request(
                    ids, p, cache_salt=cache_salt, draft_token_ids=_draft_input(prompt),
                    blend=spec, num_scored=num_scored))
            final: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        finally:
            # An error mid-batch (or Ctrl-C) must not leave requests holding blocks.
            for r in requests:
                self.engine.abort(r.request_id)
        # Only a single request scores positions (`score`); a sample group (n > 1) has none.
        return [(final[r.request_id], r.scored if isinstance(r, Request) else None)
                for r in requests]

    def _prompt_input(self, prompt: PromptType, blend: BlendParams | None
                      ) -> tuple[str | list[int], BlendSpec | None]:
        if isinstance(prompt, dict) and "segments" in prompt:
            ids, chunks = tokenize_segments(self.engine.tokenizer, prompt["segments"])
            return ids, BlendSpec(blend, tuple(chunks)) if blend is not None and chunks else None
        return _prompt_input(prompt), None

    def score(self, prompts: PromptType | Sequence[PromptType], num_positions: int = 1,
              blend: BlendParams | None = None, cache_salt: str | None = None
              ) -> list[ScoredPrompt]:
        """Log-probability distributions at each prompt's last `num_positions` positions
        (the last one is the first output token's), e.g. to measure what blending costs
        against full prefill: `score(p, blend=BlendParams(...))` vs `score(p)`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(num_positions, int) or num_positions < 1:
            raise InvalidRequestError(f"num_positions must be >= 1, got {num_positions!r}")
        params = [SamplingParams(max_tokens=1, temperature=0.0)] * len(prompts)
        runs = self._run(prompts, params, cache_salt, blend, num_positions)
        return [ScoredPrompt(out, scored) for out, scored in runs if scored is not None]

    def precompute_chunks(self, chunks: Sequence[str | Chunk | Document],
                          cache_salt: str | None = None) -> int:
        """Compute and cache the K/V of these chunks (texts, Chunks or chat documents, which
        are rendered as `chat(documents=...)` renders them) ahead of the requests that use
        them; waits for the tier writes. Returns how many were computed (the rest were
        cached already)."""
        blender = self.blender
        if blender is None:
            raise InvalidRequestError("the chunk cache needs the paged KV cache, not window "
                                      "mode nor int4 K/V")
        if isinstance(chunks, (str, Chunk, Mapping)):
            chunks = [chunks]
        ids = []
        for i, chunk in enumerate(chunks):
            if isinstance(chunk, Mapping):
                chunk = document_text(chunk, f"chunks[{i}]")
            ids.append(tokenize_segments(self.engine.tokenizer, [Chunk(chunk) if isinstance(
                chunk, str) else chunk])[0])
        return blender.precompute(ids, cache_salt)

    def stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Run one prompt, yielding its output after every new token (cumulative text)."""
        params = sampling_params or SamplingParams()
        request = self.engine.add_request(_prompt_input(prompt), params, cache_salt=cache_salt,
                                          draft_token_ids=_draft_input(prompt))
        try:
            while not request.finished:
                for out in self.engine.step():
                    if out.request_id == request.request_id:
                        yield out
        finally:
            self.engine.abort(request.request_id)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
        documents: Sequence[Document] | None = None,
        blend: BlendParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them.

        `documents` (`[{"title": ..., "text": ...}]`, for every conversation) go into the
        system message, each one a chunk (the template is in `blend/segments.py` and
        docs/cache/blending.md); with `blend` their K/V are reused from the chunk cache
        (APPROXIMATE)."""
        conversations = cast(Sequence[Sequence[Message]], [messages] if messages and isinstance(
            messages[0], dict) else messages)
        prompts: list[PromptType] = []
        for c in conversations:
            if documents:
                marked, texts = with_documents(c, documents)
                prompts.append({"segments": chat_segments(self.engine.tokenizer, marked, texts,
                                                          add_generation_prompt)})
            else:
                prompts.append({"prompt_token_ids": self.apply_chat_template(
                    c, add_generation_prompt)})
        return self.generate(prompts, sampling_params, cache_salt=cache_salt, blend=blend)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        return chat_token_ids(self.engine.tokenizer, messages, add_generation_prompt)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cache_snapshot(self) -> KVSnapshot | None:
        """The KV pool block by block (see `LLMEngine.cache_snapshot`)."""
        return self.engine.cache_snapshot()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block not in use (e.g. after reloading weights)."""
        return self.engine.reset_prefix_cache()

    def forget_drafts(self, cache_salt: str | None = None) -> int:
        """Drop the outputs kept for one tenant's suffix drafts (`cache_salt` as given to
        `generate`; the server's tenants are salted by key); returns how many."""
        forget = getattr(self.engine.hooks.features.get("drafts"), "forget", None)
        return int(forget(cache_salt)) if callable(forget) else 0

    def reset_chunk_cache(self) -> int:
        """Drop the blend chunk entries held in memory (the tiers keep theirs, so later
        requests restore them from there); returns how many."""
        return self.blender.reset_cache() if self.blender is not None else 0

    @property
    def blender(self) -> Blender | None:
        """Blending's chunk cache and blended steps, as registered with the engine's hooks
        (None: no KV cache, window mode, int4 K/V or a model with sliding-window layers)."""
        blender = self.engine.hooks.features.get("blend")
        return blender if isinstance(blender, Blender) else None

    def warm(self, prompt: PromptType, cache_salt: str | None = None) -> int:
        """Precompute a prompt's KV into the tiers (a named prompt cache, e.g. a document that
        later requests start with); returns how many tokens the tiers hold for it."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        out = self.generate(prompt, params, cache_salt=cache_salt)[0]
        return self.engine.warm(out.prompt_token_ids, cache_salt)

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters of the disk and Redis tiers: hits, misses, stores, faults by kind, bytes."""
        return self.engine.tier_stats()

    def close(self) -> None:
        """Wait for pending tier writes and release the tiers; also runs at interpreter exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        try:
            return list(prompt["prompt_token_ids"])
        except TypeError:
            raise InvalidRequestError("prompt_token_ids must be a list of token ids") from None
    raise InvalidRequestError("a prompt is a string or a dict with 'prompt_token_ids'")


def _draft_input(prompt: PromptType) -> list[int] | None:
    if not isinstance(prompt, dict) or prompt.get("draft_token_ids") is None:
        return None
    try:
        return list(prompt["draft_token_ids"])
    except TypeError:
        raise InvalidRequestError("draft_token_ids must be a list of token ids") from None


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
