"""`kvstack eval ppl`: what each weight format costs in quality.

For each format (fp32 through PyTorch ops only, i.e. the reference path; fp32, bf16 and int8
weights through the engine's fast path) it measures perplexity on a held-out text (Python's
own documentation) and greedy agreement with the reference over a fixed chat prompt set, and
prints one table (JSON with `--out`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from kvstack.argtypes import name_list
from kvstack.eval.quality import (
    SCORE_HEADER,
    AgainstReference,
    Scores,
    add_eval_args,
    score_columns,
    write_eval_json,
)

# name -> LLM keyword arguments; the first is the reference the others are compared with.
FORMATS: dict[str, dict[str, Any]] = {
    "float32-reference": {"dtype": "float32", "kernels": "torch"},
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
}


@dataclass(frozen=True)
class FormatRow:
    name: str
    weight_bytes: int
    scores: Scores


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "ppl",
        help="weight formats: perplexity and greedy agreement with the fp32 reference",
        description="Perplexity on held-out text (pydoc_data.topics) and greedy agreement with "
        "the fp32 reference path, for each weight format (float32-reference, float32, "
        "bfloat16, int8).",
        epilog="example: kvstack eval ppl --tokens 2048 --formats float32-reference,int8",
    )
    add_eval_args(parser)
    parser.add_argument("--formats", type=name_list(tuple(FORMATS), "format"),
                        default=list(FORMATS), metavar="LIST",
                        help=f"comma-separated, first is the reference (default: "
                        f"{','.join(FORMATS)})")
    parser.set_defaults(run=run)
    return parser


def evaluate(args: argparse.Namespace) -> list[FormatRow]:
    from kvstack.engine.llm import LLM

    scorer = AgainstReference(args.tokens, args.window, args.agreement_tokens)
    rows = []
    for name in args.formats:
        with LLM(model=args.model, kv_cache_memory="512MiB", num_threads=args.threads,
                 **FORMATS[name]) as llm:
            rows.append(FormatRow(name, llm.info.num_weight_bytes, scorer.score(llm)))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = evaluate(args)
    print(f"held-out text: {args.tokens} tokens of pydoc_data.topics in windows of "
          f"{args.window}; greedy agreement: {rows[0].scores.num_prompts} chat prompts x "
          f"{args.agreement_tokens} tokens vs {rows[0].name}")
    print(f"{'format':<18} {'weights':>9} {SCORE_HEADER}")
    for r in rows:
        print(f"{r.name:<18} {r.weight_bytes / 2**20:7.0f}MiB {score_columns(r.scores)}")
    write_eval_json(args.out, {
        "eval": "ppl", "model": args.model, "tokens": args.tokens, "window": args.window,
        "agreement_tokens": args.agreement_tokens,
        "rows": [{"name": r.name, "weight_bytes": r.weight_bytes} | asdict(r.scores)
                 for r in rows],
    })
    return 0
