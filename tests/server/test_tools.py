"""Tool calling's text side without a model: parsing calls, streaming content that never
shows a call's text, the constraints of required and named choices, closed schemas, the
prompt that offers the tools, and the output-constraint translation of request bodies."""

from __future__ import annotations

import json

import pytest

from kvstack.errors import InvalidRequestError
from kvstack.server.errors import ApiError
from kvstack.server.protocol import ChatCompletionRequest
from kvstack.server.structured import structured_outputs
from kvstack.server.tools import (
    ToolChoice,
    ToolSpec,
    ToolStream,
    check_tools,
    closed,
    constraint,
    parse_calls,
    render_call,
    template_takes_tools,
    tools_prompt,
    tools_prompt_parts,
)

TOOLS = [ToolSpec("get_weather", "weather", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}),
         ToolSpec("get_time", None, {"type": "object"})]
AUTO = ToolChoice("auto")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_auto_parses_calls_and_the_content_before_them() -> None:
    content, calls = parse_calls("Checking. " + CALL + "\n" + CALL.replace("Oslo", "Rome"),
                                 TOOLS, AUTO, "call_") or ("", [])
    assert content == "Checking. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    single = parse_calls(CALL + CALL, TOOLS, ToolChoice("auto", parallel=False), "call_")
    assert single is not None and len(single[1]) == 1


@pytest.mark.parametrize("text", [
    "Just text.",
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": "Oslo"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {}}',  # cut off: no closing tag
])
def test_anything_but_well_formed_calls_of_known_tools_is_text(text: str) -> None:
    assert parse_calls(text, TOOLS, AUTO, "call_") is None
    assert parse_calls(text, TOOLS, ToolChoice("none"), "call_") is None


def test_a_named_choice_parses_the_arguments_object() -> None:
    named = ToolChoice("named", "get_weather")
    content, [call] = parse_calls('{"city": "Oslo"}', TOOLS, named, "toolu_") or ("", [None])
    assert content == "" and call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert parse_calls('{"city": "Os', TOOLS, named, "toolu_") is None


def test_streamed_content_holds_back_what_may_become_a_call() -> None:
    stream = ToolStream(TOOLS, AUTO, "call_")
    text = "Checking. " + CALL
    seen = [stream.content(text[:n], False) for n in range(len(text) + 1)]
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:], strict=False)), "only grows"
    assert seen[-1] == "Checking. " and "<" not in "".join(seen)
    assert stream.content(text, True) == "Checking. "
    assert stream.calls(text) == stream.calls(text), "parsed once: ids stay the same"
    # A tag that never completes turns back into content once the output is finished.
    broken = "A <tool_call> that is not one"
    assert stream.content(broken, False) == "A " and stream.content(broken, True) == broken
    assert stream.content("x <tool", False) == "x " and stream.content("x <to", True) == "x <to"


def test_required_and_named_constraints() -> None:
    named = constraint(TOOLS, ToolChoice("named", "get_weather"))
    assert named is not None and named.json == closed(TOOLS[0].parameters)
    assert named.json["additionalProperties"] is False
    required = constraint(TOOLS, ToolChoice("required"))
    assert required is not None and required.grammar is not None
    assert required.grammar.startswith('start: "<tool_call>\\n" call')
    assert '"const": "get_time"' in required.grammar
    assert constraint(TOOLS, AUTO) is None and constraint(TOOLS, ToolChoice("none")) is None


def test_closed_schemas_forbid_unnamed_properties_only_where_silent() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"type": "object", "properties": {}}},
        "d": {"type": "object", "properties": {}, "additionalProperties": True}},
        "$defs": {"e": {"type": "object", "properties": {"f": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["d"]["additionalProperties"] is True
    assert out["$defs"]["e"]["additionalProperties"] is False
    assert "additionalProperties" not in schema, "the caller's schema is not changed"


def test_the_offer_lists_every_tool_and_splits_after_each() -> None:
    parts = tools_prompt_parts(TOOLS)
    assert len(parts) == 2 and "\n".join(parts) == tools_prompt(TOOLS)
    assert "<tool_call>" in parts[0] and json.loads(parts[1])["name"] == "get_time"
    assert render_call("f", '{"x": 1}') == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}' \
                                           "\n</tool_call>"


def test_bad_tool_definitions_and_choices() -> None:
    with pytest.raises(InvalidRequestError, match="unique"):
        check_tools([TOOLS[0], TOOLS[0]], AUTO)
    with pytest.raises(InvalidRequestError, match="tool name"):
        check_tools([ToolSpec("has space", None, {})], AUTO)
    with pytest.raises(InvalidRequestError, match="not among"):
        check_tools(TOOLS, ToolChoice("named", "other"))
    with pytest.raises(InvalidRequestError, match="no tools"):
        check_tools([], ToolChoice("required"))


def test_a_template_takes_tools_when_it_reads_them() -> None:
    class Tokenizer:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert not template_takes_tools(Tokenizer())
    Tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}"
    assert template_takes_tools(Tokenizer())


def spec_of(**kw: object) -> object:
    """The constraint of an OpenAI chat body with these fields."""
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": []} | kw)
    return structured_outputs(request, request.response_format)


def test_request_bodies_name_at_most_one_constraint() -> None:
    assert spec_of() is None and spec_of(response_format={"type": "text"}) is None
    spec = spec_of(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}})
    assert spec.json == {"type": "object"} and spec.strict  # type: ignore[attr-defined]
    assert not spec_of(guided_json={"type": "object"}).strict  # type: ignore[attr-defined]
    assert spec_of(guided_choice=["a", "b"]).choice == ["a", "b"]  # type: ignore[attr-defined]
    with pytest.raises(ApiError, match="at most one"):
        spec_of(guided_regex="a", response_format={"type": "json_object"})
    with pytest.raises(ApiError, match="json_schema.schema"):
        spec_of(response_format={"type": "json_schema"})
