"""K/V storage behind one interface (`base.KVCacheStorage`): floats, int8/fp8, int4."""

from __future__ import annotations

import torch

from kvstack.config import ModelConfig
from kvstack.kv.storage.base import KVCacheStorage, torch_dtype
from kvstack.kv.storage.int4 import Int4KVStorage
from kvstack.kv.storage.quantized import QuantizedKVStorage

__all__ = ["KVCacheStorage", "make_kv_storage", "torch_dtype"]


def make_kv_storage(model: ModelConfig, num_blocks: int, block_size: int, kv_dtype: str,
                    compute_dtype: torch.dtype, max_num_seqs: int) -> KVCacheStorage:
    """The storage of a resolved KV dtype (`kv/dtypes.py`): float, int8/fp8 or int4."""
    if kv_dtype in ("float32", "bfloat16", "float16"):
        return KVCacheStorage(model, num_blocks, block_size, torch_dtype(kv_dtype),
                              compute_dtype)
    if kv_dtype == "int4":
        return Int4KVStorage(model, num_blocks, block_size, compute_dtype, max_num_seqs)
    return QuantizedKVStorage(model, num_blocks, block_size, kv_dtype, compute_dtype)
