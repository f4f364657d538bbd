"""A chunk entry as bytes for the disk and Redis tiers: the KV block header (`kv/tiers/
codec.py`) with its own magic, the token count where a block has its block size, and the
entry's key where a block has its hash; then K (before RoPE) and V of every layer.

    payload: k [num_layers, num_tokens, H_kv, D] then v, in the entry's dtype, C order

The checks and fault kinds are the blocks' (`BlockFault`: truncated, bad_magic, version,
layout, fingerprint, hash, checksum): a damaged, foreign or misfiled entry is a counted miss.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvstack.blend.entry import ChunkEntry
from kvstack.kv.tiers.codec import DTYPE_CODES, HEADER, BlockFault

CHUNK_MAGIC = b"KVSTCHK\0"
CHUNK_VERSION = 1
MAX_TOKENS = 0xFFFF  # the header's u16 token count; longer chunks are not written to tiers
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class ChunkHeader:
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    fingerprint: str
    key: bytes
    payload_len: int
    crc32: int


def parse_chunk_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """The header of an encoded chunk entry; raises BlockFault if it is not one."""
    if len(data) < HEADER.size:
        raise BlockFault("truncated", f"{len(data)} bytes is shorter than a chunk header")
    (magic, version, dtype, num_layers, num_kv_heads, head_dim, num_tokens, fingerprint, key,
     payload_len, crc) = HEADER.unpack_from(data)
    if magic != CHUNK_MAGIC:
        raise BlockFault("bad_magic", "not a kvstack chunk entry")
    if version != CHUNK_VERSION:
        raise BlockFault("version", f"chunk format version {version}, expected {CHUNK_VERSION}")
    if dtype not in _DTYPE_NAMES or _DTYPE_NAMES[dtype] not in ("float32", "bfloat16",
                                                                "float16"):
        raise BlockFault("layout", f"unknown chunk dtype code {dtype}")
    return ChunkHeader(_DTYPE_NAMES[dtype], num_layers, num_kv_heads, head_dim, num_tokens,
                       fingerprint.hex(), key, payload_len, crc)


@dataclass(frozen=True)
class ChunkFormat:
    """What one engine writes and accepts: its fingerprint, entry dtype and K/V layout."""

    fingerprint: str  # 64 hex digits
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def payload_bytes(self, num_tokens: int) -> int:
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * num_tokens * self.dtype.itemsize

    def encode(self, entry: ChunkEntry) -> bytes | None:
        """Header + payload; None for a chunk too long for the header."""
        if entry.num_tokens > MAX_TOKENS:
            return None
        payload = b"".join(t.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
                           for t in (entry.k, entry.v))
        header = HEADER.pack(CHUNK_MAGIC, CHUNK_VERSION, DTYPE_CODES[self.dtype_name],
                             self.num_layers, self.num_kv_heads, self.head_dim,
                             entry.num_tokens, bytes.fromhex(self.fingerprint), entry.key,
                             len(payload), zlib.crc32(payload))
        return header + payload

    def decode(self, key: bytes, data: bytes | bytearray | memoryview) -> ChunkEntry:
        """The entry stored under `key`, after every check; raises BlockFault."""
        h = parse_chunk_header(data)
        if h.fingerprint != self.fingerprint:
            raise BlockFault("fingerprint", "chunk of another model, tokenizer or dtype")
        if (h.dtype, h.num_layers, h.num_kv_heads, h.head_dim) != (
                self.dtype_name, self.num_layers, self.num_kv_heads, self.head_dim):
            raise BlockFault("layout", "chunk of another dtype or KV layout")
        if h.key != key:
            raise BlockFault("hash", "chunk stored under another chunk's key")
        size = self.payload_bytes(h.num_tokens)
        if h.payload_len != size or len(data) != HEADER.size + size:
            raise BlockFault("truncated", f"chunk of {len(data)} B, expected "
                                          f"{HEADER.size + size}")
        payload = memoryview(data)[HEADER.size:]
        if zlib.crc32(payload) != h.crc32:
            raise BlockFault("checksum", "payload checksum mismatch")
        buf = data if isinstance(data, bytearray) else bytearray(data)  # torch wants writable
        raw = torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER.size,
                               count=size).view(self.dtype)
        shape = (self.num_layers, h.num_tokens, self.num_kv_heads, self.head_dim)
        k, v = raw.view(2, *shape)
        return ChunkEntry(key, k, v)
