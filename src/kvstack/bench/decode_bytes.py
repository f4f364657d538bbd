"""What one decode step reads from memory, per part: the layers' weights, the vocabulary head,
and the cached K/V its attention reads (full-attention layers: the whole context; sliding
layers: their window), for our engine and for llama.cpp on the same GGUF file.

The embedding lookup reads one row (negligible) and the norms a few KiB; both are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.kv.dtypes import layer_block_bytes

# llama.cpp's default KV cache type (f16 K and V) in our dtype names
LLAMACPP_KV_DTYPE = "float16"


def kv_read_bytes(windows: Sequence[int | None], kv_heads: int, head_dim: int, dtype: str,
                  context: int) -> int:
    """K/V bytes one decode step reads at `context` positions: per layer min(context, window)
    positions (window None: all), scales included for int8 / fp8."""
    block = 16
    per_token = layer_block_bytes(dtype, kv_heads, head_dim, block) / block
    return round(sum(min(context, w or context) for w in windows) * per_token)


def parts(weights: int, head: int, kv: int) -> dict[str, int]:
    return {"weights": weights, "head": head, "kv": kv, "total": weights + head + kv}


def ours(model: Any, windows: Sequence[int | None], kv_heads: int, head_dim: int,
         kv_dtype: str, context: int) -> dict[str, int]:
    """Our engine's bytes per step: the head as held, the other weights (the total less the
    head and any separate embedding table), the K/V in the engine's KV dtype."""
    head = int(model.lm_head.num_bytes)
    embed = getattr(model, "embed", None)
    embed_bytes = 0
    if embed is not None and embed is not model.lm_head and embed is not getattr(
            model.lm_head, "weight", None):
        embed_bytes = int(getattr(embed, "num_bytes", 0)
                          or embed.numel() * embed.element_size())
    weights = int(model.num_weight_bytes) - head - embed_bytes
    return parts(weights, head, kv_read_bytes(windows, kv_heads, head_dim, kv_dtype, context))


def gguf_head_and_weights(path: Path) -> tuple[int, int]:
    """(head, other weights) bytes of a GGUF file: the head is `output.weight`, or the tied
    `token_embd.weight`; the others exclude a separate embedding table."""
    import gguf

    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    head_name = "output.weight" if "output.weight" in sizes else "token_embd.weight"
    head = sizes[head_name]
    skip = {head_name, "token_embd.weight"}
    return head, sum(n for name, n in sizes.items() if name not in skip)


def llamacpp(path: Path, windows: Sequence[int | None], kv_heads: int, head_dim: int,
             context: int) -> dict[str, int]:
    """llama.cpp's bytes per step on the file: its tensors as stored, an f16 KV cache."""
    head, weights = gguf_head_and_weights(path)
    return parts(weights, head,
                 kv_read_bytes(windows, kv_heads, head_dim, LLAMACPP_KV_DTYPE, context))
