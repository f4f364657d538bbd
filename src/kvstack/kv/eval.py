"""`kvstack eval kv`: what each KV cache setting costs in quality, and what it saves in memory.

For each setting (the float32 cache as reference; bfloat16, int8, fp8, int4 K/V; the
APPROXIMATE sliding-window mode) it measures perplexity on a held-out text (Python's own
documentation, `kvstack.quality`) prefilled in chunks, so every chunk attends to the earlier
ones through the cache as stored, and greedy agreement with the reference over a fixed chat
prompt set; beside them the KV bytes per token the engine allocates and the tokens a 1 GiB
budget holds. One table is printed; `--out` writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstack.cli import DEFAULT_MODEL, name_list, non_negative_int, positive_int

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
    perplexity: float
    perplexity_change: float  # relative to the first setting, e.g. 0.002 = +0.2%
    token_agreement: float
    exact_prompts: int
    num_prompts: int


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
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the embedded model's name, a .gguf file or a Hugging Face folder")
    parser.add_argument("--settings", type=name_list(SETTINGS, "setting"),
                        default=list(SETTINGS), metavar="LIST",
                        help=f"comma-separated, the first is the reference (default: "
                        f"{','.join(SETTINGS)})")
    parser.add_argument("--tokens", type=positive_int, default=4096, metavar="N",
                        help="held-out tokens scored")
    parser.add_argument("--window", type=positive_int, default=1024, metavar="N",
                        help="tokens per scored window (each window is one prompt)")
    parser.add_argument("--chunk", type=positive_int, default=256, metavar="N",
                        help="prefill chunk (max_num_batched_tokens): later chunks read the "
                        "earlier ones from the cache")
    parser.add_argument("--agreement-tokens", type=positive_int, default=64, metavar="N",
                        help="greedy tokens generated per agreement prompt")
    parser.add_argument("--kv-window", type=positive_int, default=256, metavar="N",
                        help="tokens attended in the window settings (sinks included)")
    parser.add_argument("--kv-sink-tokens", type=non_negative_int, default=4, metavar="N",
                        help="sink tokens of the window settings")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="also write the table as JSON here")
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
    from kvstack.estimate import KVShape
    from kvstack.llm import LLM
    from kvstack.quality import greedy_agreement, greedy_outputs, heldout_token_ids, perplexity

    rows: list[KVRow] = []
    reference: tuple[float, list[list[int]]] | None = None
    for name in args.settings:
        kwargs = setting_kwargs(name, args.kv_window, args.kv_sink_tokens)
        llm = LLM(model=args.model, kv_cache_memory="512MiB", num_threads=args.threads,
                  max_num_batched_tokens=args.chunk, enable_prefix_caching=False, **kwargs)
        ids = heldout_token_ids(llm.get_tokenizer(), args.tokens)
        ppl = perplexity(llm, ids, window=args.window).perplexity
        outputs = greedy_outputs(llm, max_tokens=args.agreement_tokens)
        if reference is None:
            reference = (ppl, outputs)
        agreement = greedy_agreement(reference[1], outputs)
        engine = llm.engine
        shape = KVShape.of(engine.model_config, engine.kv_cache_dtype,
                           block_size=engine.config.cache.block_size,
                           model_dtype=engine.config.dtype)
        rows.append(KVRow(
            name, engine.kv_cache_dtype, kwargs.get("kv_window"), shape.bytes_per_token,
            shape.max_tokens_for_budget(GIB), ppl, ppl / reference[0] - 1,
            agreement.token_agreement, agreement.exact_matches, agreement.num_prompts,
        ))
        llm.close()
    return rows


def run(args: argparse.Namespace) -> int:
    from kvstack.config import CacheConfig

    if any(name.startswith("window") for name in args.settings):  # fail before any model run
        CacheConfig(kv_window=args.kv_window, kv_sink_tokens=args.kv_sink_tokens)
    rows = evaluate(args)
    print(f"held-out text: {args.tokens} tokens of pydoc_data.topics in windows of "
          f"{args.window}, prefilled {args.chunk} tokens a step; greedy agreement: "
          f"{rows[0].num_prompts} chat prompts x {args.agreement_tokens} tokens vs "
          f"{rows[0].setting}; window settings attend {args.kv_sink_tokens} sink + "
          f"{args.kv_window - args.kv_sink_tokens} recent tokens (approximate)")
    print(f"{'setting':<12} {'KV/token':>9} {'tokens/GiB':>10} {'perplexity':>10} "
          f"{'change':>8} {'agreement':>9} {'identical':>9}")
    for r in rows:
        print(f"{r.setting:<12} {r.bytes_per_token / 1024:6.2f}KiB {r.tokens_per_gib:>10,} "
              f"{r.perplexity:10.4f} {100 * r.perplexity_change:+7.2f}% "
              f"{100 * r.token_agreement:8.1f}% {r.exact_prompts:>5}/{r.num_prompts}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"eval": "kv", "model": args.model, "tokens": args.tokens,
                   "window": args.window, "chunk": args.chunk,
                   "agreement_tokens": args.agreement_tokens, "kv_window": args.kv_window,
                   "kv_sink_tokens": args.kv_sink_tokens,
                   "load_average": os.getloadavg()[0], "rows": [asdict(r) for r in rows]}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0
