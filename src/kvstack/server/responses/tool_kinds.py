"""The Responses API's tool list as kvstack can serve it.

- `function` tools are offered as they are.
- A `namespace` (Codex's group of function tools: `{"type": "namespace", "name", "tools"}`)
  is the client's own grouping: its function tools are offered flat, and a call to one comes
  back as a `function_call` with the namespace's name in `namespace`, the shape the client
  sent its tools in.
- Hosted tools (`web_search`, `file_search`, ...) run on OpenAI's servers; kvstack cannot run
  them, so they are left out of the prompt and the answer carries a `Warning` header saying
  so (the model is never told of a tool it cannot call). A `tool_choice` forcing one is a
  400: the request cannot be answered as asked.
- Any other type is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstack.server.errors import ApiError

HOSTED = ("web_search", "web_search_preview", "web_search_preview_2025_03_11",
          "web_search_2025_08_26", "file_search", "code_interpreter", "computer_use_preview",
          "image_generation", "mcp")


@dataclass(frozen=True)
class OfferedTools:
    functions: list[dict[str, Any]]  # function tools, namespaces' ones flattened in
    namespace_of: dict[str, str] = field(default_factory=dict)  # tool name -> its namespace
    dropped: list[str] = field(default_factory=list)  # "tools[i] TYPE" of hosted tools

    def warning(self) -> dict[str, str]:
        """The response header that tells the client which tools were left out."""
        if not self.dropped:
            return {}
        listed = ", ".join(self.dropped)
        return {"Warning": f'299 kvstack "hosted tools left out (this server cannot run '
                           f'them): {listed}"'}


def offered_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> OfferedTools:
    """`tools` checked and flattened; a 400 for what cannot be served."""
    functions: list[dict[str, Any]] = []
    namespace_of: dict[str, str] = {}
    dropped: list[str] = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append(tool)
        elif kind == "namespace":
            for inner in _namespace_tools(i, tool):
                functions.append(inner)
                namespace_of[inner["name"]] = tool["name"]
        elif kind in HOSTED:
            dropped.append(f"tools[{i}] {kind}")
        else:
            raise ApiError(400, f"tools[{i}]: tool type {kind!r} is not supported; send "
                                "function or namespace tools (hosted tools such as "
                                "web_search are left out)", param="tools")
    forced = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if forced in HOSTED:
        raise ApiError(400, f"tool_choice forces the hosted tool {forced!r}, which this "
                            "server cannot run; choose a function tool or 'auto'",
                       param="tool_choice")
    return OfferedTools(functions, namespace_of, dropped)


def _namespace_tools(index: int, tool: dict[str, Any]) -> list[dict[str, Any]]:
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"tools[{index}]: a namespace needs 'name' (a string)",
                       param="tools")
    if not isinstance(inner, list) or not inner:
        raise ApiError(400, f"tools[{index}]: namespace {name!r} has no tools; give it at "
                            "least one function tool", param="tools")
    for j, t in enumerate(inner):
        if not isinstance(t, dict) or t.get("type") != "function" \
                or not isinstance(t.get("name"), str):
            raise ApiError(400, f"tools[{index}].tools[{j}]: a namespace holds function "
                                "tools, each with a 'name'", param="tools")
    return inner


_EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = (None, "auto", "concise", "detailed", "none")
INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs",
              "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


def check_reasoning(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    """`reasoning` as the response echoes it. Any effort and summary are accepted and change
    nothing: a model whose template writes reasoning blocks returns them as a reasoning item
    (its text, no summary), any other never does; values OpenAI does not define are a 400."""
    given = reasoning or {}
    effort, summary = given.get("effort"), given.get("summary", given.get("generate_summary"))
    if effort not in _EFFORTS:
        raise ApiError(400, f"reasoning.effort must be one of {', '.join(map(str, _EFFORTS[1:]))}",
                       param="reasoning")
    if summary not in _SUMMARIES:
        raise ApiError(400, "reasoning.summary must be one of "
                            f"{', '.join(map(str, _SUMMARIES[1:]))}", param="reasoning")
    return {"effort": effort, "summary": summary}


def check_include(include: list[str] | None) -> None:
    """`include` values OpenAI defines are accepted (what they add does not exist here: no
    reasoning items, no hosted tool calls); others are a 400."""
    for value in include or []:
        if value not in INCLUDABLE:
            raise ApiError(400, f"include: {value!r} is not a supported value; use "
                                f"{', '.join(INCLUDABLE)}", param="include")
