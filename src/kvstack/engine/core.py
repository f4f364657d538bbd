"""The step loop: schedule -> run -> update -> emit. Synchronous; the async and offline
front ends drive it."""

from __future__ import annotations

import hashlib
import itertools
import operator
import time
from collections.abc import Sequence

import torch

from kvstack.config import EngineConfig
from kvstack.engine.detokenizer import IncrementalDetokenizer, NullDecoder, find_stop, stop_holdback
from kvstack.engine.request import Request
from kvstack.engine.runner import ModelRunner
from kvstack.engine.scheduler import Scheduler, SchedulerOutput
from kvstack.engine.stats import EngineStats
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.errors import CapacityError, InvalidRequestError, PromptTooLongError
from kvstack.kv.dtypes import resolve
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.sizing import KVShape
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.storage.quantized import make_kv_storage
from kvstack.kv.tiers.base import TierStats
from kvstack.kv.tiers.chain import TierChain, build_tiers
from kvstack.kv.tiers.codec import BlockFormat
from kvstack.kv.window import SlidingWindow
from kvstack.layers.sampler import Sampler
from kvstack.models import model_class
from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.weights import load_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        ckpt = load_checkpoint(config.model)
        self.model_config = ckpt.config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(ckpt)
        self.dtype = _DTYPES[config.dtype]
        self.model = model_class(ckpt.config.architecture)(
            ckpt.config, self.dtype, config.quantization, use_kernels=config.kernels == "auto"
        )
        self.model.load_weights(ckpt.tensors)
        # Blocks are only shared between engines with the same weights, tokenizer, dtype and
        # weight format (int8 weights give other K/V).
        fingerprint = f"{ckpt.fingerprint}|{config.dtype}"
        if config.quantization:
            fingerprint += f"|{config.quantization}"
        cache = config.cache
        self.kv_cache_dtype = resolve(cache.kv_cache_dtype, config.dtype)
        self.window = (SlidingWindow(cache.kv_window, cache.kv_sink_tokens, cache.block_size)
                       if cache.kv_window is not None else None)
        # ... and the same KV dtype and attention (window mode); the default KV dtype (the
        # model's) keeps the fingerprint it always had.
        if self.kv_cache_dtype != config.dtype:
            fingerprint += f"|kv={self.kv_cache_dtype}"
        if self.window is not None:
            fingerprint += f"|window={self.window.window},{self.window.sink_tokens}"
        self.fingerprint = hashlib.sha256(fingerprint.encode()).hexdigest()
        del ckpt
        self.eos_token_ids = self._eos_ids()
        if self.window is not None and self.window.window > self.max_model_len:
            raise InvalidRequestError(
                f"kv_window {self.window.window} is longer than the model's context "
                f"({self.max_model_len} tokens); give a smaller kv_window"
            )
        self.kv_storage: KVCacheStorage | None = None
        self.kv_manager: KVCacheManager | None = None
        self.kv_tiers: TierChain | None = None
        if cache.use_kv_cache:
            shape = KVShape.of(self.model_config, self.kv_cache_dtype, block_size=cache.block_size,
                               model_dtype=config.dtype, window=cache.kv_window,
                               sink_tokens=cache.kv_sink_tokens)
            max_num_seqs = config.scheduler.max_num_seqs
            num_blocks = shape.num_blocks_for_budget(cache.kv_cache_memory,
                                                     max_num_seqs=max_num_seqs)
            if num_blocks < 1:
                raise InvalidRequestError(
                    f"kv_cache_memory {cache.kv_cache_memory} B holds no block of "
                    f"{shape.bytes_per_block} B (plus {shape.window_pool_bytes(max_num_seqs)} B "
                    "of int4 window); raise kv_cache_memory"
                )
            self.kv_storage = make_kv_storage(self.model_config, num_blocks, cache.block_size,
                                              self.kv_cache_dtype, self.dtype, max_num_seqs)
            block_format = BlockFormat(self.fingerprint, self.kv_cache_dtype, shape.num_layers,
                                       shape.num_kv_heads, shape.head_dim, cache.block_size)
            self.kv_tiers = build_tiers(cache, block_format, self.kv_storage)
            self.kv_manager = KVCacheManager(
                num_blocks, cache.block_size,
                cache.enable_prefix_caching and self.window is None, self.fingerprint,
                int(num_blocks * cache.max_pinned_fraction), self.kv_tiers, self.window,
                self.kv_storage.release,
            )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.runner = ModelRunner(self.model, self.kv_storage, Sampler(), self.window)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and queue a request. Raises a KvstackError subclass on bad input."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(prompt)
        max_len = self.max_model_len
        if self.window is not None:
            # Window mode never runs out of context: positions are indices in the window.
            max_tokens = params.max_tokens or max_len
        elif len(token_ids) >= max_len:
            raise PromptTooLongError(len(token_ids), max_len)
        else:
            max_tokens = min(params.max_tokens or max_len, max_len - len(token_ids))
        self._check_capacity(len(token_ids) + max_tokens)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=max_tokens,
            detokenizer=IncrementalDetokenizer(self.tokenizer or NullDecoder(), token_ids,
                                               params.skip_special_tokens),
            cache_salt=cache_salt,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this engine runs without a tokenizer; give prompt_token_ids"
                )
            if not prompt:
                raise InvalidRequestError("prompt is empty; give at least one token of text")
            return list(self.tokenizer.encode(prompt))
        token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt_token_ids is empty; give at least one token")
        vocab = self.model_config.vocab_size
        token_ids = [_as_index(t) for t in token_ids]
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab}); "
                "give integer ids from this model's tokenizer"
            )
        return token_ids

    def _check_capacity(self, num_tokens: int) -> None:
        if self.kv_manager is None:
            return
        need = self.kv_manager.max_blocks_held(num_tokens)
        have = self.kv_manager.pool.num_blocks
        if need > have:
            bs = self.kv_manager.block_size
            fix = "lower kv_window" if self.window is not None else "lower max_tokens"
            raise CapacityError(
                f"request needs {need} KV blocks ({num_tokens} tokens) but the pool holds "
                f"{have} ({have * bs} tokens); {fix} or raise kv_cache_memory"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return outputs of requests that gained tokens or finished."""
        if self.kv_manager is not None:
            self.kv_manager.pins.expire(time.monotonic())
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return []
        now = time.perf_counter()
        for s in batch.scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        result = self.runner.run(batch)
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(batch, result.prompt_logprobs)
        self.scheduler.after_step(batch)
        return self._update(batch, result.token_ids, result.logprobs)

    @staticmethod
    def _record_prompt_logprobs(
        batch: SchedulerOutput, scored: list[tuple[int, list[float]] | None]
    ) -> None:
        for s, entry in zip(batch.scheduled, scored, strict=True):
            if entry is None:
                continue
            r = s.request
            if not r.prompt_logprobs:
                r.prompt_logprobs = [None] * r.num_prompt_tokens
            first, values = entry
            # By index, so a preempted request that recomputes its prompt rewrites, not appends.
            r.prompt_logprobs[first : first + len(values)] = values

    def _update(
        self,
        batch: SchedulerOutput,
        token_ids: list[int | None],
        logprobs: list[float | None],
    ) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for s, token, logprob in zip(batch.scheduled, token_ids, logprobs, strict=True):
            request = s.request
            if token is None or request.finished:
                continue
            if not request.output_token_ids:
                self.num_prompt_tokens += request.num_prompt_tokens
            self.num_generation_tokens += 1
            self._append_token(request, token, logprob, now)
            if request.finished:
                self.requests.pop(request.request_id, None)
            outputs.append(self.make_output(request))
        return outputs

    def _append_token(self, request: Request, token: int, logprob: float | None,
                      now: float) -> None:
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        request.output_token_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        delta = request.detokenizer.add(token)
        request.text += delta
        reason = self._stop_reason(request, token, delta)
        if reason is not None:
            m.finished_time = now
            self.scheduler.finish(request, reason)

    def _stop_reason(self, request: Request, token: int, delta: str) -> str | None:
        p = request.params
        if p.stop_token_ids and token in p.stop_token_ids:
            request.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            request.stop_reason = token
            return "stop"
        if p.stop:
            match = find_stop(request.text, len(delta), p.stop)
            if match is not None:
                index, stop = match
                request.text = request.text[: index + (len(stop) if
                                                       p.include_stop_str_in_output else 0)]
                request.stop_reason = stop
                return "stop"
        if len(request.output_token_ids) >= request.max_tokens:
            return "length"
        return None

    def make_output(self, request: Request) -> RequestOutput:
        text = request.text
        if not request.finished and request.params.stop:
            # Hold back a tail that may still grow into a stop string.
            text = text[: len(text) - stop_holdback(text, request.params.stop)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=request.metrics,
            prompt_logprobs=(list(request.prompt_logprobs or [None] * request.num_prompt_tokens)
                             if request.params.prompt_logprobs is not None else None),
        )

    # -- cache control and stats ------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache() if self.kv_manager else 0

    def pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, ttl_s: float
    ) -> tuple[int, int]:
        """Keep the cached blocks of this prefix from eviction for `ttl_s` seconds (a pin hit
        again is refreshed). Returns (tokens newly pinned, tokens already pinned); only full
        blocks already in the prefix cache are pinned, so call it after the prefill."""
        if self.kv_manager is None:
            return 0, 0
        now = time.monotonic()
        self.kv_manager.pins.expire(now)
        return self.kv_manager.pin_prefix(list(token_ids), cache_salt, now + ttl_s)

    def warm(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Make sure the tiers hold this prefix's full blocks, which a finished prefill left in
        the memory cache; returns the tokens the tiers now hold (waits for the writes)."""
        if self.kv_tiers is None or self.kv_manager is None:
            raise InvalidRequestError("warming needs a KV tier; give kv_disk_dir or kv_redis_url")
        hashes = self.kv_manager.prefix_hashes(token_ids, cache_salt)
        self.kv_tiers.flush()
        held = self.kv_tiers.lookup(hashes)
        if held < len(hashes):
            # Dropped from a full write queue, or lost by a tier since: write them again.
            self.kv_tiers.forget(hashes[held:])
            self.kv_tiers.offload(self.kv_manager.cached_run(hashes)[held:], wait=True)
            self.kv_tiers.flush()
            held = self.kv_tiers.lookup(hashes)
        return held * self.kv_manager.block_size

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait for blocks queued for the tiers to be written; False on timeout."""
        return self.kv_tiers.flush(timeout) if self.kv_tiers else True

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters of each tier below the memory pool, by tier name (disk, redis)."""
        return {s.name: s for s in self.kv_tiers.stats()} if self.kv_tiers else {}

    def close(self) -> None:
        """Wait for pending tier writes and release the tiers (idempotent)."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    def stats(self) -> EngineStats:
        kv = self.kv_manager
        pool = kv.pool if kv else None
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            block_size=kv.block_size if kv else 0,
            num_blocks_total=pool.num_blocks if pool else 0,
            num_blocks_free=pool.num_free if pool else 0,
            num_blocks_cached=pool.num_cached_free if pool else 0,
            num_blocks_used=pool.num_in_use if pool else 0,
            kv_cache_bytes=self.kv_storage.num_bytes if self.kv_storage else 0,
            prefix_cache_query_tokens=kv.num_query_tokens if kv else 0,
            prefix_cache_hit_tokens=kv.num_hit_tokens if kv else 0,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_blocks_pinned=len(kv.pins) if kv else 0,
            tier_hit_tokens=kv.num_restored_tokens if kv else 0,
            tiers=self.kv_tiers.stats() if self.kv_tiers else (),
        )

    def check_integrity(self) -> None:
        if self.kv_manager is not None:
            self.kv_manager.pool.check_integrity()
            self.kv_manager.pins.check_integrity()


def _as_index(value: object) -> object:
    """numpy and torch integers as plain ints (they are valid ids); anything else unchanged."""
    try:
        return operator.index(value)
    except TypeError:
        return value
