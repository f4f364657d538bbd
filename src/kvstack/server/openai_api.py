"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.blend.params import BlendSpec
from kvstack.engine.chat import chat_token_ids
from kvstack.engine.tokenizer import check_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.server.auth import AuthTenant
from kvstack.server.blend_api import (
    blend_usage,
    chat_with_documents,
    check_blend_input,
    completion_segments,
)
from kvstack.server.body import parse_body
from kvstack.server.errors import ApiError
from kvstack.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAISampling,
)
from kvstack.server.responses import respond, sse
from kvstack.server.semantic_api import Probe, split_conversation
from kvstack.server.state import ServerState, server_state

router = APIRouter()


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
    else:
        prompt_ids = _completion_prompt(state, body.prompt)
    params = _sampling(state, body, len(prompt_ids), body.max_tokens, default_max_tokens=16,
                       logprobs=body.logprobs)
    echo = state.tokenizer.decode(prompt_ids) if body.echo else ""
    probe = None
    if state.semantic is not None and body.segments is None:
        probe = await state.semantic.probe(tenant, "openai.completions",
                                           _completion_text(body.prompt), None, params,
                                           body.max_tokens, body.semantic_cache,
                                           body.cache_salt)
    wire = _OpenAIWire(state, "cmpl", "text_completion", len(prompt_ids), body, probe, echo)
    return await _answer(request, state, wire, prompt_ids, params,
                         tenant.cache_salt(body.cache_salt), body, probe, blend)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request,
                           tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    messages = [_chat_message(i, m) for i, m in enumerate(body.messages)]
    check_blend_input(bool(body.documents), body.blend, "documents")
    blend = None
    if body.documents:
        prompt_ids, blend = chat_with_documents(state.tokenizer, messages, body.documents,
                                                body.blend)
    else:
        prompt_ids = chat_token_ids(state.tokenizer, messages)
    if body.top_logprobs:
        raise ApiError(400, "top_logprobs is not supported; give 0 or leave it out",
                       param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = _sampling(state, body, len(prompt_ids), max_tokens,
                       logprobs=0 if body.logprobs else None)
    probe = None
    if state.semantic is not None and not body.documents:  # answers depend on the documents
        key_text, context = split_conversation(messages)
        probe = await state.semantic.probe(tenant, "openai.chat", key_text, context, params,
                                           max_tokens, body.semantic_cache, body.cache_salt)
    wire = _OpenAIWire(state, "chatcmpl", "chat.completion", len(prompt_ids), body, probe)
    return await _answer(request, state, wire, prompt_ids, params,
                         tenant.cache_salt(body.cache_salt), body, probe, blend)


async def _answer(request: Request, state: ServerState, wire: _OpenAIWire,
                  prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                  body: OpenAISampling, probe: Probe | None, blend: BlendSpec | None = None
                  ) -> JSONResponse | StreamingResponse:
    stream = state.start(prompt_ids, params, wire.id, cache_salt, probe, blend)
    return await respond(request, stream, wire, bool(body.stream), probe)


# -- request translation ---------------------------------------------------------------------


def _completion_prompt(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one token of text")
        return list(state.tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return check_token_ids(prompt, state.info.vocab_size)
    raise ApiError(400, "give one prompt per request (a string or a list of token ids)",
                   param="prompt")


def _completion_text(prompt: Any) -> str | None:
    """A text prompt, or None (token ids have no text to compare by meaning)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _chat_message(index: int, message: ChatMessage) -> dict[str, str]:
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
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content or ""}


def _sampling(state: ServerState, body: OpenAISampling, num_prompt_tokens: int,
              max_tokens: int | None, default_max_tokens: int | None = None,
              logprobs: int | None = None) -> SamplingParams:
    return state.sampling_params(
        body, state.max_tokens(max_tokens, num_prompt_tokens, default_max_tokens),
        n=body.n, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=body.stop, logprobs=logprobs,
    )


# -- responses -------------------------------------------------------------------------------


class _OpenAIWire:
    """A completion's or chat completion's JSON and chunk shapes (see `responses.WireFormat`)."""

    def __init__(self, state: ServerState, prefix: str, obj: str, num_prompt_tokens: int,
                 body: OpenAISampling, probe: Probe | None, echo: str = "") -> None:
        self.state = state
        self.probe = probe  # the semantic cache's view of this request, if it looked it up
        self.headers = probe.headers if probe is not None else {}
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.chat = obj == "chat.completion"
        self.obj = obj
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.echo = echo

    async def started(self, first: RequestOutput) -> None:
        return None

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        completion = out.outputs[0]
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(out, 0, 0),
                                  "finish_reason": completion.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice["text"] = self.echo + completion.text
        return {**self._envelope(self.obj), "choices": [choice], "usage": self._usage(out)}

    def opening(self, first: RequestOutput) -> Iterable[str]:
        if self.chat:
            yield self._chunk({"role": "assistant", "content": ""}, None, None)
        elif self.echo:
            yield self._chunk(self.echo, None, None)

    def delta(self, out: RequestOutput, text: str, sent_chars: int,
              sent_tokens: int) -> Iterable[str]:
        reason = out.outputs[0].finish_reason if out.finished else None
        if text or reason:
            logprobs = self._logprobs(out, sent_tokens, sent_chars)
            yield self._chunk({"content": text} if self.chat else text, reason, logprobs)

    def closing(self, out: RequestOutput) -> Iterable[str]:
        if self.include_usage:
            yield sse({**self._envelope(self._chunk_object), "choices": [],
                       "usage": self._usage(out)})

    def error(self, body: dict[str, Any]) -> str:
        return sse(body)

    def done(self) -> Iterable[str]:
        yield "data: [DONE]\n\n"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else self.obj

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.state.model_name}

    def _chunk(self, delta: Any, reason: str | None, logprobs: Any) -> str:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
        choice["delta" if self.chat else "text"] = delta
        chunk = {**self._envelope(self._chunk_object), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        num_out = len(out.outputs[0].token_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": num_out,
            "total_tokens": self.num_prompt_tokens + num_out,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }
        if (blended := blend_usage(out)) is not None:
            usage["blend"] = blended
        if self.probe is not None:
            usage["semantic_cache_hit"] = self.probe.hit
            usage["semantic_cache"] = self.probe.usage(out)
        return usage

    def _logprobs(self, out: RequestOutput, start: int, offset: int) -> dict[str, Any] | None:
        """Log-probs of output tokens from `start` on; `offset`: characters sent before."""
        completion = out.outputs[0]
        if completion.logprobs is None:
            return None
        ids = completion.token_ids[start:]
        values = completion.logprobs[start:]
        tokens = [self.state.token_text(t) for t in ids]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                 "top_logprobs": []} for tok, lp in zip(tokens, values,
                                                                        strict=True)]}
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None,
                "text_offset": offsets}
