"""Writes the CLI and HTTP references at build time (mkdocs-gen-files runs it): the CLI page
from the `kvstack` argparse parser, the HTTP page from the FastAPI app's OpenAPI schema. Nothing
here is written by hand, so the references cannot drift from the code."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from typing import Any

import mkdocs_gen_files

from kvstack.cli.main import build_parser
from kvstack.server.app import openapi_schema

os.environ["COLUMNS"] = "100"  # argparse wraps help text to the terminal's width


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvstack",)
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's parser, depth first, in the order the parser lists them."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def cli_page() -> str:
    lines = ["# CLI reference", "",
             "_Generated from the `kvstack` argparse parser when the site is built: each "
             "command's `--help`, as printed._", ""]
    found = list(commands(build_parser()))
    lines += [f"- [`{' '.join(path)}`](#{'-'.join(path)})" for path, _ in found]
    for path, parser in found:
        lines += ["", f"## `{' '.join(path)}` {{#{'-'.join(path)}}}", "", "```text",
                  parser.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def type_of(prop: dict[str, Any]) -> str:
    """A property's JSON type(s), e.g. `number or null`, `array of string`."""
    if "anyOf" in prop:
        return " or ".join(dict.fromkeys(type_of(p) for p in prop["anyOf"]))
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if prop.get("type") == "array" and "items" in prop:
        return f"array of {type_of(prop['items'])}"
    if "enum" in prop:
        return " / ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    return str(prop.get("type", "any"))


def body_table(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    lines = ["| field | type | default |", "|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        default = "required" if name in required else json.dumps(prop.get("default"))
        lines.append(f"| `{name}` | {type_of(prop).replace('|', '/')} | {default} |")
    return lines


def http_page(schema: dict[str, Any]) -> str:
    lines = ["# HTTP API reference", "",
             f"_Generated from the server's OpenAPI schema ({schema['info']['title']} "
             f"{schema['info']['version']}) when the site is built; the whole schema: "
             "[openapi.json](openapi.json). The pages under Serving say what each field does._",
             "", "| method | path | summary |", "|---|---|---|"]
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            lines.append(f"| {method.upper()} | [`{path}`](#{op['operationId']}) | "
                         f"{op.get('summary', '')} |")
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            lines += ["", f"## {method.upper()} `{path}` {{#{op['operationId']}}}", ""]
            if op.get("description"):
                lines += [op["description"].strip(), ""]
            for param in op.get("parameters", []):
                kind = param.get("schema", {}).get("type", "any")
                need = "required" if param.get("required") else "optional"
                lines.append(f"- `{param['name']}` ({param['in']}, {kind}, {need})")
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                lines += ["", "JSON body:", "", *body_table(body["schema"])]
            codes = ", ".join(sorted(op.get("responses", {})))
            lines += ["", f"Responses: {codes}."]
    return "\n".join(lines) + "\n"


schema = openapi_schema()
with mkdocs_gen_files.open("reference/cli.md", "w") as out:
    out.write(cli_page())
with mkdocs_gen_files.open("reference/http.md", "w") as out:
    out.write(http_page(schema))
with mkdocs_gen_files.open("reference/openapi.json", "w") as out:
    json.dump(schema, out, indent=2)
