"""Routes that generate nothing: vLLM's POST /tokenize and /detokenize, and OpenAI's
POST /v1/embeddings.

/tokenize takes a `prompt` (tokenized as /v1/completions does: with the tokenizer's special
tokens unless `add_special_tokens` is false) or chat `messages` (rendered exactly as
/v1/chat/completions renders them, tools included; `add_generation_prompt` defaults to true
and `add_special_tokens` to false, as in vLLM, where true tokenizes the rendered text again
with the special tokens). It answers `{"count", "max_model_len", "tokens", "token_strs"}`,
`token_strs` (each token's vocabulary string) only with `return_token_strs`.

/v1/embeddings: each input's vector is the mean over its tokens of the model's final hidden
state (after the final norm), L2-normalized (`engine/embedding.py`); it runs outside the KV
cache and touches no request's blocks. `dimensions` is refused unless it is the model's
hidden size: vectors are never truncated. `encoding_format` "base64" is the little-endian
float32 bytes, as OpenAI sends them.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from kvstack.engine.chat import chat_token_ids
from kvstack.engine.tokenizer import check_token_ids
from kvstack.server.auth import AuthTenant
from kvstack.server.body import parse_body
from kvstack.server.engine_client import EmbeddingEngine
from kvstack.server.errors import ApiError
from kvstack.server.openai_api import _chat_prompt, _tool_use
from kvstack.server.prompt_batch import token_id_batch
from kvstack.server.protocol import ChatCompletionRequest
from kvstack.server.state import ServerState, server_state

router = APIRouter()
MAX_INPUTS = 2048  # inputs in one /v1/embeddings request, OpenAI's limit


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(_Strict):
    model: str
    prompt: str | None = None
    messages: Any = None  # the chat form: parsed as `TokenizeChatRequest`
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


@router.post("/tokenize")
async def tokenize(request: Request, _: AuthTenant) -> dict[str, Any]:
    state = server_state(request)
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give prompt or messages, exactly one of them", param="prompt")
    if body.prompt is not None:
        special = body.add_special_tokens is not False
        token_ids = list(state.tokenizer.encode(body.prompt, add_special_tokens=special))
    else:
        token_ids = _chat_ids(state, await parse_body(request, TokenizeChatRequest))
    return {"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids,
            "token_strs": state.tokenizer.convert_ids_to_tokens(token_ids)
            if body.return_token_strs else None}


def _chat_ids(state: ServerState, body: TokenizeChatRequest) -> list[int]:
    """The prompt /v1/chat/completions would run for these messages and tools."""
    if body.documents:
        raise ApiError(400, "documents are not supported by /tokenize; send messages only",
                       param="documents")
    messages, tools = _chat_prompt(state, body, _tool_use(body))
    token_ids = chat_token_ids(state.tokenizer, messages, body.add_generation_prompt,
                               body.continue_final_message, tools)
    if not body.add_special_tokens:
        return token_ids
    return list(state.tokenizer.encode(state.tokenizer.decode(token_ids),
                                       add_special_tokens=True))


@router.post("/detokenize")
async def detokenize(request: Request, _: AuthTenant) -> dict[str, Any]:
    state = server_state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    if body.tokens:
        check_token_ids(body.tokens, state.info.vocab_size)  # 400 for an id out of vocabulary
    return {"prompt": state.tokenizer.decode(body.tokens)}


@router.post("/v1/embeddings")
async def embeddings(request: Request, _: AuthTenant) -> dict[str, Any]:
    state = server_state(request)
    body = await parse_body(request, EmbeddingRequest)
    state.check_model(body.model)
    size = state.info.config.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise ApiError(400, f"dimensions {body.dimensions} is not supported: this model's "
                            f"embeddings have {size} dimensions; omit dimensions",
                       param="dimensions")
    engine = state.engine
    if not isinstance(engine, EmbeddingEngine):
        raise ApiError(501, "this server cannot compute embeddings (a cluster's ingress runs no "
                            "model); serve them from a single-engine server", param="input")
    batch = embedding_inputs(state, body.input)
    data = []
    for i, token_ids in enumerate(batch):
        vector = await engine.embed(token_ids)
        data.append({"object": "embedding", "index": i,
                     "embedding": _encode(vector, body.encoding_format)})
    num_tokens = sum(map(len, batch))
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def embedding_inputs(state: ServerState, given: str | list[Any]) -> list[list[int]]:
    """Each input's token ids (a text, token ids, or a list of either), every one non-empty
    and within the model's context."""
    batch = token_id_batch(state, given, "input", MAX_INPUTS)
    for i, token_ids in enumerate(batch):
        if len(token_ids) > state.max_model_len:
            raise ApiError(400, f"input {i} has {len(token_ids)} tokens but the model's context "
                                f"is {state.max_model_len} tokens; shorten it", param="input",
                           code="context_length_exceeded")
    return batch


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
