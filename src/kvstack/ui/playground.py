"""The playground: one chat or completion run through the server, streamed to the page with
the text of every prompt and output token and where each token came from.

Events (server-sent, JSON data):
  prompt    {"request_id", "pieces": [text of each prompt token]} as soon as it is tokenized
  admitted  {"provenance": [[source, count], ...], "num_cached_tokens", "ttft_ms"} with the
            first output: the prompt's sources (`outputs.Provenance.prompt`) in prompt order
  tokens    {"pieces": [...], "sources": [[source, count], ...]} new output tokens
  done      {"finish_reason", "ttft_ms", "tpot_ms", "num_output_tokens", "num_draft_tokens",
             "num_accepted_tokens", "provenance": {"prompt", "output"}}
  error     {"message"} (the status line is long gone once the stream began)
A token's text is what it adds to the text decoded so far; a token that ends inside a UTF-8
character adds "" and the token that completes it carries the character.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvstack.engine.chat import chat_token_ids
from kvstack.engine.detokenizer import IncrementalDetokenizer
from kvstack.errors import InvalidRequestError, KvstackError
from kvstack.outputs import Provenance, RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.ui.access import Viewer
from kvstack.ui.service import UiService, sse


class PlaygroundMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class PlaygroundRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["chat", "completion"] = "chat"
    messages: list[PlaygroundMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    prompt_lookup: int | None = Field(default=None, ge=1, le=64)


def prompt_ids(body: PlaygroundRequest, tokenizer: Any) -> list[int]:
    """The prompt's token ids: the chat template over `messages`, or the `prompt` text."""
    if body.mode == "chat":
        if not body.messages:
            raise InvalidRequestError("a chat needs at least one message")
        return chat_token_ids(tokenizer, [m.model_dump() for m in body.messages])
    if not body.prompt:
        raise InvalidRequestError("prompt is empty; give at least one token of text")
    return list(tokenizer.encode(body.prompt))


def token_pieces(tokenizer: Any, token_ids: Sequence[int],
                 context: Sequence[int] = ()) -> list[str]:
    """The text each token adds, special tokens included (see the module docstring)."""
    detok = IncrementalDetokenizer(tokenizer, list(context), skip_special_tokens=False)
    return [detok.add(t) for t in token_ids]


def source_slice(runs: Sequence[tuple[str, int]], start: int, end: int) -> list[list[Any]]:
    """The runs covering tokens [start, end) of a run-length list."""
    out: list[list[Any]] = []
    pos = 0
    for source, count in runs:
        lo, hi = max(start, pos), min(end, pos + count)
        if lo < hi:
            out.append([source, hi - lo])
        pos += count
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _provenance(p: Provenance) -> dict[str, Any]:
    return {"prompt": [list(r) for r in p.prompt], "output": [list(r) for r in p.output]}


def sampling_params(service: UiService, body: PlaygroundRequest,
                    num_prompt_tokens: int) -> SamplingParams:
    """The run's sampling parameters; a prompt or output that cannot fit raises here, before
    the stream begins, so the page gets a 4xx."""
    return SamplingParams(temperature=body.temperature,
                          max_tokens=service.host.max_tokens(body.max_tokens, num_prompt_tokens,
                                                             body.mode == "chat"),
                          prompt_lookup=body.prompt_lookup)


async def run(service: UiService, viewer: Viewer, params: SamplingParams,
              ids: list[int], pieces: list[str]) -> AsyncIterator[str]:
    """The events of one playground request (the prompt is tokenized and checked already)."""
    host = service.host
    request_id = f"ui-{uuid.uuid4().hex}"
    yield sse("prompt", compact_json({"request_id": request_id, "pieces": pieces}))
    stream = None
    try:
        stream = host.start(ids, params, request_id, viewer.salt)
        out = await stream.next()
        yield sse("admitted", compact_json({
            "provenance": [list(r) for r in out.provenance.prompt],
            "num_cached_tokens": out.num_cached_tokens, "ttft_ms": _ms(out.metrics.ttft)}))
        async for event in _outputs(stream, out, host.engine.tokenizer, ids):
            yield event
    except KvstackError as err:
        yield sse("error", compact_json({"message": " ".join(str(err).split())}))
    except Exception as err:  # the page shows it; the stream must end cleanly
        yield sse("error", compact_json({"message": f"internal error: {type(err).__name__}"}))
    finally:
        if stream is not None:
            stream.close()


async def _outputs(stream: Any, out: RequestOutput, tokenizer: Any,
                   ids: list[int]) -> AsyncIterator[str]:
    detok = IncrementalDetokenizer(tokenizer, ids, skip_special_tokens=False)
    sent = 0
    while True:
        token_ids = out.outputs[0].token_ids
        if len(token_ids) > sent:
            yield sse("tokens", compact_json({
                "pieces": [detok.add(t) for t in token_ids[sent:]],
                "sources": source_slice(out.provenance.output, sent, len(token_ids))}))
            sent = len(token_ids)
        if out.finished:
            break
        out = await stream.next()
    m = out.metrics
    yield sse("done", compact_json({
        "finish_reason": out.outputs[0].finish_reason, "ttft_ms": _ms(m.ttft),
        "tpot_ms": _ms(m.tpot), "num_output_tokens": sent,
        "num_draft_tokens": out.num_draft_tokens, "num_accepted_tokens": out.num_accepted_tokens,
        "provenance": _provenance(out.provenance)}))


def compact_json(value: Any) -> str:
    """One line of JSON, unescaped text (the page's API bodies and event data)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
