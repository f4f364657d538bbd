"""`kvstack eval ppl`: what each weight format costs in quality.

For each format (fp32 through PyTorch ops only, i.e. the reference path; fp32, bf16 and int8
weights through the engine's fast path; gguf: a GGUF file's own quantized blocks, GGUF models
only; llama.cpp: the same GGUF file run by llama.cpp, where llama-cpp-python is installed) it
measures perplexity on a held-out text (Python's own documentation) and greedy agreement with
the reference over a fixed chat prompt set, and prints one table (JSON with `--out`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from typing import Any

from kvstack.argtypes import name_list
from kvstack.errors import InvalidRequestError
from kvstack.eval.quality import (
    SCORE_HEADER,
    AgainstReference,
    Scores,
    add_eval_args,
    agreement_prompt_ids,
    heldout_token_ids,
    score_columns,
    write_eval_json,
)

# name -> LLM keyword arguments; the first is the reference the others are compared with.
FORMATS: dict[str, dict[str, Any]] = {
    "float32-reference": {"dtype": "float32", "kernels": "torch"},
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
}
LLAMA_CPP = "llama.cpp"  # not our engine: scored by `eval/llamacpp.py`, never the reference


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
        "bfloat16, int8, gguf: a GGUF file's own blocks; llama.cpp: the same file run by "
        "llama.cpp, where llama-cpp-python is installed).",
        epilog="example: kvstack eval ppl --tokens 2048 --formats float32-reference,int8",
    )
    add_eval_args(parser)
    names = (*FORMATS, LLAMA_CPP)
    parser.add_argument("--formats", type=name_list(names, "format"),
                        default=list(names), metavar="LIST",
                        help=f"comma-separated, first is the reference (default: "
                        f"{','.join(names)})")
    parser.set_defaults(run=run)
    return parser


def evaluate(args: argparse.Namespace) -> list[FormatRow]:
    from kvstack.engine.llm import LLM
    from kvstack.weights import is_gguf_model

    if args.formats[0] == LLAMA_CPP:
        raise InvalidRequestError("llama.cpp cannot be the reference: list one of ours first, "
                                  "e.g. --formats float32-reference,llama.cpp")
    scorer = AgainstReference(args.tokens, args.window, args.agreement_tokens)
    rows = []
    gguf = is_gguf_model(args.model)
    for name in args.formats:
        if name == LLAMA_CPP:
            row = _llamacpp_row(args, scorer)
            if row is not None:
                rows.append(row)
            continue
        if name == "gguf" and not gguf:
            print(f"gguf: skipped, {args.model} is not a GGUF file", file=sys.stderr)
            continue
        with LLM(model=args.model, kv_cache_memory="512MiB", num_threads=args.threads,
                 **FORMATS[name]) as llm:
            rows.append(FormatRow(name, llm.info.num_weight_bytes, scorer.score(llm)))
    return rows


def _llamacpp_row(args: argparse.Namespace, scorer: AgainstReference,
                  llama: Any = None) -> FormatRow | None:
    """llama.cpp on the model's GGUF file, scored on the reference's token ids; None (with a
    notice) where it cannot run. `llama`: the `Llama` class (llama_cpp's by default)."""
    from kvstack.eval.llamacpp import LlamaCppScorer, unavailable_reason

    reason = unavailable_reason(args.model) if llama is None else None
    if reason is not None:
        print(f"{LLAMA_CPP}: skipped, {reason}", file=sys.stderr)
        return None
    text = heldout_token_ids(scorer.tokenizer, args.tokens)
    prompts = agreement_prompt_ids(scorer.tokenizer)
    n_ctx = max(args.window, max(len(p) for p in prompts) + args.agreement_tokens)
    peer = LlamaCppScorer(args.model, n_ctx, args.threads, llama=llama)
    scores = scorer.compare(peer.perplexity(text, args.window),
                            peer.greedy(prompts, args.agreement_tokens))
    return FormatRow(LLAMA_CPP, peer.num_weight_bytes, scores)


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
