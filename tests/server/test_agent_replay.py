"""The requests the agent CLIs really send (captured from Claude Code, Codex and Qwen Code by
`kvstack bench agents`' recording proxy, versions in the files under agent_requests/),
replayed against the server with a tiny random model of the same context as gemma3-270m's
(32,768 tokens) and SmolLM2's tokenizer and chat template. What is asserted is what each
client reads back: the status, the overflow wording its retry keys on, the stream's event
shape, and the usage fields. Output is capped where the client sent no cap or a huge one
(the point is the shape, and a random model never stops)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.asgi_clients import AsgiClients
from helpers.tiny_models import make_tiny_chat_folder

from kvstack import LLM
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.weights import Checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

FIXTURES = Path(__file__).parent / "agent_requests"
CONTEXT = 32768
# Claude Code 2.1.332 lowers max_tokens only on this pattern, to context - input - 1000,
# and gives up below 3,000 (its FLOOR_OUTPUT_TOKENS).
CLAUDE_OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ "
                             r"(\d+) > (\d+)")
CLAUDE_FLOOR = 3000


def fixture(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    assert doc["version"] and doc["requests"]
    return doc


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory,
        embedded_checkpoint: Checkpoint) -> Iterator[AsgiClients]:
    folder = make_tiny_chat_folder(tmp_path_factory.mktemp("agents"),
                                   load_tokenizer(embedded_checkpoint), context=CONTEXT)
    clients = AsgiClients(LLM(str(folder), kv_cache_memory="64MiB"))
    yield clients
    clients.close(pins=True)  # Claude Code's cache_control breakpoints pin its prefix


def replay(api: AsgiClients, request: dict[str, Any], **changes: Any) -> Any:
    body = {**request["body"], "model": api.engine.info.name, **changes}
    return api.run(api.http.post(request["path"], json=body, headers=request["headers"]))


def sse_events(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(event name, data) of each event; comments (keep-alives) skipped."""
    events = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln and not ln.startswith(":")]
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        if data and data[0] != "[DONE]":
            events.append((name, json.loads(data[0])))
    return events


def test_claude_code_overflow_gets_the_400_its_retry_keys_on(api: AsgiClients) -> None:
    first, retry = fixture("claude-code")["requests"][:2]
    assert any(m["role"] == "system" for m in first["body"]["messages"])  # mid-conversation
    r = replay(api, first)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    match = CLAUDE_OVERFLOW.search(error["error"]["message"])
    assert match is not None, error
    num_input, asked, context = map(int, match.groups())
    assert (asked, context) == (first["body"]["max_tokens"], CONTEXT)
    lowered = context - num_input - 1000
    assert lowered >= CLAUDE_FLOOR  # so the CLI retries rather than gives up
    assert retry["body"]["max_tokens"] < asked
    # The retry, at the lowered max_tokens, fits; its answer streams in Anthropic's shape.
    count = api.run(api.http.post("/v1/messages/count_tokens", json={
        **retry["body"], "model": api.engine.info.name}, headers=retry["headers"])).json()
    assert count["input_tokens"] == num_input and num_input + lowered <= CONTEXT
    r = replay(api, retry, max_tokens=4)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-2:] == ["message_delta", "message_stop"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["context_management"] == {"applied_edits": []}
    assert not any(e.get("content_block", {}).get("type") == "thinking" for _, e in events)
    usage = delta["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] \
        + usage["cache_creation_input_tokens"] == num_input


def test_codex_first_turn_is_served_with_its_namespace_and_hosted_tools(
        api: AsgiClients) -> None:
    first = fixture("codex")["requests"][0]
    body = first["body"]
    kinds = [t["type"] for t in body["tools"]]
    assert "namespace" in kinds and "web_search" in kinds and body["reasoning"]
    # Codex sends no max_output_tokens (a random model would fill the context): capped here.
    r = replay(api, first, max_output_tokens=4)
    assert r.status_code == 200, r.text
    assert "web_search" in r.headers["warning"]
    events = sse_events(r.text)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    response = events[-1][1]["response"]
    assert not any(item["type"] == "reasoning" for item in response["output"])
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert response["tools"] == body["tools"]  # echoed as sent
