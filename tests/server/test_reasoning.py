"""Qwen3's reasoning blocks and tool calls on synthetic model outputs (no weights): the split
of `<think>...</think>` whole and streamed, the chat completion's `reasoning_content` and tool
calls after a block, and `enable_thinking` reaching the chat template."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvstack.server.openai_wire import OpenAIWire, ToolUse
from kvstack.server.protocol import ChatCompletionRequest
from kvstack.server.reasoning import (
    ReasoningStream,
    prompt_opens_thinking,
    split_reasoning,
    template_thinks,
)
from kvstack.server.tools import ToolChoice, ToolSpec

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants the weather.\nI should call the tool.\n</think>\n\n"


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), [
    (THOUGHT + "Sunny.", False, "The user wants the weather.\nI should call the tool.",
     "Sunny."),
    ("<think>\n\n</think>\n\nHi!", False, "", "Hi!"),  # thinking off / "/no_think"
    ("Plain answer with <think> inside.", False, "", "Plain answer with <think> inside."),
    ("Still thinking, cut off by max_tokens", True, "Still thinking, cut off by max_tokens", ""),
    ("reasoned\n</think>\n\nanswer", True, "reasoned", "answer"),
    ("<think>cut off", False, "cut off", ""),
])
def test_split_reasoning(text: str, opened: bool, reasoning: str, content: str) -> None:
    split = split_reasoning(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("text", "opened"), [
    (THOUGHT + "Sunny " + "and warm.", False), ("a\n</think>\nb", True),
    ("no block at all", False), ("<think>\n\n</think>\n\nHi", False)])
def test_streamed_split_only_grows_and_ends_as_the_whole(text: str, opened: bool) -> None:
    stream = ReasoningStream(opened)
    reasoning = content = ""
    for n in range(len(text) + 1):
        r, c = stream.step(text[:n], n == len(text))
        reasoning, content = reasoning + r, content + c
        assert "<" not in r and "</" not in c
    whole = split_reasoning(text, opened)
    assert (reasoning, content) == (whole.reasoning, whole.content)


def test_the_prompt_may_open_the_block() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    assert template_thinks(SimpleNamespace(chat_template="{{ '</think>' }}"))
    assert not template_thinks(SimpleNamespace(chat_template="{{ messages }}"))


def wire(thinking: bool | None, tools: bool = False) -> OpenAIWire:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    state: Any = SimpleNamespace(tokenizer=None, model_name="m")
    use = ToolUse([ToolSpec("get_weather", None, {"type": "object"})],
                  ToolChoice("auto")) if tools else None
    return OpenAIWire(state, "chatcmpl", "chat.completion", 3, body, None, tool_use=use,
                      thinking=thinking)


def output(text: str, reason: str | None = "stop") -> RequestOutput:
    c = CompletionOutput(0, text, list(range(len(text))), finish_reason=reason)
    return RequestOutput("r", None, [1, 2, 3], [c], reason is not None, 0,
                         RequestMetrics(arrival_time=0.0))


def test_chat_message_carries_reasoning_content_and_tool_calls_after_it() -> None:
    body = wire(False, tools=True).whole(output(THOUGHT + CALL))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"].startswith("The user wants")
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    plain = wire(False).whole(output("<think>\n\n</think>\n\nHello."))["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": "Hello."}
    # a model without reasoning blocks keeps its text as it is
    other = wire(None).whole(output(THOUGHT + "x"))["choices"][0]["message"]
    assert other["content"] == THOUGHT + "x" and "reasoning_content" not in other


@pytest.mark.parametrize("tools", [False, True])
def test_streamed_chat_sends_reasoning_then_content(tools: bool) -> None:
    w, text = wire(False, tools), THOUGHT + "Sunny. " + (CALL if tools else "")
    events: list[dict[str, Any]] = []
    for n in range(1, len(text) + 1):
        out = output(text[:n], "stop" if n == len(text) else None)
        for event in w.delta(out, out.outputs[0], 0, 0):
            events.append(json.loads(event.removeprefix("data: ").strip()))
    deltas = [e["choices"][0]["delta"] for e in events]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning == "The user wants the weather.\nI should call the tool."
    assert content == "Sunny. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == int(tools)
    assert events[-1]["choices"][0]["finish_reason"] == ("tool_calls" if tools else "stop")


class Template:
    """A tokenizer stand-in that records the template variables it was given."""

    chat_template = "{{ '</think>' }}"

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> list[int]:
        self.kwargs = kwargs
        return [1, 2]


def test_enable_thinking_reaches_the_template_and_reserved_names_are_refused() -> None:
    tok = Template()
    chat_token_ids(tok, [{"role": "user", "content": "hi"}],
                   template_kwargs={"enable_thinking": False})
    assert tok.kwargs["enable_thinking"] is False
    with pytest.raises(InvalidRequestError, match="tokenize"):
        chat_token_ids(tok, [{"role": "user", "content": "hi"}],
                       template_kwargs={"tokenize": False})
