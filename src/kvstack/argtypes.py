"""argparse value types shared by every command line (`cli/`, the evaluations): a bad value
becomes an argparse usage error, one line and exit 2. Imports nothing heavy."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from kvstack.config import EMBEDDED_MODEL, DraftConfig
from kvstack.errors import KvstackError
from kvstack.units import parse_size

DEFAULT_MODEL = EMBEDDED_MODEL


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def speculative_config(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON object, checked as `DraftConfig` checks it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as "
                                         f"'{{\"method\": \"suffix\"}}', got {text!r}")
    try:
        DraftConfig.from_speculative_config(value)
    except KvstackError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def name_list(choices: Sequence[str], noun: str) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of names, each one of `choices`."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {noun} {', '.join(unknown) or text!r}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def byte_size(text: str) -> int:
    try:
        return parse_size(text)
    except KvstackError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
