"""A whole decode step of a Llama-family model in one C call (`decode_step_*` in ops.c).

At one token per sequence per step the per-layer Python (ten kernel calls, views and small
allocations per layer) costs milliseconds per token next to ~10-20 ms of weight streaming; this
hands the C side a table of every layer's weights and cache tensors, built once per KV storage,
and runs all layers for steps where every row is a decode over a plain cache (the model's
dtype) or an int8 / fp8 one (`kv/storage/quantized.py`: codes quantized and read in C).
Weights are dense (`Linear`: fp32, bf16, int8) or a GGUF file's blocks (`GGUFLinear`, run by
`gguf_gemv`, or `gguf_gemv_x8` for blocks repacked 8 rows at a time). The kernels, their order
and their roundings are those of the per-op path, so both give the same numbers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstack.kernels import build
from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import Linear

_KINDS = {"gemv_f32": 0, "gemv_bf16": 1, "gemv_i8": 2, "gemv_q8": 3, "gemv_bf16dp": 4}
_GGUF_KIND = 100  # + the ggml type: GGUF blocks through gguf_gemv (ops.c's GGUF_KIND)
_GGUF_X8_KIND = 200  # + the ggml type: x8-packed GGUF blocks through gguf_gemv_x8
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class LinEntry(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kind", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", LinEntry), ("o", LinEntry), ("gate_up", LinEntry),
                ("down", LinEntry),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kv_scale", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("num_layers", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("kv_kind", ctypes.c_int64), ("rotate", ctypes.c_int64)]


class KVTensors(Protocol):
    """What the step needs of a KV storage (`kv/storage/`)."""

    basis: torch.Tensor | None

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def quantized_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...


@dataclass(frozen=True)
class StepCaches:
    """What the step reads and writes per layer: a plain cache's (K, V) tensors [slots, H_kv,
    D] in the model's dtype, or a quantized one's (codes [slots, 2, H_kv, D], float16 scales
    [slots, 2, H_kv]) with `rotate` when stored in the Hadamard basis."""

    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    quantized: bool = False
    rotate: bool = False

    @classmethod
    def of(cls, storage: KVTensors, num_layers: int, dtype: torch.dtype) -> StepCaches | None:
        """A storage's caches as the step reads them: plain tensors in the model's dtype, or
        int8 / fp8 codes and scales; None for anything else (a cast float cache, int4)."""
        plain = [storage.layer_tensors(i) for i in range(num_layers)]
        if all(t is not None and t[0].dtype == dtype for t in plain):
            return cls([t for t in plain if t is not None])
        quantized = [storage.quantized_tensors(i) for i in range(num_layers)]
        if all(t is not None for t in quantized):
            return cls([t for t in quantized if t is not None], quantized=True,
                       rotate=storage.basis is not None)
        return None

    @property
    def kv_kind(self) -> int:
        """ops.c's Dims.kv_kind: 0 plain, 1 int8 codes, 2 e4m3 codes."""
        if not self.quantized:
            return 0
        return 1 if self.layers[0][0].dtype == torch.int8 else 2


class LayerWeights(Protocol):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear | GGUFLinear
    o: Linear | GGUFLinear
    gate_up: Linear | GGUFLinear
    down: Linear | GGUFLinear


def runs_in_decode_step(lin: object) -> bool:
    """Whether the one-call step has a kernel for this layer (dense or GGUF blocks with the
    C kernels on; not a `ConcatLinear` of parts)."""
    return isinstance(lin, (Linear, GGUFLinear)) and lin.kernel is not None


def lin_entry(lin: Linear | GGUFLinear) -> LinEntry:
    """A linear layer as the C steps' table entry (ops.c's Lin)."""
    assert lin.kernel is not None
    if isinstance(lin, GGUFLinear):
        return LinEntry(lin.blocks.data_ptr(), None,
                    lin.bias32.data_ptr() if lin.bias32 is not None else None,
                    lin.out_features, lin.in_features,
                    (_GGUF_X8_KIND if lin.x8 else _GGUF_KIND) + int(lin.qtype))
    return LinEntry(lin.weight.data_ptr(),
                lin.scale.data_ptr() if lin.scale is not None else None,
                lin.bias32.data_ptr() if lin.bias32 is not None else None,
                lin.out_features, lin.in_features, _KINDS[lin.kernel])


class DecodeStep:
    """Runs all layers of decode-only steps over one KV storage's per-layer tensors."""

    def __init__(self, layers: Sequence[LayerWeights], caches: StepCaches, dtype: torch.dtype,
                 hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 eps: float) -> None:
        lib = build.load()
        assert lib is not None and dtype in _SUFFIX
        self._fn = getattr(lib, f"decode_step_{_SUFFIX[dtype]}")
        self.dtype = dtype
        self.hidden = hidden
        self._dims = _Dims(hidden, heads, kv_heads, head_dim, inter, len(layers), eps,
                           head_dim**-0.5, caches.kv_kind, int(caches.rotate))
        table = (_Layer * len(layers))()
        for entry, layer, (first, second) in zip(table, layers, caches.layers, strict=True):
            entry.qkv, entry.o = lin_entry(layer.qkv), lin_entry(layer.o)
            entry.gate_up, entry.down = lin_entry(layer.gate_up), lin_entry(layer.down)
            entry.input_norm, entry.post_norm = (layer.input_norm.data_ptr(),
                                                 layer.post_norm.data_ptr())
            entry.k_cache = first.data_ptr()
            if caches.quantized:  # codes, then their scales
                entry.kv_scale = second.data_ptr()
            else:
                entry.v_cache = second.data_ptr()
        self._table = table
        # The table holds raw pointers: keep what they point into alive.
        self._keep = (list(layers), list(caches.layers))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor
                 ) -> torch.Tensor:
        """h: [B, hidden] embeddings (updated in place into the residual stream); cos, sin:
        fp32 [B, head_dim]; slot_mapping: [B]; slots: [B, max_ctx]; lens: [B] (all int64)
        -> the last layer's MLP output, still to be added to h (as the per-op path's
        `pending`)."""
        rows = h.shape[0]
        pending = torch.empty(rows, self.hidden, dtype=self.dtype)
        ok = self._fn(ctypes.byref(self._dims), self._table, h.data_ptr(), rows,
                      cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                      slots.data_ptr(), lens.data_ptr(), slots.shape[1], pending.data_ptr(),
                      torch.get_num_threads())
        if not ok:
            raise MemoryError("decode step could not allocate its scratch buffers")
        return pending
