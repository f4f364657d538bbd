"""Structured outputs as engine hooks (registered in `engine/builder.py`): a new request's
constraint is compiled when it is added (a bad one refused before anything is queued), each
of its samples gets a guide, and before each step runs the guides that sample this step
start computing their masks in the background."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kvstack.layers.sampler import SamplingState
from kvstack.sampling_params import SamplingParams
from kvstack.structured.guides import Guide, StructuredBackend


class GuidedRequest(Protocol):
    @property
    def sampling_state(self) -> SamplingState: ...
    @property
    def output_token_ids(self) -> list[int]: ...


class Scheduled(Protocol):
    @property
    def request(self) -> GuidedRequest: ...
    @property
    def samples(self) -> bool: ...


class StructuredOutputs:
    """The engine's constraints over one tokenizer; the llguidance backend is built on the
    first constrained request (converting the vocabulary takes about a second)."""

    def __init__(self, tokenizer: Any | None, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.backend: StructuredBackend | None = None

    def on_add(self, sampling_params: SamplingParams
               ) -> Callable[[GuidedRequest], None] | None:
        """Compile the request's constraint, if any (`InvalidRequestError` if bad); what to
        do to each of its requests once they exist: give it a guide."""
        if sampling_params.structured_outputs is None:
            return None
        if self.backend is None:
            self.backend = StructuredBackend.for_tokenizer(self.tokenizer, self.vocab_size,
                                                           self.eos_token_ids)
        backend = self.backend
        grammar = backend.compile(sampling_params.structured_outputs)

        def attach(request: GuidedRequest) -> None:
            request.sampling_state.guide = backend.guide(grammar, request)
        return attach

    def on_finish(self, request: GuidedRequest, reason: str) -> None:
        """A finished request's guide (its matcher) is released now, not with the request."""
        request.sampling_state.guide = None

    def before_run(self, scheduled: Sequence[Scheduled]) -> None:
        """Masks of the guides that sample this step, computed while the model runs."""
        if self.backend is None:
            return
        # The guides this feature hands out are its backend's own (`backend.guide`).
        self.backend.prepare([guide for s in scheduled if s.samples
                              and isinstance(guide := s.request.sampling_state.guide, Guide)])
