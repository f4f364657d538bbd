"""Linear layers that run a GGUF file's quantized weight blocks as they are (`gguf.c`).

A `GGUFLinear` holds one [out, in] weight as its raw blocks -- a uint8 tensor [out, row
bytes], each row `in / block elements` blocks of its ggml type -- and multiplies without a
dequantized copy: decode-sized steps (up to `MAX_KERNEL_ROWS` rows) go to the C kernel, which
rounds each 32-element block of an activation row to int8 (scale amax / 127, as llama.cpp's
Q8_0) and takes integer dot products with the weight blocks, streaming each block once for
all rows of the step.

Larger steps (prefill) dequantize the weight into a temporary fp32 matrix per call (C, all
threads) and use PyTorch's matmul: in fp32, or on a CPU with bf16 dot products
(`isa.fast_bf16_matmul`: AVX512-BF16, AMX) in bf16 -- weights and activations rounded to bf16,
the output once more (about 2e-3 relative, against the blocks' own few per cent), several
times faster. Dequantizing per call rather than once: no dequantized copy
stays in memory (the layer keeps the file's size; a call briefly holds one fp32 matrix), and
its cost is fixed while the matmul's grows with the rows -- past the 64-row crossover it is
about half the step (7-8 of 15 ms on the embedded model's layer shapes at 64 rows, 1
thread) and a small share of a long prefill. With the kernels
off (`KVSTACK_KERNELS=0`, no AVX2/compiler) the weight is dequantized once with the `gguf`
package on first use and that matrix is kept (numpy dequantizing is too slow to repeat per
call): the memory of today's dequantize-everything loader, for that layer only.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (K a multiple of 32) and Q4_K, Q6_K (K a multiple of
256). Anything else raises `UnsupportedGGUFTensor`, which the loader can catch to dequantize
that tensor as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from kvstack.kernels import build, isa

# ggml type -> weights per block. K-quants' super-blocks are 256 weights.
KERNEL_TYPES: dict[QType, int] = {
    QType.Q4_0: 32, QType.Q4_1: 32, QType.Q5_0: 32, QType.Q5_1: 32, QType.Q8_0: 32,
    QType.Q4_K: 256, QType.Q6_K: 256,
}  # fmt: skip

# Up to this many rows a step runs on the quantized blocks (its cost: the weight bytes, and
# at more rows the integer dot products); above it, dequantize + PyTorch matmul (its cost:
# dequantizing, then FLOPs). Measured here (AVX2, 1 thread, CPU time, the embedded model's
# four Q4_1 layer shapes): kernel 1.6 / 3.4 / 6.7 / 13.2 ms at 8 / 16 / 32 / 64 rows against
# 8.4 / 8.7 / 11.6 / 15.3 ms; Q4_K (1024 / 4096 shapes) 4.5 / 9.0 / 12.5 / 28 vs 19 / 23 /
# 29 / 41 ms.
MAX_KERNEL_ROWS = 64
# With the bf16 matmul (`isa.fast_bf16_matmul`) the crossover stays: Xeon with AMX, 2 threads,
# the four Q4_1 shapes: kernel 0.59 / 1.15 / 2.17 / 2.99 ms at 32 / 64 / 96 / 128 rows against
# 1.36 / 1.67 / 1.82 / 2.14 (dequantizing 0.24 ms and rounding to bf16 0.29 of that); at 1,024
# rows the bf16 matmul itself takes 4.2 ms against fp32's 29.


class UnsupportedGGUFTensor(ValueError):
    """A tensor this module cannot run: a type without a kernel, or rows that are not whole
    blocks. The loader falls back to dequantizing it."""


def block_layout(qtype: QType | int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a type with a kernel; else UnsupportedGGUFTensor."""
    try:
        qt = QType(qtype)
    except ValueError as err:
        raise UnsupportedGGUFTensor(f"unknown ggml type {qtype!r}") from err
    if qt not in KERNEL_TYPES:
        names = ", ".join(t.name for t in KERNEL_TYPES)
        raise UnsupportedGGUFTensor(f"no GGUF kernel for {qt.name} (kernels: {names})")
    elems, nbytes = gguf.GGML_QUANT_SIZES[qt]
    return elems, nbytes


class GGUFLinear:
    """y = x @ W.T (+ b) with W [out, in] held as GGUF blocks; x: [T, in] float32 or bfloat16
    -> [T, out] in x's dtype."""

    def __init__(self, blocks: torch.Tensor | np.ndarray, qtype: QType | int,
                 shape: tuple[int, int], bias: torch.Tensor | None = None,
                 use_kernels: bool = True) -> None:
        """blocks: the tensor's bytes as stored in the file (any shape, uint8, e.g. a
        `gguf.ReaderTensor.data`); shape: (out, in), the reverse of ggml's dims. A read-only
        array (the reader's memory map) is copied, so the layer owns its memory."""
        self.qtype = QType(qtype)
        elems, nbytes = block_layout(self.qtype)
        self.out_features, self.in_features = (int(d) for d in shape)
        if self.in_features <= 0 or self.in_features % elems:
            raise UnsupportedGGUFTensor(
                f"{self.qtype.name} rows are blocks of {elems} weights; in_features="
                f"{self.in_features} is not a multiple")
        self.row_bytes = self.in_features // elems * nbytes
        self.blocks = _as_uint8_rows(blocks, self.out_features, self.row_bytes)
        self.bias32 = bias.float().contiguous() if bias is not None else None
        self._lib = build.load() if use_kernels else None
        # Q4_0 / Q4_1 / Q8_0 blocks are repacked 8 rows at a time for the decode kernel
        # (gguf_x8.c): the same bytes, moved; `file_blocks()` gives the file's layout back.
        lib = self._lib
        self.x8 = lib is not None and bool(lib.gguf_x8_supported(int(self.qtype)))
        if lib is not None and self.x8:
            packed = torch.empty_like(self.blocks)
            _check(lib.gguf_x8_pack(int(self.qtype), self.blocks.data_ptr(),
                                          self.out_features, self.in_features,
                                          packed.data_ptr()))
            self.blocks = packed
        self.kernel = ("gguf_gemv_x8" if self.x8 else "gguf_gemv") if self._lib else None
        self.max_kernel_rows = MAX_KERNEL_ROWS
        # Prefill-sized products in bf16 where PyTorch's bf16 matmul is fast (see the module's
        # docstring), never with the kernels off; public so tests can run either path here.
        self.bf16_prefill = self._lib is not None and isa.fast_bf16_matmul()
        self._dense: torch.Tensor | None = None  # kernels off: the dequantized weight

    @classmethod
    def from_reader_tensor(cls, tensor: Any, bias: torch.Tensor | None = None,
                           use_kernels: bool = True) -> GGUFLinear:
        """From a `gguf.GGUFReader` tensor (2-D; ggml dims are [in, out])."""
        dims = [int(d) for d in tensor.shape]
        if len(dims) != 2:
            raise UnsupportedGGUFTensor(f"{tensor.name}: a linear weight is 2-D, got {dims}")
        return cls(tensor.data, tensor.tensor_type, (dims[1], dims[0]), bias, use_kernels)

    @classmethod
    def cat(cls, parts: list[GGUFLinear]) -> GGUFLinear:
        """The parts' rows one after another (a fused QKV or gate/up weight): rows are whole
        blocks, so this is a byte concatenation. Parts must share type and in_features (GGUF
        files often mix types across q/k/v: then keep them apart); biases all or none."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
            raise UnsupportedGGUFTensor(
                "cannot fuse GGUF weights of different types or widths: "
                + ", ".join(f"{p.qtype.name}[{p.out_features}, {p.in_features}]" for p in parts))
        biases = [p.bias32 for p in parts if p.bias32 is not None]
        if biases and len(biases) != len(parts):
            raise ValueError("either every part has a bias or none does")
        bias = torch.cat(biases) if biases else None
        blocks = torch.cat([p.file_blocks() for p in parts])
        return cls(blocks, first.qtype, (blocks.shape[0], first.in_features), bias,
                   use_kernels=first._lib is not None)

    def take_rows(self, index: torch.Tensor) -> GGUFLinear:
        """A layer whose row i is this one's row index[i] (e.g. undoing convert_hf_to_gguf's
        Q/K row permutation; rows are whole blocks, so bytes move unchanged)."""
        bias = self.bias32[index] if self.bias32 is not None else None
        return GGUFLinear(self.file_blocks(index), self.qtype, (index.numel(), self.in_features),
                          bias, use_kernels=self._lib is not None)

    def file_blocks(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (all rows if None) as the file stores them: uint8 [rows, row bytes]."""
        if not self.x8:
            return self.blocks if ids is None else self.blocks[ids]
        assert self._lib is not None
        ids = None if ids is None else ids.reshape(-1).to(torch.int64).contiguous()
        if ids is not None and ids.numel() and (int(ids.min()) < 0
                                                or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")
        count = self.out_features if ids is None else ids.numel()
        out = torch.empty(count, self.row_bytes, dtype=torch.uint8)
        _check(self._lib.gguf_x8_unpack(int(self.qtype), self.blocks.data_ptr(),
                                        self.out_features, self.in_features, _ptr(ids), count,
                                        out.data_ptr()))
        return out

    @property
    def shape(self) -> torch.Size:
        """(out, in), as a weight tensor's shape (for the loader's shape checks)."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def num_bytes(self) -> int:
        """Bytes held: the blocks (and the bias; not a kernels-off dequantized copy)."""
        extra = self.bias32.numel() * 4 if self.bias32 is not None else 0
        return self.blocks.numel() + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a new [out, in] tensor."""
        return self._dequantize_rows(None).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64 [N]) of W as [N, in]: a tied embedding table used in place."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features})")
        return self._dequantize_rows(ids).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.out_features)
        if self._lib is not None and rows <= self.max_kernel_rows:
            return self._kernel(x, rows)
        if self._lib is not None:  # prefill-sized: a temporary dequantized weight
            return self._prefill(x)
        if self._dense is None or self._dense.dtype != x.dtype:
            self._dense = self._dequantize_rows(None).to(x.dtype)
        bias = self.bias32.to(x.dtype) if self.bias32 is not None else None
        return F.linear(x, self._dense, bias)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """The weight dequantized for this call, times x: in bf16 where the CPU has bf16 dot
        products (`bf16_prefill`), else in fp32 as the dequantized model does."""
        weight = self._dequantize_rows(None)
        if not self.bf16_prefill:
            return F.linear(x.float(), weight, self.bias32).to(x.dtype)
        y = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
        if self.bias32 is not None:
            y += self.bias32
        return y.to(x.dtype)

    def _kernel(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        assert self._lib is not None
        x32 = x.to(torch.float32).contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        bias = self.bias32.data_ptr() if self.bias32 is not None else None
        gemv = self._lib.gguf_gemv_x8 if self.x8 else self._lib.gguf_gemv
        rc = gemv(int(self.qtype), x32.data_ptr(), rows, self.in_features,
                  self.blocks.data_ptr(), self.out_features, bias, y.data_ptr(),
                  torch.get_num_threads())
        _check(rc)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _dequantize_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """fp32 [len(ids) or out, in]: the C dequantizer, or the gguf package's."""
        count = self.out_features if ids is None else ids.numel()
        if count == 0:  # gguf's numpy dequantizer cannot reshape zero blocks
            return torch.empty(0, self.in_features, dtype=torch.float32)
        if self._lib is None:
            raw = self.blocks if ids is None else self.blocks[ids]
            values = gguf.quants.dequantize(raw.numpy(), self.qtype)
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
                count, self.in_features)
        out = torch.empty(count, self.in_features, dtype=torch.float32)
        if self.x8 and ids is None:  # prefill's whole weight, straight from the x8 layout
            _check(self._lib.gguf_x8_dequantize(int(self.qtype), self.blocks.data_ptr(),
                                                self.out_features, self.in_features,
                                                out.data_ptr(), torch.get_num_threads()))
            return out
        blocks = self.blocks
        if self.x8:  # a few rows (embedding lookups): moved back to the file's layout
            blocks, ids = self.file_blocks(ids), None
        rc = self._lib.gguf_dequantize(int(self.qtype), blocks.data_ptr(), self.in_features,
                                       _ptr(ids), count, out.data_ptr(),
                                       torch.get_num_threads())
        _check(rc)
        return out


class ConcatLinear:
    """Several linear layers over the same input whose outputs are concatenated: a fused QKV
    or gate/up projection whose parts cannot share one `GGUFLinear` (GGUF files often store
    q/k/v or gate/up in different types, or a part falls back to a dequantized weight)."""

    kernel = None  # never part of the one-call decode step

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.max_kernel_rows = min(p.max_kernel_rows for p in parts)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _as_uint8_rows(blocks: torch.Tensor | np.ndarray, rows: int, row_bytes: int) -> torch.Tensor:
    if isinstance(blocks, np.ndarray):
        array = np.ascontiguousarray(blocks).view(np.uint8)
        if not array.flags.writeable:  # a memory map: own a copy
            array = array.copy()
        tensor = torch.from_numpy(array)
    else:
        tensor = blocks
    if tensor.dtype != torch.uint8:
        raise UnsupportedGGUFTensor(f"GGUF blocks are bytes (uint8), got {tensor.dtype}")
    if tensor.numel() != rows * row_bytes:
        raise UnsupportedGGUFTensor(
            f"{tensor.numel()} bytes for {rows} rows of {row_bytes} bytes: not this tensor's size")
    return tensor.reshape(rows, row_bytes).contiguous()


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def _check(rc: int) -> None:
    if rc == -2:
        raise MemoryError("GGUF kernel could not allocate its activation buffers")
    if rc != 0:
        raise UnsupportedGGUFTensor(f"GGUF kernel refused the tensor (code {rc})")


def gemv_many(lins: list[GGUFLinear], x: torch.Tensor, offsets: list[int]) -> torch.Tensor | None:
    """Several GGUF layers of one type and shape, each on its own rows of x [total, in] (layer
    e on rows offsets[e]:offsets[e + 1]), in one C call (`gguf_gemv_x8_many`): [total, out] in
    x's dtype, each row's bits those of `lin(x[rows])` at decode size. None where it does not
    apply (kernels off, not the x8 layout, mixed types or shapes, bias, prefill-sized groups)."""
    first = lins[0]
    lib = first._lib
    sizes = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    if (lib is None or not first.x8 or first.out_features % 8
            or max(sizes) > first.max_kernel_rows
            or any(not lin.x8 or lin.qtype != first.qtype or lin.bias32 is not None
                   or lin.shape != first.shape for lin in lins)):
        return None
    x32 = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], first.out_features, dtype=torch.float32)
    ptrs = (ctypes.c_void_p * len(lins))(*(lin.blocks.data_ptr() for lin in lins))
    offs = torch.tensor(offsets, dtype=torch.int64)
    _check(lib.gguf_gemv_x8_many(int(first.qtype), len(lins), x32.data_ptr(), offs.data_ptr(),
                                 first.in_features, ptrs, first.out_features, y.data_ptr(),
                                 torch.get_num_threads()))
    return y if x.dtype == torch.float32 else y.to(x.dtype)
