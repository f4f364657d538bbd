"""What a user gives to blend: chunks in a segmented prompt and the blending settings.

Blending is APPROXIMATE: a reused chunk's K/V were computed without the text before it, and
only a fraction of its tokens is recomputed in context (`recompute_ratio`). `1.0` recomputes
every token and gives full prefill's result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstack.errors import InvalidRequestError

# How the reused tokens to recompute are chosen (`selectors.py` says how each works).
SELECTORS = ("kv_deviation", "first_k", "random", "attention", "impact", "first_k_deviation",
             "gradual")
DEFAULT_SELECTOR = "kv_deviation"


class BlendError(InvalidRequestError):
    """A segmented prompt or blend setting that cannot be run (one line: what to change)."""


@dataclass(frozen=True)
class Chunk:
    """A segment whose K/V are cached by content and reused wherever it appears (a retrieved
    document). Give its text, or its token ids for an engine without a tokenizer."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise BlendError("a Chunk holds text or token_ids, exactly one of them")
        if self.text is not None and not isinstance(self.text, str):
            raise BlendError(f"a Chunk's text must be a string, got {type(self.text).__name__}")
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", tuple(self.token_ids))


Segment = str | Chunk | Sequence[int]  # text, text as token ids, or a chunk


@dataclass(frozen=True)
class BlendParams:
    """Blending settings of one request.

    `recompute_ratio`: share of the reused chunk tokens recomputed in context, in [0, 1].
    `selector`: which ones: "kv_deviation" (CacheBlend: whose K/V at `check_layer` deviate
    most from a fresh computation), "first_k" (EPIC: the first tokens of each chunk),
    "random" (a control), "attention" (the ones the question attends to most at
    `check_layer`), "impact" (attention times deviation: the estimated change of the
    question's attention output), "first_k_deviation" (each chunk's first `first_k` tokens,
    default 4, then the rest of the budget by deviation) or "gradual" (deviation at
    `check_layer` keeps twice the ratio, deviation three layers later keeps the ratio).
    `check_layer`: the layer whose fresh K/V the dynamic selectors compare (every layer up to
    it runs on all tokens); `first_k`: tokens per chunk for "first_k" (None: the ratio of each
    chunk); `seed`: of "random".
    """

    recompute_ratio: float = 0.15
    selector: str = DEFAULT_SELECTOR
    check_layer: int = 1
    first_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        ratio = self.recompute_ratio
        if (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                or not math.isfinite(ratio) or not 0 <= ratio <= 1):
            raise BlendError(f"recompute_ratio must be a number in [0, 1], got {ratio!r}")
        if self.selector not in SELECTORS:
            raise BlendError(f"selector must be one of {', '.join(SELECTORS)}, "
                             f"got {self.selector!r}")
        for name, low in (("check_layer", 0), ("first_k", 1), ("seed", 0)):
            value = getattr(self, name)
            if value is None and name == "first_k":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BlendError(f"{name} must be an integer >= {low}, got {value!r}")

    @classmethod
    def from_dict(cls, fields: dict[str, Any] | None) -> BlendParams:
        """From a JSON object (the HTTP APIs' `blend`); unknown fields are refused."""
        fields = dict(fields or {})
        known = {"recompute_ratio", "selector", "check_layer", "first_k", "seed"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise BlendError(f"blend has no field {unknown[0]!r}; use {', '.join(sorted(known))}")
        return cls(**fields)


@dataclass(frozen=True)
class BlendSpec:
    """A request's blending: its settings and where its chunks lie in the prompt ([start,
    end) token spans, in order, not overlapping)."""

    params: BlendParams
    chunks: tuple[tuple[int, int], ...]


def check_spans(chunks: Sequence[tuple[int, int]], num_tokens: int) -> None:
    """Chunk spans must be non-empty, in order, inside the prompt."""
    last = 0
    for start, end in chunks:
        if not last <= start < end <= num_tokens:
            raise BlendError(f"chunk span [{start}, {end}) is empty, out of order or past the "
                             f"prompt's {num_tokens} tokens")
        last = end
