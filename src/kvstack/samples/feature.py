"""Parallel samples at the engine's hook points (`engine/hooks.py`), registered in
`engine/builder.py`: a request with n or best_of > 1 is split into its samples, an abort of
its id names them all, and the samples' outputs are reported as one per request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic

from kvstack.config import SchedulerConfig
from kvstack.errors import InvalidRequestError
from kvstack.kv.mode import KVCacheMode
from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.samples.groups import R, SampleGroups, check_fits, sample_ids, sample_params
from kvstack.sampling_params import SamplingParams


class ParallelSamples(Generic[R]):
    """`completion`: one sample's completion, as the engine reports a request's."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheMode,
                 completion: Callable[[R], CompletionOutput]) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.groups: SampleGroups[R] = SampleGroups(completion)

    def split(self, request_id: str, sampling_params: SamplingParams, num_prompt_tokens: int,
              max_tokens: int) -> list[tuple[str, SamplingParams]] | None:
        """The samples' ids and settings (None: one sequence, the request itself), once all
        its sequences are known to fit (CapacityError, InvalidRequestError). A request id in
        use by a group is refused, as the engine refuses one in use by a request."""
        sp = sampling_params
        check_fits(sp, self.config, self.kv_manager, num_prompt_tokens, max_tokens)
        ids = sample_ids(request_id, sp.num_sequences)
        if any(i in self.groups for i in {request_id, *ids}):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(ids) == 1:
            return None
        return [(rid, sample_params(sp, i)) for i, rid in enumerate(ids)]

    def add(self, request_id: str, sampling_params: SamplingParams, samples: list[R]) -> None:
        self.groups.add(request_id, sampling_params, samples)

    def on_abort(self, request_id: str) -> list[str]:
        """An abort of a request's own id stops all its samples (forgotten first, so their
        finishes report nothing)."""
        group = self.groups.pop(request_id)
        return [s.request_id for s in group.samples] if group is not None else []

    def on_finish(self, request: R, reason: str) -> RequestOutput | None:
        """A sample aborted alone: its request's output, for the next step, if that ended it
        (a sample that stops or reaches its length is reported by `take_outputs`)."""
        if reason != "abort" or request.parent_request_id is None:
            return None
        return self.groups.sample_ended(request)

    def take_outputs(self, gained: list[R]) -> tuple[list[RequestOutput], list[R]]:
        """The samples among the requests that gained tokens are reported as their request's
        one output (all while it streams, at the end with best_of > n); the rest are left."""
        parents = [r.parent_request_id for r in gained if r.parent_request_id is not None]
        return (self.groups.outputs(parents),
                [r for r in gained if r.parent_request_id is None])
