"""Blending over HTTP (a live server on the embedded model): OpenAI chat `documents` with
`blend`, `/v1/completions` `segments`, `usage.blend`, metrics, and 400s in the API's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.live_server import LiveServer, start_server
from test_server import assert_error_shape, metrics

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
DOCS = [{"title": "Harbor", "text": "The harbor town of Velm ships salt and amber."},
        {"title": "Lighthouse", "text": "Velm's lighthouse was built in 1822 by Ada Korrin."},
        {"text": "The mayor of Velm, Jon Arvid, was elected in 2019."}]
QUESTION = [{"role": "user", "content": "Who built the lighthouse?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(["--kv-cache-memory", "64MiB", "--chunk-cache-memory", "16MiB"],
                       tmp_path_factory.mktemp("blend") / "log.txt")
    yield srv
    srv.terminate()


def post(server: LiveServer, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, "temperature": 0,
                                                   "max_tokens": 4, **body}, timeout=120)


def test_chat_documents_blend_and_usage(server: LiveServer) -> None:
    exact = post(server, "/v1/chat/completions", messages=QUESTION, documents=DOCS).json()
    assert "blend" not in exact["usage"]
    one = post(server, "/v1/chat/completions", messages=QUESTION, documents=DOCS,
               blend={"recompute_ratio": 1.0}).json()
    assert one["choices"][0]["message"]["content"] == exact["choices"][0]["message"]["content"]
    blended = post(server, "/v1/chat/completions", messages=QUESTION, documents=DOCS[::-1],
                   blend={"recompute_ratio": 0.15, "selector": "kv_deviation"}).json()
    usage = blended["usage"]["blend"]
    assert usage["chunks_hit"] == 3 and usage["chunks_missed"] == 0
    assert 0 < usage["recomputed_tokens"] < usage["reused_tokens"]
    assert blended["usage"]["prompt_tokens_details"]["cached_tokens"] % 16 == 0
    assert metrics(server)["kvstack_blend_chunks_hit_total"] >= 3


def test_completion_segments(server: LiveServer) -> None:
    segments = [{"text": "Documents:\n"}, {"text": DOCS[0]["text"], "chunk": True},
                {"text": "\n"}, {"text": DOCS[1]["text"], "chunk": True},
                {"text": "\nQuestion: who built the lighthouse?\nAnswer:"}]
    first = post(server, "/v1/completions", segments=segments, blend={}).json()
    assert first["usage"]["blend"]["chunks_missed"] + first["usage"]["blend"]["chunks_hit"] == 2
    again = post(server, "/v1/completions", segments=[segments[0], segments[3], segments[2],
                                                      segments[1], segments[4]],
                 blend={"selector": "first_k", "first_k": 4}).json()
    assert again["usage"]["blend"]["chunks_hit"] == 2
    assert again["usage"]["blend"]["recomputed_tokens"] == 8


BAD = {
    "unknown selector": ("/v1/chat/completions", {"messages": QUESTION, "documents": DOCS,
                                                  "blend": {"selector": "best"}}, "selector"),
    "ratio outside": ("/v1/chat/completions", {"messages": QUESTION, "documents": DOCS,
                                               "blend": {"recompute_ratio": 2}}, "[0, 1]"),
    "unknown field": ("/v1/chat/completions", {"messages": QUESTION, "documents": DOCS,
                                               "blend": {"ratio": 0.2}}, "no field"),
    "empty document": ("/v1/chat/completions", {"messages": QUESTION, "documents": [
        {"text": "  "}], "blend": {}}, "empty"),
    "blend without documents": ("/v1/chat/completions", {"messages": QUESTION, "blend": {}},
                                "documents"),
    "empty chunk": ("/v1/completions", {"segments": [{"text": "a"}, {"text": "",
                                                                     "chunk": True}],
                                        "blend": {}}, "empty chunk"),
    "no text": ("/v1/completions", {"segments": [{"text": ""}]}, "no text"),
    "prompt and segments": ("/v1/completions", {"prompt": "a", "segments": [{"text": "a"}]},
                            "exactly one"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_blend_requests_are_400(server: LiveServer, case: str) -> None:
    path, body, needle = BAD[case]
    response = httpx.post(f"{server.url}{path}", content=json.dumps(
        {"model": MODEL, "max_tokens": 2, **body}), timeout=60,
        headers={"content-type": "application/json"})
    assert_error_shape(path, response, 400, needle)



def test_anthropic_document_and_search_result_blocks(server: LiveServer) -> None:
    content = [{"type": "document", "title": "Harbor",
                "source": {"type": "text", "media_type": "text/plain", "data": DOCS[0]["text"]}},
               {"type": "search_result", "source": "https://example.org/l", "title": "Light",
                "content": [{"type": "text", "text": DOCS[1]["text"]}]},
               {"type": "text", "text": "Who built the lighthouse?"}]
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    exact = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120).json()
    assert "blend" not in exact["usage"]
    one = httpx.post(f"{server.url}/v1/messages", json=body | {"blend": {
        "recompute_ratio": 1.0}}, timeout=120).json()
    assert one["content"] == exact["content"]
    # The exact run published the prompt's blocks: the same prompt is an exact prefix hit.
    assert one["usage"]["blend"]["chunks_hit"] == 0 and one["usage"]["cache_read_input_tokens"]
    content[0], content[1] = content[1], content[0]
    again = httpx.post(f"{server.url}/v1/messages", json=body | {"blend": {}},
                       timeout=120).json()
    assert again["usage"]["blend"]["chunks_hit"] == 2
    bad = httpx.post(f"{server.url}/v1/messages", json=body | {"messages": [
        {"role": "user", "content": "hi"}], "blend": {}}, timeout=60)
    assert_error_shape("/v1/messages", bad, 400, "document")
    # A cache_control breakpoint on the first document cuts the prompt before the second.
    content[0] = content[0] | {"cache_control": {"type": "ephemeral"}}
    pinned = httpx.post(f"{server.url}/v1/messages", json=body | {"blend": {}}, timeout=120)
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["usage"]["blend"]["chunks_hit"] == 2
