"""The step loop: schedule -> run -> update -> emit. Synchronous; the async and offline
front ends drive it."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import asdict

from kvstack.clock import MONOTONIC, Clock
from kvstack.config import EngineConfig
from kvstack.engine.builder import build_engine, eos_token_ids
from kvstack.engine.detokenizer import IncrementalDetokenizer, NullDecoder
from kvstack.engine.hooks import NewRequest
from kvstack.engine.info import ModelInfo
from kvstack.engine.request import Request, RequestGroup
from kvstack.engine.request_output import request_output, stop_reason
from kvstack.engine.runner import ModelRunner, Sampled
from kvstack.engine.scheduler import Scheduler, SchedulerOutput
from kvstack.engine.stats import EngineStats
from kvstack.engine.tokenizer import check_token_ids
from kvstack.errors import InvalidRequestError, PromptTooLongError
from kvstack.kv.block_pool import BlockListener
from kvstack.kv.snapshot import KVSnapshot
from kvstack.kv.tiers.base import BlockTiers, TierStats
from kvstack.layers.sampler import Sampler
from kvstack.outputs import DRAFT, MODEL, RequestOutput
from kvstack.recurrent.store import StateStore
from kvstack.recurrent.tiers import SnapshotSide
from kvstack.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Clock = MONOTONIC) -> None:
        self.config = config
        self.clock = clock  # pin deadlines and the tiers' retry pauses are on this clock
        parts = build_engine(config, clock)
        self.model_config = parts.model_config
        self.model = parts.model
        self.tokenizer = parts.tokenizer
        self.fingerprint = parts.fingerprint
        self.kv_cache_dtype = parts.kv_cache_dtype
        self.kv_storage = parts.kv_storage
        self.kv_manager = parts.kv_manager
        self.kv_tiers = parts.kv_tiers
        self.scores = parts.score_store  # prompt scores beside the cached blocks (`scoring/`)
        self.info = ModelInfo(
            name=config.model, config=parts.model_config, fingerprint=parts.fingerprint,
            dtype=config.dtype, quantization=config.quantization,
            kv_cache_dtype=parts.kv_cache_dtype, num_weight_bytes=parts.model.num_weight_bytes,
            kv_shape=parts.kv_shape,
            num_kv_blocks=parts.kv_manager.num_blocks,
            kv_cache_bytes=parts.kv_storage.num_bytes if parts.kv_storage else 0,
            kv_window=config.cache.kv_window,
            kv_sink_tokens=config.cache.kv_sink_tokens if config.cache.kv_window else 0,
        )
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        assert parts.steps is not None and parts.tier_control is not None  # build_engine's
        self.tier_control = parts.tier_control
        self.hooks = parts.hooks  # optional features' hook points (`engine/hooks.py`)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.hooks.feed)
        self.runner = ModelRunner(self.model, self.kv_storage, Sampler(), parts.steps,
                                  self.hooks)
        self.requests: dict[str, Request] = {}
        # Outputs made between steps (an abort that ended a caller's request), for the next.
        self.pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        **options: object,
    ) -> Request | RequestGroup:
        """Validate and queue a request. Raises a KvstackError subclass on bad input.

        `options`: the registered features' own inputs (`StepHooks.options`), each read by its
        feature's `on_add` hook: `blend=BlendSpec(...)` reuses the prompt's chunks' K/V
        (APPROXIMATE, `blend/`); `num_scored=k` keeps the log-prob rows of the last k prompt
        positions (`Request.scored`); `draft_token_ids=[...]` is a guess at the output,
        verified against the model's greedy choices (`drafts/`). Any other keyword is a
        TypeError.

        A request a feature splits
        (`StepHooks.split`: n or best_of > 1, samples sharing the prompt, `samples/`) runs as
        several engine requests, returned as a `RequestGroup`."""
        if unknown := sorted(set(options) - self.hooks.options):
            raise TypeError(f"add_request() got unexpected keyword arguments {unknown}")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(prompt)
        max_tokens = self._max_tokens(sampling_params, len(token_ids))
        sp = sampling_params
        request_id = request_id if request_id is not None else str(next(self._ids))
        new = NewRequest(request_id, sp, token_ids, cache_salt, max_tokens, options=options)
        runs = self.hooks.split_request(new)  # (id, params) of each engine request
        if any(i in self.requests for i in {request_id, *(rid for rid, _ in runs)}):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        # Features check the request first (structured outputs, blending) and say how to set
        # up each of its engine requests (their per-request state).
        setups = self.hooks.run_on_add(dataclasses.replace(new, num_samples=len(runs)))
        requests = []
        for rid, params in runs:
            request = self.requests[rid] = Request(
                request_id=rid,
                prompt=text,
                prompt_token_ids=token_ids,
                sampling_params=params,
                max_tokens=max_tokens,
                detokenizer=IncrementalDetokenizer(self.tokenizer or NullDecoder(), token_ids,
                                                   sp.skip_special_tokens),
                cache_salt=cache_salt,
            )
            for setup in setups:
                setup(request)
            requests.append(request)
        forked = {id(f) for r in requests for f in r.pending_forks}  # they enter with it
        for request in requests:
            if id(request) not in forked:
                self.scheduler.add(request)
        if [r.request_id for r in requests] == [request_id]:
            return requests[0]
        return RequestGroup(request_id, requests)

    def _max_tokens(self, sampling_params: SamplingParams, num_prompt_tokens: int) -> int:
        max_len = self.max_model_len
        if self.kv_manager.unbounded_context:  # window mode: positions index the window
            return sampling_params.max_tokens or max_len
        if num_prompt_tokens >= max_len:
            raise PromptTooLongError(num_prompt_tokens, max_len)
        return min(sampling_params.max_tokens or max_len, max_len - num_prompt_tokens)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this engine runs without a tokenizer; give prompt_token_ids"
                )
            if not prompt:
                raise InvalidRequestError("prompt is empty; give at least one token of text")
            return list(self.tokenizer.encode(prompt))
        return check_token_ids(list(prompt), self.model_config.vocab_size)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored. The
        id of a request a feature split stops all its engine requests (`StepHooks.on_abort`:
        a parallel-sampling request's samples); a sample's id (`<id>#<i>`) only that one (the
        next step reports the request if that finished it)."""
        for rid in self.hooks.aborted_ids(request_id):
            request = self.requests.pop(rid, None)
            if request is not None:
                self.scheduler.finish(request, "abort")  # ignores a finished one
                self.pending += self.hooks.run_on_finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return outputs of requests that gained tokens or finished."""
        self.hooks.run_before_schedule(self.scheduler.waiting)  # pins lapse, blending, ...
        ready, self.pending = self.pending, []
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            return ready
        now = time.perf_counter()
        for s in batch.scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        self.hooks.run_before_run(batch.scheduled)
        self.scores.before_run(s.request for s in batch.scheduled)
        result = self.runner.run(batch)
        # Tokens first (a block's hash needs its tokens), then the computed counts and the
        # blocks they complete, then the finishes: a finished request's blocks are published
        # before they are freed.
        finishing = self._append_samples(batch, result.samples)
        self.scheduler.after_step(batch, [s.num_rejected if s else 0 for s in result.samples])
        self.scores.after_step(s.request for s in batch.scheduled)
        self.hooks.run_after_step(batch.scheduled)
        for request, reason in finishing:
            self.scheduler.finish(request, reason)
            self.requests.pop(request.request_id, None)
            self.pending += self.hooks.run_on_finish(request, reason)
        gained = [s.request for s, sampled in zip(batch.scheduled, result.samples, strict=True)
                  if sampled is not None]
        return ready + self.hooks.outputs(gained, self.make_output)

    def _append_samples(self, batch: SchedulerOutput,
                        samples: list[Sampled | None]) -> list[tuple[Request, str]]:
        """Append each request's new tokens one by one (a stop ends it mid-draft); returns the
        requests that finished and why, to be finished once their blocks are published."""
        now = time.perf_counter()
        finishing = []
        for s, sampled in zip(batch.scheduled, samples, strict=True):
            request = s.request
            if sampled is None or request.finished:
                continue
            if not request.output_token_ids and s.num_new_tokens:  # a fork shares its prompt
                self.num_prompt_tokens += request.num_prompt_tokens
            num_accepted = len(sampled.token_ids) - 1  # verified draft tokens (`drafts/`)
            self.hooks.run_after_sampling(request, s.num_draft_tokens, sampled.token_ids)
            for k, token in enumerate(sampled.token_ids):
                self.num_generation_tokens += 1
                request.add_output_source(DRAFT if k < num_accepted else MODEL)
                logprob = sampled.logprobs[k] if sampled.logprobs is not None else None
                if sampled.top_logprobs is not None:
                    request.top_logprobs.append(sampled.top_logprobs[k])
                reason = self._append_token(request, token, logprob, now)
                if reason is not None:
                    finishing.append((request, reason))
                    break
        return finishing

    def _append_token(self, request: Request, token: int, logprob: float | None,
                      now: float) -> str | None:
        """Append one output token; returns why the request stops there, or None."""
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        else:
            assert m.last_token_time is not None  # set with the first token
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        request.output_token_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        delta = request.detokenizer.add(token)
        request.text += delta
        reason = stop_reason(request, token, delta, self.eos_token_ids)
        if reason is not None:
            m.finished_time = now
        return reason

    def make_output(self, request: Request) -> RequestOutput:
        return self.hooks.run_fill_output(request, request_output(request))

    # -- cache control and stats ------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache()

    def add_block_listener(self, listener: BlockListener) -> None:
        """Tell `listener` of every block hash entering or leaving the prefix cache (on the
        step thread; a cluster replica publishes them to its router)."""
        if not self.kv_manager.add_listener(listener):
            raise InvalidRequestError("block listeners need the prefix cache; turn it on")

    def set_block_tiers(self, tiers: BlockTiers) -> None:
        """Prefix hits restore from, new blocks write through to, `tiers` (wrapping kv_tiers)."""
        if not self.kv_manager.set_tiers(tiers):
            raise InvalidRequestError("block tiers need the prefix cache; turn it on")
        store = self.hooks.features.get("recurrent")
        if isinstance(store, StateStore) and store.tiers is not None:
            # a hybrid model's snapshots travel beside the blocks where these tiers carry them
            store.tiers.side = tiers if isinstance(tiers, SnapshotSide) else None

    # -- tier control (`kv/tiers/control.py`) -----------------------------------------------

    def pin_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, ttl_s: float
    ) -> tuple[int, int]:
        """Keep the cached blocks of this prefix from eviction for `ttl_s` seconds (a pin hit
        again is refreshed). Returns (tokens newly pinned, tokens already pinned); only full
        blocks already in the prefix cache are pinned, so call it after the prefill."""
        return self.tier_control.pin_prefix(token_ids, cache_salt, ttl_s)

    def warm(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Make sure the tiers hold this prefix's full blocks, which a finished prefill left in
        the memory cache; returns the tokens the tiers now hold (waits for the writes)."""
        return self.tier_control.warm(token_ids, cache_salt)

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait for blocks queued for the tiers to be written; False on timeout."""
        return self.tier_control.flush(timeout)

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters of each tier below the memory pool, by tier name (disk, redis)."""
        return self.tier_control.stats()

    def close(self) -> None:
        """Wait for pending tier writes and release the tiers (idempotent)."""
        self.tier_control.close()

    def stats(self) -> EngineStats:
        usage = self.kv_manager.usage()
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_bytes=self.info.kv_cache_bytes,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            tiers=self.kv_tiers.stats() if self.kv_tiers else (),
            **(asdict(usage) if usage else {}),
            **self.hooks.stats_fields(),
        )

    def cache_snapshot(self) -> KVSnapshot | None:
        """The KV pool right now: each block's state, the published prefix blocks (tokens,
        tenant salt, hits, tiers) and the requests holding blocks; None without a KV cache.
        O(blocks) plain copies; call it between steps (AsyncLLM takes the engine lock)."""
        return self.kv_manager.snapshot()

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()
        self.scores.check_integrity()
