"""Reasoning blocks in the Messages and Responses APIs, on synthetic model outputs (no
weights): each wire's answer, whole and streamed, is parsed by the official SDK (the anthropic
and openai clients, over an httpx transport that replays the wire's bytes), so the shapes are
the ones those clients accept: thinking blocks with their signature, reasoning items with
their text, and the reasoning tokens counted."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx2 as httpx  # the SDKs send through httpx2
import openai
import pytest

from kvstack.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvstack.server.anthropic_api import _build_prompt
from kvstack.server.anthropic_wire import AnthropicWire, Prompt
from kvstack.server.protocol import MessagesRequest
from kvstack.server.reasoning import reasoning_tokens
from kvstack.server.responses.items import input_items
from kvstack.server.responses.wire import ResponsesWire
from kvstack.server.tools import ToolChoice, ToolSpec

THOUGHT = "<think>\nThe user wants the weather.\nI should answer.\n</think>\n\n"
REASONING = "The user wants the weather.\nI should answer."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class Chars:
    """A tokenizer stand-in: one token per character (its code point)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


def output(text: str, reason: str | None = "stop") -> RequestOutput:
    c = CompletionOutput(0, text, [ord(ch) for ch in text], finish_reason=reason)
    return RequestOutput("r", None, [1, 2, 3], [c], reason is not None, 0,
                         RequestMetrics(arrival_time=0.0))


def streamed(wire: Any, text: str) -> str:
    """The SSE bytes the server's lifecycle writes for `text`, one character per step."""
    steps = [output(text[:n], "stop" if n == len(text) else None)
             for n in range(1, len(text) + 1)]
    events = list(wire.opening(steps[0]))
    sent = 0
    for out in steps:
        events += wire.delta(out, out.outputs[0], sent, sent)
        sent = len(out.outputs[0].text)
    events += wire.closing(steps[-1])
    return "".join([*events, *wire.done()])


def replaying(body: Callable[[], Any], stream: bool) -> httpx.Client:
    """An httpx client whose every request is answered with the wire's JSON or SSE."""
    def handle(request: httpx.Request) -> httpx.Response:
        if stream:
            return httpx.Response(200, text=body(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=body())
    return httpx.Client(transport=httpx.MockTransport(handle))


# -- Messages ---------------------------------------------------------------------------------


def messages_wire(thinking: bool | None, show: bool, tools: bool = False) -> AnthropicWire:
    state: Any = SimpleNamespace(model_name="m", tokenizer=Chars())
    specs = [ToolSpec("get_weather", None, {"type": "object"})] if tools else []
    prompt = Prompt([1, 2, 3], [], specs, ToolChoice("auto") if tools else None)
    return AnthropicWire(state, prompt, None, None, thinking=thinking, show_thinking=show)


def claude(text: str, stream: bool, **wire: Any) -> anthropic.types.Message:
    def body() -> Any:
        w = messages_wire(**wire)
        return streamed(w, text) if stream else w.whole(output(text))
    client = anthropic.Anthropic(api_key="k", base_url="http://kv",
                                 http_client=replaying(body, stream))
    asked: dict[str, Any] = {"model": "m", "max_tokens": 4096,
                             "messages": [{"role": "user", "content": "weather?"}]}
    if stream:
        with client.messages.stream(**asked) as events:
            return events.get_final_message()
    return client.messages.create(**asked)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_block_then_text(stream: bool) -> None:
    message = claude(THOUGHT + "Sunny.", stream, thinking=False, show=True)
    first, second = message.content
    assert first.type == "thinking" and first.thinking == REASONING and first.signature
    assert second.type == "text" and second.text == "Sunny."
    assert message.stop_reason == "end_turn"


def test_streamed_thinking_is_deltas_then_a_signature_then_text() -> None:
    sse = streamed(messages_wire(False, True), THOUGHT + "Sunny.")
    events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]
    kinds = [e["delta"]["type"] if e["type"] == "content_block_delta" else e["type"]
             for e in events]
    start = kinds.index("content_block_start")
    assert events[start]["content_block"] == {"type": "thinking", "thinking": "",
                                              "signature": ""}
    signature = kinds.index("signature_delta")
    assert set(kinds[start + 1:signature]) == {"thinking_delta"}
    assert kinds[signature + 1:signature + 3] == ["content_block_stop", "content_block_start"]
    assert events[signature + 2]["index"] == 1
    assert events[signature + 2]["content_block"]["type"] == "text"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_without_thinking_enabled_hide_it_and_other_models_keep_their_text(
        stream: bool) -> None:
    hidden = claude(THOUGHT + "Sunny.", stream, thinking=False, show=False)
    assert [(b.type, getattr(b, "text", None)) for b in hidden.content] == [("text", "Sunny.")]
    plain = claude(THOUGHT + "Sunny.", stream, thinking=None, show=True)
    assert [(b.type, getattr(b, "text", None)) for b in plain.content] == \
        [("text", THOUGHT + "Sunny.")]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_call_after_thinking(stream: bool) -> None:
    message = claude(THOUGHT + CALL, stream, thinking=False, show=True, tools=True)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == {"city": "Oslo"}  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_reasoning_cut_off_by_max_tokens_is_all_thinking(stream: bool) -> None:
    text = "<think>\nStill going"
    w = messages_wire(False, True)
    body = json.loads(json.dumps(w.whole(output(text, "length"))))
    assert body["content"][0] == {"type": "thinking", "thinking": "Still going",
                                  "signature": body["content"][0]["signature"]}
    assert body["content"][1] == {"type": "text", "text": ""}


class Template:
    """A tokenizer stand-in with a thinking template that records what it rendered."""

    chat_template = "{{ '</think>' }}"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> list[int]:
        self.calls.append((messages, kwargs))
        return [1, 2]


@pytest.mark.parametrize(("thinking", "enabled"), [
    ({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False), (None, False)])
def test_messages_thinking_turns_the_template_on_and_past_thinking_is_dropped(
        thinking: dict[str, Any] | None, enabled: bool) -> None:
    tok = Template()
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 4096, "thinking": thinking, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "old", "signature": "s"},
                {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "again"}]})
    _build_prompt(SimpleNamespace(tokenizer=tok), body)  # type: ignore[arg-type]
    messages, kwargs = tok.calls[-1]
    assert kwargs["enable_thinking"] is enabled
    assert [m["content"] for m in messages] == ["hi", "Hello.", "again"]


# -- Responses --------------------------------------------------------------------------------


def responses_wire(thinking: bool | None) -> ResponsesWire:
    return ResponsesWire("m", {}, None, 3, lambda body, out: None, thinking=thinking,
                         tokenizer=Chars())


def gpt(text: str, stream: bool, thinking: bool | None) -> Any:
    def body() -> Any:
        w = responses_wire(thinking)
        return streamed(w, text) if stream else w.whole(output(text))
    client = openai.OpenAI(api_key="k", base_url="http://kv/v1",
                           http_client=replaying(body, stream))
    if stream:
        with client.responses.stream(model="m", input="weather?") as events:
            return events.get_final_response()
    return client.responses.create(model="m", input="weather?")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_item_then_message(stream: bool) -> None:
    response = gpt(THOUGHT + "Sunny.", stream, thinking=False)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [REASONING]
    assert message.type == "message" and message.content[0].text == "Sunny."
    assert response.output_text == "Sunny."
    # the tokens up to and including the one that completes "</think>" (one per character)
    assert response.usage.output_tokens_details.reasoning_tokens == THOUGHT.index(">\n\n") + 1


def test_streamed_reasoning_events_and_message_index() -> None:
    sse = streamed(responses_wire(False), THOUGHT + "Sunny.")
    events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == REASONING
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"} == {1}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_responses_without_reasoning_have_no_item(stream: bool) -> None:
    off = gpt("<think>\n\n</think>\n\nSunny.", stream, thinking=False)
    assert [item.type for item in off.output] == ["message"]
    assert off.output_text == "Sunny." and off.usage.output_tokens_details.reasoning_tokens == 0
    other = gpt(THOUGHT + "Sunny.", stream, thinking=None)  # a model without reasoning blocks
    assert other.output_text == THOUGHT + "Sunny."


def test_reasoning_tokens_and_past_reasoning_items() -> None:
    ids = [ord(ch) for ch in "cut off"]
    assert reasoning_tokens(Chars(), ids, opened=True) == len(ids)
    assert reasoning_tokens(Chars(), ids, opened=False) == 0
    items = input_items([{"type": "reasoning", "id": "rs_1", "summary": []},
                         {"type": "message", "role": "user", "content": "hi"}])
    assert items == [{"type": "message", "role": "user", "content": "hi"}]


