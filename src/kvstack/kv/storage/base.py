"""Preallocated paged K/V tensors: write new tokens into slots, read a sequence's blocks back.

Layout per layer: `k[layer]`, `v[layer]`: [num_blocks * block_size, H_kv, D]. A slot is
`block_id * block_size + offset`; a request's slots follow its block table. Under a hybrid
layout (`kv/groups.py`) a storage holds `num_layers` = a page's layers, and "layer" here is a
layer's place in its page (attention maps model layers to places).

This class stores K/V as floats (the model's dtype, or another float dtype cast on write and
back on read); `kv/quantized.py` and `kv/int4.py` store them quantized behind the same methods.
A block's bytes (`read_block`, `write_blocks`: what the tiers keep) are its slice of every
tensor in `_block_views` order, so they carry the KV dtype's scales with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstack.config import ModelConfig


def torch_dtype(name: str) -> torch.dtype:
    """'float32' -> torch.float32: the one map from dtype names in configs to torch dtypes."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _word_dtype(byte_counts: list[int], byte_offset: int) -> torch.dtype:
    """The widest integer dtype that divides every one of these byte counts and the offset."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if byte_offset % size == 0 and all(n % size == 0 for n in byte_counts):
            return dtype
    return torch.uint8


def gather(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """t[slots] for a [slots, ...] tensor: rows copied whole by `index_select` on a 2-D view,
    several times faster than advanced indexing, which copies element by element."""
    rows = torch.index_select(t.view(t.shape[0], -1), 0, slots.reshape(-1))
    return rows.view(*slots.shape, *t.shape[1:])


class KVCacheStorage:
    """Owns the K/V bytes. Knows slots, never which request owns them.

    `basis`: None, or an orthonormal [D, D] matrix B in which K/V are stored and read back
    (x @ B on the head dimension). Attention then multiplies queries by B and its output by
    B^T, which leaves scores and outputs unchanged (B B^T = I).
    """

    basis: torch.Tensor | None = None

    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
        compute_dtype: torch.dtype | None = None, num_layers: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # of the stored elements
        self.compute_dtype = compute_dtype or dtype  # of what `read` returns
        shape = (num_blocks * block_size, model.num_kv_heads, model.head_dim)
        layers = range(num_layers or model.num_layers)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in layers]

    @property
    def lossy(self) -> bool:
        """True when K/V read back differ from what was written (cast or quantized): attention
        then always reads them back, so a prefix hit computes what a cold run computed."""
        return self.dtype != self.compute_dtype

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's K and V tensors [slots, H_kv, D], for kernels that read slots in
        place; None when what is stored is not what `read` returns (lossy storage)."""
        return None if self.lossy else (self.k[layer], self.v[layer])

    def stored_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's K and V float tensors [slots, H_kv, D] as stored, lossy or not, for
        kernels that widen another float dtype exactly as `read` does (bfloat16 under float32
        queries); None for storages whose tensors are codes (quantized, int4)."""
        return self.k[layer], self.v[layer]

    def quantized_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized storage's (codes [slots, 2, H_kv, D], float16 scales [slots, 2, H_kv])
        of this layer, for the kernels (`kv/storage/quantized.py`); None for other storages."""
        return None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this storage allocated."""
        return [*self.k, *self.v]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """slots: [T] int64; k, v: [T, H_kv, D]."""
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: any int64 shape S -> (k, v) each [*S, H_kv, D] in `compute_dtype` (a gathered
        copy)."""
        if self.lossy:
            return (gather(self.k[layer], slots).to(self.compute_dtype),
                    gather(self.v[layer], slots).to(self.compute_dtype))
        return self.k[layer][slots], self.v[layer][slots]

    def release(self, block_ids: Sequence[int]) -> None:
        """These blocks were freed; storages that keep per-block state drop it."""

    # -- whole blocks, as bytes (the tiers) -------------------------------------------------

    def _slot_tensors(self) -> list[torch.Tensor] | None:
        """Every tensor a block's bytes come from, in payload order, when each is indexed by
        slot (a block: `block_size` rows of each); None when some are not (int4's per-block
        scales), which `_block_views` then lists itself. Float storages: per layer, K then V
        ([num_layers, 2, block_size, H_kv, D], the tier format since version 1)."""
        return [t for kv in zip(self.k, self.v, strict=True) for t in kv]

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        """The block's slice of every tensor, in payload order."""
        tensors = self._slot_tensors()
        assert tensors is not None, "a storage without slot tensors lists its own views"
        start, end = block_id * self.block_size, (block_id + 1) * self.block_size
        return [t[start:end] for t in tensors]

    @property
    def block_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._block_views(0))

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block of every layer, copied out as bytes: uint8 [block_bytes]."""
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in self._block_views(block_id)])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s bytes over block `dst` (copy-on-write of a shared block): every
        tensor's slice, scales included, so any KV dtype copies exactly."""
        self.release([dst])
        for source, target in zip(self._block_views(src), self._block_views(dst), strict=True):
            target.copy_(source)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_block` for many blocks: data uint8 [N, block_bytes]."""
        self.release(block_ids)
        tensors = self._slot_tensors()
        if tensors is not None:
            # One index_copy_ per tensor for all the blocks, in words as wide as every
            # stretch allows (PyTorch copies uint8 rows byte by byte): view by view, two per
            # layer and block, a 3,000-token float32 handoff of the embedded model took 0.18 s
            # to restore; this way 0.07 s, the handoff inbox's concatenation included.
            data = data.contiguous()
            rows = [t.view(torch.uint8).view(self.num_blocks, -1) for t in tensors]
            word = _word_dtype([data.shape[1], *(r.shape[1] for r in rows)],
                               int(data.storage_offset()))
            ids = torch.tensor(block_ids, dtype=torch.int64)
            src, offset = data.view(word), 0
            for r in rows:
                width = r.shape[1] // word.itemsize
                r.view(word).index_copy_(0, ids, src[:, offset:offset + width])
                offset += width
            return
        for i, block_id in enumerate(block_ids):
            offset = 0
            for view in self._block_views(block_id):
                raw = view.view(torch.uint8).reshape(-1)
                raw.copy_(data[i, offset:offset + raw.numel()])
                offset += raw.numel()
