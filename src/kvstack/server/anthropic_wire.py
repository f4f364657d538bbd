"""Anthropic's response shapes: a message whole or as events, with `thinking`, text and
`tool_use` content blocks and cache usage (see `lifecycle.WireFormat`), and the pinning of
`cache_control` breakpoints once the prompt is computed.

A model whose template writes reasoning blocks (server/reasoning.py) has them split off its
output; a request that enables thinking gets them as a `thinking` block first (streamed as
`thinking_delta`s, then one `signature_delta` as the block closes), any other request gets
only what follows them. The signature is opaque to clients as Anthropic's is; here it is a
digest of the thinking text (nothing is encrypted, and a block sent back is never checked)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstack.blend.params import BlendSpec
from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.server.blend_api import blend_usage
from kvstack.server.lifecycle import sse
from kvstack.server.reasoning import ReasoningStream, split_reasoning
from kvstack.server.semantic_api import Probe
from kvstack.server.state import ServerState
from kvstack.server.tools import ToolCall, ToolChoice, ToolSpec, ToolStream, new_call_id


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    breakpoints: list[tuple[int, float]]  # (prefix length in tokens, TTL in seconds)
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: no tools, or tool_choice none
    blend: BlendSpec | None = None  # document blocks' chunks, reused when `blend` is given


async def pin_breakpoints(state: ServerState, prompt: Prompt, cache_salt: str | None) -> int:
    """Pin each breakpoint's prefix; returns how many prompt tokens pinned blocks now cover."""
    longest: dict[float, int] = {}  # per TTL its longest prefix: shorter ones lie inside it
    for num_tokens, ttl_s in prompt.breakpoints:
        longest[ttl_s] = max(longest.get(ttl_s, 0), num_tokens)
    num_pinned = 0
    for ttl_s, num_tokens in sorted(longest.items()):
        created, read = await state.engine.pin_prefix(
            prompt.token_ids[:num_tokens], cache_salt, ttl_s * state.config.cache_ttl_scale
        )
        num_pinned = max(num_pinned, created + read)
    return num_pinned


@dataclass(frozen=True)
class _Usage:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_pinned_tokens: int
    probe: Probe | None = None  # None: the semantic cache was not consulted

    def as_dict(self, out: RequestOutput | None) -> dict[str, Any]:
        """Usage once `out` is produced (None: before any output)."""
        creation = max(0, self.num_pinned_tokens - self.num_cached_tokens)
        usage: dict[str, Any] = {
            "input_tokens": self.num_prompt_tokens - self.num_cached_tokens - creation,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": self.num_cached_tokens,
            "output_tokens": 0 if out is None else len(out.outputs[0].token_ids),
        }
        if out is not None and (blended := blend_usage(out)) is not None:
            usage["blend"] = blended
        if self.probe is not None:
            usage["semantic_cache_hit"] = self.probe.hit
            if out is not None:
                usage["semantic_cache"] = self.probe.usage(out)
        return usage


class AnthropicWire:
    """A message's JSON and event shapes. Without tools the one text block opens with the
    message; with tools a text block opens at the first content and each call is a
    `tool_use` block (a named tool's input streams as it is generated)."""

    def __init__(self, state: ServerState, prompt: Prompt, cache_salt: str | None,
                 probe: Probe | None, edits_asked: bool = False,
                 thinking: bool | None = None, show_thinking: bool = False) -> None:
        self.state = state
        choice = prompt.tool_choice
        # None: the output holds no reasoning blocks (True: the prompt opened one). A forced
        # tool call is constrained from its first token, so it never reasons.
        self.thinking = thinking if choice is None or choice.mode == "auto" else None
        self.show_thinking = show_thinking  # the request enabled thinking: blocks are sent
        self._reasoning: ReasoningStream | None = None
        self._thought = ""  # thinking text sent so far
        self._thinking_open = self._thinking_done = False
        # The request asked for context_management edits: answers report those applied (none).
        self.edits: dict[str, Any] = {"context_management": {"applied_edits": []}} \
            if edits_asked else {}
        self.prompt = prompt
        self.cache_salt = cache_salt
        self.probe = probe
        self.headers = probe.headers if probe is not None else {}
        self.id = f"msg_{uuid.uuid4().hex}"
        self.usage = _Usage(len(prompt.token_ids), 0, 0)
        self.tools = ToolStream(prompt.tools, choice, "toolu_") if choice else None
        self._blocks = 0  # content blocks opened so far
        self._closed = 0  # of those, closed
        self._text_open = False
        self._sent_content = 0
        self._sent_input = 0  # named tool: characters of its input sent

    async def started(self, first: RequestOutput) -> None:
        # The prefill is done once the first token is out: its blocks are cached, so pin now.
        replayed = self.probe is not None and self.probe.replays
        num_pinned = 0 if replayed else await pin_breakpoints(self.state, self.prompt,
                                                              self.cache_salt)
        self.usage = _Usage(len(self.prompt.token_ids), first.num_cached_tokens, num_pinned,
                            self.probe)

    def whole(self, out: RequestOutput | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        reason, sequence = (None, None) if out is None else _stop(out)
        if out is not None:
            c = out.outputs[0]
            if self.thinking is not None:
                split = split_reasoning(c.text, self.thinking)
                if split.reasoning and self.show_thinking:
                    content.append(_thinking(split.reasoning))
                c = dataclasses.replace(c, text=split.content)
            calls = self._calls(c)
            text = self.tools.content(c.text, True) if self.tools and calls else c.text
            if text or not calls:
                content.append({"type": "text", "text": text})
            content += [_tool_use(call) for call in calls or []]
            reason = "tool_use" if calls else reason
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.state.model_name, "content": content, "stop_reason": reason,
                "stop_sequence": sequence, "usage": self.usage.as_dict(out), **self.edits}

    def opening(self, first: RequestOutput) -> Iterable[str]:
        yield _event("message_start", {"message": self.whole(None)})
        if self.tools is None and self.thinking is None:
            yield from self._open_text()
        elif self.tools is not None and self.tools.choice.mode == "named":
            call = ToolCall(new_call_id("toolu_"), self.tools.choice.name or "", "{}")
            yield from self._open({**_tool_use(call), "input": {}})

    def delta(self, out: RequestOutput, completion: CompletionOutput, sent_chars: int,
              sent_tokens: int) -> Iterable[str]:
        c = completion
        if self.thinking is not None:
            yield from self._thinking_delta(c)
            c = self._visible(c)
            if self.tools is None:
                yield from self._text_delta(c)
                return
        elif self.tools is None:
            text = c.text[sent_chars:]
            if text:
                yield _event("content_block_delta",
                             {"index": 0, "delta": {"type": "text_delta", "text": text}})
            return
        if self.tools.choice.mode == "named":
            partial, self._sent_input = c.text[self._sent_input:], len(c.text)
            if partial:
                yield _event("content_block_delta", {"index": 0, "delta": {
                    "type": "input_json_delta", "partial_json": partial}})
            return
        finished = c.finish_reason is not None
        text = self.tools.content(c.text, finished)[self._sent_content:]
        self._sent_content += len(text)
        if text and not self._text_open:
            yield from self._open_text()
        if text:
            yield _event("content_block_delta", {"index": self._blocks - 1,
                                                 "delta": {"type": "text_delta", "text": text}})
        for call in (self._calls(c) or []) if finished else []:
            yield from self._close()
            yield from self._open({**_tool_use(call), "input": {}})
            yield _event("content_block_delta", {"index": self._blocks - 1, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}})

    def _thinking_delta(self, c: CompletionOutput) -> Iterable[str]:
        """The reasoning as it becomes certain, in a thinking block closed (signed) once the
        content after it starts or the output ends."""
        if self._reasoning is None:
            self._reasoning = ReasoningStream(bool(self.thinking))
        finished = c.finish_reason is not None
        new, _ = self._reasoning.step(c.text, finished)
        if new and self.show_thinking:
            if not self._thinking_open:
                self._thinking_open = True
                yield from self._open({"type": "thinking", "thinking": "", "signature": ""})
            self._thought += new
            yield _event("content_block_delta", {"index": self._blocks - 1, "delta": {
                "type": "thinking_delta", "thinking": new}})
        ended = finished or split_reasoning(c.text, self._reasoning.opened, False).content
        if self._thinking_open and not self._thinking_done and ended:
            self._thinking_done = True
            yield _event("content_block_delta", {"index": self._blocks - 1, "delta": {
                "type": "signature_delta", "signature": _signature(self._thought)}})
            yield from self._close()

    def _text_delta(self, c: CompletionOutput) -> Iterable[str]:
        """Content after the reasoning, in a text block opened at its first character (or
        empty at the end, as a message with no text has)."""
        text = c.text[self._sent_content:]
        self._sent_content += len(text)
        if (text or c.finish_reason is not None) and not self._text_open:
            yield from self._open_text()
        if text:
            yield _event("content_block_delta", {"index": self._blocks - 1,
                                                 "delta": {"type": "text_delta", "text": text}})

    def _visible(self, c: CompletionOutput) -> CompletionOutput:
        """`c` with only the content after its reasoning block (what tools parse)."""
        if self.thinking is None:
            return c
        split = split_reasoning(c.text, self.thinking, c.finish_reason is not None)
        return dataclasses.replace(c, text=split.content)

    def closing(self, out: RequestOutput) -> Iterable[str]:
        yield from self._close()
        reason, sequence = _stop(out)
        if self._calls(self._visible(out.outputs[0])):
            reason = "tool_use"
        yield _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": self.usage.as_dict(out), **self.edits,
        })
        yield _event("message_stop", {})

    def error(self, body: dict[str, Any]) -> str:
        return _event("error", body)

    def keepalive(self) -> str:
        return _event("ping", {})  # Anthropic's own keep-alive; the SDKs skip it

    def done(self) -> Iterable[str]:
        return ()

    def _calls(self, c: CompletionOutput) -> list[ToolCall] | None:
        if self.tools is None or c.finish_reason != "stop":
            return None
        return self.tools.calls(c.text)

    def _open_text(self) -> Iterable[str]:
        self._text_open = True
        yield from self._open({"type": "text", "text": ""})

    def _open(self, block: dict[str, Any]) -> Iterable[str]:
        self._blocks += 1
        yield _event("content_block_start", {"index": self._blocks - 1, "content_block": block})

    def _close(self) -> Iterable[str]:
        if self._blocks > self._closed:
            self._closed = self._blocks
            yield _event("content_block_stop", {"index": self._blocks - 1})


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": _signature(text)}


def _signature(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}


def _stop(out: RequestOutput) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence)."""
    completion = out.outputs[0]
    if not out.finished:
        return None, None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _event(kind: str, payload: dict[str, Any]) -> str:
    return sse(payload if kind == "error" else {"type": kind, **payload}, event=kind)
