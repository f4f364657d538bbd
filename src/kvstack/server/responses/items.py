"""The Responses API's request body and its input items, checked and turned into chat messages.

Items are messages (role user, system, developer or assistant; content a string or
`input_text` / `output_text` parts), `function_call` and `function_call_output`. A past call
and its result are rendered as server/tools.py describes; an assistant message and the calls
after it are one assistant turn; a `reasoning` item (a past output's) is dropped, as thinking
templates drop past reasoning. What kvstack cannot do (built-in tools,
background runs, images and files) is refused with a 400 that names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvstack.server.errors import ApiError
from kvstack.server.protocol import ExtraSampling, JsonSchemaFormat, ResponseFormat
from kvstack.server.tools import render_call, render_result

Message = dict[str, Any]


class ResponsesRequest(ExtraSampling):
    """POST /v1/responses. Fields OpenAI defines that change nothing here (metadata, include,
    reasoning, user, truncation "disabled", prompt_cache_key, service_tier) are accepted."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None  # checked, echoed (tool_kinds.py)
    # Refused when set (see `refuse_unsupported`).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def refuse_unsupported(body: ResponsesRequest) -> ResponsesRequest:
    """`body`, or a 400 for a field whose meaning kvstack cannot honour: silently ignoring one
    would answer a different question than the one asked."""
    if body.background:
        raise ApiError(400, "background responses are not supported; send background: false "
                            "and wait for the answer (or stream it)", param="background")
    for name in ("conversation", "prompt", "max_tool_calls", "top_logprobs"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} is not supported by this server; leave it out",
                           param=name)
    if body.truncation == "auto":
        raise ApiError(400, "truncation 'auto' is not supported: a conversation longer than "
                            "the context is refused, never cut; send truncation: 'disabled'",
                       param="truncation")
    return body


def response_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    """`text.format` as chat's `response_format` (the flat json_schema shape unfolded), for
    server/structured.py."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("text", "json_object",
                                                                "json_schema"):
        raise ApiError(400, "text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                            "{'type': 'json_schema', 'name', 'schema'}", param="text")
    if spec["type"] != "json_schema":
        return ResponseFormat(type=spec["type"])
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, "text.format json_schema needs 'schema', a JSON schema object",
                       param="text")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=spec.get("name"), schema=schema, strict=spec.get("strict") is True))


# -- items -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """Items as the chat template sees them, and what later items may refer to."""

    messages: list[Message]
    call_ids: frozenset[str]  # the call_id of every function_call so far


def input_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as a list of items in their canonical shapes (text content, no ids)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not raw:
        raise ApiError(400, "input is empty; give a string or at least one item",
                       param="input")
    # A past reasoning item is dropped, as thinking templates drop a past turn's reasoning.
    items = [_item(i, item) for i, item in enumerate(raw)
             if not (isinstance(item, dict) and item.get("type") == "reasoning")]
    if not items:
        raise ApiError(400, "input holds only reasoning items; give a message too",
                       param="input")
    return items


def _item(index: int, item: dict[str, Any]) -> dict[str, Any]:
    where = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _bad(where, "a message's role must be user, system, developer or assistant")
        return {"type": "message", "role": role, "content": _text(where, item.get("content"))}
    if kind == "function_call":
        call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
        if not all(isinstance(v, str) and v for v in (call_id, name)):
            raise _bad(where, "a function_call needs 'call_id' and 'name' (strings)")
        if not isinstance(arguments, str) or not isinstance(_json(arguments), dict):
            raise _bad(where, "a function_call's 'arguments' must be a JSON object as text")
        return {"type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments}
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(where, "a function_call_output needs 'call_id' (a string)")
        return {"type": "function_call_output", "call_id": call_id,
                "output": output if isinstance(output, str) else _text(where, output)}
    raise ApiError(400, f"{where}: item type {kind!r} is not supported; send message, "
                        "function_call and function_call_output items", param="input")


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise _bad(where, f"content part type {kind!r} is not supported; send "
                              "input_text or output_text parts")
        if not isinstance(part.get("text"), str):
            raise _bad(where, "a text part needs 'text' (a string)")
        texts.append(part["text"])
    return "\n".join(texts)


def _json(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except json.JSONDecodeError:
        return None


def _bad(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param="input")


def extend(history: Conversation, items: list[dict[str, Any]], native: bool) -> Conversation:
    """`history` followed by `items`. A function_call_output must answer a function_call of
    the conversation; `native`: the template renders calls and results itself."""
    messages = list(history.messages)
    call_ids = set(history.call_ids)
    after_assistant = False  # calls join the assistant turn they follow
    for index, item in enumerate(items):
        kind = item["type"]
        if kind == "function_call":
            call_ids.add(item["call_id"])
            if not after_assistant:
                messages.append({"role": "assistant", "content": ""})
            messages[-1] = _with_call(messages[-1], item, native)
            after_assistant = True
            continue
        after_assistant = kind == "message" and item["role"] == "assistant"
        if kind == "function_call_output":
            if item["call_id"] not in call_ids:
                raise _bad(f"input[{index}]", f"function_call_output call_id "
                                              f"{item['call_id']!r} answers no function_call "
                                              "of this conversation")
            messages.append({"role": "tool", "content": item["output"],
                             "tool_call_id": item["call_id"]} if native else
                            {"role": "user", "content": render_result(item["output"])})
            continue
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": item["content"]})
    return Conversation(messages, frozenset(call_ids))


def _with_call(turn: Message, call: dict[str, Any], native: bool) -> Message:
    if native:
        listed = [*turn.get("tool_calls", []), {"type": "function", "id": call["call_id"],
                  "function": {"name": call["name"], "arguments": _json(call["arguments"])}}]
        return {**turn, "tool_calls": listed}
    written = render_call(call["name"], call["arguments"])
    return {**turn, "content": f"{turn['content']}\n{written}" if turn["content"] else written}
