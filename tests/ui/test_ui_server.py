"""The live view's HTTP side: access, static files and headers, the playground's events and
provenance, the event stream's cost, and a server that still drains on SIGTERM with a page
open. One in-process server (keys for two tenants and an admin), one `kvstack serve` process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.live_server import start_server

from kvstack import LLM
from kvstack.engine.async_llm import AsyncLLM
from kvstack.engine.chat import chat_token_ids
from kvstack.server.app import create_app
from kvstack.server.auth import KeyRing
from kvstack.server.threaded import ServerThread

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KEY_A, KEY_B, ADMIN = "srv-key-a", "srv-key-b", "srv-admin"
SYSTEM = "You are a terse assistant for the museum of clocks. Answer in a few words only."


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Any]]:
    llm = LLM("smollm2-135m", kv_cache_memory="32MiB")
    engine = AsyncLLM(llm.engine)
    app = create_app(engine, KeyRing([KEY_A, KEY_B], admin_key=ADMIN))
    with ServerThread(app) as url:
        yield {"url": url, "engine": engine, "app": app, "llm": llm}
    engine.shutdown()
    llm.engine.check_integrity()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def events(url: str, path: str, key: str, body: dict[str, Any] | None = None,
           stop_after: int | None = None, event: str = "tick") -> list[tuple[str, Any]]:
    """Server-sent events of a stream as (name, data): all of them, or until `stop_after`
    events named `event`."""
    method = "POST" if body is not None else "GET"
    out: list[tuple[str, Any]] = []
    with httpx.stream(method, url + path, json=body, headers=auth(key), timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                if stop_after and sum(n == event for n, _ in out) >= stop_after:
                    break
    return out


def run_playground(url: str, key: str, user: str, **fields: Any) -> dict[str, Any]:
    body = {"mode": "chat", "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            **fields}
    got = events(url, "/ui/api/playground", key, body)
    names = [n for n, _ in got]
    assert names[0] == "prompt" and names[1] == "admitted" and names[-1] == "done", names
    assert set(names[2:-1]) == {"tokens"}
    data = {n: d for n, d in got}
    data["pieces"] = [p for n, d in got if n == "tokens" for p in d["pieces"]]
    data["sources"] = [s for n, d in got if n == "tokens" for s in d["sources"]]
    return data


def test_page_and_static_files_carry_a_strict_policy(served: dict[str, Any]) -> None:
    url = served["url"]
    page = httpx.get(url + "/ui")
    assert page.status_code == 200 and "app.js" in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    script = httpx.get(url + "/ui/static/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith(
        "text/javascript") and "innerHTML" not in script.text
    for bad in ("../app.py", "..%2Fservice.py", "routes.py", ".hidden.js", "nope.js"):
        assert httpx.get(f"{url}/ui/static/{bad}").status_code == 404, bad


def test_data_routes_need_a_key(served: dict[str, Any]) -> None:
    url = served["url"]
    session = httpx.get(url + "/ui/api/session").json()
    assert session == {"auth_required": True, "model": "smollm2-135m", "viewer": None}
    for path in ("/ui/api/state", "/ui/api/events"):
        for headers in ({}, auth("wrong")):
            r = httpx.get(url + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/ui/api/playground", content=b"{broken", headers=auth("wrong"))
    assert r.status_code == 401  # the key is checked before the body is read
    assert httpx.get(url + "/ui/api/session", headers=auth("wrong")).status_code == 401
    assert httpx.get(url + "/ui/api/session", headers=auth(ADMIN)).json()["viewer"] == {
        "role": "admin", "label": "admin"}


def test_playground_streams_pieces_and_provenance(served: dict[str, Any]) -> None:
    url, tokenizer = served["url"], served["engine"].tokenizer
    first = run_playground(url, KEY_A, "Which clock is the oldest?")
    question = "Which clock is the oldest?"
    prompt_ids = chat_token_ids(tokenizer, [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": question}])
    assert "".join(first["prompt"]["pieces"]) == tokenizer.decode(prompt_ids)
    assert len(first["prompt"]["pieces"]) == len(prompt_ids)
    n = len(prompt_ids)
    assert first["admitted"]["provenance"] == [["computed", n]]
    assert first["done"]["provenance"]["prompt"] == [["computed", n]]
    out = first["done"]["num_output_tokens"]
    assert len(first["pieces"]) == out and sum(c for _, c in first["sources"]) == out
    assert first["done"]["provenance"]["output"] == [["model", out]]
    assert first["done"]["ttft_ms"] > 0
    second = run_playground(url, KEY_A, "Which clock is the oldest?")
    cached = second["admitted"]["num_cached_tokens"]
    assert cached == (n - 1) // 16 * 16 > 0
    assert second["admitted"]["provenance"] == [["prefix_cache", cached], ["computed", n - cached]]
    assert second["pieces"] == first["pieces"]  # greedy: the same answer
    # Another tenant's identical conversation shares nothing.
    other = run_playground(url, KEY_B, "Which clock is the oldest?")
    assert other["admitted"]["provenance"] == [["computed", n]]
    served["llm"].engine.check_integrity()


def test_playground_marks_verified_draft_tokens(served: dict[str, Any]) -> None:
    # Prompt lookup drafts from a prompt the answer copies; accepted drafts are marked.
    text = "one two three four five six seven eight nine ten eleven twelve"
    run = run_playground(served["url"], KEY_A, f"Repeat exactly: {text}. {text}.",
                         max_tokens=24, prompt_lookup=8)
    done = run["done"]
    drafted = sum(c for s, c in done["provenance"]["output"] if s == "draft")
    assert drafted == done["num_accepted_tokens"] > 0
    assert {s for s, _ in run["sources"]} == {"draft", "model"}


def test_playground_refuses_bad_bodies_in_the_api_shape(served: dict[str, Any]) -> None:
    url = served["url"]
    for body, words in (({"mode": "completion"}, "prompt is empty"),
                        ({"mode": "chat", "messages": []}, "at least one message"),
                        ({"mode": "chat", "extra": 1}, "extra"),
                        ({"mode": "completion", "prompt": "hi", "max_tokens": 10**6},
                         "in the prompt, 1000000 in the completion")):
        r = httpx.post(url + "/ui/api/playground", json=body, headers=auth(KEY_A), timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)


def test_event_stream_sends_the_pool_when_it_changes_and_costs_one_snapshot_a_tick(
        served: dict[str, Any]) -> None:
    url, service = served["url"], served["app"].state.kvstack.ui
    got = events(url, "/ui/api/events", KEY_A, stop_after=4)
    assert got[0][0] == "hello" and got[0][1]["viewer"]["role"] == "tenant"
    ticks = [d for n, d in got if n == "tick"]
    assert any("pool" in t for t in ticks)
    assert sum("pool" in t for t in ticks[1:]) <= 1  # idle: the same map is not sent again
    assert [t["seq"] for t in ticks] == sorted({t["seq"] for t in ticks})
    # Five pages at once still cost one engine snapshot per tick.
    streams: list[list[tuple[str, Any]]] = [[] for _ in range(5)]
    threads = [threading.Thread(target=lambda out=out: out.extend(
        events(url, "/ui/api/events", KEY_A, stop_after=4))) for out in streams]
    before, started = service.num_snapshots, time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    elapsed = time.monotonic() - started
    taken = service.num_snapshots - before
    assert all(sum(n == "tick" for n, _ in s) == 4 for s in streams)
    assert taken <= elapsed / service.interval_s + 6, (taken, elapsed)  # ticks + wake-ups


def test_sigterm_drains_with_a_page_open(tmp_path: Path) -> None:
    server = start_server(["--kv-cache-memory", "32MiB", "--threads", "1"],
                          tmp_path / "log.txt", env={"KVSTACK_ADMIN_KEY": "env-admin"})
    got: list[str] = []

    def watch() -> None:
        with httpx.stream("GET", server.url + "/ui/api/events", timeout=120,
                          headers=auth("env-admin")) as r:
            got.extend(line for line in r.iter_lines() if line.startswith("event:"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    deadline = time.monotonic() + 60
    while "event: tick" not in got and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got[:1] == ["event: hello"] and "event: tick" in got, server.log()[-2000:]
    r = httpx.get(server.url + "/ui/api/session", headers=auth("env-admin"))
    assert r.json()["viewer"]["role"] == "admin"  # --admin-key from the environment
    started = time.monotonic()
    assert server.terminate(timeout=60) == 0, server.log()[-3000:]
    assert time.monotonic() - started < 30
    watcher.join(timeout=10)
    assert not watcher.is_alive()


def test_no_ui_flag_turns_the_view_off(tmp_path: Path) -> None:
    server = start_server(["--kv-cache-memory", "16MiB", "--threads", "1", "--no-ui"],
                          tmp_path / "log.txt")
    try:
        assert httpx.get(server.url + "/ui").status_code == 404
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        assert server.terminate() == 0
