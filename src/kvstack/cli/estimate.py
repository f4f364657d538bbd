"""`kvstack estimate`: KV-cache bytes of a shape or a model, and what fits in a budget.

The budget rows use the engine's own sizing (`KVShape.num_blocks_for_budget`), so they say
what `--kv-cache-memory` really holds, whole blocks included.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstack.cli import DEFAULT_MODEL, byte_size, positive_int
from kvstack.config import DTYPE_BYTES, CacheConfig
from kvstack.errors import InvalidRequestError
from kvstack.estimate import KVShape, format_bytes
from kvstack.weights import load_checkpoint

_SHAPE_FLAGS = ("layers", "kv_heads", "head_dim")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "estimate",
        help="KV-cache memory of a model or a shape, and what fits in a budget",
        description="KV-cache bytes per token and per batch, from --model's config or from "
        "--layers/--kv-heads/--head-dim; with --kv-cache-memory, the tokens and sequences "
        "that fit.",
        epilog=f"example: kvstack estimate --layers 32 --kv-heads 8 --head-dim 128 "
        f"--seq-len 4096 --dtype float16   (or: --model {DEFAULT_MODEL})",
    )
    shape = parser.add_argument_group("shape (instead of --model)")
    shape.add_argument("--layers", type=positive_int, metavar="N", help="decoder layers")
    shape.add_argument("--kv-heads", type=positive_int, metavar="N",
                       help="key/value heads per layer (fewer than query heads under GQA)")
    shape.add_argument("--head-dim", type=positive_int, metavar="N", help="size of one head")
    parser.add_argument("--model", metavar="NAME",
                        help="read the shape from this model's config (e.g. smollm2-135m)")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPE_BYTES),
                        help="KV element type")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens per sequence (default: the model's context length)")
    parser.add_argument("--batch", type=positive_int, default=1, metavar="N",
                        help="sequences at once")
    parser.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                        help="a KV budget, e.g. 1GiB: report the tokens and sequences that fit")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                        help="tokens per KV block (a power of two)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    given = [name for name in _SHAPE_FLAGS if getattr(args, name) is not None]
    if args.model is not None and given:
        raise InvalidRequestError("give either --model or --layers/--kv-heads/--head-dim, not both")
    if args.kv_cache_memory is not None:
        # The engine's own check (block size a power of two) before any arithmetic.
        CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory)
    rows: list[tuple[str, str]] = []
    if args.model is not None:
        config = load_checkpoint(args.model).config
        shape = KVShape.of(config, args.dtype)
        seq_len = args.seq_len or config.max_model_len
        rows.append(("model", f"{args.model} ({config.architecture})"))
    elif len(given) == len(_SHAPE_FLAGS):
        shape = KVShape(args.layers, args.kv_heads, args.head_dim, args.dtype)
        if args.seq_len is None:
            raise InvalidRequestError("give --seq-len, the tokens per sequence")
        seq_len = args.seq_len
    else:
        raise InvalidRequestError("give --model NAME, or all of --layers, --kv-heads, --head-dim")
    rows += [
        ("shape", f"{shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                  f"{shape.head_dim} head dim, {shape.dtype}"),
        ("per token", _bytes(shape.bytes_per_token)),
        (f"{seq_len} tokens x {args.batch} seqs", _bytes(shape.bytes_for(seq_len, args.batch))),
    ]
    if args.kv_cache_memory is not None:
        budget, block = args.kv_cache_memory, args.block_size
        blocks = shape.num_blocks_for_budget(budget, block)
        rows += [
            ("budget", f"{format_bytes(budget)} = {blocks} blocks of {block} tokens"),
            ("max tokens", f"{shape.max_tokens_for_budget(budget, block):,}"),
            (f"max seqs of {seq_len} tokens",
             f"{shape.max_sequences_for_budget(budget, block, seq_len):,}"),
        ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def _bytes(n: int) -> str:
    return f"{format_bytes(n)} ({n:,} B)"
