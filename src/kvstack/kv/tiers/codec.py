"""One KV block as bytes: a fixed header, then the block's K/V of every layer.

    offset  size  field
         0     8  magic b"KVSTBLK\\0"
         8     2  format version (u16, little endian like every field)
        10     1  KV dtype code (1 float32, 2 bfloat16, 3 float16, 4 int8, 5 fp8, 6 int4)
        11     1  reserved (0)
        12     8  layout: num_layers, num_kv_heads, head_dim, block_size (u16 each)
        20    32  model fingerprint (sha256: weights, tokenizer, dtype)
        52    32  block hash (the chained prefix hash the block is stored under)
        84     8  payload length in bytes
        92     4  crc32 of the payload
        96     -  payload: the block's slice of every storage tensor (`KVCacheStorage.
                  read_block`); float dtypes: [num_layers, 2 (k, v), block_size, H_kv, D] in
                  C order; quantized ones add their scales (`kv/dtypes.py` has the sizes)

A reader checks every field against what it expects before it trusts a byte of payload, so a
truncated, corrupted, foreign (other model, dtype or layout) or misfiled block is a `BlockFault`
— a miss — never K/V of the wrong tokens. Blocks of another KV dtype never match: the dtype is
in the engine fingerprint (so in every block hash) and in the header.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.dtypes import layer_block_bytes

MAGIC = b"KVSTBLK\0"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHBx4H32s32sQI")
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "int8": 4, "fp8": 5, "int4": 6}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


class BlockFault(Exception):
    """A stored block that must not be used; `kind` names why (it keys the fault counters)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class BlockHeader:
    version: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    fingerprint: str  # hex
    block_hash: BlockHash
    payload_len: int
    crc32: int


def parse_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """The header of an encoded block; raises BlockFault if it is not one of ours."""
    if len(data) < HEADER.size:
        raise BlockFault("truncated", f"{len(data)} bytes is shorter than a block header")
    (magic, version, dtype, num_layers, num_kv_heads, head_dim, block_size, fingerprint,
     block_hash, payload_len, crc) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFault("bad_magic", "not a kvstack KV block")
    if version != FORMAT_VERSION:
        raise BlockFault("version", f"block format version {version}, expected {FORMAT_VERSION}")
    if dtype not in _DTYPE_NAMES:
        raise BlockFault("layout", f"unknown dtype code {dtype}")
    return BlockHeader(version, _DTYPE_NAMES[dtype], num_layers, num_kv_heads, head_dim,
                       block_size, fingerprint.hex(), block_hash, payload_len, crc)


@dataclass(frozen=True)
class BlockFormat:
    """What one engine writes and accepts: its model fingerprint, KV dtype and block layout."""

    fingerprint: str  # 64 hex digits
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if len(bytes.fromhex(self.fingerprint)) != 32:
            raise ValueError("fingerprint must be 64 hex digits (a sha256)")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"no block format for dtype {self.dtype!r}")

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * layer_block_bytes(self.dtype, self.num_kv_heads, self.head_dim,
                                                   self.block_size)

    @property
    def block_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.block_size)

    def encode(self, block_hash: BlockHash, payload: bytes | memoryview) -> bytes:
        """Header + payload; `payload` is the block's K/V bytes in this format's layout."""
        payload = memoryview(payload).cast("B")
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} B, format needs {self.payload_bytes} B")
        header = HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[self.dtype], *self.layout,
                             bytes.fromhex(self.fingerprint), block_hash, len(payload),
                             zlib.crc32(payload))
        return header + payload

    def decode(self, block_hash: BlockHash, data: bytes | bytearray | memoryview) -> memoryview:
        """The payload of an encoded block, after every check; raises BlockFault."""
        header = parse_header(data)
        if header.fingerprint != self.fingerprint:
            raise BlockFault("fingerprint", "block of another model, tokenizer or dtype")
        if header.dtype != self.dtype or (header.num_layers, header.num_kv_heads,
                                          header.head_dim, header.block_size) != self.layout:
            raise BlockFault("layout", "block of another dtype or KV layout")
        if header.block_hash != block_hash:
            raise BlockFault("hash", "block stored under another block's hash")
        if header.payload_len != self.payload_bytes or len(data) != self.block_bytes:
            raise BlockFault("truncated", f"block of {len(data)} B, expected {self.block_bytes}")
        payload = memoryview(data)[HEADER.size:]
        if zlib.crc32(payload) != header.crc32:
            raise BlockFault("checksum", "payload checksum mismatch")
        return payload
