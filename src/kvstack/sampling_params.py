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
# Alternatives reported per token with `logprobs=k` (OpenAI's top_logprobs allows up to 20).
MAX_LOGPROBS = 20


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
class StructuredOutputsParams:
    """A constraint on the output text (vLLM's names); give exactly one of:

    `json`: a JSON schema (dict or its JSON text) the output must validate against;
    `json_object`: any JSON object; `regex`: a regular expression the whole output matches;
    `choice`: one of these strings exactly; `grammar`: a context-free grammar in Lark syntax
    (llguidance's dialect) or GBNF (llama.cpp's).
    `strict` (json only): True refuses a schema with a keyword the grammar engine cannot
    enforce; False ignores such keywords (the output may then break them).
    The engine compiles the constraint when the request is added (a bad or unsatisfiable one
    is an `InvalidRequestError`) and masks every token that cannot continue it; a request
    that samples the end-of-sequence token is complete under the constraint.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                         else [])
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}")
        _check_bool("json_object", self.json_object)
        _check_bool("strict", self.strict)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(f"json must be a JSON schema object, got {_shown(self.json)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string, got "
                                          f"{_shown(value)}")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(
                f"choice must be a non-empty list of non-empty strings, got {_shown(self.choice)}")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request; validated on construction.

    Every out-of-range or mistyped field raises `InvalidRequestError` whose one-line message
    names the field and its valid range. After construction `stop` is always a list (empty when
    none) and `stop_token_ids` is a list or None.

    `n` samples are returned for the prompt (`best_of` >= n are generated and the n with the
    highest cumulative log-probability kept); the prompt is computed once and its KV blocks
    shared, and sample i draws with seed `seed + i`, so it equals a request with that seed.
    `logprobs=k` (0-20) reports the log-probability of each chosen token under the raw model
    distribution and, for k > 0, the k most likely tokens at that position with theirs.
    `structured_outputs` constrains the output (JSON schema, regex, choice, grammar).
    `prompt_logprobs=k` (0-20) asks for the log-probability of each prompt token given the
    tokens before it (perplexity, choice scoring) and the k most likely tokens there, in
    vLLM's shape (`RequestOutput.prompt_logprobs`). Such a request takes a prefix-cache hit
    only over blocks whose scores were kept when an earlier scoring request computed them
    (`scoring/`), and computes the rest: its numbers equal a cold computation.
    `prompt_lookup=N` drafts up to N tokens at each step by copying what followed the last few
    tokens where they occurred earlier in the prompt or output; the engine verifies drafts, so
    a greedy output is the one it would be without them (`drafts/`). Greedy requests without
    penalties only: other requests ignore drafts, and so do parallel samples and constrained
    requests (a draft row would need the constraint's mask at each drafted position).
    `suffix_drafts=N` drafts up to N tokens a step from suffix trees over the request's own
    text and its tenant's earlier outputs, as many as their counts back (SuffixDecoding; the
    engine's `speculative_config` sets the trees' knobs and can make it every request's
    default); same rules as prompt lookup, and not together with it.
    """

    n: int = 1
    best_of: int | None = None
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
    suffix_drafts: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, ">= 1", lambda n: n >= 1)
        _check_int("best_of", self.best_of, f">= n ({self.n}) or null",
                   lambda b: b >= self.n, allow_none=True)
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
        _check_int("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or null",
                   lambda k: 0 <= k <= MAX_LOGPROBS, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, f"in [0, {MAX_LOGPROBS}] or null",
                   lambda k: 0 <= k <= MAX_LOGPROBS, allow_none=True)
        self.stop = _normalized_stop(self.stop)
        self.stop_token_ids = _normalized_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        for name in ("prompt_lookup", "suffix_drafts"):
            _check_int(name, getattr(self, name), "in [1, 64] or null", lambda n: 1 <= n <= 64,
                       allow_none=True)
        if self.prompt_lookup is not None and self.suffix_drafts is not None:
            raise InvalidRequestError("prompt_lookup and suffix_drafts are two draft sources; "
                                      "give one (suffix trees also search the prompt)")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams")
            if self.ignore_eos:
                raise InvalidRequestError(
                    "ignore_eos cannot be combined with structured outputs: the end-of-sequence "
                    "token is how a constrained output ends")

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the prompt: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalized) logits."""
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def verifies_drafts(self) -> bool:
        """True when draft tokens can be checked against this request's own choice: greedy,
        no penalties (a penalty would make each draft position's choice depend on the
        accepted ones before it)."""
        return (self.greedy and not self.has_penalties and self.num_sequences == 1
                and self.structured_outputs is None)

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
