"""Anthropic-compatible route: POST /v1/messages, with prompt caching by `cache_control`.

A `cache_control` breakpoint (at most 4, on tools, system blocks or message blocks) pins the
prompt prefix that ends there for its TTL ("5m" or "1h"); a later request hitting it refreshes
the pin. Usage reports what the engine did: `cache_read_input_tokens` were found in the prefix
cache, `cache_creation_input_tokens` were computed and pinned now, `input_tokens` are the rest.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.engine.chat import chat_token_ids, common_prefix_len
from kvstack.errors import InvalidRequestError
from kvstack.outputs import RequestOutput
from kvstack.server.app import ServerState, parse_body, server_state
from kvstack.server.auth import AuthTenant
from kvstack.server.errors import ApiError, from_exception
from kvstack.server.generation import Generation, unless_disconnected
from kvstack.server.protocol import CacheControl, ContentBlock, MessagesRequest
from kvstack.server.semantic_api import Probe, Replay, split_conversation

router = APIRouter()

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@router.post("/v1/messages", response_model=None)
async def messages(request: Request, tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, MessagesRequest)
    state.check_model(body.model)
    prompt = _build_prompt(state, body)
    num_prompt = len(prompt.token_ids)
    params = state.sampling_params(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=body.stop_sequences,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        max_tokens=state.max_tokens(body.max_tokens, num_prompt),
    )
    salt = tenant.cache_salt(body.cache_salt)
    message_id = f"msg_{uuid.uuid4().hex}"
    probe = None
    if state.semantic is not None:
        key_text, context = _semantic_key(body)
        probe = await state.semantic.probe(tenant, "anthropic.messages", key_text, context,
                                           params, body.max_tokens, body.semantic_cache,
                                           body.cache_salt)
    headers = probe.headers if probe is not None else {}
    gen: Generation | Replay
    if probe is not None and probe.hit:
        gen = probe.replay(message_id, prompt.token_ids)
    else:
        gen = state.start(prompt.token_ids, params, message_id, salt)
    try:
        # The prefill is done once the first token is out: its blocks are cached, so pin now.
        first = await unless_disconnected(request, gen.next())
        hit = probe is not None and probe.hit
        num_pinned = 0 if hit else await _pin(state, prompt, salt)
        usage = _Usage(num_prompt, first.num_cached_tokens, num_pinned,
                       None if probe is None else hit)
        if not body.stream:
            out = await unless_disconnected(request, gen.final(first))
            if probe is not None:
                await probe.store(out)
            return JSONResponse(_message(state, message_id, out, usage), headers=headers)
    except BaseException:
        gen.close()
        raise
    finally:
        if not body.stream:
            gen.close()
    events = _events(state, request, message_id, gen, first, usage, probe)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"cache-control": "no-cache", **headers})


# -- prompt and breakpoints ------------------------------------------------------------------


@dataclass(frozen=True)
class _Prompt:
    token_ids: list[int]
    breakpoints: list[tuple[int, float]]  # (prefix length in tokens, TTL in seconds)


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
    for tool in body.tools or []:
        system.append(json.dumps({"name": tool.name, "description": tool.description,
                                  "input_schema": tool.input_schema}, ensure_ascii=False))
        if tool.cache_control:
            marks.append((_Cut(len(system), 0), tool.cache_control))
    for block in _blocks(body.system, "system"):
        system.append(_text(block, "system"))
        if block.cache_control:
            marks.append((_Cut(len(system), 0), block.cache_control))
    turns: list[tuple[str, list[str]]] = []
    for i, message in enumerate(body.messages):
        texts = []
        for j, block in enumerate(_blocks(message.content, f"messages[{i}]")):
            texts.append(_text(block, f"messages[{i}].content[{j}]"))
            if block.cache_control:
                marks.append((_Cut(len(system), i, j + 1), block.cache_control))
        turns.append((message.role, texts))
    if body.cache_control:
        marks.append((_Cut(len(system), len(turns) - 1, len(turns[-1][1])), body.cache_control))
    if len(marks) > MAX_BREAKPOINTS:
        raise ApiError(400, f"a request may set at most {MAX_BREAKPOINTS} cache_control "
                            f"breakpoints; this one sets {len(marks)}")
    prefill = turns[-1][0] == "assistant"  # the model continues a final assistant turn

    def render(cut: _Cut, final: bool) -> list[int]:
        messages = []
        if cut.num_system_parts:
            messages.append({"role": "system",
                             "content": "\n\n".join(system[: cut.num_system_parts])})
        for role, texts in turns[: cut.num_messages]:
            messages.append({"role": role, "content": "\n".join(texts)})
        if cut.num_blocks:
            role, texts = turns[cut.num_messages]
            messages.append({"role": role, "content": "\n".join(texts[: cut.num_blocks])})
        return chat_token_ids(state.tokenizer, messages, add_generation_prompt=final,
                              continue_final_message=final and prefill)

    token_ids = render(_Cut(len(system), len(turns)), final=True)
    # Templates need not render a prefix of a conversation as a prefix of its tokens, so a
    # breakpoint covers what the partial and the full rendering share.
    breakpoints = [(common_prefix_len(token_ids, render(cut, final=False)), TTL_SECONDS[c.ttl])
                   for cut, c in marks]
    return _Prompt(token_ids, breakpoints)


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


def _text(block: ContentBlock, where: str) -> str:
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
    semantic_cache_hit: bool | None = None  # None: the semantic cache was not consulted

    def as_dict(self, output_tokens: int) -> dict[str, Any]:
        creation = max(0, self.num_pinned_tokens - self.num_cached_tokens)
        usage: dict[str, Any] = {
            "input_tokens": self.num_prompt_tokens - self.num_cached_tokens - creation,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": self.num_cached_tokens,
            "output_tokens": output_tokens,
        }
        if self.semantic_cache_hit is not None:
            usage["semantic_cache_hit"] = self.semantic_cache_hit
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


def _message(state: ServerState, message_id: str, out: RequestOutput | None,
             usage: _Usage) -> dict[str, Any]:
    content = [] if out is None else [{"type": "text", "text": out.outputs[0].text}]
    reason, sequence = (None, None) if out is None else _stop(out)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": state.model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage.as_dict(0 if out is None else len(out.outputs[0].token_ids)),
    }


async def _events(state: ServerState, request: Request, message_id: str,
                  gen: Generation | Replay, out: RequestOutput, usage: _Usage,
                  probe: Probe | None) -> AsyncIterator[str]:
    try:
        yield _event("message_start", {"message": _message(state, message_id, None, usage)})
        yield _event("content_block_start",
                     {"index": 0, "content_block": {"type": "text", "text": ""}})
        sent = 0
        while True:
            text = out.outputs[0].text
            if len(text) > sent:
                yield _event("content_block_delta",
                             {"index": 0, "delta": {"type": "text_delta", "text": text[sent:]}})
                sent = len(text)
            if out.finished:
                break
            out = await gen.next()
        if probe is not None:
            await probe.store(out)
        yield _event("content_block_stop", {"index": 0})
        reason, sequence = _stop(out)
        yield _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage.as_dict(len(out.outputs[0].token_ids)),
        })
        yield _event("message_stop", {})
    except Exception as err:  # noqa: BLE001 - the status line is gone; say it in-band
        yield _event("error", json.loads(from_exception(request.url.path, err).body))
    finally:
        gen.close()


def _event(kind: str, payload: dict[str, Any]) -> str:
    data = payload if kind == "error" else {"type": kind, **payload}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
