"""The samples of each parallel-sampling request: their ids and settings, the check that they
fit, and the one output the caller sees of them (see the package docstring)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvstack.config import SchedulerConfig
from kvstack.errors import CapacityError, InvalidRequestError
from kvstack.kv.mode import KVCacheMode
from kvstack.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from kvstack.sampling_params import SamplingParams


class PromptScores(Protocol):
    def logprobs(self, k: int) -> PromptLogprobs: ...


class Sample(Protocol):
    """What a group reads of its samples (the engine's `Request`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt(self) -> str | None: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def metrics(self) -> RequestMetrics: ...
    @property
    def prompt_scores(self) -> PromptScores | None: ...
    @property
    def parent_request_id(self) -> str | None: ...
    @property
    def finished(self) -> bool: ...


R = TypeVar("R", bound=Sample)


def sample_ids(request_id: str, num_sequences: int) -> list[str]:
    """Engine request ids of a request's sequences: its own id alone, or `<id>#<i>`."""
    if num_sequences == 1:
        return [request_id]
    return [f"{request_id}#{i}" for i in range(num_sequences)]


def sample_params(sampling_params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s own settings: one sequence, seed + index, and logprobs kept when best_of
    ranks by them."""
    sp = sampling_params
    logprobs = sp.logprobs
    if logprobs is None and sp.num_sequences > sp.n:
        logprobs = 0
    return dataclasses.replace(sp, n=1, best_of=None, logprobs=logprobs,
                               seed=None if sp.seed is None else sp.seed + index)


def check_fits(sampling_params: SamplingParams, config: SchedulerConfig,
               kv_manager: KVCacheMode, num_prompt_tokens: int,
               max_tokens: int) -> None:
    """Refuse a request whose sequences exceed the parallel-sample cap, or whose KV blocks
    (all its samples at once) exceed the pool even running alone."""
    num = sampling_params.num_sequences
    cap = min(config.max_parallel_samples, config.max_num_seqs)
    if num > cap:
        name = "best_of" if sampling_params.best_of is not None else "n"
        raise InvalidRequestError(
            f"{name} is {num} but this engine runs at most {cap} parallel samples per request "
            "(max_parallel_samples, max_num_seqs); lower it")
    need = blocks_needed(kv_manager, num_prompt_tokens, max_tokens, num)
    have = kv_manager.num_blocks
    if need > have:
        what = f"{num_prompt_tokens + max_tokens} tokens" + (f" x {num} samples" if num > 1
                                                              else "")
        fix = kv_manager.capacity_fix
        raise CapacityError(
            f"request needs {need} KV blocks ({what}) but the pool holds {have} "
            f"({have * kv_manager.block_size} tokens); {fix}{' or n' if num > 1 else ''} or "
            "raise kv_cache_memory")


def blocks_needed(kv_manager: KVCacheMode, num_prompt_tokens: int, max_tokens: int,
                  num_sequences: int) -> int:
    """KV blocks the samples hold at once, at most: the prompt's full blocks once, and each
    sample's own (its copy of a partly filled prompt tail, then its output)."""
    alone = kv_manager.max_blocks_held(num_prompt_tokens + max_tokens)
    if num_sequences == 1 or alone == 0:  # alone == 0: a mode without blocks
        return alone
    shared = num_prompt_tokens // kv_manager.block_size
    return shared + num_sequences * max(alone - shared, 1)


@dataclass(eq=False)
class SampleGroup(Generic[R]):
    """The samples of one request, as the engine tracks them."""

    request_id: str
    sampling_params: SamplingParams  # as the caller gave them (n, best_of, seed)
    samples: list[R]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.samples)

    @property
    def streams(self) -> bool:
        """False with best_of > n: which samples are returned is known only at the end."""
        return self.sampling_params.num_sequences == self.sampling_params.n

    def output(self, completions: list[CompletionOutput]) -> RequestOutput:
        """One `RequestOutput` for the caller's id from its samples' completions (in sample
        order): all of them, or with best_of > n the n most likely, most likely first."""
        sp = self.sampling_params
        ranked = completions
        if sp.num_sequences > sp.n:
            ranked = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))[:sp.n]
        keep = sp.logprobs is not None  # logprobs computed only to rank are not reported
        outputs = [dataclasses.replace(
            c, index=i, logprobs=c.logprobs if keep else None,
            cumulative_logprob=c.cumulative_logprob if keep else None)
            for i, c in enumerate(ranked)]
        first = self.samples[0]
        scores = first.prompt_scores  # sample 0 computes the shared prompt
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=max(max(r.num_cached_tokens for r in self.samples), 0),
            metrics=self._metrics(),
            prompt_logprobs=(scores.logprobs(sp.prompt_logprobs)
                             if scores is not None and sp.prompt_logprobs is not None else None),
            num_draft_tokens=0,
            num_accepted_tokens=0,
        )

    def _metrics(self) -> RequestMetrics:
        """The request's timings: from the first sample's arrival to the last one's end."""
        each = [r.metrics for r in self.samples]
        metrics = RequestMetrics(min(m.arrival_time for m in each))
        metrics.first_scheduled_time = _first([m.first_scheduled_time for m in each])
        metrics.first_token_time = _first([m.first_token_time for m in each])
        metrics.last_token_time = _last([m.last_token_time for m in each])
        if self.finished:
            metrics.finished_time = _last([m.finished_time for m in each])
        metrics.inter_token_latencies = list(each[0].inter_token_latencies)
        return metrics


def _first(values: list[float | None]) -> float | None:
    return min((v for v in values if v is not None), default=None)


def _last(values: list[float | None]) -> float | None:
    return max((v for v in values if v is not None), default=None)


class SampleGroups(Generic[R]):
    """The engine's parallel-sampling requests by the caller's id."""

    def __init__(self, completion: Callable[[R], CompletionOutput]) -> None:
        self._completion = completion
        self._groups: dict[str, SampleGroup[R]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, request_id: str, sampling_params: SamplingParams,
            samples: list[R]) -> SampleGroup[R]:
        group = self._groups[request_id] = SampleGroup(request_id, sampling_params, samples)
        return group

    def pop(self, request_id: str) -> SampleGroup[R] | None:
        return self._groups.pop(request_id, None)

    def sample_ended(self, request: R) -> RequestOutput | None:
        """A sample was aborted: its group's output if that ended the group."""
        group = self._groups.get(request.parent_request_id or "")
        return self.output(group) if group is not None and group.finished else None

    def outputs(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """The outputs of these groups whose samples gained tokens this step: all while they
        stream, only the finished ones otherwise."""
        groups = [self._groups[i] for i in dict.fromkeys(request_ids) if i in self._groups]
        return [self.output(g) for g in groups if g.streams or g.finished]

    def output(self, group: SampleGroup[R]) -> RequestOutput:
        if group.finished:
            self._groups.pop(group.request_id, None)
        return group.output([self._completion(r) for r in group.samples])
