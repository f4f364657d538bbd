"""The Responses API's shapes: a response object whole, or as the typed events the OpenAI SDK
parses (see `server.lifecycle.WireFormat`), each with its `sequence_number`.

Output items: a `reasoning` item first when the model's template writes reasoning blocks and
this output has one (server/reasoning.py; its text one `reasoning_text` content part, no
summary: nothing here summarises), one `message` (its text one `output_text` part) and a
`function_call` per call. Reasoning streams as `response.reasoning_text.delta`s; the item is
done when the message opens or the output ends, and usage counts its tokens
(`output_tokens_details.reasoning_tokens`).
Text streams as `response.output_text.delta`s as it becomes certain (a tail that may grow
into a tool call is held back, server/tools.py); calls are parsed once the output is finished
(only then do they parse), so each goes out whole: added, its arguments in one delta, done.
A finished response is handed to `keep` (the store, or nothing with `store: false`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from kvstack.outputs import CompletionOutput, RequestOutput
from kvstack.server.lifecycle import sse
from kvstack.server.openai_wire import ToolUse
from kvstack.server.reasoning import ReasoningStream, reasoning_tokens, split_reasoning
from kvstack.server.tools import ToolStream

Keep = Callable[[dict[str, Any], RequestOutput], None]


class ResponsesWire:
    def __init__(self, model: str, echo: dict[str, Any], tool_use: ToolUse | None,
                 num_prompt_tokens: int, keep: Keep,
                 namespace_of: dict[str, str] | None = None, thinking: bool | None = None,
                 tokenizer: Any = None) -> None:
        self.headers: dict[str, str] = {}
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self._echo = echo  # the request's fields a response object repeats
        self._tools = None if tool_use is None or tool_use.choice.mode == "none" else \
            ToolStream(tool_use.tools, tool_use.choice, "call_")
        self._num_prompt_tokens = num_prompt_tokens
        self._keep = keep
        self._namespace_of = namespace_of or {}  # a call's tool -> the namespace it came in
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._seq = 0
        self._announced = False  # response.created is out
        self._open = False  # the message item and its text part are out
        self._sent = 0  # characters of message text sent
        # None: the output holds no reasoning blocks (True: the prompt opened one)
        self._thinking = thinking
        self._tokenizer = tokenizer  # counts reasoning tokens
        self._reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._reasoning: ReasoningStream | None = None
        self._thought = ""  # reasoning text sent
        self._thought_open = self._thought_done = False

    async def started(self, first: RequestOutput) -> None:
        return None

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        body = self._response(out)
        self._keep(body, out)
        return body

    # -- streamed ---------------------------------------------------------------------------

    def opening(self, first: RequestOutput) -> Iterable[str]:
        if not self._announced:
            yield from self._announce()

    def keepalive(self) -> str:
        """Before the first token: the response is created, then in progress again and
        again (Codex's idle timer counts events, not SSE comments)."""
        if not self._announced:
            return "".join(self._announce())
        return self._event("response.in_progress", response=self._response(None))

    def _announce(self) -> Iterable[str]:
        self._announced = True
        body = self._response(None)
        yield self._event("response.created", response=body)
        yield self._event("response.in_progress", response=body)

    def delta(self, out: RequestOutput, completion: CompletionOutput, sent_chars: int,
              sent_tokens: int) -> Iterable[str]:
        if self._thinking is not None:
            yield from self._reasoning_delta(completion)
        text = self._content(completion)
        # The message opens at its first visible text: output that turns out to be only tool
        # calls then has no message item, whole or streamed.
        if not self._open and text.strip():
            yield from self._close_reasoning(self._thought)
            yield from self._open_message()
        yield from self._text_delta(text)

    def closing(self, out: RequestOutput) -> Iterable[str]:
        body = self._response(out)
        self._keep(body, out)
        for index, item in enumerate(body["output"]):
            if item["type"] == "reasoning":
                yield from self._close_reasoning(item["content"][0]["text"])
                continue
            if item["type"] == "message":
                yield from self._close_message(item)
                continue
            opened = {**item, "arguments": "", "status": "in_progress"}
            yield self._event("response.output_item.added", output_index=index, item=opened)
            where = {"item_id": item["id"], "output_index": index}
            yield self._event("response.function_call_arguments.delta", **where,
                              delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", **where,
                              name=item["name"], arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)
        kind = "completed" if body["status"] == "completed" else "incomplete"
        yield self._event(f"response.{kind}", response=body)

    def error(self, body: dict[str, Any]) -> str:
        error = body.get("error", {})
        return self._event("error", code=error.get("code") or error.get("type"),
                           message=error.get("message"), param=error.get("param"))

    def done(self) -> Iterable[str]:
        return ()  # a Responses stream ends with its last event; it has no [DONE]

    def _reasoning_delta(self, completion: CompletionOutput) -> Iterable[str]:
        if self._reasoning is None:
            self._reasoning = ReasoningStream(bool(self._thinking))
        new, _ = self._reasoning.step(completion.text, completion.finish_reason is not None)
        yield from self._thought_delta(new)

    def _thought_delta(self, new: str) -> Iterable[str]:
        if not new:
            return
        if not self._thought_open:
            self._thought_open = True
            yield self._event("response.output_item.added", output_index=0,
                              item=self._reasoning_item("", "in_progress"))
            yield self._event("response.content_part.added", **self._thought_at,
                              part=_reasoning_part(""))
        self._thought += new
        yield self._event("response.reasoning_text.delta", **self._thought_at, delta=new)

    def _close_reasoning(self, text: str) -> Iterable[str]:
        """The reasoning item done with its whole `text` (opened first if it never was)."""
        if self._thought_done or not text:
            return
        yield from self._thought_delta(text[len(self._thought):])
        self._thought_done = True
        yield self._event("response.reasoning_text.done", **self._thought_at, text=text)
        yield self._event("response.content_part.done", **self._thought_at,
                          part=_reasoning_part(text))
        yield self._event("response.output_item.done", output_index=0,
                          item=self._reasoning_item(text, "completed"))

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self._reasoning_id, "type": "reasoning", "summary": [],
                "content": [_reasoning_part(text)] if text else [], "status": status}

    @property
    def _thought_at(self) -> dict[str, Any]:
        return {"item_id": self._reasoning_id, "output_index": 0, "content_index": 0}

    def _open_message(self) -> Iterable[str]:
        self._open = True
        item = {"id": self._message_id, "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        yield self._event("response.output_item.added", output_index=self._message_index,
                          item=item)
        yield self._event("response.content_part.added", **self._text_at,
                          part=_text_part(""))

    def _text_delta(self, text: str) -> Iterable[str]:
        if self._open and len(text) > self._sent:
            yield self._event("response.output_text.delta", **self._text_at,
                              delta=text[self._sent:], logprobs=[])
            self._sent = len(text)

    def _close_message(self, item: dict[str, Any]) -> Iterable[str]:
        if not self._open:
            yield from self._open_message()
        text = item["content"][0]["text"]
        yield from self._text_delta(text)
        yield self._event("response.output_text.done", **self._text_at, text=text,
                          logprobs=[])
        yield self._event("response.content_part.done", **self._text_at,
                          part=_text_part(text))
        yield self._event("response.output_item.done", output_index=self._message_index,
                          item=item)

    @property
    def _message_index(self) -> int:
        return 1 if self._thought_open else 0  # after the reasoning item, if there is one

    @property
    def _text_at(self) -> dict[str, Any]:
        return {"item_id": self._message_id, "output_index": self._message_index,
                "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return sse(payload, event=kind)

    # -- the response object ----------------------------------------------------------------

    def _response(self, out: RequestOutput | None) -> dict[str, Any]:
        """The response object; `out` None: one still in progress."""
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": "in_progress", "error": None, "incomplete_details": None,
            "model": self.model, "output": [], "usage": None, **self._echo}
        if out is None:
            return body
        completion = out.outputs[0]
        done = completion.finish_reason == "stop"
        body["output"] = self._output(completion, "completed" if done else "incomplete")
        body["status"] = "completed" if done else "incomplete"
        if not done:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        num_out = len(completion.token_ids)
        body["usage"] = {
            "input_tokens": self._num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": num_out,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(completion)},
            "total_tokens": self._num_prompt_tokens + num_out,
        }
        return body

    def _reasoning_tokens(self, completion: CompletionOutput) -> int:
        if self._thinking is None or self._tokenizer is None:
            return 0
        return reasoning_tokens(self._tokenizer, list(completion.token_ids), self._thinking)

    def _visible(self, completion: CompletionOutput) -> str:
        """The output after its reasoning block (all of it for a model without them)."""
        if self._thinking is None:
            return completion.text
        return split_reasoning(completion.text, self._thinking,
                               completion.finish_reason is not None).content

    def _content(self, completion: CompletionOutput) -> str:
        finished = completion.finish_reason is not None
        if self._tools is None:
            return self._visible(completion)
        return self._tools.content(self._visible(completion), finished)

    def _output(self, completion: CompletionOutput, status: str) -> list[dict[str, Any]]:
        visible = self._visible(completion)
        calls = self._tools.calls(visible) if self._tools is not None \
            and completion.finish_reason == "stop" else None
        text = self._content(completion)
        items: list[dict[str, Any]] = []
        thought = split_reasoning(completion.text, self._thinking).reasoning \
            if self._thinking is not None else ""
        if thought:
            items.append({**self._reasoning_item(thought, "completed")})
        if not calls or text.strip():
            items.append({"id": self._message_id, "type": "message", "status": status,
                          "role": "assistant", "content": [_text_part(text)]})
        for call in calls or []:
            item = {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call",
                    "status": "completed", "call_id": call.id, "name": call.name,
                    "arguments": call.arguments}
            if call.name in self._namespace_of:
                item["namespace"] = self._namespace_of[call.name]
            items.append(item)
        return items


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
