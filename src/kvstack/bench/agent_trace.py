"""`bench agent`'s workload and clients: a seeded agent trace, and one turn of it through the
Responses API (`previous_response_id`) or chat completions (the whole history resent).

The trace: a system prompt of Python's reference docs followed by tool schemas as text (the
same bytes for every arm, so each arm prompts the model with the same conversation), then
turns that each append a tool result of seeded words. Both clients stream, greedy with a fixed
number of output tokens (`ignore_eos`), and time the first server-sent event: the server
answers only once the first token exists, so that is the time to first token as a client sees
it in either API.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvstack.bench.common import Subject, topic_texts
from kvstack.errors import KvstackError

TOOLS = [
    {"name": "search_docs", "description": "Full-text search over the project documentation; "
     "returns the best passages with their file and line",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string", "description": "words to look for"},
         "limit": {"type": "integer", "minimum": 1, "maximum": 20}}, "required": ["query"]}},
    {"name": "read_file", "description": "Read a file of the repository, or a range of lines",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}, "start": {"type": "integer"},
         "end": {"type": "integer"}}, "required": ["path"]}},
    {"name": "run_tests", "description": "Run the test suite, or the tests matching a pattern; "
     "returns the failures with their tracebacks",
     "parameters": {"type": "object", "properties": {
         "pattern": {"type": "string"}, "verbose": {"type": "boolean"}}}},
    {"name": "edit_file", "description": "Replace an exact passage of a file with new text",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
         "required": ["path", "old", "new"]}},
]
TASK = "Find why the tests of the parser fail and fix them. Call one tool per turn."


class AgentRequestError(KvstackError):
    """The server under test refused or failed a request of the trace."""


@dataclass(frozen=True)
class Trace:
    system: str  # the system prompt: docs, then the tool schemas
    results: list[list[str]]  # per conversation, per turn: the tool result that turn appends

    @property
    def num_turns(self) -> int:
        return len(self.results[0])


def make_trace(subject: Subject, system_tokens: int, num_conversations: int, num_turns: int,
               result_tokens: int, seed: int) -> Trace:
    """A seeded trace; every conversation gets its own tool results (they share the system
    prompt, as one agent's sessions do)."""
    tools = "You can call these tools:\n" + json.dumps(TOOLS, indent=1)
    docs_tokens = max(0, system_tokens - len(subject.encode(tools)))
    docs: list[int] = []
    for text in topic_texts():
        docs += subject.encode(text)
        if len(docs) >= docs_tokens:
            break
    assert subject.tokenizer is not None  # the agent trace runs on a model with a tokenizer
    head = subject.tokenizer.decode(docs[:docs_tokens]) if docs_tokens else ""
    system = f"You are a coding agent. Reference:\n{head}\n\n{tools}"
    words = [w for t in topic_texts()[:40] for w in t.split() if w.isalpha()]
    rng = random.Random(seed)
    results = [[_result(rng, words, c, t, result_tokens) for t in range(num_turns)]
               for c in range(num_conversations)]
    return Trace(system, results)


def _result(rng: random.Random, words: list[str], conversation: int, turn: int,
            num_tokens: int) -> str:
    # About one token a word for these dictionary words; the tag makes each result distinct.
    body = " ".join(rng.choice(words) for _ in range(max(1, num_tokens - 12)))
    return f"Tool result #{conversation}.{turn}: {body}"


@dataclass
class Turn:
    ttft_s: float
    total_s: float
    input_tokens: int
    cached_tokens: int
    response_id: str = ""
    text: str = ""

    @property
    def computed_tokens(self) -> int:
        return self.input_tokens - self.cached_tokens


@dataclass
class Conversation:
    """One conversation's client side: the chat history it resends, or the id it continues."""

    index: int
    history: list[dict[str, Any]] = field(default_factory=list)
    previous_id: str | None = None
    turns: list[Turn] = field(default_factory=list)


def turn_input(trace: Trace, conversation: int, turn: int) -> str:
    result = trace.results[conversation][turn]
    return f"{TASK}\n\n{result}" if turn == 0 else result


async def responses_turn(client: httpx.AsyncClient, model: str, trace: Trace,
                         talk: Conversation, max_tokens: int) -> Turn:
    text = turn_input(trace, talk.index, len(talk.turns))
    body = {"model": model, "instructions": trace.system, "input": text, "stream": True,
            "temperature": 0, "max_output_tokens": max_tokens, "ignore_eos": True,
            "previous_response_id": talk.previous_id}
    start = time.perf_counter()
    first, final = None, None
    async for event in _events(client, "/v1/responses", body):
        first = first if first is not None else time.perf_counter() - start
        if event.get("type") in ("response.completed", "response.incomplete"):
            final = event["response"]
    if final is None or first is None:
        raise AgentRequestError("a Responses stream ended without response.completed")
    usage = final["usage"]
    turn = Turn(first, time.perf_counter() - start, usage["input_tokens"],
                usage["input_tokens_details"]["cached_tokens"], final["id"])
    talk.previous_id = final["id"]
    talk.turns.append(turn)
    return turn


async def chat_turn(client: httpx.AsyncClient, model: str, trace: Trace, talk: Conversation,
                    max_tokens: int) -> Turn:
    if not talk.history:
        talk.history.append({"role": "system", "content": trace.system})
    talk.history.append({"role": "user", "content": turn_input(trace, talk.index,
                                                                len(talk.turns))})
    body = {"model": model, "messages": talk.history, "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage, parts = None, None, []
    async for chunk in _events(client, "/v1/chat/completions", body):
        first = first if first is not None else time.perf_counter() - start
        for choice in chunk.get("choices") or []:
            parts.append((choice.get("delta") or {}).get("content") or "")
        usage = chunk.get("usage") or usage
    if usage is None or first is None:
        raise AgentRequestError("a chat completions stream ended without usage")
    text = "".join(parts)
    talk.history.append({"role": "assistant", "content": text})
    details = usage.get("prompt_tokens_details") or {}
    turn = Turn(first, time.perf_counter() - start, usage["prompt_tokens"],
                details.get("cached_tokens") or 0, text=text)
    talk.turns.append(turn)
    return turn


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    """The JSON payloads of a streamed answer's server-sent events."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise AgentRequestError(f"{path} answered {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if payload.get("type") == "error" or "error" in payload:
                raise AgentRequestError(f"{path} failed mid-stream: {payload}")
            yield payload


async def pressure(client: httpx.AsyncClient, model: str, vocab_size: int, num_tokens: int,
                   prompt_tokens: int, seed: int) -> None:
    """Push `num_tokens` new prompt tokens through the pool (distinct random ids, one output
    token each), so that every block no pin holds is evicted."""
    rng = random.Random(seed)
    for _ in range(max(1, -(-num_tokens // prompt_tokens))):
        ids = [rng.randrange(100, vocab_size) for _ in range(prompt_tokens)]
        r = await client.post("/v1/completions", json={"model": model, "prompt": ids,
                                                       "max_tokens": 1})
        if r.status_code != 200:
            raise AgentRequestError(f"/v1/completions answered {r.status_code}: {r.text[:300]}")
