"""A whole Gemma 3 decode step in one C call (`gemma_decode_step` in gemma_step.c).

At one token per sequence, Gemma's per-layer PyTorch (six RMSNorms, Q/K norms, RoPE, GELU:
~25 ops a layer, 18 layers) costs several milliseconds a token next to the weights' streaming;
this hands the C side a table of every layer's weights and cache tensors, built once per KV
storage and layer placement, and per step each layer's slots (its group's block table; a
sliding layer's narrowed to its window). float32 models over a plain float32 cache or an int8 /
fp8 one (codes and scales, stored and read by ops.c's quantized kernels), with dense
(`Linear`) or GGUF-block (`GGUFLinear`, a `ConcatLinear` of them for mixed-type QKV) weights;
anything else keeps the per-op path. The two paths agree to float32 rounding (the C loops and
PyTorch's vectorized ops round differently), measured in tests/kernels/test_gemma_step.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from kvstack.kernels import build
from kvstack.kernels.decode_step import LinEntry, StepCaches, lin_entry
from kvstack.kernels.gguf import ConcatLinear, GGUFLinear
from kvstack.kernels.linear import Linear

MAX_PARTS = 3  # gemma_step.c's MAX_PARTS: a fused QKV's parts


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", LinEntry * MAX_PARTS), ("num_qkv", ctypes.c_int64),
                ("o", LinEntry), ("gate_up", LinEntry), ("down", LinEntry),
                ("input_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
                ("pre_ffw_norm", ctypes.c_void_p), ("post_ffw_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kv_scale", ctypes.c_void_p), ("rope", ctypes.c_int64)]


class _View(ctypes.Structure):
    _fields_ = [("slot_mapping", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("lens", ctypes.c_void_p), ("max_ctx", ctypes.c_int64)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("inter", ctypes.c_int64), ("num_layers", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("kv_kind", ctypes.c_int64), ("rotate", ctypes.c_int64)]


class GemmaLayerWeights(Protocol):
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ffw_norm: torch.Tensor
    post_ffw_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    qkv: object
    o: object
    gate_up: object
    down: object


def _parts(lin: object) -> list[Linear | GGUFLinear] | None:
    """A linear as the step's parts: itself, or a ConcatLinear's parts; None if any has no
    kernel."""
    parts = lin.parts if isinstance(lin, ConcatLinear) else [lin]
    usable = [p for p in parts if isinstance(p, (Linear, GGUFLinear)) and p.kernel is not None]
    return usable if len(usable) == len(parts) <= MAX_PARTS else None


def _single(lin: object) -> Linear | GGUFLinear | None:
    parts = _parts(lin) if not isinstance(lin, ConcatLinear) else None
    return parts[0] if parts else None


def step_supported(layers: Sequence[GemmaLayerWeights]) -> bool:
    """Whether every layer's products have a kernel in the step (only QKV may be in parts)."""
    return all(_parts(layer.qkv) is not None
               and all(_single(lin) is not None for lin in (layer.o, layer.gate_up, layer.down))
               for layer in layers)


class GemmaDecodeStep:
    """All layers of decode-only float32 steps over one storage's caches: plain float32
    (K, V) per layer, or int8 / fp8 (codes, scales) per layer (`StepCaches`)."""

    def __init__(self, layers: Sequence[GemmaLayerWeights], caches: StepCaches,
                 full: Sequence[bool],
                 hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 scale: float) -> None:
        lib = build.load()
        assert lib is not None
        self._fn = lib.gemma_decode_step
        self._dims = _Dims(hidden, heads, kv_heads, head_dim, inter, len(layers), eps, scale,
                           caches.kv_kind, int(caches.rotate))
        table = (_Layer * len(layers))()
        for entry, layer, (first, second), is_full in zip(table, layers, caches.layers, full,
                                                          strict=True):
            parts = _parts(layer.qkv)
            assert parts is not None
            for i, part in enumerate(parts):
                entry.qkv[i] = lin_entry(part)
            entry.num_qkv = len(parts)
            o, gate_up, down = _single(layer.o), _single(layer.gate_up), _single(layer.down)
            assert o is not None and gate_up is not None and down is not None
            entry.o, entry.gate_up, entry.down = lin_entry(o), lin_entry(gate_up), lin_entry(down)
            for name in ("input_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm",
                         "q_norm", "k_norm"):
                norm = getattr(layer, name)
                assert norm.dtype == torch.float32 and norm.is_contiguous()
                setattr(entry, name, norm.data_ptr())
            entry.k_cache = first.data_ptr()
            if caches.quantized:  # codes, then their scales
                entry.kv_scale = second.data_ptr()
            else:
                entry.v_cache = second.data_ptr()
            entry.rope = int(is_full)
        self._table = table
        self._views = (_View * len(layers))()
        # The table holds raw pointers: keep what they point into alive.
        self._keep = (list(layers), list(caches.layers))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 views: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """h: float32 [B, hidden] embeddings, turned in place into the residual stream after
        the last layer (before the final norm); cos, sin: float32 [2, B, head_dim] (sliding,
        full); views: per layer (slot_mapping [B], slots [B, max_ctx], lens [B]), int64 and
        contiguous."""
        for view, (slot_mapping, slots, lens) in zip(self._views, views, strict=True):
            view.slot_mapping, view.slots = slot_mapping.data_ptr(), slots.data_ptr()
            view.lens, view.max_ctx = lens.data_ptr(), slots.shape[1]
        ok = self._fn(ctypes.byref(self._dims), self._table, self._views, h.data_ptr(),
                      h.shape[0], cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        if not ok:
            raise MemoryError("decode step could not allocate its scratch buffers")


class GemmaOps:
    """The step's per-layer loops one at a time (gemma_step.c), for decode-sized steps that
    the one-call step does not take (prefill rows among them): a row gets the same bits
    either way. float32, contiguous tensors."""

    def __init__(self) -> None:
        lib = build.load()
        assert lib is not None
        self._lib = lib

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm of x [..., d] by w (1 + the checkpoint's weight)."""
        out = torch.empty_like(x)
        d = x.shape[-1]
        self._lib.gemma_norm_f32(x.data_ptr(), x.numel() // d, d, w.data_ptr(), eps,
                                 out.data_ptr())
        return out

    def add_norm_(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        """h += norm(y) in place (y is normed in place too)."""
        self._lib.gemma_add_norm_f32(h.data_ptr(), y.data_ptr(), h.shape[0], h.shape[1],
                                     w.data_ptr(), eps)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of gate_up [T, 2 I] -> [T, I]."""
        inter = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inter)
        self._lib.gemma_gelu_mul_f32(gate_up.data_ptr(), gate_up.shape[0], inter,
                                     out.data_ptr())
        return out

    def qk_norm_rope_(self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int,
                      q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place on fused QKV rows [T, (H + 2 H_kv) D]: q and k heads' RMSNorm, then RoPE
        from cos/sin float32 [T, D]."""
        self._lib.gemma_qk_norm_rope_f32(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], heads,
                                         kv_heads, dim, q_norm.data_ptr(), k_norm.data_ptr(),
                                         eps, cos.data_ptr(), sin.data_ptr())
