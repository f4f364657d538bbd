"""Preallocated paged K/V tensors: write new tokens into slots, read a sequence's blocks back.

Layout per layer: `k[layer]`, `v[layer]`: [num_blocks * block_size, H_kv, D]. A slot is
`block_id * block_size + offset`; a request's slots follow its block table.
"""

from __future__ import annotations

import torch

from kvstack.config import ModelConfig


class KVCacheStorage:
    """Owns the K/V bytes. Knows slots, never which request owns them."""

    def __init__(
        self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks * block_size, model.num_kv_heads, model.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """slots: [T] int64; k, v: [T, H_kv, D]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: any int64 shape S -> (k, v) each [*S, H_kv, D] (a gathered copy)."""
        return self.k[layer][slots], self.v[layer][slots]

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block of every layer, copied out: [num_layers, 2 (k, v), block_size, H_kv, D]."""
        start, end = block_id * self.block_size, (block_id + 1) * self.block_size
        return torch.stack([torch.stack((k[start:end], v[start:end]))
                            for k, v in zip(self.k, self.v, strict=True)])

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_block` for many blocks: data [N, num_layers, 2, block_size,
        H_kv, D] with N == len(block_ids)."""
        for i, block_id in enumerate(block_ids):
            start, end = block_id * self.block_size, (block_id + 1) * self.block_size
            for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
                k[start:end].copy_(data[i, layer, 0])
                v[start:end].copy_(data[i, layer, 1])
