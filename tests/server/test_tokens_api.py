"""/tokenize, /detokenize, /v1/messages/count_tokens and /v1/embeddings (in process, over ASGI)
through the official SDKs where one exists: counts equal to what the generating routes prompt
with, vectors equal to transformers' pooled hidden states, no KV block touched, keys required,
and typed 4xx for bad input."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch
from helpers.asgi_clients import AsgiClients

from kvstack import LLM

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"
KEY = "key-tokens-0123"
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
    "parameters": WEATHER_TOOL["input_schema"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TEXTS = ["The cat sat on the mat.", "A kitten was sitting on the rug.",
         "Quarterly revenue rose by four percent."]


class Clients(AsgiClients):
    def post(self, path: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return self.run(self.http.post(path, json={"model": MODEL} | body, headers=headers))

    def embed(self, **kw: Any) -> Any:
        return self.run(self.openai.embeddings.create(**({"model": MODEL} | kw)))


@pytest.fixture(scope="module")
def api() -> Iterator[Clients]:
    clients = Clients(LLM(MODEL, kv_cache_memory="32MiB"), [KEY], key=KEY)
    yield clients
    clients.close()


# -- /tokenize and /detokenize ----------------------------------------------------------------


def test_tokenize_a_prompt_and_detokenize_it_back(api: Clients) -> None:
    tokenizer = api.llm.get_tokenizer()
    text = "Hello, world: tokens in and out."
    r = api.post("/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == api.llm.info.max_model_len and body["token_strs"] is None
    strs = api.post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert len(strs["token_strs"]) == body["count"]
    back = api.post("/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_counts_what_chat_completions_prompts(api: Clients) -> None:
    for tools in (None, CHAT_TOOLS):
        extra = {"tools": tools} if tools else {}
        r = api.post("/tokenize", {"messages": ASK, **extra})
        assert r.status_code == 200, r.text
        chat = api.run(api.openai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, temperature=0, **extra))
        assert r.json()["count"] == chat.usage.prompt_tokens
    full = api.post("/tokenize", {"messages": ASK}).json()["tokens"]
    bare = api.post("/tokenize", {"messages": ASK, "add_generation_prompt": False}).json()
    assert 0 < bare["count"] < len(full) and full[: bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, needle", [
    ("/detokenize", {"tokens": [1, 10**9]}, "not in the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "not in the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {}, "exactly one"),
    ("/tokenize", {"prompt": "a", "messages": ASK}, "exactly one"),
    ("/tokenize", {"messages": []}, "empty"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "role"),
])
def test_bad_tokenize_requests_get_a_typed_400(api: Clients, path: str, body: dict[str, Any],
                                               needle: str) -> None:
    r = api.post(path, body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


# -- /v1/messages/count_tokens ----------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"system": "You answer in one short sentence.", "messages": ASK},
    {"tools": [WEATHER_TOOL], "messages": ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "18 C and sunny"}]}]},
])
def test_count_tokens_equals_the_input_tokens_of_the_message(api: Clients,
                                                            body: dict[str, Any]) -> None:
    counted = api.run(api.claude.messages.count_tokens(model=MODEL, **body))
    # A salt of its own: no cached prefix, so usage.input_tokens is the whole prompt.
    sent = api.run(api.claude.messages.create(
        model=MODEL, max_tokens=1, **body,
        extra_body={"temperature": 0, "cache_salt": uuid.uuid4().hex}))
    assert sent.usage.cache_read_input_tokens == 0
    assert counted.input_tokens == sent.usage.input_tokens > 10


def test_count_tokens_refuses_what_messages_refuses(api: Clients) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        api.run(api.claude.messages.count_tokens(model=MODEL, messages=[]))
    assert err.value.body["type"] == "error" and "empty" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        api.run(api.claude.messages.count_tokens(model="nope", messages=ASK))


# -- /v1/embeddings ---------------------------------------------------------------------------


def _reference(hf: Any, token_ids: list[int]) -> np.ndarray:
    """transformers' final hidden state (after the final norm), mean-pooled, L2-normalized."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([token_ids])).last_hidden_state[0].double()
    return torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()


def test_embeddings_equal_transformers_pooled_hidden_states(api: Clients, hf_embedded: Any
                                                            ) -> None:
    tokenizer = api.llm.get_tokenizer()
    floats = api.embed(input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1, 2]
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    size = api.llm.info.config.hidden_size
    for d, token_ids in zip(floats.data, ids, strict=True):
        got = np.asarray(d.embedding)
        assert got.shape == (size,) and abs(np.linalg.norm(got) - 1) < 1e-5
        assert np.abs(got - _reference(hf_embedded, token_ids)).max() < 1e-4
    encoded = api.embed(input=TEXTS, encoding_format="base64")
    for d, f in zip(encoded.data, floats.data, strict=True):
        assert isinstance(d.embedding, str)
        assert np.frombuffer(base64.b64decode(d.embedding), "<f4").tolist() == f.embedding
    # The SDK's default asks for base64 and decodes it to the same floats.
    assert api.embed(input=TEXTS[0]).data[0].embedding == floats.data[0].embedding
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]


def test_embeddings_of_token_ids_equal_those_of_their_text(api: Clients) -> None:
    ids = [api.llm.get_tokenizer().encode(t) for t in TEXTS[:2]]
    by_text = api.embed(input=TEXTS[:2], encoding_format="float")
    one = api.embed(input=ids[0], encoding_format="float", dimensions=len(
        by_text.data[0].embedding))
    many = api.embed(input=ids, encoding_format="float")
    assert one.data[0].embedding == by_text.data[0].embedding
    assert [d.embedding for d in many.data] == [d.embedding for d in by_text.data]


def test_embeddings_leave_running_requests_and_the_pool_alone(api: Clients) -> None:
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0}
    alone = api.run(api.openai.chat.completions.create(**chat)).choices[0].message.content

    async def both() -> tuple[Any, Any]:
        return await asyncio.gather(api.openai.chat.completions.create(**chat),
                                    api.openai.embeddings.create(model=MODEL, input=TEXTS))
    answer, vectors = api.run(both())
    assert answer.choices[0].message.content == alone and len(vectors.data) == 3
    api.llm.engine.check_integrity()
    assert api.llm.stats().num_blocks_used == 0


@pytest.mark.parametrize("body, needle", [
    ({"input": ""}, "input 0 is empty"),
    ({"input": []}, "non-empty list of either"),
    ({"input": ["a", ""]}, "input 1 is empty"),
    ({"input": [[1, 2], []]}, "input 1 must be a string or a non-empty list"),
    ({"input": [1, 10**9]}, "not in the vocabulary"),
    ({"input": "hello", "dimensions": 64}, "not supported"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [1, "a"]}, "input"),
])
def test_bad_embedding_requests_get_a_typed_400(api: Clients, body: dict[str, Any],
                                                needle: str) -> None:
    r = api.post("/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    api.llm.engine.check_integrity()


def test_an_input_longer_than_the_context_is_refused(api: Clients) -> None:
    context = api.llm.info.max_model_len
    with pytest.raises(openai.BadRequestError) as err:
        api.embed(input=[[7] * (context + 1)])
    assert err.value.code == "context_length_exceeded"
    assert f"{context + 1} tokens" in err.value.body["message"]


# -- auth ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1]}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/messages/count_tokens", {"messages": ASK}),
])
def test_every_route_needs_a_valid_key(api: Clients, path: str, body: dict[str, Any]) -> None:
    for key in (None, "wrong-key"):
        r = api.post(path, body, key=key)
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["type"] == "authentication_error"
    assert api.post(path, body).status_code == 200
