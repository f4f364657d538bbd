"""How one request wants its tokens chosen and when it stops: vLLM's names and defaults."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstack.errors import InvalidRequestError

# Below this temperature a request is decoded greedily: dividing logits by ~0 would only turn
# sampling into a numerically fragile argmax.
_GREEDY_TEMPERATURE = 1e-5


def _shown(value: Any) -> str:
    """A short, single-line repr for error messages (user input can be long)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `top_k=True` is a client bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: Any, valid: str, ok: Callable[[float], bool]) -> None:
    """Raise unless `value` is an int or non-NaN float (not a bool) for which `ok` holds."""
    is_number = _is_int(value) or (isinstance(value, float) and not math.isnan(value))
    if not is_number or not ok(value):
        raise InvalidRequestError(f"{name} must be a number {valid}, got {_shown(value)}")


def _check_int(
    name: str, value: Any, valid: str, ok: Callable[[int], bool], allow_none: bool = False
) -> None:
    """Raise unless `value` is an int (not a bool) for which `ok` holds, or None if allowed."""
    if value is None and allow_none:
        return
    if not _is_int(value) or not ok(value):
        raise InvalidRequestError(f"{name} must be an integer {valid}, got {_shown(value)}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {_shown(value)}")


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request; validated on construction.

    Every out-of-range or mistyped field raises `InvalidRequestError` whose one-line message
    names the field and its valid range. After construction `stop` is always a list (empty when
    none) and `stop_token_ids` is a list or None.

    `logprobs` accepts only 0 or 1 and both mean the same: report the log-probability of each
    chosen token under the raw model distribution. Top alternatives are not computed, so larger
    values are refused rather than silently answered with less than was asked.
    `prompt_logprobs` (0 or 1, same meaning) asks for the log-probability of each prompt token
    given the tokens before it (perplexity); such a request computes its whole prompt, so it
    neither takes nor needs a prefix-cache hit.
    `prompt_lookup=N` drafts up to N tokens at each step by copying what followed the last few
    tokens where they occurred earlier in the prompt or output; the engine verifies drafts, so
    a greedy output is the one it would be without them (`drafts/`). Greedy requests without
    penalties only: other requests ignore drafts.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_lookup: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, "equal to 1 (parallel samples are not supported)",
                   lambda n: n == 1)
        _check_number("temperature", self.temperature, ">= 0", lambda t: t >= 0)
        _check_number("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        _check_int("top_k", self.top_k, ">= -1 (0 or -1 = off)", lambda k: k >= -1)
        _check_number("min_p", self.min_p, "in [0, 1]", lambda p: 0 <= p <= 1)
        _check_number("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)",
                      lambda r: 0 < r < math.inf)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), "in [-2, 2]", lambda x: -2 <= x <= 2)
        _check_int("seed", self.seed, "or null", lambda _: True, allow_none=True)
        _check_int("max_tokens", self.max_tokens, ">= 1 or null", lambda m: m >= 1,
                   allow_none=True)
        for name in ("logprobs", "prompt_logprobs"):
            _check_int(name, getattr(self, name), "0 or 1 or null (top alternatives unsupported)",
                       lambda k: k in (0, 1), allow_none=True)
        self.stop = _normalized_stop(self.stop)
        self.stop_token_ids = _normalized_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        _check_int("prompt_lookup", self.prompt_lookup, "in [1, 64] or null",
                   lambda n: 1 <= n <= 64, allow_none=True)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalized) logits."""
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def verifies_drafts(self) -> bool:
        """True when draft tokens can be checked against this request's own choice: greedy,
        no penalties (a penalty would make each draft position's choice depend on the
        accepted ones before it)."""
        return self.greedy and not self.has_penalties

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _normalized_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    # An empty stop string would match everywhere and end every request at once.
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError(
            f"stop must be a non-empty string or a list of them, got {_shown(stop)}"
        )
    return list(stops)


def _normalized_stop_token_ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise InvalidRequestError(
            f"stop_token_ids must be a list of integers >= 0, got {_shown(ids)}"
        )
    return list(ids)
