"""K/V storage behind one interface (`base.KVCacheStorage`): floats, int8/fp8, int4."""

from __future__ import annotations

import torch

from kvstack.config import ModelConfig
from kvstack.kv.storage.base import KVCacheStorage, torch_dtype
from kvstack.kv.storage.int4 import Int4KVStorage
from kvstack.kv.storage.quantized import QuantizedKVStorage

__all__ = ["KVCacheStorage", "make_kv_storage", "torch_dtype"]


def make_kv_storage(model: ModelConfig, num_blocks: int, block_size: int, kv_dtype: str,
                    compute_dtype: torch.dtype, max_num_seqs: int,
                    num_layers: int | None = None, use_kernels: bool = True) -> KVCacheStorage:
    """The storage of a resolved KV dtype (`kv/dtypes.py`): float, int8/fp8 or int4.
    `num_layers`: the layers of a page under a hybrid layout (default: the model's); int4
    plans a step's writes once for every layer, so it keeps the single layout.
    `use_kernels=False` (the engine's `kernels="torch"`): int8/fp8 writes in PyTorch too."""
    if kv_dtype in ("float32", "bfloat16", "float16"):
        return KVCacheStorage(model, num_blocks, block_size, torch_dtype(kv_dtype),
                              compute_dtype, num_layers)
    if kv_dtype == "int4":
        assert num_layers in (None, model.num_layers), "int4 keeps the single KV layout"
        return Int4KVStorage(model, num_blocks, block_size, compute_dtype, max_num_seqs)
    return QuantizedKVStorage(model, num_blocks, block_size, kv_dtype, compute_dtype, num_layers,
                              use_kernels)
