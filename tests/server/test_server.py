"""The HTTP server against live processes on loopback: SDK compatibility, prompt caching,
tenant isolation, error shapes, overload, disconnects and graceful shutdown (pin TTLs run
in process, on a fake clock).

Two servers are started once each: an open one, and one with API keys, one running sequence,
a one-request waiting room and cache_control TTLs shrunk 100x.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from helpers.asgi_clients import AsgiClients
from helpers.clock import FakeClock
from helpers.live_server import LiveServer, start_server

from kvstack import LLM
from kvstack.server.auth import KeyRing, Tenant

MODEL = "smollm2-135m"
GREEDY = {"temperature": 0}
KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
TTL_SCALE = 0.01  # on the keyed server "5m" lasts 3 s
MAX_BODY = 256 * 1024


def _log_on_failure(server: LiveServer) -> str:
    return f"server log tail:\n{server.log()[-3000:]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(["--kv-cache-memory", "64MiB", "--max-body-bytes", str(MAX_BODY)],
                       tmp_path_factory.mktemp("server") / "log.txt")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(
        ["--kv-cache-memory", "32MiB", "--api-key", KEY_A, "--max-num-seqs", "1",
         "--max-waiting", "1", "--cache-ttl-scale", str(TTL_SCALE)],
        tmp_path_factory.mktemp("keyed") / "log.txt",
        env={"KVSTACK_API_KEYS": f" {KEY_B} ,"},
    )
    yield srv
    srv.terminate()


def oai(srv: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def claude(srv: LiveServer, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def metrics(srv: LiveServer) -> dict[str, float]:
    """Unlabelled samples of /metrics."""
    return unlabelled(httpx.get(f"{srv.url}/metrics", timeout=30).text)


def unlabelled(exposition: str) -> dict[str, float]:
    out = {}
    for line in exposition.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(check: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


_WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "a", "dog", "ran", "to", "the", "park",
          "while", "birds", "sang", "in", "old", "trees")


def long_text(tag: str, words: int = 120) -> str:
    """About `words` tokens after the tag; texts with distinct tags share no cached block."""
    return f"[{tag}] " + " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


# -- no server needed ------------------------------------------------------------------------


def test_each_key_is_its_own_tenant_and_keys_match_exactly() -> None:
    ring = KeyRing([KEY_A, KEY_B])
    a, b = ring.tenant(KEY_A), ring.tenant(KEY_B)
    assert a is not None and b is not None
    assert ring.tenant(KEY_A[:-1]) is None and ring.tenant(KEY_A + "x") is None
    assert ring.tenant(None) is None and ring.tenant("") is None
    salts = {a.cache_salt(None), b.cache_salt(None), a.cache_salt("u"), b.cache_salt("u")}
    assert len(salts) == 4 and KEY_A not in str(salts)
    assert Tenant("ab").cache_salt("c") != Tenant("a").cache_salt("bc")
    open_ring = KeyRing([])
    assert open_ring.tenant(None) == open_ring.tenant("anything") == Tenant("")
    assert Tenant("").cache_salt("u") == "u" and Tenant("").cache_salt(None) is None


# -- endpoints and SDKs ----------------------------------------------------------------------


def test_health_models_and_metrics(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in oai(server).models.list()] == [MODEL]
    assert oai(server).models.retrieve(MODEL).id == MODEL
    m = metrics(server)
    for name in ("kvstack_requests_running", "kvstack_requests_waiting",
                 "kvstack_kv_cache_usage_ratio", "kvstack_kv_blocks_used",
                 "kvstack_prefix_cache_queries_total", "kvstack_prefix_cache_hits_total",
                 "kvstack_preemptions_total", "kvstack_prompt_tokens_total",
                 "kvstack_generation_tokens_total", "kvstack_time_to_first_token_seconds_count",
                 "kvstack_time_per_output_token_seconds_count"):
        assert name in m, name


def test_openai_sdk_chat_and_completions_stream_and_not(server: LiveServer) -> None:
    client = oai(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           **GREEDY)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens <= 8
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens \
        == whole.usage.completion_tokens
    # The repeated prompt's full blocks come from the prefix cache now.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    done = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=6, logprobs=1, **GREEDY)
    assert done.choices[0].text and len(done.choices[0].logprobs.token_logprobs) == 6
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=6, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_anthropic_sdk_messages_stream_and_not(server: LiveServer) -> None:
    client = claude(server)
    kwargs: dict[str, Any] = {
        "model": MODEL, "max_tokens": 8, "system": "You answer briefly.",
        "messages": [{"role": "user", "content": "Name a fruit."}],
        "stop_sequences": ["\n\n"], "extra_body": GREEDY,
    }
    message = client.messages.create(**kwargs)
    assert message.role == "assistant" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    u = message.usage
    assert u.output_tokens <= 8 and u.input_tokens > 0
    assert u.cache_creation_input_tokens == 0  # no cache_control, nothing pinned

    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text == final.content[0].text
    assert final.usage.output_tokens == u.output_tokens

    kinds = [e.type for e in client.messages.create(**kwargs, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_anthropic_prefill_continues_the_assistant_turn(server: LiveServer) -> None:
    message = claude(server).messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count to five."},
                  {"role": "assistant", "content": "1, 2,"}])
    assert message.content[0].text.lstrip().startswith("3")


def test_vllm_extra_fields_are_accepted(server: LiveServer) -> None:
    out = oai(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "stop_token_ids": [0], "cache_salt": "s1"},
        seed=7, temperature=0.8)
    assert out.usage.completion_tokens == 5  # ignore_eos: exactly max_tokens


def test_repeated_long_system_prompt_reports_cached_tokens(server: LiveServer) -> None:
    client = oai(server)
    messages = [{"role": "system", "content": long_text(uuid.uuid4().hex)},
                {"role": "user", "content": "Summarise."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           **GREEDY)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                            **GREEDY)
    assert first.usage.prompt_tokens > 6 * 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and first.usage.prompt_tokens - 16 <= cached


# -- bad requests ----------------------------------------------------------------------------

CHAT, MSGS = "/v1/chat/completions", "/v1/messages"
_USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": _USER, "max_tokens": 4} | fields).encode()


def _msgs(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": _USER, "max_tokens": 4} | fields).encode()


_FIVE_BREAKPOINTS = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
                     for i in range(5)]
_TOO_LONG = [{"role": "user", "content": "hello " * 9000}]

BAD_REQUESTS = {
    "malformed json": (CHAT, b'{"model": ', 400, "not valid JSON"),
    "malformed json (anthropic)": (MSGS, b"{nope}", 400, "not valid JSON"),
    "invalid utf-8": (CHAT, b'{"model": "\xff\xfe"}', 400, "UTF-8"),
    "invalid utf-8 (anthropic)": (MSGS, b"\xc3\x28", 400, "UTF-8"),
    "not an object": (CHAT, b"[1, 2]", 400, "JSON object"),
    "lone surrogate": (CHAT, _chat(messages=[{"role": "user", "content": "\ud800"}]), 400,
                       "surrogate"),
    "lone surrogate (anthropic)": (MSGS, rb'{"model": "x", "system": "\udfff"}', 400,
                                   "surrogate"),
    "deeply nested": (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "nested"),
    "max_tokens as string": (CHAT, _chat(max_tokens="4"), 400, "max_tokens"),
    "messages as string": (MSGS, _msgs(messages="hi"), 400, "messages"),
    "temperature as list": (CHAT, _chat(temperature=[1]), 400, "temperature"),
    "stream as string": (MSGS, _msgs(stream="yes"), 400, "stream"),
    "unknown role": (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    "missing model": (CHAT, json.dumps({"messages": _USER}).encode(), 400, "model"),
    "unknown model": (CHAT, _chat(model="gpt-9"), 404, "gpt-9"),
    "unknown model (anthropic)": (MSGS, _msgs(model="claude-9"), 404, "claude-9"),
    "empty messages": (CHAT, _chat(messages=[]), 400, "messages is empty"),
    "empty messages (anthropic)": (MSGS, _msgs(messages=[]), 400, "messages is empty"),
    "negative max_tokens": (CHAT, _chat(max_tokens=-3), 400, "max_tokens"),
    "negative max_tokens (anthropic)": (MSGS, _msgs(max_tokens=-3), 400, "max_tokens"),
    "huge max_tokens": (CHAT, _chat(max_tokens=10**12), 400, "8192"),
    "huge max_tokens (anthropic)": (MSGS, _msgs(max_tokens=10**12), 400, "8192"),
    "prompt too long": (CHAT, _chat(messages=_TOO_LONG), 400, "8192"),
    "prompt too long (anthropic)": (MSGS, _msgs(messages=_TOO_LONG), 400, "8192"),
    "bad sampling value": (CHAT, _chat(top_p=0), 400, "top_p"),
    "n above the cap": (CHAT, _chat(n=1000), 400, "parallel samples"),
    "n (anthropic)": (MSGS, _msgs(n=2), 400, "not part of the Anthropic"),
    "top_logprobs over 20": (CHAT, _chat(logprobs=True, top_logprobs=21), 400, "logprobs"),
    "invalid json schema": (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nothing"}}}), 400, "JSON schema"),
    "unsatisfiable regex (anthropic)": (MSGS, _msgs(guided_regex="[^\\s\\S]"), 400,
                                        "matches no output"),
    "image part": (CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "image_url"),
    "image block (anthropic)": (MSGS, _msgs(messages=[{"role": "user", "content": [
        {"type": "image", "source": {}}]}]), 400, "image"),
    "five breakpoints": (MSGS, _msgs(system=_FIVE_BREAKPOINTS), 400, "at most 4"),
    "bad cache_control ttl": (MSGS, _msgs(system=[{"type": "text", "text": "x", "cache_control":
                                                   {"type": "ephemeral", "ttl": "2d"}}]),
                              400, "ttl"),
    "a batch with a bad prompt": ("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": ["a", ""]}).encode(), 400, "prompt 1 is empty"),
    "token id out of vocabulary": ("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [1, 10**9]}).encode(), 400, "vocabulary"),
    "body too large": (CHAT, _chat(messages=[{"role": "user", "content": "x" * MAX_BODY}]),
                       413, "larger than"),
    "body too large (anthropic)": (MSGS, b" " * (MAX_BODY + 1), 413, "larger than"),
}


def assert_error_shape(path: str, response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    if path.startswith(MSGS):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        message = body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        message = body["error"]["message"]
    assert needle.lower() in message.lower(), message
    assert "\n" not in message


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_in_the_apis_shape(server: LiveServer, case: str) -> None:
    path, body, status, needle = BAD_REQUESTS[case]
    response = httpx.post(f"{server.url}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert_error_shape(path, response, status, needle)


def test_chunked_body_over_the_limit_is_413(server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096

    response = httpx.post(f"{server.url}{CHAT}", content=chunks(), timeout=60)
    assert_error_shape(CHAT, response, 413, "larger than")


def test_unknown_route_and_method_keep_the_shape(server: LiveServer) -> None:
    assert_error_shape("/v1/nothing", httpx.get(f"{server.url}/v1/nothing"), 404, "not found")
    assert_error_shape(MSGS, httpx.get(f"{server.url}{MSGS}"), 405, "not allowed")


def test_sdks_raise_typed_errors_and_server_keeps_serving(server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError):
        oai(server).chat.completions.create(model="nope", messages=_USER)
    with pytest.raises(anthropic.BadRequestError):
        claude(server).messages.create(model=MODEL, max_tokens=-1, messages=_USER)
    out = oai(server).completions.create(model=MODEL, prompt="One, two,", max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


# -- concurrency and disconnects -------------------------------------------------------------

CONCURRENT_PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):",
                      "Water boils at"]


async def _stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, **GREEDY}
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_32_concurrent_streams_match_sequential_runs(server: LiveServer) -> None:
    async def run(prompts: list[str], concurrent: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            if concurrent:
                return await asyncio.gather(*(_stream_completion(client, p, 16)
                                              for p in prompts))
            return [await _stream_completion(client, p, 16) for p in prompts]

    sequential = dict(zip(CONCURRENT_PROMPTS, asyncio.run(run(CONCURRENT_PROMPTS, False)),
                          strict=True))
    prompts = CONCURRENT_PROMPTS * 8
    got = asyncio.run(run(prompts, True))
    assert got == [sequential[p] for p in prompts]
    m = metrics(server)
    assert m["kvstack_requests_running"] == 0 and m["kvstack_preemptions_total"] == 0


def _idle_and_no_request_blocks(srv: LiveServer) -> bool:
    m = metrics(srv)
    return (m["kvstack_requests_running"] == 0 and m["kvstack_requests_waiting"] == 0
            and m["kvstack_kv_blocks_used"] == m["kvstack_kv_blocks_pinned"])


def test_client_leaving_mid_stream_aborts_and_frees_blocks(server: LiveServer) -> None:
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with httpx.Client(base_url=server.url, timeout=60) as client, \
            client.stream("POST", CHAT, json=body) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(4), lines, strict=False) if line) >= 2
        assert metrics(server)["kvstack_requests_running"] == 1
    wait_for(lambda: _idle_and_no_request_blocks(server), what="the stream's abort")
    finished = httpx.get(f"{server.url}/metrics").text
    assert 'kvstack_requests_finished_total{finish_reason="abort"}' in finished

    # A non-streaming client that gives up (timeout) aborts its request too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{CHAT}", json={**body, "stream": False}, timeout=1.5)
    wait_for(lambda: _idle_and_no_request_blocks(server), what="the non-streaming abort")


# -- prompt caching with cache_control -------------------------------------------------------


def _breakpointed(system_text: str, ttl: str = "5m") -> dict[str, Any]:
    return {
        "model": MODEL, "max_tokens": 2, "extra_body": GREEDY,
        "system": [{"type": "text", "text": system_text,
                    "cache_control": {"type": "ephemeral", "ttl": ttl}}],
        "messages": [{"role": "user", "content": "Go on."}],
    }


def test_cache_control_writes_then_reads_the_pinned_prefix(server: LiveServer) -> None:
    client = claude(server)
    request = _breakpointed(long_text(uuid.uuid4().hex))
    pinned_before = metrics(server)["kvstack_kv_blocks_pinned"]
    first = client.messages.create(**request).usage
    total = first.input_tokens + first.cache_creation_input_tokens + first.cache_read_input_tokens
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens >= 6 * 16
    assert first.cache_creation_input_tokens % 16 == 0 and first.input_tokens < total
    assert metrics(server)["kvstack_kv_blocks_pinned"] - pinned_before \
        == first.cache_creation_input_tokens // 16

    second = client.messages.create(**request).usage
    assert second.cache_creation_input_tokens == 0
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert second.input_tokens + second.cache_read_input_tokens == total

    # Top-level cache_control (the SDK's automatic caching) marks the last block.
    auto = {**request, "system": request["system"][0]["text"],
            "cache_control": {"type": "ephemeral"},
            "messages": [{"role": "user", "content": long_text(uuid.uuid4().hex, 40)}]}
    assert client.messages.create(**auto).usage.cache_creation_input_tokens > 0
    assert client.messages.create(**auto).usage.cache_read_input_tokens > 0


def test_pins_survive_eviction_pressure_that_evicts_unpinned_prefixes(
        server: LiveServer) -> None:
    chat, client = oai(server), claude(server)
    unpinned = [{"role": "system", "content": long_text(uuid.uuid4().hex)},
                {"role": "user", "content": "Hi"}]
    pinned = _breakpointed(long_text(uuid.uuid4().hex))
    chat.chat.completions.create(model=MODEL, messages=unpinned, max_tokens=1)
    written = client.messages.create(**pinned).usage.cache_creation_input_tokens
    assert written > 0
    # Push more new prompt tokens through the pool than it holds: every unpinned block goes.
    pool_tokens = int(metrics(server)["kvstack_kv_blocks_total"]) * 16
    for _ in range(3):
        prompt = long_text(uuid.uuid4().hex, words=pool_tokens // 3)
        chat.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = chat.chat.completions.create(model=MODEL, messages=unpinned, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    reread = client.messages.create(**pinned).usage
    assert reread.cache_read_input_tokens >= written and reread.cache_creation_input_tokens == 0


def test_pins_lapse_after_their_ttl() -> None:
    """In process, on a fake clock: "5m" passes without waiting five minutes."""
    clock = FakeClock()
    clients = AsgiClients(LLM(MODEL, kv_cache_memory="32MiB", clock=clock), [KEY_A], KEY_A)

    def pinned() -> float:
        return unlabelled(clients.run(clients.http.get("/metrics")).text)[
            "kvstack_kv_blocks_pinned"]

    try:
        request = _breakpointed(long_text(uuid.uuid4().hex))
        create = clients.claude.messages.create
        assert clients.run(create(**request)).usage.cache_creation_input_tokens > 0
        assert pinned() > 0
        clock.advance(300 + 0.5)
        # Pins are checked every engine step: one more request lets them lapse.
        clients.run(clients.openai.completions.create(model=MODEL, prompt="Hi", max_tokens=1))
        assert pinned() == 0
        # The blocks stay cached (just evictable), so the prefix still hits.
        usage = clients.run(create(**request)).usage
        assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
    finally:
        clock.advance(300 + 0.5)  # the last request pinned again: let it lapse before close
        clients.run(clients.openai.completions.create(model=MODEL, prompt="Hi", max_tokens=1))
        clients.close()


# -- the keyed server: auth, tenants, TTLs, overload, shutdown -------------------------------


@pytest.mark.parametrize("path", [CHAT, MSGS, "/v1/models"])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"},
                                     {"x-api-key": "key-a-012345678"}])
def test_missing_or_wrong_key_is_401(keyed: LiveServer, path: str,
                                     headers: dict[str, str]) -> None:
    if path == "/v1/models":
        response = httpx.get(f"{keyed.url}{path}", headers=headers)
    else:
        response = httpx.post(f"{keyed.url}{path}", content=_msgs(), headers=headers)
    assert_error_shape(path, response, 401, "API key")


def test_each_key_is_a_tenant_with_its_own_prefix_cache(keyed: LiveServer) -> None:
    assert httpx.get(f"{keyed.url}/health").status_code == 200  # open without a key
    messages = [{"role": "system", "content": long_text("shared-by-everyone")},
                {"role": "user", "content": "Hi"}]

    def cached(key: str, **extra: Any) -> int:
        out = oai(keyed, key).chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=1, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY_A) == 0
    assert cached(KEY_A) > 6 * 16
    assert cached(KEY_B) == 0  # the same prompt under another key: no hit
    assert cached(KEY_A, cache_salt="mine") == 0  # a user salt splits a tenant further
    # The Anthropic SDK sends x-api-key; key B's blocks are its own.
    usage = claude(keyed, KEY_B).messages.create(
        model=MODEL, max_tokens=1, system=messages[0]["content"],
        messages=[{"role": "user", "content": "Hi"}]).usage
    assert usage.cache_read_input_tokens > 6 * 16


def test_full_waiting_queue_answers_429(keyed: LiveServer) -> None:
    headers = {"authorization": f"Bearer {KEY_A}"}
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "stream": True,
            "ignore_eos": True}
    queued: dict[str, Any] = {}

    def wait_in_line() -> None:
        queued["response"] = httpx.post(
            f"{keyed.url}/v1/completions", headers=headers, timeout=120,
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})

    with httpx.Client(base_url=keyed.url, headers=headers, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json=long) as running:
        lines = running.iter_lines()  # kept: dropping the iterator would close the stream
        next(lines)  # it holds the one running slot now
        waiter = threading.Thread(target=wait_in_line)
        waiter.start()
        wait_for(lambda: metrics(keyed)["kvstack_requests_waiting"] == 1, what="a waiter")
        refused = httpx.post(f"{keyed.url}{MSGS}", content=_msgs(), headers=headers)
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            oai(keyed, KEY_A).completions.create(model=MODEL, prompt="x", max_tokens=1)
    waiter.join(120)  # leaving the stream aborted it, so the waiter runs
    assert queued["response"].status_code == 200
    wait_for(lambda: _idle_and_no_request_blocks(keyed), what="the keyed server to go idle")


def test_sigterm_drains_the_request_in_flight_then_exits_0(keyed: LiveServer) -> None:
    """Last on the keyed server: it stops the server."""
    client = oai(keyed, KEY_B)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count slowly."}], max_tokens=24,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        **GREEDY)
    chunks = [next(stream)]
    keyed.proc.send_signal(15)
    chunks += list(stream)
    assert chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert keyed.proc.wait(60) == 0, _log_on_failure(keyed)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{keyed.url}/health")
