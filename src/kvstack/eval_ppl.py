"""`kvstack eval ppl`: what each weight format costs in quality.

For each format (fp32 through PyTorch ops only, i.e. the reference path; fp32, bf16 and int8
weights through the engine's fast path) it measures perplexity on a held-out text (Python's
own documentation) and greedy agreement with the reference over a fixed chat prompt set, and
prints one table (JSON with `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.cli import DEFAULT_MODEL, name_list, positive_int

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
    perplexity: float
    perplexity_change: float  # relative to the reference, e.g. 0.002 = +0.2%
    token_agreement: float
    exact_prompts: int
    num_prompts: int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "ppl",
        help="weight formats: perplexity and greedy agreement with the fp32 reference",
        description="Perplexity on held-out text (pydoc_data.topics) and greedy agreement with "
        "the fp32 reference path, for each weight format (float32-reference, float32, "
        "bfloat16, int8).",
        epilog="example: kvstack eval ppl --tokens 2048 --formats float32-reference,int8",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the embedded model's name, a .gguf file or a Hugging Face folder")
    parser.add_argument("--formats", type=name_list(tuple(FORMATS), "format"),
                        default=list(FORMATS), metavar="LIST",
                        help=f"comma-separated, first is the reference (default: "
                        f"{','.join(FORMATS)})")
    parser.add_argument("--tokens", type=positive_int, default=4096, metavar="N",
                        help="held-out tokens scored")
    parser.add_argument("--window", type=positive_int, default=1024, metavar="N",
                        help="tokens per scored window (each window is one prompt)")
    parser.add_argument("--agreement-tokens", type=positive_int, default=64, metavar="N",
                        help="greedy tokens generated per agreement prompt")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="also write the table as JSON here")
    parser.set_defaults(run=run)
    return parser


def evaluate(model: str, formats: list[str], num_tokens: int, window: int,
             agreement_tokens: int, threads: int | None = None) -> list[FormatRow]:
    from kvstack.llm import LLM
    from kvstack.quality import greedy_agreement, greedy_outputs, heldout_token_ids, perplexity

    rows: list[FormatRow] = []
    reference: tuple[float, list[list[int]]] | None = None
    for name in formats:
        llm = LLM(model=model, kv_cache_memory="512MiB", num_threads=threads, **FORMATS[name])
        ids = heldout_token_ids(llm.get_tokenizer(), num_tokens)
        ppl = perplexity(llm, ids, window=window).perplexity
        outputs = greedy_outputs(llm, max_tokens=agreement_tokens)
        if reference is None:
            reference = (ppl, outputs)
        agreement = greedy_agreement(reference[1], outputs)
        rows.append(FormatRow(name, llm.engine.model.num_weight_bytes, ppl,
                              ppl / reference[0] - 1, agreement.token_agreement,
                              agreement.exact_matches, agreement.num_prompts))
        llm.close()
    return rows


def run(args: argparse.Namespace) -> int:
    rows = evaluate(args.model, args.formats, args.tokens, args.window, args.agreement_tokens,
                    args.threads)
    print(f"held-out text: {args.tokens} tokens of pydoc_data.topics in windows of "
          f"{args.window}; greedy agreement: {rows[0].num_prompts} chat prompts x "
          f"{args.agreement_tokens} tokens vs {rows[0].name}")
    print(f"{'format':<18} {'weights':>9} {'perplexity':>10} {'change':>8} "
          f"{'agreement':>9} {'identical':>9}")
    for r in rows:
        print(f"{r.name:<18} {r.weight_bytes / 2**20:7.0f}MiB {r.perplexity:10.4f} "
              f"{100 * r.perplexity_change:+7.2f}% {100 * r.token_agreement:8.1f}% "
              f"{r.exact_prompts:>5}/{r.num_prompts}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"eval": "ppl", "model": args.model, "tokens": args.tokens,
                   "window": args.window, "agreement_tokens": args.agreement_tokens,
                   "load_average": os.getloadavg()[0],
                   "rows": [r.__dict__ for r in rows]}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0
