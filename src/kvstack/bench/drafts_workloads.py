"""The sessions of `bench drafts` and how their outputs are scored.

Agent sessions repeat themselves the way agents do, built from seeded data that ships with
kvstack: a source file of kvstack itself read and rewritten with a rename (then another), a
tool result whose fields a tool call echoes with one changed (then another record), a plan
restated with a step marked done (then the next). Each turn is a chat prompt holding the
earlier turns, the model's own answers included. The control is plain chat questions whose
answers repeat nothing.

Small models fall into loops, which any suffix tree drafts perfectly: an output is scored only
up to its first repeated LOOP_SPAN-token span (`loop_start`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstack.bench.common import Subject

_PACKAGE = Path(__file__).resolve().parents[1]  # kvstack's own sources: the files edited
LOOP_SPAN = 32
_SEED = 55
_FILES = ("drafts/verify.py", "drafts/state.py", "kv/block_pool.py", "units.py", "clock.py")
_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo",
          "juniper", "kernel", "lumen", "meadow", "nectar", "orbit", "pylon", "quartz", "raven")
_CHATS = ("Write a short poem about the autumn wind.",
          "Give me three ideas for a birthday party.",
          "What should I pack for a weekend of hiking?",
          "Describe a sunrise over the sea in a few sentences.")


@dataclass
class Session:
    """A conversation: the user's turns, and the model's answers as they come."""

    kind: str
    user_turns: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for i in range(turn):
            out += [{"role": "user", "content": self.user_turns[i]},
                    {"role": "assistant", "content": self.answers[i]}]
        return out + [{"role": "user", "content": self.user_turns[turn]}]


def agent_sessions(num: int) -> list[Session]:
    """`num` seeded agent sessions of two turns, cycling over the three kinds."""
    rng = random.Random(_SEED)
    makers = (_edit_session, _tool_session, _plan_session)
    return [makers[i % 3](rng) for i in range(num)]


def chat_sessions(num: int) -> list[Session]:
    return [Session("chat", [q]) for q in _CHATS[:num]]


def _edit_session(rng: random.Random) -> Session:
    path = rng.choice(_FILES)
    lines = (_PACKAGE / path).read_text().splitlines()
    start = rng.randrange(0, max(1, len(lines) - 30))
    code = "\n".join(lines[start:start + 30])
    names = sorted({w for w in code.replace("(", " ").replace(".", " ").split()
                    if w.isidentifier() and len(w) > 5})
    old, old2 = rng.sample(names, 2) if len(names) >= 2 else ("self", "return")
    return Session("edit file", [
        f"Here is part of the file {path}:\n```python\n{code}\n```\nRewrite this code with "
        f"`{old}` renamed to `{old2}_x`. Output the whole code, nothing else.",
        f"Good. Now also rename `{old2}` to `{old2}_y` and output the whole code again."])


def _record(rng: random.Random) -> dict[str, Any]:
    return {"id": rng.randrange(10000, 99999), "customer": rng.choice(_WORDS).title(),
            "items": [{"sku": f"{rng.choice(_WORDS)}-{rng.randrange(100)}",
                       "qty": rng.randrange(1, 9)} for _ in range(3)],
            "address": f"{rng.randrange(1, 200)} {rng.choice(_WORDS).title()} Street",
            "status": "pending"}


def _tool_session(rng: random.Random) -> Session:
    first, second = _record(rng), _record(rng)
    ask = ("Call the tool update_order with the same fields as the result, but with status "
           "\"shipped\". Answer with the call's JSON arguments only.")
    return Session("tool call", [
        f"The tool get_order returned:\n{json.dumps(first, indent=1)}\n{ask}",
        f"The tool get_order returned:\n{json.dumps(second, indent=1)}\nDo the same: {ask}"])


def _plan_session(rng: random.Random) -> Session:
    verbs = ("Read", "Test", "Fix", "Check", "Update", "Write")
    steps = [f"{i + 1}. {rng.choice(verbs)} the {rng.choice(_WORDS)} module and its "
             f"{rng.choice(_WORDS)} tests" for i in range(8)]
    plan = "\n".join(steps)
    return Session("plan", [
        f"Here is our plan:\n{plan}\nRestate the whole plan with step 1 marked [done].",
        "Step 2 is finished too. Restate the whole plan again with steps 1 and 2 marked "
        "[done]."])


def prompt_ids(subject: Subject, messages: list[dict[str, str]]) -> list[int]:
    """The conversation through the model's chat template (its plain text without one)."""
    template = getattr(subject.tokenizer, "chat_template", None)
    if template is None:
        return subject.encode("\n".join(m["content"] for m in messages))
    assert subject.tokenizer is not None
    ids = subject.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding or list


def loop_start(tokens: list[int], span: int = LOOP_SPAN) -> int:
    """Where the output first repeats a `span`-token span of its own (the start of the
    repeat); its length if it never does."""
    seen: set[tuple[int, ...]] = set()
    for i in range(len(tokens) - span + 1):
        window = tuple(tokens[i:i + span])
        if window in seen:
            return i
        seen.add(window)
    return len(tokens)
