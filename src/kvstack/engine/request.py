"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvstack.engine.detokenizer import IncrementalDetokenizer
from kvstack.layers.sampler import SamplingState
from kvstack.outputs import (
    BLENDED,
    COMPUTED,
    PREFIX_CACHE,
    TIER,
    BlendUsage,
    PromptLogprobs,
    Provenance,
    RequestMetrics,
)
from kvstack.sampling_params import SamplingParams


class StepPlan(Protocol):
    """A request's own say in how its prompt is cut into steps and which of its K/V are
    exact (a blended request's region, `blend/state.py`, set by blending's `on_add` hook):
    the scheduler, the KV manager's publishing and the output ask it, never which feature
    made it."""

    def admit(self, prefix_len: int) -> None:
        """Admitted with this exact prefix hit."""
        ...
    def fit(self, start: int, num_new: int, num_rest: int, region_taken: bool) -> int:
        """Tokens from `start` this step, `num_new` being what the budget allows; 0: wait."""
        ...
    def is_region_step(self, start: int) -> bool:
        """True when the step from `start` is the one run whole (one such step at a time)."""
        ...
    @property
    def exact_limit(self) -> int | None:
        """Tokens whose K/V are exact, so publishable (None: all of them)."""
        ...
    @property
    def reused_runs(self) -> Sequence[tuple[int, int]]:
        """Prompt positions [start, end) whose K/V were reused, not computed."""
        ...
    def final_usage(self) -> BlendUsage | None:
        """What the plan reused, for the output (None: nothing to report)."""
        ...


class PromptScoring(Protocol):
    """A request's prompt scores (prompt logprobs, `scoring/prompt.py`, set by scoring's
    `on_add` hook): the runner feeds it each step's rows, the output shows it."""

    @property
    def num_prompt_tokens(self) -> int: ...
    def score_step(self, start: int, hidden: torch.Tensor,
                   compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None: ...
    def logprobs(self, k: int) -> PromptLogprobs: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never past the model's context
    detokenizer: IncrementalDetokenizer
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # With prompt_logprobs: the prompt's scores (parallel samples: sample 0's are shown).
    prompt_scores: PromptScoring | None = None
    # Tokens whose K/V sit in this request's blocks (the KV manager holds its block table);
    # advanced only by the scheduler.
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_restored_tokens: int = 0  # of num_cached_tokens, restored from a tier
    num_preemptions: int = 0
    resumed_at_step: int = -1
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # output text, stop strings already cut
    # A feature's own per-request state, by the feature's name (set by its `on_add` hook):
    # only that feature reads it, so the engine's request names no feature.
    feature_state: dict[str, object] = field(default_factory=dict)
    # Per output token, its `logprobs=k` most likely alternatives (k > 0 only).
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # A request a feature split into several (parallel samples, `samples/`): the caller's
    # request id and this one's index (None: a request of its own), and on the request that
    # computes the shared prompt, the ones still to fork from it once the prompt is computed
    # (the scheduler forks them; they are queued with it).
    parent_request_id: str | None = None
    sample_index: int = 0
    pending_forks: list[Request] = field(default_factory=list)
    # Output tokens by source (outputs.DRAFT, outputs.MODEL) as [source, count] runs.
    output_sources: list[list[str | int]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    # The request's own plan of its prompt's steps, if a feature gave it one (blending's).
    step_plan: StepPlan | None = None
    # Log-probability rows [num_scored, vocab] of the last num_scored prompt positions, when
    # asked for (`LLM.score`): row i predicts the token after position N - num_scored + i.
    num_scored: int = 0
    scored: torch.Tensor | None = None
    sampling_state: SamplingState = field(init=False)

    def __post_init__(self) -> None:
        # The state shares `output_token_ids`: appending a token here is the sampler's view too.
        self.sampling_state = SamplingState(
            sampling_params=self.sampling_params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def record_scores(self, first: int, values: torch.Tensor) -> None:
        """Scored rows from row `first` on (by index: a recomputed prompt rewrites them)."""
        if self.scored is None:
            self.scored = torch.full((self.num_scored, values.shape[1]), float("nan"))
        self.scored[first:first + values.shape[0]] = values

    @property
    def num_exact_tokens(self) -> int | None:
        """Tokens whose K/V are exact, so publishable to the prefix cache (None: all)."""
        return self.step_plan.exact_limit if self.step_plan is not None else None

    @property
    def scores_prompt(self) -> bool:
        """True when the request scores its prompt (prompt logprobs)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (a
        decode step needs one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def add_output_source(self, source: str) -> None:
        runs = self.output_sources
        if runs and runs[-1][0] == source:
            runs[-1][1] += 1  # type: ignore[operator]
        else:
            runs.append([source, 1])

    def provenance(self) -> Provenance:
        """Where the prompt's K/V and the output tokens came from (see `outputs.Provenance`)."""
        cached = max(self.num_cached_tokens, 0)
        runs = [(PREFIX_CACHE, cached - self.num_restored_tokens),
                (TIER, self.num_restored_tokens)]
        at = cached
        for start, end in self.step_plan.reused_runs if self.step_plan is not None else ():
            runs += [(COMPUTED, start - at), (BLENDED, end - start)]
            at = end
        runs.append((COMPUTED, self.num_prompt_tokens - at))
        return Provenance(tuple((s, n) for s, n in runs if n > 0),
                          tuple((str(s), int(n)) for s, n in self.output_sources))

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(eq=False)
class RequestGroup:
    """A caller's request that runs as several engine requests (a feature split it:
    parallel samples), as `LLMEngine.add_request` returns it."""

    request_id: str  # the caller's; each engine request has its own
    requests: list[Request]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.requests)
