"""What a recurrent model needs per step: each sequence's rows, its live states and where to
stop for a snapshot; and the interface such a model offers the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LinearState:
    """One sequence's state in one linear-attention layer (`layers/gated_delta.py`)."""

    conv: torch.Tensor  # [conv channels, kernel - 1], the model dtype: the last inputs
    ssm: torch.Tensor  # [value heads, key dim, value dim], float32

    def clone(self) -> LinearState:
        return LinearState(self.conv.clone(), self.ssm.clone())

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()
                + self.ssm.numel() * self.ssm.element_size())


@dataclass
class SequenceStep:
    """One sequence's rows in a step, in the scheduled order."""

    start: int  # first row in the flattened batch
    end: int
    states: list[LinearState]  # per linear layer: the live state, updated in place
    stops: list[int]  # offsets (1..end - start) after which the state is snapshotted
    # per linear layer, the states at `stops` (the model fills it)
    taken: list[list[LinearState]] = field(default_factory=list)


@dataclass
class StepStates:
    sequences: list[SequenceStep]


@runtime_checkable
class RecurrentModel(Protocol):
    """A model with linear-attention layers: it reads `step_states` in `forward`."""

    step_states: StepStates | None

    def new_states(self) -> list[LinearState]:
        """Zero states, one per linear layer (a sequence before its first token)."""
        ...

    @property
    def state_nbytes(self) -> int:
        """Bytes of one sequence's states (all linear layers)."""
        ...
