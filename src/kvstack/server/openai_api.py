"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.outputs import RequestOutput
from kvstack.sampling_params import SamplingParams
from kvstack.server.app import ServerState, parse_body, server_state
from kvstack.server.auth import AuthTenant
from kvstack.server.errors import ApiError, from_exception
from kvstack.server.generation import Generation, unless_disconnected
from kvstack.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAISampling,
)
from kvstack.server.semantic_api import Probe, Replay, split_conversation

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
    prompt_ids = _completion_prompt(state, body.prompt)
    params = _sampling(state, body, len(prompt_ids), body.max_tokens, default_max_tokens=16,
                       logprobs=body.logprobs)
    echo = state.tokenizer.decode(prompt_ids) if body.echo else ""
    probe = None
    if state.semantic is not None:
        key_text = _completion_text(body.prompt)
        probe = await state.semantic.probe(tenant, "openai.completions", key_text, None, params,
                                           body.max_tokens, body.semantic_cache,
                                           body.cache_salt)
    call = _Call(state, request, "cmpl", "text_completion", len(prompt_ids), body, probe)
    return await call.run(prompt_ids, params, tenant.cache_salt(body.cache_salt), echo)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request,
                           tenant: AuthTenant) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    messages = [_chat_message(i, m) for i, m in enumerate(body.messages)]
    prompt_ids = chat_token_ids(state.tokenizer, messages)
    if body.top_logprobs:
        raise ApiError(400, "top_logprobs is not supported; give 0 or leave it out",
                       param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    params = _sampling(state, body, len(prompt_ids), max_tokens,
                       logprobs=0 if body.logprobs else None)
    probe = None
    if state.semantic is not None:
        key_text, context = split_conversation(messages)
        probe = await state.semantic.probe(tenant, "openai.chat", key_text, context, params,
                                           max_tokens, body.semantic_cache, body.cache_salt)
    call = _Call(state, request, "chatcmpl", "chat.completion", len(prompt_ids), body, probe)
    return await call.run(prompt_ids, params, tenant.cache_salt(body.cache_salt))


# -- request translation ---------------------------------------------------------------------


def _completion_prompt(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one token of text")
        return list(state.tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one token id")
        vocab = len(state.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is not in the vocabulary "
                                      f"[0, {vocab})")
        return prompt
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
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        max_tokens=state.max_tokens(max_tokens, num_prompt_tokens, default_max_tokens),
    )


# -- responses -------------------------------------------------------------------------------


class _Call:
    """One completion or chat completion, answered whole or as server-sent events."""

    def __init__(self, state: ServerState, request: Request, prefix: str, obj: str,
                 num_prompt_tokens: int, body: OpenAISampling, probe: Probe | None = None) -> None:
        self.state = state
        self.probe = probe  # the semantic cache's view of this request, if it looked it up
        self.headers = probe.headers if probe is not None else {}
        self.request = request
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.chat = obj == "chat.completion"
        self.obj = obj
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.stream = bool(body.stream)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.sent_chars = 0
        self.sent_tokens = 0

    async def run(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                  echo: str = "") -> JSONResponse | StreamingResponse:
        gen: Generation | Replay
        if self.probe is not None and self.probe.hit:
            gen = self.probe.replay(self.id, prompt_ids)
        else:
            gen = self.state.start(prompt_ids, params, self.id, cache_salt)
        try:
            # The first output is awaited before answering so that refusals (queue full, too
            # long for the pool) still get a proper status code.
            first = await unless_disconnected(self.request, gen.next())
            if not self.stream:
                out = await unless_disconnected(self.request, gen.final(first))
                if self.probe is not None:
                    await self.probe.store(out)
                return JSONResponse(self._response(out, echo), headers=self.headers)
        except BaseException:
            gen.close()
            raise
        finally:
            if not self.stream:
                gen.close()
        return StreamingResponse(self._events(gen, first, echo), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", **self.headers})

    async def _events(self, gen: Generation | Replay, out: RequestOutput,
                      echo: str) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""}, None, None)
            elif echo:
                yield self._chunk(echo, None, None)
            while True:
                completion = out.outputs[0]
                text = completion.text[self.sent_chars:]
                logprobs = self._logprobs(out, self.sent_tokens)
                self.sent_chars = len(completion.text)
                self.sent_tokens = len(completion.token_ids)
                reason = completion.finish_reason if out.finished else None
                if text or reason:
                    yield self._chunk({"content": text} if self.chat else text, reason,
                                      logprobs)
                if out.finished:
                    break
                out = await gen.next()
            if self.probe is not None:
                await self.probe.store(out)
            if self.include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self._usage(out)})
        except Exception as err:  # noqa: BLE001 - the status line is gone; say it in-band
            yield _sse(json.loads(from_exception(self.request.url.path, err).body))
        finally:
            gen.close()
        yield "data: [DONE]\n\n"

    def _envelope(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else self.obj
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.state.model_name}

    def _chunk(self, delta: Any, reason: str | None, logprobs: Any) -> str:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": reason}
        choice["delta" if self.chat else "text"] = delta
        chunk = {**self._envelope(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def _response(self, out: RequestOutput, echo: str) -> dict[str, Any]:
        completion = out.outputs[0]
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(out, 0),
                                  "finish_reason": completion.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": completion.text}
        else:
            choice["text"] = echo + completion.text
        return {"id": self.id, "object": self.obj, "created": self.created,
                "model": self.state.model_name, "choices": [choice], "usage": self._usage(out)}

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        num_out = len(out.outputs[0].token_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": num_out,
            "total_tokens": self.num_prompt_tokens + num_out,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }
        if self.probe is not None:
            usage["semantic_cache_hit"] = self.probe.hit
        return usage

    def _logprobs(self, out: RequestOutput, start: int) -> dict[str, Any] | None:
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
        offsets, offset = [], self.sent_chars if start else 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None,
                "text_offset": offsets}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
