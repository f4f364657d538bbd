"""Where a long-context decode step's time goes, part by part, each timed alone (best of a few
calls on this run's threads): the vocabulary head's product on one row, and one attention
call per layer over a cache of the engine's KV dtype at the layer's positions (the context,
or a sliding layer's window), on random K/V in blocks of 16 slots scattered over the cache.
The rest of a step (the layers' products, norms, RoPE, the Python around the step) is the
measured step time less these.

Timed alone, a part finds some of its bytes still in the caches from its previous call, so
its figure is a lower bound on its time inside a step (where the other parts evict them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstack.kernels import ops as kernel_ops

_CALLS = 5
_BLOCK = 16


def best_seconds(fn: Callable[[], object], calls: int = _CALLS) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def head_seconds(model: Any, hidden_size: int) -> float:
    """One row through the vocabulary head (`compute_logits`)."""
    h = torch.randn(1, hidden_size)
    return best_seconds(lambda: model.compute_logits(h))


def attention_seconds(kv_dtype: str, positions: int, heads: int, kv_heads: int,
                      head_dim: int, seed: int = 0) -> float | None:
    """One decode attention call (the C kernel the engine runs) over `positions` cached
    positions of `kv_dtype`; None where no kernel reads that dtype under float32 queries."""
    if positions <= 0 or not kernel_ops.available(torch.float32):
        return None
    g = torch.Generator().manual_seed(seed)
    blocks = -(-positions // _BLOCK) + 1
    order = torch.randperm(blocks, generator=g)
    slots = (order[:, None] * _BLOCK + torch.arange(_BLOCK)).reshape(1, -1)[:, :positions]
    slots, lens = slots.contiguous(), torch.tensor([positions], dtype=torch.int64)
    q = torch.randn(1, heads, head_dim, generator=g)
    shape = (blocks * _BLOCK, kv_heads, head_dim)
    scale = head_dim**-0.5
    if kv_dtype in ("float32", "bfloat16"):
        dtype = getattr(torch, kv_dtype)
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        return best_seconds(lambda: kernel_ops.decode_attention(q, k, v, slots, lens, scale))
    if kv_dtype in ("int8", "fp8"):
        codes = torch.randint(-100, 100, (blocks * _BLOCK, 2, kv_heads, head_dim),
                              dtype=torch.int8, generator=g)
        kv = codes if kv_dtype == "int8" else (codes.float() / 32).to(torch.float8_e4m3fn)
        scales = torch.full((blocks * _BLOCK, 2, kv_heads), 0.01, dtype=torch.float16)
        rotate = head_dim & (head_dim - 1) == 0
        return best_seconds(lambda: kernel_ops.decode_attention_quant(
            q, kv, scales, rotate, slots, lens, scale))
    return None


def step_parts(model: Any, kv_dtype: str, windows: Sequence[int | None], context: int,
               heads: int, kv_heads: int, head_dim: int, hidden_size: int,
               step_seconds: float | None) -> dict[str, float | None]:
    """Seconds per step: the head, attention over all layers (each distinct window once,
    times its layers), and the rest of the measured step."""
    head = head_seconds(model, hidden_size)
    attention: float | None = 0.0
    for window in sorted(set(windows), key=lambda w: w or 0):
        count = sum(1 for w in windows if w == window)
        one = attention_seconds(kv_dtype, min(context, window or context), heads, kv_heads,
                                head_dim)
        attention = None if one is None or attention is None else attention + count * one
    rest = (step_seconds - head - attention
            if step_seconds is not None and attention is not None else None)
    return {"head": head, "attention": attention, "rest": rest, "step": step_seconds}
