"""Tool calling, shared by both APIs: the tools in the prompt, the constraint a call is
generated under, and tool calls parsed back out of the output (whole or streamed).

The format is Hermes's (Qwen2.5's and NousResearch's templates use it): a call is

    <tool_call>
    {"name": "<tool>", "arguments": {...}}
    </tool_call>

and a tool's result goes back to the model as `<tool_response>...</tool_response>`. A chat
template that takes `tools` (its Jinja source reads the variable) renders the tools, past
calls and results itself; the embedded SmolLM2's template does not, so kvstack adds a system
message listing the tools (as JSON) and describing the format above, and renders past calls
and results as text in it.

- `auto`: the model is free to answer with text or calls; `<tool_call>` blocks whose JSON
  names a given tool become tool calls, text before the first block is the message content.
  A small model rarely chooses a call on its own.
- `required` (Anthropic `any`): the output is generated under a grammar: one `<tool_call>`
  block whose JSON is one of the tools with arguments valid under its schema.
- a named tool: the output is the arguments themselves, generated under the tool's schema.
- `none`: the tools are left out of the prompt and nothing is parsed.
With a constraint the arguments always parse, unless max_tokens cuts them off (then the
output is returned as text with finish reason "length").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from kvstack.errors import InvalidRequestError
from kvstack.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON schema of the arguments
    strict: bool = False  # True: refuse schema keywords the constraint cannot enforce

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description or "",
                "parameters": self.parameters}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named tool
    parallel: bool = True  # auto: more than one call allowed


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    @property
    def input(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def check_tools(tools: list[ToolSpec], choice: ToolChoice) -> None:
    names = [t.name for t in tools]
    for name in names:
        if not _NAME.match(name):
            raise InvalidRequestError(f"tool name {name!r} must be 1-64 letters, digits, "
                                      "'_', '.' or '-'")
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique")
    for tool in tools:
        if not isinstance(tool.parameters, dict):
            raise InvalidRequestError(f"tool {tool.name!r}: its parameters must be a JSON "
                                      "schema object")
    if choice.mode in ("required", "named") and not tools:
        raise InvalidRequestError("tool_choice asks for a tool call but no tools are given")
    if choice.mode == "named" and choice.name not in names:
        raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not among "
                                  "the tools")


def template_takes_tools(tokenizer: Any) -> bool:
    """True when the chat template renders `tools` itself."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False


def tools_prompt(tools: list[ToolSpec]) -> str:
    """The system text that offers the tools when the template does not."""
    return "\n".join(tools_prompt_parts(tools))


def tools_prompt_parts(tools: list[ToolSpec]) -> list[str]:
    """`tools_prompt` in one part per tool (joined by newlines): the instructions come with
    the first, so a cache breakpoint after any tool ends between parts."""
    listed = [json.dumps(t.as_json(), ensure_ascii=False) for t in tools]
    head = ("You can call the following tools. To call one, answer with only\n"
            f"{OPEN}\n{{\"name\": <tool name>, \"arguments\": <arguments as a JSON object>}}\n"
            f"{CLOSE}\nTools:")
    return [f"{head}\n{listed[0]}", *listed[1:]] if listed else [head]


def render_call(name: str, arguments: str) -> str:
    """A past call, as the model would have written it."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def render_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def constraint(tools: list[ToolSpec], choice: ToolChoice) -> StructuredOutputsParams | None:
    """What a required or named call is generated under; None for auto and none. Arguments
    get no properties their schema does not name (as OpenAI's strict mode requires): a
    function has no use for them, and a small model otherwise invents them until max_tokens."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return StructuredOutputsParams(json=closed(tool.parameters), strict=tool.strict)
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.name}, "arguments": closed(t.parameters)}}
             for t in tools]
    schema = {"anyOf": calls, "x-guidance": {"whitespace_pattern": r"[\x20\x0A]{0,8}",
                                             "lenient": not all(t.strict for t in tools)}}
    lark = (f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
            f"call: %json {json.dumps(schema)}")
    return StructuredOutputsParams(grammar=lark)


def closed(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema that lists `properties` and says
    nothing of other properties allows no others."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(s) for name, s in schema[key].items()}
    if "properties" in schema and not _OPEN_KEYS & schema.keys():
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "prefixItems", "additionalItems"}
_OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}


def parse_calls(text: str, tools: list[ToolSpec], choice: ToolChoice,
                prefix: str) -> tuple[str, list[ToolCall]] | None:
    """(content, calls) of a finished output, or None when it holds no valid call (it is
    then plain text)."""
    if choice.mode == "named":
        arguments = _json_object(text)
        if arguments is None:
            return None
        return "", [ToolCall(new_call_id(prefix), choice.name or "", arguments)]
    if choice.mode == "none" or OPEN not in text:
        return None
    names = {t.name for t in tools}
    calls = []
    for block in _BLOCK.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(new_call_id(prefix), call["name"],
                              json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return None
    return text[:text.index(OPEN)], calls if choice.parallel else calls[:1]


def _json_object(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return text.strip() if isinstance(value, dict) else None


class ToolStream:
    """One streamed choice of a request with tools: which text is content to send now, and
    its calls once finished. Content never includes a `<tool_call>` block; a tail that may
    still grow into one is held back (like a stop string)."""

    def __init__(self, tools: list[ToolSpec], choice: ToolChoice, prefix: str) -> None:
        self.tools = tools
        self.choice = choice
        self.prefix = prefix
        self._parsed: tuple[str, list[ToolCall] | None] | None = None  # (text, its calls)

    def content(self, text: str, finished: bool) -> str:
        """The content so far (a prefix of what the finished output's content will be)."""
        if self.choice.mode in ("named", "required"):
            return "" if not finished or self.calls(text) else text
        if self.choice.mode == "none":
            return text
        if finished and self.calls(text) is None:
            return text
        at = text.find(OPEN)
        if at >= 0:
            return text[:at]
        return text[:len(text) - _partial_open(text)] if not finished else text

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls of a finished output (parsed once, so their ids stay the same)."""
        if self._parsed is None or self._parsed[0] != text:
            parsed = parse_calls(text, self.tools, self.choice, self.prefix)
            self._parsed = (text, parsed[1] if parsed else None)
        return self._parsed[1]


def _partial_open(text: str) -> int:
    """Length of the longest tail of `text` that begins `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
