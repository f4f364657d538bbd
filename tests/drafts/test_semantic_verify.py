"""The semantic cache in verify mode: a hit's stored answer is a draft the model verifies, so
every answer is the model's own (what the request gets with the cache off), whatever the
stored answer says; usage reports the draft and what was accepted, in both APIs and streams.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.semantic.cache import SemanticCache, SemanticCacheConfig
from kvstack.semantic.embedder import MiniLMEmbedder
from kvstack.server.app import create_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    llm = LLM(MODEL, kv_cache_memory="96MiB")
    engine = AsyncLLM(llm.engine)
    cache = SemanticCache(MiniLMEmbedder(), SemanticCacheConfig(mode="verify"))
    app = create_app(engine, semantic_cache=cache)
    loop = asyncio.new_event_loop()
    transport = httpx.ASGITransport(app=app)
    http = httpx.AsyncClient(transport=transport, base_url="http://kvstack", timeout=300)

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return loop.run_until_complete(http.post(path, json=body))

    yield post, cache, loop, http, llm
    loop.run_until_complete(http.aclose())
    loop.close()
    engine.shutdown()
    cache.close()


def chat(post: Any, text: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 24,
            "temperature": 0} | extra
    r = post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json() | {"_header": r.headers.get("x-kvstack-semantic-cache")}


def test_a_paraphrase_hit_is_verified_into_the_models_own_answer(client: Any) -> None:
    post, cache, *_ = client
    first = chat(post, "What is the capital of Australia?")
    assert first["_header"] == "miss" and len(cache) == 1
    own = chat(post, "Which city is Australia's capital?", semantic_cache=False)
    hit = chat(post, "Which city is Australia's capital?")
    assert hit["_header"] == "hit"
    assert hit["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
    usage = hit["usage"]["semantic_cache"]
    assert usage["mode"] == "verify" and usage["hit"] is True
    assert usage["draft_tokens"] > 0 and 0 <= usage["accepted_tokens"] <= usage["draft_tokens"]


def test_a_near_miss_that_passes_the_threshold_still_answers_correctly(client: Any) -> None:
    post, *_ = client
    chat(post, "How do I sort a dictionary by value in Python?")
    question = "How do I sort a dictionary by key in Python?"
    own = chat(post, question, semantic_cache=False)
    got = chat(post, question)
    assert got["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]


def test_streams_and_the_anthropic_api_report_the_draft(client: Any) -> None:
    post, _, loop, http, _ = client
    chat(post, "Who wrote Pride and Prejudice?")
    question = "Who is the author of Pride and Prejudice?"
    own = chat(post, question, semantic_cache=False)["choices"][0]["message"]["content"]

    async def stream() -> list[dict[str, Any]]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}],
                "max_tokens": 24, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        return [json.loads(line[6:]) for line in lines]

    chunks = loop.run_until_complete(stream())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == own
    assert chunks[-1]["usage"]["semantic_cache"]["draft_tokens"] > 0

    r = post("/v1/messages", {"model": MODEL, "max_tokens": 24, "temperature": 0,
                              "messages": [{"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"][0]["text"] == own
    assert body["usage"]["semantic_cache"]["mode"] == "verify"


def test_metrics_count_draft_tokens(client: Any) -> None:
    post, _, loop, http, _ = client
    text = loop.run_until_complete(http.get("/metrics")).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("kvstack_draft")}
    drafted = values["kvstack_draft_tokens_total"]
    assert drafted > 0 and 0 <= values["kvstack_draft_accepted_tokens_total"] <= drafted
