"""OpenAI's response shapes: completions and chat completions, whole or as chunks, with n
choices, log-probabilities and tool calls (see `lifecycle.WireFormat`)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.server.batch import part_of
from kvstack.server.blend_api import blend_usage
from kvstack.server.lifecycle import KEEPALIVE, sse
from kvstack.server.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from kvstack.server.protocol import OpenAISampling
from kvstack.server.reasoning import ReasoningStream, split_reasoning
from kvstack.server.semantic_api import Probe
from kvstack.server.state import ServerState
from kvstack.server.tools import ToolCall, ToolChoice, ToolSpec, ToolStream, new_call_id


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat request offers and how it lets the model use them."""

    tools: list[ToolSpec]
    choice: ToolChoice


@dataclass
class Prompts:
    """What a completions response shows of its prompts: their ids (a batch: one per prompt,
    `n` choices each), echoed or not, and whether only the prompt is scored (`max_tokens` 0
    with echo: what was generated to finish the request is not shown)."""

    token_ids: list[list[int]]
    n: int = 1
    echo: bool = False
    logprobs: int | None = None  # the request's: with echo, the prompt's too
    score_only: bool = False
    _texts: dict[int, str] = field(default_factory=dict)

    def text(self, index: int, tokenizer: Any) -> str:
        """The echoed text of choice `index`'s prompt ("" without echo)."""
        if not self.echo:
            return ""
        i = index // self.n
        if i not in self._texts:
            self._texts[i] = tokenizer.decode(self.token_ids[i])
        return self._texts[i]


@dataclass
class _Sent:
    """What one streamed choice has sent so far, in tool mode."""

    content: int = 0  # characters of content
    tokens: int = 0  # tokens whose log-probs went out
    arguments: int = 0  # named tool: characters of its arguments
    opened: bool = False  # named tool: its call's id and name are out
    stream: ToolStream | None = field(default=None, repr=False)
    reasoning: ReasoningStream | None = field(default=None, repr=False)


class OpenAIWire:
    def __init__(self, state: ServerState, prefix: str, obj: str, num_prompt_tokens: int,
                 body: OpenAISampling, probe: Probe | None, prompts: Prompts | None = None,
                 tool_use: ToolUse | None = None, thinking: bool | None = None) -> None:
        self.state = state
        # chat: None, or the output holds reasoning blocks (True: the prompt opened one)
        self.thinking = thinking if obj == "chat.completion" else None
        self.probe = probe  # the semantic cache's view of this request, if it looked it up
        self.headers = probe.headers if probe is not None else {}
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.chat = obj == "chat.completion"
        self.obj = obj
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.prompts = prompts or Prompts([])
        self.prompt_logprobs = body.prompt_logprobs is not None  # vLLM's field, shown as is
        self.tool_use = tool_use if tool_use is not None and tool_use.choice.mode != "none" \
            else None
        self.tokens = TokenText(state.tokenizer)
        self._sent: dict[int, _Sent] = {}

    async def started(self, first: RequestOutput) -> None:
        return None

    # -- whole ------------------------------------------------------------------------------

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        body = {**self._envelope(self.obj), "choices": [self._choice(out, c) for c in out.outputs],
                "usage": self._usage(out)}
        return body | (self._chat_prompt_part(out) or {}) if self.chat else body

    def _choice(self, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
        if not self.chat:
            echo, shown = self.prompts.text(c.index, self.state.tokenizer), self._shown(c)
            choice["text"] = echo + shown.text
            completion = completion_logprobs(self.tokens, shown, 0, len(echo))
            choice["logprobs"] = (joined(self._echo_logprobs(out, c.index), completion)
                                  if self.prompts.echo and c.logprobs is not None else completion)
            return choice | self._prompt_part(out, c.index)
        choice["logprobs"] = chat_logprobs(self.tokens, c, 0)
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if self.thinking is not None:  # the reasoning apart; the rest parsed as the output
            split = split_reasoning(c.text, self.thinking)
            message = {"role": "assistant", "content": split.content}
            if split.reasoning:
                message["reasoning_content"] = split.reasoning
            c = dataclasses.replace(c, text=split.content)
        calls = self._calls(c) if c.finish_reason == "stop" else None
        if calls:
            content = self._stream(c).content(c.text, True)
            message["content"] = content if content.strip() else None
            message["tool_calls"] = [_call_json(call) for call in calls]
            choice["finish_reason"] = "tool_calls"
        choice["message"] = message
        return choice

    # -- streamed ---------------------------------------------------------------------------

    def opening(self, first: RequestOutput) -> Iterable[str]:
        for c in first.outputs:
            if self.chat:
                yield self._chunk(c.index, {"role": "assistant", "content": ""}, None, None,
                                  top=self._chat_prompt_part(first) if c.index == 0 else None)
            elif self.prompts.echo or self.prompt_logprobs:
                logprobs = (self._echo_logprobs(first, c.index)
                            if self.prompts.echo and c.logprobs is not None else None)
                yield self._chunk(c.index, self.prompts.text(c.index, self.state.tokenizer),
                                  None, logprobs, self._prompt_part(first, c.index))

    def delta(self, out: RequestOutput, completion: CompletionOutput, sent_chars: int,
              sent_tokens: int) -> Iterable[str]:
        c, reason = completion, completion.finish_reason
        if self.thinking is not None:
            yield from self._thinking_delta(c)
            return
        if self.tool_use is not None:
            yield from self._tool_delta(c)
            return
        if self.prompts.score_only:
            if reason:
                yield self._chunk(c.index, "", reason, None)
            return
        text = c.text[sent_chars:]
        if text or reason:
            if self.chat:
                logprobs = chat_logprobs(self.tokens, c, sent_tokens)
                yield self._chunk(c.index, {"content": text}, reason, logprobs)
            else:
                echo = self.prompts.text(c.index, self.state.tokenizer)
                logprobs = completion_logprobs(self.tokens, c, sent_tokens,
                                               len(echo) + sent_chars)
                yield self._chunk(c.index, text, reason, logprobs)

    def _thinking_delta(self, c: CompletionOutput) -> Iterable[str]:
        """Reasoning as `reasoning_content` deltas; the content after it as any output's."""
        sent = self._sent.setdefault(c.index, _Sent())
        if sent.reasoning is None:
            sent.reasoning = ReasoningStream(bool(self.thinking))
        finished = c.finish_reason is not None
        reasoning, _ = sent.reasoning.step(c.text, finished)
        content = split_reasoning(c.text, sent.reasoning.opened, finished).content
        logprobs = chat_logprobs(self.tokens, c, sent.tokens)
        if reasoning:
            yield self._chunk(c.index, {"reasoning_content": reasoning}, None, logprobs)
            logprobs, sent.tokens = None, len(c.token_ids)
        if self.tool_use is not None:
            yield from self._tool_delta(dataclasses.replace(c, text=content))
            return
        text = content[sent.content:]
        sent.content = len(content)
        if text or finished:
            yield self._chunk(c.index, {"content": text}, c.finish_reason, logprobs)
            sent.tokens = len(c.token_ids)

    def _tool_delta(self, c: CompletionOutput) -> Iterable[str]:
        """Content as it becomes certain; a named tool's arguments as they come; other calls
        whole once the choice is finished (only then do they parse)."""
        sent = self._sent.setdefault(c.index, _Sent())
        finished = c.finish_reason is not None
        logprobs = chat_logprobs(self.tokens, c, sent.tokens)
        sent.tokens = len(c.token_ids)
        assert self.tool_use is not None
        choice = self.tool_use.choice
        if choice.mode == "named" and not sent.opened:
            sent.opened = True
            call = {"index": 0, "id": new_call_id("call_"),
                    "type": "function", "function": {"name": choice.name, "arguments": ""}}
            yield self._chunk(c.index, {"tool_calls": [call]}, None, None)
        if choice.mode == "named":
            args = c.text[sent.arguments:]
            sent.arguments = len(c.text)
            if args:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}
                yield self._chunk(c.index, delta, None, logprobs)
                logprobs = None
        else:
            content = self._stream(c).content(c.text, finished)[sent.content:]
            sent.content += len(content)
            if content:
                yield self._chunk(c.index, {"content": content}, None, logprobs)
                logprobs = None
        if not finished:
            return
        calls = self._calls(c) if c.finish_reason == "stop" else None
        if calls and choice.mode != "named":
            yield self._chunk(c.index, {"tool_calls": [_call_json(call) | {"index": k}
                                                       for k, call in enumerate(calls)]},
                              None, None)
        reason = "tool_calls" if calls else c.finish_reason
        yield self._chunk(c.index, {}, reason, logprobs)

    def closing(self, out: RequestOutput) -> Iterable[str]:
        if self.include_usage:
            yield sse({**self._envelope(self._chunk_object), "choices": [],
                       "usage": self._usage(out)})

    def error(self, body: dict[str, Any]) -> str:
        return sse(body)

    def keepalive(self) -> str:
        return KEEPALIVE  # an SSE comment: the SDKs skip it

    def done(self) -> Iterable[str]:
        yield "data: [DONE]\n\n"

    # -- parts ------------------------------------------------------------------------------

    def _stream(self, c: CompletionOutput) -> ToolStream:
        sent = self._sent.setdefault(c.index, _Sent())
        if sent.stream is None:
            assert self.tool_use is not None
            sent.stream = ToolStream(self.tool_use.tools, self.tool_use.choice, "call_")
        return sent.stream

    def _calls(self, c: CompletionOutput) -> list[ToolCall] | None:
        return self._stream(c).calls(c.text) if self.tool_use is not None else None

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else self.obj

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.state.model_name}

    def _chunk(self, index: int, delta: Any, reason: str | None, logprobs: Any,
               extra: dict[str, Any] | None = None, top: dict[str, Any] | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": reason}
        choice["delta" if self.chat else "text"] = delta
        chunk = {**self._envelope(self._chunk_object), "choices": [choice | (extra or {})],
                 **(top or {})}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    # -- scores of the prompt --------------------------------------------------------------

    def _shown(self, c: CompletionOutput) -> CompletionOutput:
        """The completion as the response shows it: nothing of it when only scoring."""
        if not self.prompts.score_only:
            return c
        return CompletionOutput(c.index, "", [], [] if c.logprobs is not None else None,
                                c.finish_reason, c.stop_reason,
                                [] if c.top_logprobs is not None else None)

    def _echo_logprobs(self, out: RequestOutput, index: int) -> dict[str, Any]:
        part = part_of(out, index, self.prompts.n)
        return echo_logprobs(self.tokens, self.prompts.token_ids[index // self.prompts.n],
                             part.prompt_logprobs, self.prompts.logprobs or 0)

    def _prompt_part(self, out: RequestOutput, index: int) -> dict[str, Any]:
        """A completions choice's `prompt_logprobs` (vLLM's field), when asked for."""
        part = part_of(out, index, self.prompts.n)
        if not self.prompt_logprobs or part.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(part.prompt_logprobs)}

    def _chat_prompt_part(self, out: RequestOutput) -> dict[str, Any] | None:
        if not self.prompt_logprobs or out.prompt_logprobs is None:
            return None
        return {"prompt_logprobs": vllm_prompt_logprobs(out.prompt_logprobs)}

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        num_out = 0 if self.prompts.score_only else sum(len(c.token_ids) for c in out.outputs)
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": num_out,
            "total_tokens": self.num_prompt_tokens + num_out,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }
        if (blended := blend_usage(out)) is not None:
            usage["blend"] = blended
        if self.probe is not None:
            usage["semantic_cache_hit"] = self.probe.hit
            usage["semantic_cache"] = self.probe.usage(out)
        return usage


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
