"""`kvstack eval NAME`: quality evaluations, one sub-command each.

Each module listed in EVALS exposes `add_parser(subparsers)`, which adds its sub-command and
sets `run(args) -> int` as a default; a new evaluation is one more entry here. The modules are
imported to build the parser, so they import heavy libraries only inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

EVALS: tuple[str, ...] = ("kvstack.eval.semantic", "kvstack.eval.ppl", "kvstack.eval.kv",
                          "kvstack.eval.blend")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval",
        help="quality evaluations (semantic cache, KV cache, ...)",
        description="Measure how well a part of kvstack does its job; each evaluation prints "
        "its figures and can write them as JSON.",
        epilog="example: kvstack eval semantic --no-ttft",
    )
    evals = parser.add_subparsers(title="evaluations", metavar="EVAL", dest="eval",
                                  required=True)
    for name in EVALS:
        importlib.import_module(name).add_parser(evals)
    return parser
