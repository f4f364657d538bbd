"""A Responses request's prompt: its function tools and tool choice, the system message
(instructions and the tool offer), and the conversation's token ids.

Continuing a stored response (`previous_response_id`), the prompt is that response's prompt
and output token ids, exactly as computed, followed by the new turn's: the next turn is an
exact prefix-cache hit by construction, whatever re-tokenizing the model's own text would
give. This holds while the template renders the stored conversation as those tokens (same
instructions and tools); otherwise the conversation is rendered afresh, and the prefix
cache still serves what the two renderings share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2

from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.sampling_params import StructuredOutputsParams
from kvstack.server.chat_roles import fit_roles
from kvstack.server.errors import ApiError
from kvstack.server.openai_wire import ToolUse
from kvstack.server.responses.items import Conversation, Message, ResponsesRequest, extend
from kvstack.server.responses.store import StoredResponse
from kvstack.server.tools import (
    ToolChoice,
    ToolSpec,
    check_tools,
    constraint,
    template_takes_tools,
    tools_prompt,
)

# Stands for a stored response's output while its conversation is rendered as text.
_WRITTEN = "\u2063kvstack-output\u2063"


@dataclass(frozen=True)
class Tools:
    use: ToolUse  # how the output is parsed (a named tool parses as a required call)
    constraint: StructuredOutputsParams | None  # what the output is generated under


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    conversation: Conversation  # every turn so far, without the system message
    continued: bool  # True: the stored response's tokens, then this turn's


def request_tools(body: ResponsesRequest) -> Tools | None:
    """Function tools in the Responses shape `{"type": "function", "name", "description",
    "parameters", "strict"}`, and the tool choice (OpenAI's default: auto)."""
    tools = [_tool(i, t) for i, t in enumerate(body.tools or [])]
    given = body.tool_choice
    if not tools:
        if given not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    parallel = body.parallel_tool_calls is not False
    if given is None or given in ("auto", "none", "required"):
        choice = ToolChoice(given or "auto", None, parallel)
    elif isinstance(given, dict) and given.get("type") == "function" \
            and isinstance(given.get("name"), str):
        choice = ToolChoice("named", given["name"], parallel)
    else:
        raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            "{'type': 'function', 'name': ...}", param="tool_choice")
    check_tools(tools, choice)
    if choice.mode != "named":
        return Tools(ToolUse(tools, choice), constraint(tools, choice))
    # A named tool is a required call of that one tool: the model writes the whole call block
    # (not bare arguments, as chat's named mode does), so the conversation holds what it wrote
    # and the next turn continues its tokens.
    named = [t for t in tools if t.name == choice.name]
    required = ToolChoice("required", None, parallel)
    return Tools(ToolUse(tools, required), constraint(named, required))


def _tool(index: int, tool: dict[str, Any]) -> ToolSpec:
    kind = tool.get("type")
    if kind != "function":
        raise ApiError(400, f"tools[{index}]: tool type {kind!r} is not supported (built-in "
                            "tools run on OpenAI's servers); send function tools",
                       param="tools")
    name, description = tool.get("name"), tool.get("description")
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(name, str) or not isinstance(parameters, dict):
        raise ApiError(400, f"tools[{index}]: a function tool needs 'name' (a string) and "
                            "'parameters' (a JSON schema object)", param="tools")
    return ToolSpec(name, description if isinstance(description, str) else None, parameters,
                    tool.get("strict") is True)


def build_prompt(tokenizer: Any, body: ResponsesRequest, tools: Tools | None,
                 previous: StoredResponse | None, items: list[dict[str, Any]]) -> Prompt:
    offered = tools is not None and tools.use.choice.mode != "none"
    native = offered and template_takes_tools(tokenizer)
    history = previous.conversation if previous else Conversation([], frozenset())
    talk = extend(history, items, native)
    parts = [body.instructions] if body.instructions else []
    if offered and not native:
        parts.append(tools_prompt(tools.use.tools))  # type: ignore[union-attr]
    system = [{"role": "system", "content": "\n\n".join(parts)}] if parts else []
    listed = [{"type": "function", "function": t.as_json()}
              for t in tools.use.tools] if native else None  # type: ignore[union-attr]
    if previous is not None:
        new = talk.messages[len(history.messages):]
        ids = _continuation(tokenizer, previous, [*system, *history.messages], new, listed)
        if ids is not None:
            return Prompt(ids, talk, True)
    return Prompt(_render(tokenizer, [*system, *talk.messages], listed), talk, False)


def _render(tokenizer: Any, messages: list[Message],
            tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of `messages`; a template that refuses them as sent gets them fitted to
    its roles (server/chat_roles.py), and refuses only if it refuses those too."""
    try:
        return chat_token_ids(tokenizer, messages, tools=tools)
    except InvalidRequestError:
        fitted = fit_roles(tokenizer, messages)
        if fitted == messages:
            raise
        return chat_token_ids(tokenizer, fitted, tools=tools)


def _continuation(tokenizer: Any, previous: StoredResponse, head: list[Message],
                  new: list[Message], tools: list[dict[str, Any]] | None) -> list[int] | None:
    """`previous`'s prompt and output token ids, then the new turn's; None when the template
    would not render `head` (the stored conversation, its output last) as those tokens."""
    marked = _render_text(tokenizer, [*head[:-1], {"role": "assistant", "content": _WRITTEN},
                                      *new], tools)
    if marked is None or marked.count(_WRITTEN) != 1:
        return None
    before, after = marked.split(_WRITTEN)
    if _decode(tokenizer, previous.prompt_ids) != before:
        return None
    written = _decode(tokenizer, previous.output_ids)
    if not written.startswith(previous.output_text):
        return None
    # What the output has past its text is the stop token that ended the turn; the template
    # writes it too, so the new turn's tokens start after it.
    closing = written[len(previous.output_text):]
    if not after.startswith(closing):
        return None
    tail = tokenizer.encode(after[len(closing):], add_special_tokens=False)
    return [*previous.prompt_ids, *previous.output_ids, *tail]


def _render_text(tokenizer: Any, messages: list[Message],
                 tools: list[dict[str, Any]] | None) -> str | None:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False,
                                             **({"tools": tools} if tools else {}))
    except (ValueError, TypeError, KeyError, jinja2.TemplateError):
        return None  # the fresh rendering reports the error
    return text if isinstance(text, str) else None


def _decode(tokenizer: Any, token_ids: Any) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
