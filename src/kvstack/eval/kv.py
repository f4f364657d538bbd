"""`kvstack eval kv`: what each KV cache setting costs in quality, and what it saves in memory.

For each setting (the float32 cache as reference; bfloat16, int8, fp8, int4 K/V; the
APPROXIMATE sliding-window mode) it measures perplexity on a held-out text (Python's own
documentation, `kvstack.eval.quality`) prefilled in chunks, so every chunk attends to the earlier
ones through the cache as stored, and greedy agreement with the reference over a fixed chat
prompt set; beside them the KV bytes per token the engine allocates and the tokens a 1 GiB
budget holds. One table is printed; `--out` writes it as JSON.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvstack.argtypes import name_list, non_negative_int, positive_int
from kvstack.eval.quality import (
    SCORE_HEADER,
    AgainstReference,
    Scores,
    add_eval_args,
    score_columns,
    write_eval_json,
)

SETTINGS = ("float32", "bfloat16", "int8", "fp8", "int4", "window", "window-int8",
            "window-int4")
GIB = 1024**3


@dataclass(frozen=True)
class KVRow:
    setting: str
    kv_cache_dtype: str
    kv_window: int | None
    bytes_per_token: float  # allocated, scales included (window mode: while the window fills)
    tokens_per_gib: int  # tokens a 1 GiB pool holds
    scores: Scores


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "kv",
        help="KV cache dtypes and window mode: perplexity, greedy agreement, bytes per token",
        description="Perplexity on held-out text (pydoc_data.topics, prefilled in chunks that "
        "read the cache back) and greedy agreement with the float32 cache, for each KV cache "
        "dtype (bfloat16, int8, fp8, int4) and the approximate sliding-window mode, with the "
        "KV bytes per token each allocates.",
        epilog="example: kvstack eval kv --tokens 2048 --settings float32,int8,window "
        "--out kv.json",
    )
    add_eval_args(parser)
    parser.add_argument("--settings", type=name_list(SETTINGS, "setting"),
                        default=list(SETTINGS), metavar="LIST",
                        help=f"comma-separated, the first is the reference (default: "
                        f"{','.join(SETTINGS)})")
    parser.add_argument("--chunk", type=positive_int, default=256, metavar="N",
                        help="prefill chunk (max_num_batched_tokens): later chunks read the "
                        "earlier ones from the cache")
    parser.add_argument("--kv-window", type=positive_int, default=256, metavar="N",
                        help="tokens attended in the window settings (sinks included)")
    parser.add_argument("--kv-sink-tokens", type=non_negative_int, default=4, metavar="N",
                        help="sink tokens of the window settings")
    parser.set_defaults(run=run)
    return parser


def setting_kwargs(name: str, kv_window: int, sinks: int) -> dict[str, Any]:
    """`LLM` keyword arguments of a setting."""
    kv_dtype = {"float32": "auto", "window": "auto"}.get(name, name.removeprefix("window-"))
    kwargs: dict[str, Any] = {"kv_cache_dtype": kv_dtype}
    if name.startswith("window"):
        kwargs |= {"kv_window": kv_window, "kv_sink_tokens": sinks}
    return kwargs


def evaluate(args: argparse.Namespace) -> list[KVRow]:
    from kvstack.engine.llm import LLM

    scorer = AgainstReference(args.tokens, args.window, args.agreement_tokens)
    rows: list[KVRow] = []
    for name in args.settings:
        kwargs = setting_kwargs(name, args.kv_window, args.kv_sink_tokens)
        with LLM(model=args.model, kv_cache_memory="512MiB", num_threads=args.threads,
                 max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                 **kwargs) as llm:
            scores = scorer.score(llm)
            info = llm.info
            # Bytes as the pool holds them while the window fills (the window's own bound
            # is the row's kv_window).
            assert info.kv_shape is not None  # the paged KV cache is on
            shape = replace(info.kv_shape, window=None)
            rows.append(KVRow(name, info.kv_cache_dtype, kwargs.get("kv_window"),
                              shape.bytes_per_token, shape.max_tokens_for_budget(GIB), scores))
    return rows


def run(args: argparse.Namespace) -> int:
    from kvstack.config import CacheConfig

    if any(name.startswith("window") for name in args.settings):  # fail before any model run
        CacheConfig(kv_window=args.kv_window, kv_sink_tokens=args.kv_sink_tokens)
    rows = evaluate(args)
    print(f"held-out text: {args.tokens} tokens of pydoc_data.topics in windows of "
          f"{args.window}, prefilled {args.chunk} tokens a step; greedy agreement: "
          f"{rows[0].scores.num_prompts} chat prompts x {args.agreement_tokens} tokens vs "
          f"{rows[0].setting}; window settings attend {args.kv_sink_tokens} sink + "
          f"{args.kv_window - args.kv_sink_tokens} recent tokens (approximate)")
    print(f"{'setting':<12} {'KV/token':>9} {'tokens/GiB':>10} {SCORE_HEADER}")
    for r in rows:
        print(f"{r.setting:<12} {r.bytes_per_token / 1024:6.2f}KiB {r.tokens_per_gib:>10,} "
              f"{score_columns(r.scores)}")
    write_eval_json(args.out, {
        "eval": "kv", "model": args.model, "tokens": args.tokens, "window": args.window,
        "chunk": args.chunk, "agreement_tokens": args.agreement_tokens,
        "kv_window": args.kv_window, "kv_sink_tokens": args.kv_sink_tokens,
        "rows": [{k: v for k, v in asdict(r).items() if k != "scores"} | asdict(r.scores)
                 for r in rows],
    })
    return 0
