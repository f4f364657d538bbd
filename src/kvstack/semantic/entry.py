"""The values the semantic cache keeps: what may hit (scope), what is served (answer)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


def digest(value: Any) -> str:
    """sha256 of a JSON-able value; dict key order does not matter."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Scope:
    """Entries hit only within one scope: an exact match of tenant, model and context.

    `tenant` is an opaque tenant id (never an API key), `model` the model's fingerprint, and
    `context` a digest of everything else that changes the answer: the API, system prompt,
    the conversation before the key text, and the sampling parameters.
    """

    tenant: str
    model: str
    context: str = ""
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", digest([self.tenant, self.model, self.context]))


@dataclass(frozen=True)
class Answer:
    """A finished generation, enough to replay it in any API shape."""

    text: str
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # The output token ids (verify mode hands them to the engine as a draft); None for
    # entries stored before they were kept.
    token_ids: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "num_output_tokens": self.num_output_tokens,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                "token_ids": list(self.token_ids) if self.token_ids is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Answer:
        ids = data.get("token_ids")
        return cls(str(data["text"]), int(data["num_output_tokens"]),
                   data.get("finish_reason"), data.get("stop_reason"),
                   tuple(int(i) for i in ids) if isinstance(ids, list) else None)


@dataclass
class Entry:
    id: int
    scope: str  # Scope.key
    tenant: str
    model: str
    text: str  # the key text, normalized
    answer: Answer
    created_at: float
    last_used: float
