"""`kvstack estimate`: KV-cache bytes of a shape or a model, and what fits in a budget.

Bytes are the engine's own arithmetic (`KVShape`, `kv/dtypes.py`): quantized dtypes count
their scales, int4 its full-precision window pool, window mode the blocks a sequence keeps, and
the budget rows size the pool exactly as the engine does (`num_blocks_for_budget`), so they
say what `--kv-cache-memory` really holds, whole blocks included.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstack.argtypes import DEFAULT_MODEL, byte_size, non_negative_int, positive_int
from kvstack.config import CacheConfig
from kvstack.errors import InvalidRequestError
from kvstack.kv.dtypes import KV_CACHE_DTYPES, resolve
from kvstack.kv.groups import KVLayout, attention_groups
from kvstack.kv.sizing import KVShape
from kvstack.recurrent.budget import snapshot_every, split_budget
from kvstack.units import format_bytes

_SHAPE_FLAGS = ("layers", "kv_heads", "head_dim")
_SCALES = {
    "int8": "+ a float16 scale per token and KV head",
    "fp8": "e4m3, + a float16 scale per token and KV head",
    "int4": "+ float16 scale/zero per key channel per block and per value token",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "estimate",
        help="KV-cache memory of a model or a shape, and what fits in a budget",
        description="KV-cache bytes per token and per batch, from --model's config or from "
        "--layers/--kv-heads/--head-dim, for any KV dtype (scales included) and window mode; "
        "with --kv-cache-memory, the tokens and sequences that fit.",
        epilog=f"example: kvstack estimate --layers 32 --kv-heads 8 --head-dim 128 "
        f"--seq-len 4096 --dtype float16   (or: --model {DEFAULT_MODEL} --kv-cache-dtype int8 "
        "--kv-cache-memory 1GiB --seq-len 2048)",
    )
    shape = parser.add_argument_group("shape (instead of --model)")
    shape.add_argument("--layers", type=positive_int, metavar="N", help="decoder layers")
    shape.add_argument("--kv-heads", type=positive_int, metavar="N",
                       help="key/value heads per layer (fewer than query heads under GQA, 1 "
                       "under MQA)")
    shape.add_argument("--head-dim", type=positive_int, metavar="N", help="size of one head")
    shape.add_argument("--heads", type=positive_int, metavar="N",
                       help="query heads, to report the GQA/MQA saving (optional)")
    parser.add_argument("--model", metavar="NAME",
                        help="read the shape from this model's config (e.g. gemma3-270m)")
    parser.add_argument("--kv-cache-dtype", "--dtype", dest="kv_dtype", default="auto",
                        choices=KV_CACHE_DTYPES,
                        help="KV element type; auto is --model-dtype")
    parser.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype: what auto means, and int4's window precision")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens per sequence (default: the model's context length)")
    parser.add_argument("--batch", type=positive_int, default=1, metavar="N",
                        help="sequences at once")
    parser.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                        help="a KV budget, e.g. 1GiB: report the tokens and sequences that fit")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                        help="tokens per KV block (a power of two)")
    parser.add_argument("--kv-window", type=positive_int, default=None, metavar="N",
                        help="window mode (approximate): a sequence keeps its sink tokens and "
                        "its N - sinks most recent ones, in every layer")
    parser.add_argument("--kv-sink-tokens", type=non_negative_int, default=4, metavar="N",
                        help="with --kv-window: first tokens kept for ever")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64, metavar="N",
                        help="sequences the engine runs at once (sizes int4's window pool)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    given = [name for name in _SHAPE_FLAGS if getattr(args, name) is not None]
    if args.model is not None and (given or args.heads is not None):
        raise InvalidRequestError("give either --model or --layers/--kv-heads/--head-dim, not both")
    # The engine's own checks (block size a power of two, window vs sinks) before arithmetic.
    CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory or 1,
                kv_window=args.kv_window, kv_sink_tokens=args.kv_sink_tokens)
    kv_dtype = resolve(args.kv_dtype, args.model_dtype)
    options = {"block_size": args.block_size, "model_dtype": args.model_dtype,
               "window": args.kv_window, "sink_tokens": args.kv_sink_tokens}
    rows: list[tuple[str, str]] = []
    num_heads = args.heads
    layout: KVLayout | None = None
    state: tuple[int, int] = (0, 0)
    if args.model is not None:
        config = _load_checkpoint(args.model).config
        state = config.recurrent_state_bytes(4 if args.model_dtype == "float32" else 2)
        if args.kv_window is None:  # the engine's layout (window mode keeps the single one)
            layout = KVLayout.of(config.layer_windows(), kv_dtype)
        shape = KVShape.of(config, kv_dtype, layout, **options)
        seq_len = args.seq_len or config.max_model_len
        num_heads = config.num_heads
        rows.append(("model", f"{args.model} ({config.architecture})"))
    elif len(given) == len(_SHAPE_FLAGS):
        shape = KVShape(args.layers, args.kv_heads, args.head_dim, kv_dtype, **options)
        if args.seq_len is None:
            raise InvalidRequestError("give --seq-len, the tokens per sequence")
        seq_len = args.seq_len
    else:
        raise InvalidRequestError("give --model NAME, or all of --layers, --kv-heads, --head-dim")
    scales = f" ({_SCALES[kv_dtype]})" if kv_dtype in _SCALES else ""
    rows += [
        ("shape", f"{shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                  f"{shape.head_dim} head dim, {kv_dtype}{scales}"),
    ]
    if num_heads is not None:
        rows.append(("attention", _attention_kind(num_heads, shape.num_kv_heads)))
    rows += [
        ("per token", _bytes(shape.bytes_per_token)),
        ("per block", f"{_bytes(shape.bytes_per_block)}, {shape.block_size} tokens"
                      + (f" of a page's {shape.layers_per_block} layers" if shape.page_layers
                         else "")),
    ]
    if shape.window_blocks is not None and shape.window is not None:
        rows.append(("window (approximate)",
                     f"{shape.sink_tokens} sink + {shape.window - shape.sink_tokens} recent "
                     f"tokens attended; a sequence keeps at most {shape.window_blocks} blocks "
                     f"({shape.window_blocks * shape.block_size} tokens) in every layer"))
    rows.append((f"{seq_len} tokens x {args.batch} seqs",
                 _bytes(shape.bytes_for(seq_len, args.batch))))
    if layout is not None and layout.is_hybrid:
        rows += _group_rows(shape, layout, seq_len, args.batch)
    rows += _state_rows(shape, state, seq_len, args.batch)
    if args.kv_cache_memory is not None:
        budget = _split_rows(rows, args.kv_cache_memory, state, args.max_num_seqs)
        rows += _budget_rows(shape, budget, seq_len, args.max_num_seqs)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def _budget_rows(shape: KVShape, budget: int, seq_len: int,
                 max_num_seqs: int) -> list[tuple[str, str]]:
    blocks = shape.num_blocks_for_budget(budget, max_num_seqs=max_num_seqs)
    window = shape.window_pool_bytes(max_num_seqs)
    extra = (f" (after int4's window of {max_num_seqs} full-precision blocks, "
             f"{format_bytes(window)})" if window else "")
    return [
        ("budget", f"{format_bytes(budget)} = {blocks} blocks of {shape.block_size} tokens"
                   f"{extra}"),
        ("max tokens", f"{shape.max_tokens_for_budget(budget, max_num_seqs=max_num_seqs):,}"),
        (f"max seqs of {seq_len} tokens",
         f"{shape.max_sequences_for_budget(budget, None, seq_len, max_num_seqs):,}"),
    ]


def _group_rows(shape: KVShape, layout: KVLayout, seq_len: int,
                batch: int) -> list[tuple[str, str]]:
    """Pages per KV group type of a hybrid layout, as the engine holds them while a sequence
    decodes, and the saving over keeping every layer for every token."""
    page = shape.bytes_per_block
    bs = shape.block_size
    rows: list[tuple[str, str]] = []
    for kind in attention_groups(layout.layer_windows()):
        groups = [g for g in layout.groups if g.window == kind.window]
        blocks = shape.group_blocks(kind.window, seq_len)
        held = page * blocks * len(groups) * batch
        reach = "" if kind.window is None else " (what its window still reaches)"
        rows.append((f"group {kind.name}",
                     f"{len(kind.layers)} layers in {len(groups)} group(s) of <= "
                     f"{layout.page_layers}: {blocks} blocks/group/seq{reach}, "
                     f"{format_bytes(held)}"))
    pages = shape.blocks_for(seq_len)
    all_global = len(layout.groups) * -(-seq_len // bs)
    rows.append(("hybrid saving",
                 f"{pages} pages/seq held vs {all_global} if every layer kept every token: "
                 f"{format_bytes(pages * page * batch)} vs "
                 f"{format_bytes(all_global * page * batch)}, {all_global / pages:.1f}x less "
                 "(exact: a sliding layer never reads what its window left)"))
    return rows


def _split_rows(rows: list[tuple[str, str]], budget: int, state: tuple[int, int],
                max_num_seqs: int) -> int:
    """A hybrid model's budget as the engine splits it (a row); the K/V part."""
    if not state[0]:
        return budget
    split = split_budget(budget, state[1], max_num_seqs)
    rows.append(("recurrent budget",
                 f"{format_bytes(split.live_bytes)} live states ({max_num_seqs} seqs), "
                 f"{format_bytes(split.snapshot_bytes)} snapshots, "
                 f"{format_bytes(split.kv_bytes)} K/V"))
    return split.kv_bytes


def _state_rows(shape: KVShape, state: tuple[int, int], seq_len: int,
                batch: int) -> list[tuple[str, str]]:
    """A hybrid model's linear-attention layers: a fixed state per sequence (and per kept
    snapshot, the same bytes), beside the attention layers' K/V per token."""
    num_linear, nbytes = state
    if not num_linear:
        return []
    every = snapshot_every(nbytes, shape.bytes_per_block, 0)
    kv = shape.bytes_for(seq_len, batch)
    return [
        ("linear layers", f"{num_linear} linear-attention layers keep no K/V (the shape above "
                          f"is the {shape.num_layers} attention layers')"),
        ("state per seq", f"{_bytes(nbytes)}, whatever the length; a prefix-cache snapshot "
                          "is the same bytes"),
        ("snapshots", f"every {every} blocks by default ({every * shape.block_size} tokens: "
                      f"{_bytes(nbytes / (every * shape.block_size))} per cached token at most, "
                      "besides prompt and sequence ends)"),
        (f"{seq_len} tokens x {batch} seqs, all",
         _bytes(kv + nbytes * batch) + " (K/V + live states)"),
    ]


def _attention_kind(num_heads: int, num_kv_heads: int) -> str:
    if num_heads == num_kv_heads:
        return f"MHA, {num_heads} heads"
    kind = "MQA" if num_kv_heads == 1 else "GQA"
    return (f"{kind}, {num_heads} query heads share {num_kv_heads} KV heads "
            f"({num_heads // num_kv_heads}x less KV than MHA)")


def _bytes(n: float) -> str:
    return f"{format_bytes(n)} ({n:,.0f} B)"


def _load_checkpoint(model: str) -> Any:
    from kvstack.weights import load_checkpoint  # torch and the loaders: only when asked

    return load_checkpoint(model)
