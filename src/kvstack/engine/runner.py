"""Turns a scheduled step into tensors, runs the model and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.engine.hooks import StepHooks
from kvstack.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvstack.engine.steps import StepBuilder, StepInputs
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.sampler import Sampler, top_logprobs
from kvstack.models import CausalLM


@dataclass
class Sampled:
    """What one request gained in a step."""

    token_ids: list[int]  # accepted draft tokens (if any), then the model's own next token
    logprobs: list[float] | None  # of each token, when the request asked for logprobs
    num_rejected: int = 0  # draft tokens fed this step that the model did not accept
    # Per token, the `logprobs=k` most likely tokens at its position (k > 0 only).
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class StepResult:
    # One entry per scheduled request; None where the step did not reach a new token
    # (a prefill chunk that is not the last).
    samples: list[Sampled | None]


class ModelRunner:
    """`steps`: the KV mode's step builder (`engine/steps.py`); `hooks`: the features'
    hook points (`engine/hooks.py`), which may give a step a layer hook."""

    def __init__(self, model: CausalLM, kv_storage: KVCacheStorage | None, sampler: Sampler,
                 steps: StepBuilder, hooks: StepHooks | None = None) -> None:
        self.model = model
        self.steps = steps
        self.hooks = hooks if hooks is not None else StepHooks()
        self.kv_storage = kv_storage
        self.sampler = sampler

    def run(self, batch: SchedulerOutput) -> StepResult:
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hook = self.hooks.layer_hook(batch.scheduled, positions, meta)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_storage, hook)
        result = StepResult([None] * len(batch.scheduled))
        if any(s.request.num_scored for s in batch.scheduled):
            self._record_scores(batch, hidden)
        if any(s.request.prompt_scores is not None for s in batch.scheduled):
            self._score_prompts(batch, hidden)
        if sample_rows.numel():
            self._sample(batch, self.model.compute_logits(hidden[sample_rows]), result)
        return result

    def _sample(self, batch: SchedulerOutput, logits: torch.Tensor, result: StepResult) -> None:
        """logits: one row per sampling request, or 1 + its draft tokens' rows for one that
        verifies drafts (`_prepare` lays them out in scheduled order)."""
        plain: list[int] = []  # indices into batch.scheduled
        plain_rows: list[int] = []
        row = 0
        for i, s in enumerate(batch.scheduled):
            if not s.samples:
                continue
            if s.num_draft_tokens:
                rows = logits[row:row + s.num_draft_tokens + 1]
                token_ids, num_rejected = self.hooks.verify(rows, s.draft_token_ids)
                result.samples[i] = Sampled(token_ids, _logprobs(rows, token_ids, s),
                                            num_rejected, _top(rows[:len(token_ids)], s))
                row += s.num_draft_tokens + 1
            else:
                plain.append(i)
                plain_rows.append(row)
                row += 1
        if not plain:
            return
        states = [batch.scheduled[i].request.sampling_state for i in plain]
        # Rows are taken in order, so all of them is the whole tensor: no copy (~70 us).
        rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
        tokens, logprobs = self.sampler(rows, states)
        ks = [s.sampling_params.logprobs or 0 for s in states]
        top = top_logprobs(rows, ks) if any(ks) else None
        for j, i in enumerate(plain):
            result.samples[i] = Sampled([tokens[j]],
                                        [logprobs[j]] if logprobs is not None else None,
                                        top_logprobs=[top[j]] if top and ks[j] else None)

    def _score_prompts(self, batch: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Each scoring request's rows of this step into its prompt scores (row p scores
        prompt token p + 1)."""
        row = 0
        for s in batch.scheduled:
            scores = s.request.prompt_scores
            if scores is not None and s.request.num_computed_tokens < scores.num_prompt_tokens:
                scores.score_step(s.request.num_computed_tokens,
                                  hidden[row:row + s.num_new_tokens], self.model.compute_logits)
            row += s.num_new_tokens

    def _record_scores(self, batch: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Log-prob rows of the scored prompt positions each request computed this step, into
        the request (`Request.record_scores`)."""
        row = 0
        for s in batch.scheduled:
            r = s.request
            first = r.num_prompt_tokens - r.num_scored
            lo = max(first, r.num_computed_tokens)
            hi = min(r.num_prompt_tokens, r.num_computed_tokens + s.num_new_tokens)
            if r.num_scored and lo < hi:
                rows = hidden[row + lo - r.num_computed_tokens: row + hi - r.num_computed_tokens]
                r.record_scores(lo - first, torch.log_softmax(self.model.compute_logits(rows), -1))
            row += s.num_new_tokens

    def _prepare(self, batch: SchedulerOutput) -> StepInputs:
        return self.steps.prepare(batch)


def _logprobs(logits: torch.Tensor, token_ids: list[int], s: ScheduledRequest
              ) -> list[float] | None:
    """Log-probabilities of the emitted tokens under the raw model distribution, row by row."""
    if s.request.sampling_params.logprobs is None:
        return None
    chosen = torch.tensor(token_ids)[:, None]
    rows = logits[: len(token_ids)]
    return torch.log_softmax(rows.float(), dim=-1).gather(1, chosen)[:, 0].tolist()


def _top(rows: torch.Tensor, s: ScheduledRequest) -> list[list[tuple[int, float]]] | None:
    """The top alternatives of each emitted token's row, when the request asked for k > 0."""
    k = s.request.sampling_params.logprobs
    return top_logprobs(rows, [k] * rows.shape[0]) if k else None
