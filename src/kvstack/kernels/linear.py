"""Linear layers in a chosen weight format, each product done by the kernel that suits its
shape: the C kernels (`gemv.c`) for the few rows of a decode step, PyTorch's matmul (MKL /
oneDNN) for prefill-sized inputs.

Weights are held in the activations' dtype, or with `quantization="int8"` weight-only int8,
symmetric per output channel (w ~= q * scale[out], q in [-127, 127]); activations stay in the
model dtype, except inside the int8 decode kernel (`gemv_q8`: on AVX512-VNNI, and on AVX2,
not on AVX-512 without VNNI), which quantizes each 64-element block of an activation row to
int8 (as llama.cpp's Q8 activations do) so a dot product of 64 weights is one instruction
(VNNI) or six (AVX2's vpmaddubsw), not widenings and FMAs per 8-16 weights. With VNNI, steps
of a few rows and more hand those products to `gemm_q8.c` (output columns in the vector lanes;
AMX tiles where the CPU has AMX-INT8), which gives the same numbers bit for bit, so int8
steps stay on the C kernels up to `INT8_VNNI_KERNEL_ROWS` / `INT8_AMX_KERNEL_ROWS` rows.
bf16 models on AVX512-BF16 likewise multiply bf16 by bf16, 32 products an instruction. The C
kernels cover fp32, bf16 and int8 weights; other dtypes (float64 in tests) always take
PyTorch's path.

Larger (prefill-sized) products of int8 weights on a CPU with bf16 dot products
(`isa.fast_bf16_matmul`: AVX512-BF16, AMX) run as PyTorch's bf16 matmul: the weight's int8
codes are exact in bf16, the activations are rounded to bf16 and the output once more before
the per-channel scale (about 2e-3 relative, against the int8 weights' own ~1e-2), 3-9x faster
than the fp32 matmul over a dequantized copy. The codes are widened to bf16 by the C kernels
(`widen_i8_bf16`) a tile of output rows at a time into a per-thread scratch buffer that stays
in cache, never a bf16 copy of the weight. Elsewhere they take the fp32 matmul over the
dequantized weight (exact). fp32 weights always multiply in fp32.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvstack.kernels import build, isa

# Up to this many rows a step streams each weight once through the C kernel (its cost is the
# weight bytes); above it PyTorch's blocked matmul wins (its cost is FLOPs). Measured here
# (1 thread, the embedded model's shapes): float weights break even near 16 rows (bf16:
# oneDNN is ahead by 16); int8 weights stay ahead past 128 rows (52 vs 183 ms at 16 rows,
# 357 vs 520 ms at 128), as PyTorch must first dequantize them. On AVX2 (1 thread, the
# embedded model's layer shapes) both hold: int8 19 vs 39 ms at 128 rows.
FLOAT_KERNEL_ROWS = 8
INT8_KERNEL_ROWS = 128
# Without bf16 dot products in the CPU (AVX2; AVX-512 without BF16) PyTorch's bf16 matmul runs
# 5-7x slower than its fp32 one. bf16 weights there go through the C kernel (it streams the
# weight once, at about the fp32 matmul's speed) up to this many rows, and larger steps widen
# the weight to fp32 per call for the fp32 matmul. Measured (AVX2, 2 threads, the embedded
# model's four layer shapes x 30): 32 rows kernel 95 ms, widened 219, bf16 matmul 462; 64 rows
# 176 / 182 / 872; 1,800 rows 5,428 / 3,624 / 24,585 (fp32 weights: 3,363).
BF16_NO_DOT_KERNEL_ROWS = 64
# int8 weights where the CPU has bf16 dot products (`fast_bf16_matmul`): PyTorch's bf16 matmul
# over the int8 codes takes over from the C kernel above this many rows. Measured (Xeon with
# AMX, 2 threads, the embedded model's four layer shapes): kernel 0.50 / 0.95 / 2.4 / 4.9 ms
# at 16 / 32 / 64 / 128 rows against 0.60 / 0.71 / 1.2 / 1.6 ms.
INT8_BF16_KERNEL_ROWS = 24
# ... unless the kernels run int8 steps of several rows as a matrix product (`gemm_q8.c`: VNNI,
# and AMX tiles where the CPU has them), the same numbers as the decode kernel's, which beat
# PyTorch's bf16 matmul over the widened codes up to these rows. Measured (Xeon with AMX, 2
# threads, the embedded model's 30 layers and head, one-off timings): AMX 13.5 / 25.3 / 48.6 /
# 101.5 ms at 32 / 64 / 128 / 256 rows against 38.3 / 46.8 / 63.1 / 103.7; the VNNI path 29.6 /
# 45.7 / 80.6 at 32 / 64 / 128.
INT8_VNNI_KERNEL_ROWS = 64
INT8_AMX_KERNEL_ROWS = 128

# The int8 codes' bf16 products widen at most this many weights at a time (4 MB of bf16, the
# two cores' L2 here) into a per-thread scratch buffer, which the matmul then reads from cache.
# Measured (Xeon with AMX, 2 threads, one-off timings, the embedded model's 49,152 x 576 head
# at 32 rows): 9.3 ms widened whole, 5.6 ms in tiles of 1,536-6,144 rows, 6.4 / 8.0 ms in
# 1,024 / 512. The 30 layers' products alone at 32 rows: 52 ms with PyTorch's int8 -> bf16
# copy, 32 ms with these tiles; a whole 32-row decode step of `LLM.generate` 72 -> 67-70 ms.
SCRATCH_WEIGHTS = 1 << 21
_scratch = threading.local()

_GEMV = {torch.float32: "gemv_f32", torch.bfloat16: "gemv_bf16", torch.int8: "gemv_i8"}


def prefill_attention_dtype(dtype: torch.dtype,
                            linears: Iterable[object]) -> torch.dtype | None:
    """The dtype a model's prefill attention runs in when it is not the model's (None: the
    model's), given its linear layers.

    Quantized weights (int8, GGUF blocks) whose prefill products round to bf16 (their
    `bf16_prefill`: a CPU with bf16 dot products, kernels on; see the module's docstring)
    attend in bf16 too: fp32 attention over a long prompt is then about half the prefill
    (1,800 tokens, the embedded model, int8: 710 of 1,400 ms). q, k and v are rounded to bf16
    for the product only; the KV cache keeps the K/V the decode steps read. Models without
    such a layer (fp32 and bf16 weights, a GGUF file of float weights, the reference path)
    attend in the model dtype."""
    parts = (part for lin in linears for part in getattr(lin, "parts", [lin]))  # ConcatLinear
    if dtype == torch.float32 and any(getattr(part, "bf16_prefill", False) for part in parts):
        return torch.bfloat16
    return None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale [out]); symmetric, per output row."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Linear:
    """y = x @ W.T (+ b) for x: [T, in] in `act_dtype` -> [T, out] in `act_dtype`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 quantization: str | None = None, use_kernels: bool = True) -> None:
        if quantization not in (None, "int8"):
            raise ValueError(f"unknown quantization {quantization!r}")
        self.out_features, self.in_features = weight.shape
        self.act_dtype = act_dtype
        self.scale: torch.Tensor | None = None
        if quantization == "int8":
            self.weight, self.scale = quantize_int8(weight)
        else:
            self.weight = weight.to(act_dtype).contiguous()
        self.bias = bias.to(act_dtype) if bias is not None else None
        self.bias32 = bias.float().contiguous() if bias is not None else None  # for the kernels
        lib = build.load() if use_kernels and act_dtype in _GEMV else None
        name = _GEMV.get(self.weight.dtype, "")
        if name == "gemv_i8" and (build.has_vnni() or build.isa() == "avx2"):
            # int8 x int8 dot products; see gemv.c. On AVX2 (vpmaddubsw) measured 1.5x the
            # widening kernel at 1 row and level with it from 4 to 128 rows.
            name = "gemv_q8"
        if name == "gemv_bf16" and build.has_bf16_dot():
            name = "gemv_bf16dp"  # bf16 x bf16 dot products (the activations are bf16)
        self._gemv = getattr(lib, name) if lib is not None else None
        self._widen_codes = lib.widen_i8_bf16 if lib is not None else None
        self.kernel = name if lib is not None else None  # which gemv decode steps use
        # bf16 weights on a CPU without bf16 dot products: see BF16_NO_DOT_KERNEL_ROWS. The
        # CPU's flag, not the kernels' build: PyTorch's bf16 matmul is fast on an AVX512-BF16
        # CPU even where KVSTACK_KERNELS=avx2 forces the AVX2 kernels.
        self._widen = (name == "gemv_bf16" and lib is not None
                       and "avx512_bf16" not in isa.cpu_flags())
        self.max_kernel_rows = (INT8_KERNEL_ROWS if self.scale is not None else
                                BF16_NO_DOT_KERNEL_ROWS if self._widen else FLOAT_KERNEL_ROWS)
        # int8 weights' prefill-sized products in bf16 (see the module's docstring), never on
        # the reference path (no kernels); public so tests can run either path on any CPU.
        self.bf16_prefill = self.scale is not None and lib is not None and isa.fast_bf16_matmul()
        if self.bf16_prefill:
            self.max_kernel_rows = (INT8_AMX_KERNEL_ROWS if name == "gemv_q8" and build.has_amx()
                                    else INT8_VNNI_KERNEL_ROWS if name == "gemv_q8"
                                    and build.has_vnni() else INT8_BF16_KERNEL_ROWS)

    @property
    def num_bytes(self) -> int:
        extra = self.scale.numel() * 4 if self.scale is not None else 0
        return self.weight.numel() * self.weight.element_size() + extra

    def dequantized(self) -> torch.Tensor:
        """The weight as `act_dtype` [out, in] (a new tensor for int8)."""
        if self.scale is None:
            return self.weight
        return (self.weight.to(torch.float32) * self.scale[:, None]).to(self.act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._gemv is not None and 0 < rows <= self.max_kernel_rows:
            return self._kernel(x, rows)
        if self._widen:  # same products, summed in fp32 by the fp32 matmul; rounded once
            return F.linear(x.float(), self.weight.float(), self.bias32).to(self.act_dtype)
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        if self.bf16_prefill:
            return self._bf16_product(x)
        if self.act_dtype == torch.bfloat16:
            y = torch._weight_int8pack_mm(x, self.weight, self.scale.to(torch.bfloat16))
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.dequantized(), self.bias)

    def _bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """int8 weights: bf16 codes x bf16 activations, then the per-channel scale in fp32; the
        codes widened a tile of output rows at a time (`SCRATCH_WEIGHTS`)."""
        assert self.scale is not None
        xb = x.to(torch.bfloat16)
        k, n = self.in_features, self.out_features
        tile = max(1, SCRATCH_WEIGHTS // k)
        if tile >= n:
            y = F.linear(xb, self._widened(0, n)).float()
        else:
            y = torch.empty(x.shape[0], n, dtype=torch.float32)
            for lo in range(0, n, tile):
                hi = min(n, lo + tile)
                y[:, lo:hi] = F.linear(xb, self._widened(lo, hi))
        y *= self.scale
        if self.bias32 is not None:
            y += self.bias32
        return y.to(self.act_dtype)

    def _widened(self, lo: int, hi: int) -> torch.Tensor:
        """Weight rows lo:hi as bf16 [hi - lo, in], in this thread's scratch buffer (valid
        until the next call)."""
        if self._widen_codes is None:  # no C kernels: bf16_prefill was set by hand
            return self.weight[lo:hi].to(torch.bfloat16)
        count = (hi - lo) * self.in_features
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < count:
            buf = _scratch.buf = torch.empty(max(count, SCRATCH_WEIGHTS), dtype=torch.bfloat16)
        self._widen_codes(self.weight[lo].data_ptr(), buf.data_ptr(), count,
                          torch.get_num_threads())
        return buf[:count].view(hi - lo, self.in_features)

    def _kernel(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        x32 = x.to(torch.float32).contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        assert self._gemv is not None  # forward takes this path only with a kernel bound
        self._gemv(
            x32.data_ptr(), rows, self.in_features, self.weight.data_ptr(), self.out_features,
            _ptr(self.scale), _ptr(self.bias32), y.data_ptr(), torch.get_num_threads(),
        )
        return y if self.act_dtype == torch.float32 else y.to(self.act_dtype)


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None
