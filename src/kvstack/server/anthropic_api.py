"""Anthropic-compatible routes: POST /v1/messages, with prompt caching by `cache_control`, and
POST /v1/messages/count_tokens (the prompt's token count, from the same prompt building).

A `cache_control` breakpoint (at most 4, on tools, system blocks or message blocks) pins the
prompt prefix that ends there for its TTL ("5m" or "1h"); a later request hitting it refreshes
the pin. Usage reports what the engine did: `cache_read_input_tokens` were found in the prefix
cache, `cache_creation_input_tokens` were computed and pinned now, `input_tokens` are the rest.

Tools (`tools`, `tool_choice` auto / any / tool / none) and past `tool_use` / `tool_result`
blocks are rendered as server/tools.py describes; `output_config.format` (a JSON schema) and
vLLM's `guided_*` fields constrain the output. The API has no `n`: one sample per request.

`document` (text source) and `search_result` blocks are chunks, each tokenized alone
(`blend/segments.py`); with a `blend` object their K/V are reused from the chunk cache
(APPROXIMATE, see `blend/`), and usage gains `blend` counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.blend.params import BlendParams, BlendSpec
from kvstack.blend.segments import mark
from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.server.anthropic_fields import check_context_management, check_thinking
from kvstack.server.anthropic_wire import AnthropicWire, Prompt
from kvstack.server.auth import AuthTenant
from kvstack.server.blend_api import check_blend_input, document_block_text, segment_ids
from kvstack.server.body import parse_body
from kvstack.server.chat_roles import place_system_turns
from kvstack.server.errors import ApiError
from kvstack.server.lifecycle import respond
from kvstack.server.protocol import CacheControl, ContentBlock, MessagesRequest
from kvstack.server.reasoning import thinking_kwargs, thinking_of
from kvstack.server.semantic_api import split_conversation
from kvstack.server.state import ServerState, server_state
from kvstack.server.structured import structured_outputs
from kvstack.server.tools import (
    ToolChoice,
    ToolSpec,
    check_tools,
    constraint,
    render_call,
    render_result,
    template_takes_tools,
    tools_prompt_parts,
)
from kvstack.units import common_prefix_len

router = APIRouter()

MAX_BREAKPOINTS = 4
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@router.post("/v1/messages", response_model=None)
async def messages(request: Request, tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, MessagesRequest)
    state.check_model(body.model)
    if body.n is not None and body.n != 1:
        raise ApiError(400, "n is not part of the Anthropic Messages API: one request gives "
                            "one message; send n requests (or use /v1/chat/completions)",
                       param="n")
    check_thinking(body.thinking, body.max_tokens)
    edits_asked = check_context_management(body.context_management)
    prompt = _build_prompt(state, body)
    choice = prompt.tool_choice
    output_format = body.output_config.format if body.output_config else None
    structured = structured_outputs(
        body, json_schema=output_format.json_schema if output_format else None,
        tool_constraint=constraint(prompt.tools, choice) if choice else None)
    params = state.sampling_params(body, state.max_tokens(body.max_tokens, len(prompt.token_ids),
                                                         api="anthropic"),
                                   stop=body.stop_sequences, structured_outputs=structured)
    salt = tenant.cache_salt(body.cache_salt)
    probe = None
    if state.semantic is not None and not body.tools and _text_only(body):
        key_text, context = _semantic_key(body)
        probe = await state.semantic.probe(tenant, "anthropic.messages", key_text, context,
                                           params, body.max_tokens, body.semantic_cache,
                                           body.cache_salt)
    wire = AnthropicWire(state, prompt, salt, probe, edits_asked,
                         thinking=thinking_of(state.tokenizer, prompt.token_ids),
                         show_thinking=_thinking_on(body))
    # a hybrid model keeps its recurrent state at each breakpoint (`recurrent/`)
    stream = state.start(prompt.token_ids, params, wire.id, salt, probe, prompt.blend,
                         [n for n, _ in prompt.breakpoints])
    return await respond(request, stream, wire, bool(body.stream), probe)


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens' body: a Messages request, max_tokens optional."""

    max_tokens: int | None = None  # type: ignore[assignment]


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, _: AuthTenant) -> dict[str, int]:
    """The prompt tokens /v1/messages runs for the same body (system, tools, messages,
    documents): the very prompt it builds, so the two never disagree."""
    state = server_state(request)
    body = await parse_body(request, CountTokensRequest)
    state.check_model(body.model)
    return {"input_tokens": len(_build_prompt(state, body).token_ids)}


# -- prompt and breakpoints ------------------------------------------------------------------


@dataclass(frozen=True)
class _Cut:
    """A prefix of the conversation: system parts, whole messages, then blocks of the next."""

    num_system_parts: int
    num_messages: int
    num_blocks: int = 0


@dataclass
class _Conversation:
    """The request's parts as text, ready to render any prefix (`_Cut`) with the template."""

    system: list[str] = field(default_factory=list)  # tool offer parts, then system blocks
    num_offer_parts: int = 0
    turns: list[tuple[str, list[str]]] = field(default_factory=list)
    docs: list[str] = field(default_factory=list)  # chunk texts; their blocks hold mark(i)
    tools: list[dict[str, Any]] | None = None  # for a template that takes tools natively
    tokenizer: Any = None
    template_kwargs: dict[str, Any] | None = None  # thinking on or off (Qwen3's template)

    def render(self, cut: _Cut, final: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of the prefix `cut` (`final`: the whole prompt), and its chunk spans."""
        messages = []
        if cut.num_system_parts:
            # Tool parts join by a newline (one offer), the rest by a blank line.
            content = self.system[0]
            for k in range(1, cut.num_system_parts):
                content += ("\n" if k < self.num_offer_parts else "\n\n") + self.system[k]
            messages.append({"role": "system", "content": content})
        for role, texts in self.turns[: cut.num_messages]:
            messages.append({"role": role, "content": "\n".join(texts)})
        if cut.num_blocks:
            role, texts = self.turns[cut.num_messages]
            messages.append({"role": role, "content": "\n".join(texts[: cut.num_blocks])})
        messages = place_system_turns(self.tokenizer, messages)
        prefill = self.turns[-1][0] == "assistant"  # the model continues a final assistant turn
        if self.docs:  # only the documents this prefix reaches (a breakpoint may cut before)
            docs = [d for i, d in enumerate(self.docs)
                    if any(mark(i) in m["content"] for m in messages)]
            return segment_ids(self.tokenizer, messages, docs, final, prefill)
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt=final,
                              continue_final_message=final and prefill, tools=self.tools,
                              template_kwargs=self.template_kwargs), []


_PAST_THINKING = ("thinking", "redacted_thinking")


def _thinking_on(body: MessagesRequest) -> bool:
    """The request asks for thinking blocks (enabled with a budget, or adaptive)."""
    return (body.thinking or {}).get("type") in ("enabled", "adaptive")


def _tools(body: MessagesRequest) -> tuple[list[ToolSpec], ToolChoice | None]:
    """The offered tools and how they may be used (None: no tools, or tool_choice none)."""
    tools = [ToolSpec(t.name, t.description, t.input_schema or {"type": "object"})
             for t in body.tools or []]
    given = body.tool_choice
    if not tools:
        if given is not None and given.type != "none":
            raise InvalidRequestError("tool_choice needs tools")
        return [], None
    kind = given.type if given else "auto"
    if kind == "tool" and not given.name:  # type: ignore[union-attr]
        raise InvalidRequestError("tool_choice of type tool needs a name")
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[kind]
    choice = ToolChoice(mode, given.name if given and kind == "tool" else None,
                        not (given and given.disable_parallel_tool_use))
    check_tools(tools, choice)
    return tools, None if mode == "none" else choice


def _build_prompt(state: ServerState, body: MessagesRequest) -> Prompt:
    if not body.messages:
        raise InvalidRequestError("messages is empty; give at least one message")
    tools, choice = _tools(body)
    native = choice is not None and template_takes_tools(state.tokenizer)
    talk = _Conversation(tokenizer=state.tokenizer, tools=[
        {"type": "function", "function": t.as_json()} for t in tools] if native else None,
        template_kwargs=thinking_kwargs(state.tokenizer, _thinking_on(body)))
    marks: list[tuple[_Cut, CacheControl]] = []  # in the order Anthropic caches them
    offer = tools_prompt_parts(tools) if choice is not None and not native else []
    talk.num_offer_parts = len(offer)
    for part, tool in zip(offer, body.tools or [], strict=False):
        talk.system.append(part)
        if tool.cache_control:
            marks.append((_Cut(len(talk.system), 0), tool.cache_control))
    for block in _blocks(body.system, "system"):
        talk.system.append(_block_text(block, "system", talk.docs, system=True))
        if block.cache_control:
            marks.append((_Cut(len(talk.system), 0), block.cache_control))
    for i, message in enumerate(body.messages):
        texts = []
        for j, block in enumerate(_blocks(message.content, f"messages[{i}]")):
            where = f"messages[{i}].content[{j}]"
            if block.type in _PAST_THINKING and message.role == "assistant":
                continue  # a past turn's reasoning: thinking templates drop it, so do we
            if message.role == "system" and block.type != "text":
                raise InvalidRequestError(f"{where}: a system message takes text blocks only, "
                                          f"not {block.type!r}")
            texts.append(_block_text(block, where, talk.docs))
            if block.cache_control:
                marks.append((_Cut(len(talk.system), i, len(texts)), block.cache_control))
        talk.turns.append((message.role, texts))
    if body.cache_control:
        marks.append((_Cut(len(talk.system), len(talk.turns) - 1, len(talk.turns[-1][1])),
                      body.cache_control))
    if len(marks) > MAX_BREAKPOINTS:
        raise ApiError(400, f"a request may set at most {MAX_BREAKPOINTS} cache_control "
                            f"breakpoints; this one sets {len(marks)}")
    if talk.docs and tools:
        raise ApiError(400, "document or search_result blocks with tools are not supported "
                            "yet; send one or the other", param="tools")
    check_blend_input(bool(talk.docs), body.blend, "document or search_result blocks")
    token_ids, chunks = talk.render(_Cut(len(talk.system), len(talk.turns)), final=True)
    # Templates need not render a prefix of a conversation as a prefix of its tokens, so a
    # breakpoint covers what the partial and the full rendering share.
    breakpoints = [(common_prefix_len(token_ids, talk.render(cut, final=False)[0]),
                    TTL_SECONDS[c.ttl]) for cut, c in marks]
    blend = None if body.blend is None else BlendSpec(BlendParams.from_dict(body.blend),
                                                      tuple(chunks))
    return Prompt(token_ids, breakpoints, tools, choice, blend)


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


def _block_text(block: ContentBlock, where: str, docs: list[str] | None = None,
                system: bool = False) -> str:
    """A block as the model sees it: text, a document's placeholder (its text goes to `docs`,
    a chunk), or, in messages, a past call or a tool's result."""
    if block.type in ("document", "search_result") and docs is not None:
        docs.append(document_block_text(block, where))
        return mark(len(docs) - 1)
    if system:
        return _text(block, where)
    if block.type == "tool_use":
        if not block.name:
            raise InvalidRequestError(f"{where}: a tool_use block needs 'name'")
        return render_call(block.name, json.dumps(block.input or {}, ensure_ascii=False))
    if block.type == "tool_result":
        result = block.content
        text = result if isinstance(result, str) else "\n".join(
            _text(b, f"{where}.content[{k}]") for k, b in enumerate(result or []))
        return render_result(f"error: {text}" if block.is_error else text)
    return _text(block, where)


def _text_only(body: MessagesRequest) -> bool:
    """True when every message block is text (the semantic cache keys text only)."""
    return all(b.type == "text" for m in body.messages for b in _blocks(m.content, ""))
