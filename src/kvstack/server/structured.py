"""A request's output constraint from its body: OpenAI `response_format`, Anthropic
`output_config.format`, vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, or a tool call's (server/tools.py); at most one per request."""

from __future__ import annotations

from typing import Any

from kvstack.sampling_params import StructuredOutputsParams
from kvstack.server.errors import ApiError
from kvstack.server.protocol import ExtraSampling, ResponseFormat


def structured_outputs(body: ExtraSampling, response_format: ResponseFormat | None = None,
                       json_schema: dict[str, Any] | None = None,
                       tool_constraint: StructuredOutputsParams | None = None,
                       ) -> StructuredOutputsParams | None:
    """The one constraint the body asks for, or None; two at once is a 400. `json_schema`: a
    schema given by the API's own field (Anthropic's output format)."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    if body.guided_json is not None:
        given.append(("guided_json", StructuredOutputsParams(json=body.guided_json,
                                                             strict=False)))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            given.append((name, StructuredOutputsParams(**{kind: value})))
    if response_format is not None and response_format.type != "text":
        given.append(("response_format", _response_format(response_format)))
    if json_schema is not None:
        given.append(("output_config.format", StructuredOutputsParams(json=json_schema)))
    if tool_constraint is not None:
        given.append(("tool_choice", tool_constraint))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ApiError(400, f"give at most one output constraint; this request sets {names}",
                       param=given[1][0])
    return given[0][1] if given else None


def _response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ApiError(400, "response_format json_schema needs json_schema.schema",
                       param="response_format")
    # strict: every keyword is enforced or the schema is refused; otherwise keywords the
    # grammar engine cannot enforce are ignored (the output still follows the rest).
    return StructuredOutputsParams(json=spec.json_schema, strict=bool(spec.strict))
