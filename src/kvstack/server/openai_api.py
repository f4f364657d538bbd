"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Requests translate to engine calls here (prompt, sampling, n, logprobs, the output constraint
of `response_format` / `guided_*` / a tool choice, tools in the prompt); `openai_wire.py`
writes the responses.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.blend.params import BlendSpec
from kvstack.engine.chat import chat_token_ids
from kvstack.sampling_params import SamplingParams
from kvstack.server.auth import AuthTenant
from kvstack.server.batch import BatchStream
from kvstack.server.blend_api import (
    chat_with_documents,
    check_blend_input,
    completion_segments,
)
from kvstack.server.body import parse_body
from kvstack.server.context_limit import Api
from kvstack.server.errors import ApiError
from kvstack.server.lifecycle import respond
from kvstack.server.openai_wire import OpenAIWire, Prompts, ToolUse
from kvstack.server.prompt_batch import token_id_batch
from kvstack.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAISampling,
)
from kvstack.server.reasoning import thinking_of
from kvstack.server.semantic_api import Probe, split_conversation
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
    tools_prompt,
)

router = APIRouter()
_MAX_BATCH = 256  # prompts in one /v1/completions request


@router.get("/v1/models")
async def list_models(request: Request, _: AuthTenant) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(server_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, _: AuthTenant) -> dict[str, Any]:
    state = server_state(request)
    state.check_model(model_id)
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "kvstack", "max_model_len": state.max_model_len}


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    if (body.prompt is None) == (body.segments is None):
        raise ApiError(400, "give prompt or segments, exactly one of them", param="prompt")
    check_blend_input(bool(body.segments), body.blend, "segments with chunks")
    blend = None
    if body.segments is not None:
        prompt_ids, blend = completion_segments(state.tokenizer, body.segments, body.blend)
        batch = [prompt_ids]
    else:
        batch = token_id_batch(state, body.prompt, "prompt", _MAX_BATCH)
    shown = _shown_prompts(body, batch)
    max_tokens = 1 if shown.score_only else body.max_tokens  # the one token is not shown
    prompt_k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # OpenAI's echo scores the prompt too
        prompt_k = max(prompt_k or 0, body.logprobs)
    params = [_sampling(state, body, len(ids), max_tokens, default_max_tokens=16,
                        api="completions", logprobs=body.logprobs, best_of=body.best_of,
                        prompt_logprobs=prompt_k)
              for ids in batch]
    probe = None
    if (state.semantic is not None and body.segments is None and len(batch) == 1
            and prompt_k is None and not body.echo):
        probe = await state.semantic.probe(tenant, "openai.completions",
                                           _completion_text(body.prompt), None, params[0],
                                           body.max_tokens, body.semantic_cache,
                                           body.cache_salt)
    wire = OpenAIWire(state, "cmpl", "text_completion", sum(map(len, batch)), body, probe,
                      shown)
    cache_salt = tenant.cache_salt(body.cache_salt)
    if len(batch) == 1:
        return await _answer(request, state, wire, batch[0], params[0], cache_salt, body, probe,
                             blend)
    streams = [state.start(ids, p, f"{wire.id}-{i}", cache_salt)
               for i, (ids, p) in enumerate(zip(batch, params, strict=True))]
    return await respond(request, BatchStream(wire.id, streams, shown.n), wire,
                         bool(body.stream), None)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request,
                           tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    tool_use = _tool_use(body)
    messages, tools = _chat_prompt(state, body, tool_use)
    check_blend_input(bool(body.documents), body.blend, "documents")
    blend = None
    if body.documents:
        if tools:
            raise ApiError(400, "documents with tools are not supported yet; send one or the "
                           "other", param="documents")
        prompt_ids, blend = chat_with_documents(state.tokenizer, messages, body.documents,
                                                body.blend)
    else:
        prompt_ids = chat_token_ids(state.tokenizer, messages, tools=tools,
                                    template_kwargs=body.chat_template_kwargs)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = _sampling(state, body, len(prompt_ids), max_tokens,
                       logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                       tool_use=tool_use)
    probe = None
    if (state.semantic is not None and tool_use is None and not body.documents
            and body.prompt_logprobs is None):  # a replayed answer has no prompt scores
        key_text, context = split_conversation(messages)
        probe = await state.semantic.probe(tenant, "openai.chat", key_text, context, params,
                                           max_tokens, body.semantic_cache, body.cache_salt)
    wire = OpenAIWire(state, "chatcmpl", "chat.completion", len(prompt_ids), body, probe,
                      tool_use=tool_use, thinking=thinking_of(state.tokenizer, prompt_ids))
    return await _answer(request, state, wire, prompt_ids, params,
                         tenant.cache_salt(body.cache_salt), body, probe, blend)


async def _answer(request: Request, state: ServerState, wire: OpenAIWire,
                  prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                  body: OpenAISampling, probe: Probe | None, blend: BlendSpec | None = None
                  ) -> JSONResponse | StreamingResponse:
    stream = state.start(prompt_ids, params, wire.id, cache_salt, probe, blend)
    return await respond(request, stream, wire, bool(body.stream), probe)


# -- request translation ---------------------------------------------------------------------


def _shown_prompts(body: CompletionRequest, batch: list[list[int]]) -> Prompts:
    """How the response shows its prompts; refuses what echo cannot answer."""
    n = body.n or 1
    if body.echo and max(n, body.best_of or 1) > 1:
        raise ApiError(400, "echo with n or best_of > 1 is not supported; ask for one choice "
                            "per prompt", param="echo")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens 0 only scores the prompt, which needs echo: true",
                       param="max_tokens")
    return Prompts(batch, n, bool(body.echo), body.logprobs,
                   score_only=bool(body.echo) and body.max_tokens == 0)


def _completion_text(prompt: Any) -> str | None:
    """A text prompt, or None (token ids have no text to compare by meaning)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools and tool choice (OpenAI's default: auto when tools are given)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = [ToolSpec(t.function.name, t.function.description,
                      t.function.parameters or {"type": "object", "properties": {}},
                      bool(t.function.strict)) for t in body.tools]
    parallel = body.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        mode = ToolChoice(choice or "auto", None, parallel)
    else:
        mode = ToolChoice("named", choice.function.name, parallel)
    check_tools(tools, mode)
    return ToolUse(tools, mode)


def _chat_prompt(state: ServerState, body: ChatCompletionRequest, tool_use: ToolUse | None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template, and the tools for a template that renders them;
    otherwise the tools go into the system message (server/tools.py)."""
    native = tool_use is not None and template_takes_tools(state.tokenizer)
    messages = [_chat_message(i, m, native) for i, m in enumerate(body.messages)]
    if tool_use is None or tool_use.choice.mode == "none":
        return messages, None
    if native:
        return messages, [{"type": "function", "function": t.as_json()} for t in tool_use.tools]
    offer = tools_prompt(tool_use.tools)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{offer}"}
    else:
        messages.insert(0, {"role": "system", "content": offer})
    return messages, None


def _chat_message(index: int, message: ChatMessage, native: bool) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        for part in content:
            if part.type != "text":
                raise ApiError(400, f"messages[{index}]: content part type {part.type!r} is "
                                    "not supported; send text parts", param="messages")
            if part.text is None:
                raise ApiError(400, f"messages[{index}]: a text part needs 'text'",
                               param="messages")
        content = "\n".join(part.text or "" for part in content)
    text = content or ""
    if message.role == "tool":
        if native:
            return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
        return {"role": "user", "content": render_result(text)}
    if message.role == "assistant" and message.tool_calls:
        if native:
            return {"role": "assistant", "content": text, "tool_calls": [
                {"type": "function", "function": {"name": c.function.name,
                                                  "arguments": _arguments(index, c.function)}}
                for c in message.tool_calls]}
        calls = "\n".join(render_call(c.function.name, c.function.arguments)
                          for c in message.tool_calls)
        return {"role": "assistant", "content": f"{text}\n{calls}" if text else calls}
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": text}


def _arguments(index: int, function: Any) -> dict[str, Any]:
    try:
        value = json.loads(function.arguments or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(400, f"messages[{index}]: tool call arguments must be a JSON object",
                       param="messages")
    return value


def _sampling(state: ServerState, body: OpenAISampling, num_prompt_tokens: int,
              max_tokens: int | None, default_max_tokens: int | None = None,
              api: Api = "chat", logprobs: int | None = None, best_of: int | None = None,
              tool_use: ToolUse | None = None, prompt_logprobs: int | None = None
              ) -> SamplingParams:
    tool_constraint = constraint(tool_use.tools, tool_use.choice) if tool_use else None
    return state.sampling_params(
        body, state.max_tokens(max_tokens, num_prompt_tokens, default_max_tokens, api),
        n=body.n, best_of=best_of, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=body.stop, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
        structured_outputs=structured_outputs(body, body.response_format,
                                              tool_constraint=tool_constraint),
    )
