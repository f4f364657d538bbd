"""KV cache element types and what one block of them costs, scales included.

    kv_cache_dtype  element                 stored with the block (float16)
    float32         4 B                     -
    bfloat16        2 B                     -
    float16         2 B                     -
    int8            1 B, symmetric          a scale per token and KV head, for K and for V
    fp8             1 B, e4m3 (float8_e4m3fn) a scale per token and KV head, for K and for V
    int4            0.5 B, asymmetric       K: a scale and a zero point per channel per block
                                            (KIVI: keys per channel); V: a scale and a zero
                                            point per token and KV head (values per token)

`auto` is the model's dtype. int4 quantizes a block's keys over its tokens, so a block being
filled stays in full precision (the model dtype) until it is full: each running sequence keeps
its most recent 0..block_size-1 tokens exact, in a window pool of `max_num_seqs` blocks.

Every byte figure here is what the storage (`kv/storage.py`, `kv/quantized.py`) allocates;
`KVShape` (`estimate.py`) and the tier block format (`kv/tiers/codec.py`) read them from here.
"""

from __future__ import annotations

from kvstack.config import KV_CACHE_DTYPES, check_kv_cache_dtype
from kvstack.errors import InvalidRequestError

__all__ = ["KV_CACHE_DTYPES", "check_kv_cache_dtype", "layer_block_bytes", "resolve"]

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED = ("int8", "fp8", "int4")
SCALE_BYTES = 2  # float16


def resolve(kv_cache_dtype: str, model_dtype: str) -> str:
    """`auto` -> the model dtype; any other name is itself."""
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def layer_block_bytes(dtype: str, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Bytes of K and V of one block in one layer, scales included."""
    tokens = block_size * num_kv_heads  # (token, head) rows of one block
    if dtype in FLOAT_BYTES:
        return 2 * tokens * head_dim * FLOAT_BYTES[dtype]
    if dtype in ("int8", "fp8"):
        return 2 * tokens * (head_dim + SCALE_BYTES)
    if dtype == "int4":
        check_int4_head_dim(head_dim)
        packed = 2 * tokens * head_dim // 2
        key_scales = 2 * num_kv_heads * head_dim * SCALE_BYTES  # scale, zero per channel
        value_scales = 2 * tokens * SCALE_BYTES  # scale, zero per token and head
        return packed + key_scales + value_scales
    known = ", ".join((*FLOAT_BYTES, *QUANTIZED))
    raise InvalidRequestError(f"unknown KV dtype {dtype!r}; use one of {known}")


def window_pool_blocks(dtype: str, max_num_seqs: int) -> int:
    """Full-precision blocks int4 keeps for the block each running sequence is filling."""
    return max_num_seqs if dtype == "int4" else 0


def check_int4_head_dim(head_dim: int) -> None:
    if head_dim % 2:
        raise InvalidRequestError(f"int4 KV packs two values a byte; head_dim {head_dim} is odd")
