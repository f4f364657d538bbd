"""Typed wrappers of the fused decode operations in `ops.c` (fp32 and bf16 tensors).

Callers check `available()` first; the model's PyTorch path is the fallback and the reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from kvstack.kernels import build

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def available(dtype: torch.dtype) -> bool:
    return dtype in _SUFFIX and build.load() is not None


def _fn(base: str, dtype: torch.dtype) -> Callable[..., Any]:
    lib = build.load()
    assert lib is not None, "check kernels.ops.available() first"
    return getattr(lib, f"{base}_{_SUFFIX[dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, d] contiguous -> w * norm(x); with `residual`, x += residual first (in place)."""
    rows, d = x.shape
    out = torch.empty_like(x)
    _fn("rms_norm", x.dtype)(
        x.data_ptr(), residual.data_ptr() if residual is not None else None, rows, d,
        weight.data_ptr(), eps, out.data_ptr(),
    )
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads (q then k) of each row of qkv [T, W] in place;
    cos, sin: fp32 [T, head_dim]."""
    rows, width = qkv.shape
    _fn("rope", qkv.dtype)(qkv.data_ptr(), rows, width, heads, head_dim, cos.data_ptr(),
                           sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] -> silu(gate) * up, [T, I]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> None:
    """k, v: [T, H_kv, D] views whose rows may be strided (into a fused QKV row), inner dims
    contiguous; slots: int64 [T] -> written into the caches [slots, H_kv, D] in place."""
    rows, kv_heads, dim = k.shape
    assert k.stride(1) == dim and k.stride(2) == 1 and v.stride() == k.stride()
    _fn("store_kv", k.dtype)(k.data_ptr(), v.data_ptr(), rows, k.stride(0), slots.data_ptr(),
                             k_cache.data_ptr(), v_cache.data_ptr(), kv_heads * dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D] contiguous; k_cache, v_cache: [slots, H_kv, D] of q's dtype, or bfloat16
    under float32 queries (`cache_readable`); slots: int64 [B, max_ctx]; lens: int64 [B] ->
    out [B, H, D]."""
    seqs, heads, dim = q.shape
    out = torch.empty_like(q)
    fn = (_bf16_cache_fn() if k_cache.dtype != q.dtype else _fn("decode_attention", q.dtype))
    assert cache_readable(q.dtype, k_cache.dtype) and v_cache.dtype == k_cache.dtype
    rc = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lens.data_ptr(),
        seqs, slots.shape[1], heads, k_cache.shape[1], dim, scale, out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc:
        raise MemoryError("decode attention: no memory for its per-chunk partial results")
    return out


def cache_readable(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """`decode_attention` reads a plain cache of `cache_dtype` under queries of `dtype`."""
    return cache_dtype == dtype or (dtype, cache_dtype) == (torch.float32, torch.bfloat16)


def _bf16_cache_fn() -> Callable[..., Any]:
    """`decode_attention_bf16kv_f32` (fp32 queries over a bfloat16 cache), bound here: its
    arguments are `decode_attention`'s."""
    lib = build.load()
    assert lib is not None, "check kernels.ops.available() first"
    fn = lib.decode_attention_bf16kv_f32
    if fn.argtypes is None:
        fn.argtypes, fn.restype = lib.decode_attention_f32.argtypes, ctypes.c_int
    return fn


def store_kv_quant(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                   kv_scale: torch.Tensor, rotate: bool) -> None:
    """Quantize k, v [T, H_kv, D] (rows may be strided, inner dims contiguous) into their slots
    of a quantized cache: kv [slots, 2, H_kv, D] int8 or float8_e4m3fn codes, kv_scale [slots,
    2, H_kv] float16 (`kv/storage/quantized.py`'s scheme; `rotate`: in the Hadamard basis)."""
    rows, kv_heads, dim = k.shape
    assert k.stride()[1:] == (dim, 1) and v.stride()[1:] == (dim, 1)
    slots = slots.to(torch.int64).contiguous()
    _fn("store_kv_quant", k.dtype)(
        k.data_ptr(), v.data_ptr(), rows, k.stride(0), v.stride(0), slots.data_ptr(),
        kv.data_ptr(), kv_scale.data_ptr(), int(kv.dtype != torch.int8), int(rotate), kv_heads,
        dim)


def decode_attention_quant(q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor,
                           rotate: bool, slots: torch.Tensor, lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """`decode_attention` over a quantized cache (kv, kv_scale as in `store_kv_quant`): q and
    the output in the model's basis (the kernel turns them into and out of the cache's)."""
    seqs, heads, dim = q.shape
    out = torch.empty_like(q)
    rc = _fn("decode_attention_quant", q.dtype)(
        q.data_ptr(), kv.data_ptr(), kv_scale.data_ptr(), int(kv.dtype != torch.int8),
        int(rotate), slots.data_ptr(), lens.data_ptr(), seqs, slots.shape[1], heads,
        kv.shape[2], dim, scale, out.data_ptr(), torch.get_num_threads(),
    )
    if rc:
        raise MemoryError("decode attention: no memory for its per-chunk partial results")
    return out
