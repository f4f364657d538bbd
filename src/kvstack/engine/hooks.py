"""The points where an optional feature joins the engine's step, so the loop never names it.

`engine/builder.py` is the one place that registers features here (today: parallel samples
split a request, check that it fits and report their outputs as one; structured outputs,
blending, scoring and drafts when a request is added; structured outputs before a step runs;
blending's chunk lookups before scheduling and its row filter in the layer loop; drafts'
tokens to feed in the scheduler, their verification in the runner, and drafts after
sampling, in each output and after output; structured outputs, drafts and parallel samples
when a request finishes or is aborted). A new feature adds a callable to a list;
`LLMEngine`, the scheduler and `ModelRunner.run` call every one in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvstack.engine.request import Request
from kvstack.engine.scheduler import ExtraTokens, ScheduledRequest
from kvstack.layers.attention import LayerHook, StepMetadata
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request being added, before its samples exist: what `on_add` hooks decide on."""

    request_id: str  # the caller's
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    cache_salt: str | None
    max_tokens: int  # resolved: never past the model's context
    num_samples: int = 1  # the engine requests it runs as (`split`; parallel samples: n)
    # The features' own per-request inputs, by the keyword `LLMEngine.add_request` took
    # (blending's `blend`, scoring's `num_scored`); a feature reads only its own.
    options: Mapping[str, object] = field(default_factory=dict)


# When a request is added, before any other check: the engine requests it runs as, each
# (request id, sampling parameters), or None where it runs as one under its own id (the first
# split that answers wins); it may refuse the request (a typed error).
Split = Callable[[NewRequest], list[tuple[str, SamplingParams]] | None]
# When a request is added, before anything is queued: it may refuse it (a typed error), and
# returns what to do to each of the request's samples once they exist (None: nothing) -- the
# feature's per-request state is made there.
OnAdd = Callable[[NewRequest], Callable[[Request], None] | None]
# Before each schedule, with the waiting queue (a feature may prepare its requests).
BeforeSchedule = Callable[[Sequence[Request]], None]
# Before a scheduled step runs, with its requests.
BeforeRun = Callable[[Sequence[ScheduledRequest]], None]
# After a step, once the scheduler advanced the computed counts and published the blocks
# they completed, with the step's requests.
AfterStep = Callable[[Sequence[ScheduledRequest]], None]
# Per step, with the scheduled requests, positions [T] and metadata: the step's layer hook, or
# None where the feature has nothing to do this step.
LayerPlanner = Callable[[Sequence[ScheduledRequest], torch.Tensor, StepMetadata],
                        LayerHook | None]
# A request's draft tokens checked against the step's logits, rows [len(draft) + 1, V] at
# its last known token and at each draft token: (the tokens it emits -- the accepted draft
# tokens, then the model's own next one --, the draft tokens it rejected).
VerifyDrafts = Callable[[torch.Tensor, list[int]], tuple[list[int], int]]
# After a step sampled a request: (request, draft tokens it fed, the tokens it emitted).
AfterSampling = Callable[[Request, int, list[int]], None]
# A request's output just made: a feature fills the fields it reports (drafts' counts).
FillOutput = Callable[[Request, RequestOutput], None]
# A request that gained tokens this step and goes on (its output already made).
AfterOutput = Callable[[Request], None]
# The requests that gained tokens this step, in order: a feature takes those it reports
# itself and returns (its outputs, the requests left, each reported as its own output).
TakeOutputs = Callable[[list[Request]], tuple[list[RequestOutput], list[Request]]]
# An abort of a caller's request id: the engine requests it names (none: only a request of
# that id); a feature that split the request forgets it here.
OnAbort = Callable[[str], list[str]]
# A request that finished (why: "stop", "length", "abort"), its blocks already freed: a
# feature drops its per-request state; it may return an output the next step reports (an
# abort that ended a caller's request split into several).
OnFinish = Callable[[Request, str], RequestOutput | None]
# A feature's `EngineStats` fields.
StatsFields = Callable[[], dict[str, int]]


@dataclass
class StepHooks:
    split: list[Split] = field(default_factory=list)
    on_add: list[OnAdd] = field(default_factory=list)
    before_schedule: list[BeforeSchedule] = field(default_factory=list)
    before_run: list[BeforeRun] = field(default_factory=list)
    layer: list[LayerPlanner] = field(default_factory=list)
    after_step: list[AfterStep] = field(default_factory=list)
    # The one source of tokens fed after a request's known ones (drafts'); the scheduler asks
    # it per request whose step reaches the end of its known tokens, with the room left.
    extra_tokens: ExtraTokens | None = None
    # The one verifier of fed draft tokens (drafts'); the runner calls it per drafting request.
    verify_drafts: VerifyDrafts | None = None
    after_sampling: list[AfterSampling] = field(default_factory=list)
    fill_output: list[FillOutput] = field(default_factory=list)
    after_output: list[AfterOutput] = field(default_factory=list)
    take_outputs: list[TakeOutputs] = field(default_factory=list)
    on_abort: list[OnAbort] = field(default_factory=list)
    on_finish: list[OnFinish] = field(default_factory=list)
    stats: list[StatsFields] = field(default_factory=list)
    # The `add_request` keywords the features read (`NewRequest.options`); any other is refused.
    options: set[str] = field(default_factory=set)
    # The registered features by name, for front ends and benchmarks that tune one.
    features: dict[str, object] = field(default_factory=dict)

    def split_request(self, new: NewRequest) -> list[tuple[str, SamplingParams]]:
        for split in self.split:
            if (requests := split(new)) is not None:
                return requests
        return [(new.request_id, new.sampling_params)]

    def run_on_add(self, new: NewRequest) -> list[Callable[[Request], None]]:
        return [setup for hook in self.on_add if (setup := hook(new)) is not None]

    def run_before_schedule(self, waiting: Sequence[Request]) -> None:
        for hook in self.before_schedule:
            hook(waiting)

    def run_before_run(self, scheduled: Sequence[ScheduledRequest]) -> None:
        for hook in self.before_run:
            hook(scheduled)

    def run_after_step(self, scheduled: Sequence[ScheduledRequest]) -> None:
        for hook in self.after_step:
            hook(scheduled)

    def layer_hook(self, scheduled: Sequence[ScheduledRequest], positions: torch.Tensor,
                   meta: StepMetadata) -> LayerHook | None:
        """The step's layer hook: the first planner's that has one (one per step)."""
        for planner in self.layer:
            if (hook := planner(scheduled, positions, meta)) is not None:
                return hook
        return None

    def feed(self, request: Request, room: int) -> list[int]:
        return self.extra_tokens(request, room) if self.extra_tokens is not None else []

    def verify(self, logits: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
        if self.verify_drafts is None:
            raise RuntimeError("a step fed draft tokens, but no feature verifies drafts")
        return self.verify_drafts(logits, draft)

    def run_after_sampling(self, request: Request, num_fed: int, token_ids: list[int]) -> None:
        for hook in self.after_sampling:
            hook(request, num_fed, token_ids)

    def run_fill_output(self, request: Request, output: RequestOutput) -> RequestOutput:
        for hook in self.fill_output:
            hook(request, output)
        return output

    def run_after_output(self, request: Request) -> None:
        for hook in self.after_output:
            hook(request)

    def outputs(self, gained: list[Request], make_output: Callable[[Request], RequestOutput]
                ) -> list[RequestOutput]:
        """The step's outputs: one per request that gained tokens, but those a feature took
        (reported after them, as it made them); `after_output` runs for each request left
        that goes on."""
        taken: list[RequestOutput] = []
        for take in self.take_outputs:
            outputs, gained = take(gained)
            taken += outputs
        left = []
        for request in gained:
            left.append(make_output(request))
            if not request.finished:
                self.run_after_output(request)
        return left + taken

    def aborted_ids(self, request_id: str) -> list[str]:
        """The engine requests an abort of `request_id` stops."""
        return [i for hook in self.on_abort for i in hook(request_id)] or [request_id]

    def run_on_finish(self, request: Request, reason: str) -> list[RequestOutput]:
        return [out for hook in self.on_finish if (out := hook(request, reason)) is not None]

    def stats_fields(self) -> dict[str, int]:
        return {k: v for fields in self.stats for k, v in fields().items()}
