"""Anthropic-compatible route: POST /v1/messages, with prompt caching by `cache_control`.

A `cache_control` breakpoint (at most 4, on tools, system blocks or message blocks) pins the
prompt prefix that ends there for its TTL ("5m" or "1h"); a later request hitting it refreshes
the pin. Usage reports what the engine did: `cache_read_input_tokens` were found in the prefix
cache, `cache_creation_input_tokens` were computed and pinned now, `input_tokens` are the rest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.blend.params import BlendParams, BlendSpec
from kvstack.blend.segments import mark
from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.outputs import RequestOutput
from kvstack.server.auth import AuthTenant
from kvstack.server.blend_api import (
    blend_usage,
    check_blend_input,
    document_block_text,
    segment_ids,
)
from kvstack.server.body import parse_body
from kvstack.server.errors import ApiError
from kvstack.server.protocol import CacheControl, ContentBlock, MessagesRequest
from kvstack.server.responses import respond, sse
from kvstack.server.semantic_api import Probe, split_conversation
from kvstack.server.state import ServerState, server_state
from kvstack.units import common_prefix_len

router = APIRouter()

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@router.post("/v1/messages", response_model=None)
async def messages(request: Request, tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, MessagesRequest)
    state.check_model(body.model)
    prompt = _build_prompt(state, body)
    params = state.sampling_params(body, state.max_tokens(body.max_tokens, len(prompt.token_ids)),
                                   stop=body.stop_sequences)
    salt = tenant.cache_salt(body.cache_salt)
    probe = None
    if state.semantic is not None and not prompt.chunks:  # answers depend on the documents
        key_text, context = _semantic_key(body)
        probe = await state.semantic.probe(tenant, "anthropic.messages", key_text, context,
                                           params, body.max_tokens, body.semantic_cache,
                                           body.cache_salt)
    wire = _AnthropicWire(state, prompt, salt, probe)
    stream = state.start(prompt.token_ids, params, wire.id, salt, probe, prompt.blend)
    return await respond(request, stream, wire, bool(body.stream), probe)


# -- prompt and breakpoints ------------------------------------------------------------------


@dataclass(frozen=True)
class _Prompt:
    token_ids: list[int]
    breakpoints: list[tuple[int, float]]  # (prefix length in tokens, TTL in seconds)
    chunks: list[tuple[int, int]]  # spans of document / search_result blocks
    blend: BlendSpec | None = None


@dataclass(frozen=True)
class _Cut:
    """A prefix of the conversation: system parts, whole messages, then blocks of the next."""

    num_system_parts: int
    num_messages: int
    num_blocks: int = 0


def _build_prompt(state: ServerState, body: MessagesRequest) -> _Prompt:
    if not body.messages:
        raise InvalidRequestError("messages is empty; give at least one message")
    system: list[str] = []  # tools, then system blocks: the order Anthropic caches them in
    marks: list[tuple[_Cut, CacheControl]] = []
    docs: list[str] = []  # document blocks' chunk texts; their content holds mark(i)
    for tool in body.tools or []:
        system.append(json.dumps({"name": tool.name, "description": tool.description,
                                  "input_schema": tool.input_schema}, ensure_ascii=False))
        if tool.cache_control:
            marks.append((_Cut(len(system), 0), tool.cache_control))
    for block in _blocks(body.system, "system"):
        system.append(_text(block, "system", docs))
        if block.cache_control:
            marks.append((_Cut(len(system), 0), block.cache_control))
    turns: list[tuple[str, list[str]]] = []
    for i, message in enumerate(body.messages):
        texts = []
        for j, block in enumerate(_blocks(message.content, f"messages[{i}]")):
            texts.append(_text(block, f"messages[{i}].content[{j}]", docs))
            if block.cache_control:
                marks.append((_Cut(len(system), i, j + 1), block.cache_control))
        turns.append((message.role, texts))
    if body.cache_control:
        marks.append((_Cut(len(system), len(turns) - 1, len(turns[-1][1])), body.cache_control))
    if len(marks) > MAX_BREAKPOINTS:
        raise ApiError(400, f"a request may set at most {MAX_BREAKPOINTS} cache_control "
                            f"breakpoints; this one sets {len(marks)}")
    prefill = turns[-1][0] == "assistant"  # the model continues a final assistant turn

    def render(cut: _Cut, final: bool) -> tuple[list[int], list[tuple[int, int]]]:
        messages = []
        if cut.num_system_parts:
            messages.append({"role": "system",
                             "content": "\n\n".join(system[: cut.num_system_parts])})
        for role, texts in turns[: cut.num_messages]:
            messages.append({"role": role, "content": "\n".join(texts)})
        if cut.num_blocks:
            role, texts = turns[cut.num_messages]
            messages.append({"role": role, "content": "\n".join(texts[: cut.num_blocks])})
        if docs:  # each document tokenized alone (`blend/segments.py`)
            return segment_ids(state.tokenizer, messages, docs, final, prefill)
        return chat_token_ids(state.tokenizer, messages, add_generation_prompt=final,
                              continue_final_message=final and prefill), []

    token_ids, chunks = render(_Cut(len(system), len(turns)), final=True)
    # Templates need not render a prefix of a conversation as a prefix of its tokens, so a
    # breakpoint covers what the partial and the full rendering share.
    breakpoints = [(common_prefix_len(token_ids, render(cut, final=False)[0]),
                    TTL_SECONDS[c.ttl]) for cut, c in marks]
    check_blend_input(bool(chunks), body.blend, "document or search_result blocks")
    blend = None if body.blend is None else BlendSpec(BlendParams.from_dict(body.blend),
                                                      tuple(chunks))
    return _Prompt(token_ids, breakpoints, chunks, blend)


def _semantic_key(body: MessagesRequest) -> tuple[str | None, Any]:
    """The last user turn's text, and what surrounds it (tools, system, other turns); only
    text counts, so cache_control breakpoints do not split the semantic cache."""
    turns = [{"role": m.role, "content": "\n".join(b.text or "" for b in _blocks(m.content, ""))}
             for m in body.messages]
    key_text, around = split_conversation(turns)
    tools = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
             for t in body.tools or []]
    system = [b.text for b in _blocks(body.system, "system")]
    return key_text, {"tools": tools, "system": system, "turns": around}


def _blocks(content: str | list[ContentBlock] | None, where: str) -> list[ContentBlock]:
    if content is None:
        return []
    if isinstance(content, str):
        return [ContentBlock(type="text", text=content)]
    if not content and where != "system":
        raise InvalidRequestError(f"{where}: content is empty; give at least one text block")
    return content


def _text(block: ContentBlock, where: str, docs: list[str] | None = None) -> str:
    if block.type in ("document", "search_result") and docs is not None:
        docs.append(document_block_text(block, where))
        return mark(len(docs) - 1)
    if block.type != "text":
        raise InvalidRequestError(
            f"{where}: content block type {block.type!r} is not supported; send text blocks"
        )
    if block.text is None:
        raise InvalidRequestError(f"{where}: a text block needs 'text'")
    return block.text


async def _pin(state: ServerState, prompt: _Prompt, cache_salt: str | None) -> int:
    """Pin each breakpoint's prefix; returns how many prompt tokens pinned blocks now cover."""
    longest: dict[float, int] = {}  # per TTL its longest prefix: shorter ones lie inside it
    for num_tokens, ttl_s in prompt.breakpoints:
        longest[ttl_s] = max(longest.get(ttl_s, 0), num_tokens)
    num_pinned = 0
    for ttl_s, num_tokens in sorted(longest.items()):
        created, read = await state.engine.pin_prefix(
            prompt.token_ids[:num_tokens], cache_salt, ttl_s * state.config.cache_ttl_scale
        )
        num_pinned = max(num_pinned, created + read)
    return num_pinned


# -- responses -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Usage:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_pinned_tokens: int
    probe: Probe | None = None  # None: the semantic cache was not consulted

    def as_dict(self, out: RequestOutput | None) -> dict[str, Any]:
        """Usage once `out` is produced (None: before any output)."""
        creation = max(0, self.num_pinned_tokens - self.num_cached_tokens)
        usage: dict[str, Any] = {
            "input_tokens": self.num_prompt_tokens - self.num_cached_tokens - creation,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": self.num_cached_tokens,
            "output_tokens": 0 if out is None else len(out.outputs[0].token_ids),
        }
        if out is not None and (blended := blend_usage(out)) is not None:
            usage["blend"] = blended
        if self.probe is not None:
            usage["semantic_cache_hit"] = self.probe.hit
            if out is not None:
                usage["semantic_cache"] = self.probe.usage(out)
        return usage


def _stop(out: RequestOutput) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence)."""
    completion = out.outputs[0]
    if not out.finished:
        return None, None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


class _AnthropicWire:
    """A message's JSON and event shapes (see `responses.WireFormat`)."""

    def __init__(self, state: ServerState, prompt: _Prompt, cache_salt: str | None,
                 probe: Probe | None) -> None:
        self.state = state
        self.prompt = prompt
        self.cache_salt = cache_salt
        self.probe = probe
        self.headers = probe.headers if probe is not None else {}
        self.id = f"msg_{uuid.uuid4().hex}"
        self.usage = _Usage(len(prompt.token_ids), 0, 0)

    async def started(self, first: RequestOutput) -> None:
        # The prefill is done once the first token is out: its blocks are cached, so pin now.
        replayed = self.probe is not None and self.probe.replays
        num_pinned = 0 if replayed else await _pin(self.state, self.prompt, self.cache_salt)
        self.usage = _Usage(len(self.prompt.token_ids), first.num_cached_tokens, num_pinned,
                            self.probe)

    def whole(self, out: RequestOutput | None) -> dict[str, Any]:
        content = [] if out is None else [{"type": "text", "text": out.outputs[0].text}]
        reason, sequence = (None, None) if out is None else _stop(out)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage.as_dict(out),
        }

    def opening(self, first: RequestOutput) -> Iterable[str]:
        yield _event("message_start", {"message": self.whole(None)})
        yield _event("content_block_start",
                     {"index": 0, "content_block": {"type": "text", "text": ""}})

    def delta(self, out: RequestOutput, text: str, sent_chars: int,
              sent_tokens: int) -> Iterable[str]:
        if text:
            yield _event("content_block_delta",
                         {"index": 0, "delta": {"type": "text_delta", "text": text}})

    def closing(self, out: RequestOutput) -> Iterable[str]:
        yield _event("content_block_stop", {"index": 0})
        reason, sequence = _stop(out)
        yield _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": self.usage.as_dict(out),
        })
        yield _event("message_stop", {})

    def error(self, body: dict[str, Any]) -> str:
        return _event("error", body)

    def done(self) -> Iterable[str]:
        return ()


def _event(kind: str, payload: dict[str, Any]) -> str:
    return sse(payload if kind == "error" else {"type": kind, **payload}, event=kind)
