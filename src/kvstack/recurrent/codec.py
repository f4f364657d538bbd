"""A recurrent-state snapshot as bytes, for the disk and Redis tiers and the prefill/decode
handoff: the KV block header (`kv/tiers/codec.py`) with its own magic, the linear layers'
shape where a block has its KV layout, the hash of the block the snapshot ends; then every
linear layer's conv tail (model dtype) and delta-rule state (float32), in layer order.

    payload: per linear layer: conv [channels, kernel - 1], then ssm [heads, key dim, value dim]

The payload's CRC32 is the in-memory snapshot's checksum (`store.checksum`: the same bytes in
the same order), so it is computed once. A snapshot is stored under `snapshot_key(block hash)`:
a key derived from the block's, so the block and the state ending at it sit side by side in
a tier without one overwriting the other. The checks are the blocks' (`BlockFault`): a
damaged, foreign or misfiled snapshot is a counted miss, never a wrong state.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstack.kv.block_hash import BlockHash
from kvstack.kv.tiers.codec import DTYPE_CODES, HEADER, BlockFault
from kvstack.recurrent.plan import LinearState

SNAPSHOT_MAGIC = b"KVSTSNP\0"
SNAPSHOT_VERSION = 1
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


def snapshot_key(block_hash: BlockHash) -> bytes:
    """The tier key of the snapshot that ends at `block_hash` (32 bytes, like a block's)."""
    return hashlib.sha256(b"kvstack-state-snapshot-v1\0" + block_hash).digest()


@dataclass(frozen=True)
class SnapshotHeader:
    dtype: str  # the conv tails'
    num_layers: int
    num_heads: int
    key_dim: int
    value_dim: int
    fingerprint: str
    block_hash: BlockHash
    payload_len: int
    crc32: int


def parse_snapshot_header(data: bytes | bytearray | memoryview) -> SnapshotHeader:
    """The header of an encoded snapshot; raises BlockFault if it is not one."""
    if len(data) < HEADER.size:
        raise BlockFault("truncated", f"{len(data)} bytes is shorter than a snapshot header")
    (magic, version, dtype, num_layers, num_heads, key_dim, value_dim, fingerprint, block_hash,
     payload_len, crc) = HEADER.unpack_from(data)
    if magic != SNAPSHOT_MAGIC:
        raise BlockFault("bad_magic", "not a kvstack state snapshot")
    if version != SNAPSHOT_VERSION:
        raise BlockFault("version",
                         f"snapshot format version {version}, expected {SNAPSHOT_VERSION}")
    if dtype not in _DTYPE_NAMES:
        raise BlockFault("layout", f"unknown snapshot dtype code {dtype}")
    return SnapshotHeader(_DTYPE_NAMES[dtype], num_layers, num_heads, key_dim, value_dim,
                          fingerprint.hex(), block_hash, payload_len, crc)


class SnapshotFormat:
    """What one engine writes and accepts: its fingerprint and its states' shapes (from a
    zero state of the model, `RecurrentModel.new_states`)."""

    def __init__(self, fingerprint: str, template: Sequence[LinearState]) -> None:
        if len(bytes.fromhex(fingerprint)) != 32:
            raise ValueError("fingerprint must be 64 hex digits (a sha256)")
        self.fingerprint = fingerprint
        first = template[0]
        self.conv_shape, self.conv_dtype = tuple(first.conv.shape), first.conv.dtype
        self.ssm_shape = tuple(first.ssm.shape)
        self.num_layers = len(template)
        self.dtype_name = str(self.conv_dtype).removeprefix("torch.")
        self._conv_bytes = first.conv.numel() * first.conv.element_size()
        self._ssm_bytes = first.ssm.numel() * 4
        self.payload_bytes = self.num_layers * (self._conv_bytes + self._ssm_bytes)

    @property
    def layout(self) -> tuple[str, int, int, int, int]:
        return (self.dtype_name, self.num_layers, *self.ssm_shape)  # type: ignore[return-value]

    def encode(self, block_hash: BlockHash, states: Sequence[LinearState], crc: int) -> bytes:
        """Header + payload; `crc` is the states' `store.checksum` (the payload's CRC32)."""
        parts = []
        for st in states:
            for t in (st.conv, st.ssm):
                parts.append(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        payload = b"".join(parts)
        if len(payload) != self.payload_bytes:
            raise ValueError(f"states of {len(payload)} B, format needs {self.payload_bytes} B")
        header = HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, DTYPE_CODES[self.dtype_name],
                             self.num_layers, *self.ssm_shape, bytes.fromhex(self.fingerprint),
                             block_hash, len(payload), crc)
        return header + payload

    def decode(self, block_hash: BlockHash, data: bytes | bytearray | memoryview
               ) -> tuple[list[LinearState], int]:
        """The states stored for `block_hash` and their checksum, after every check; raises
        BlockFault."""
        h = parse_snapshot_header(data)
        if h.fingerprint != self.fingerprint:
            raise BlockFault("fingerprint", "snapshot of another model, tokenizer or dtype")
        if (h.dtype, h.num_layers, h.num_heads, h.key_dim, h.value_dim) != self.layout:
            raise BlockFault("layout", "snapshot of another state layout")
        if h.block_hash != block_hash:
            raise BlockFault("hash", "snapshot stored under another block's key")
        if h.payload_len != self.payload_bytes or len(data) != HEADER.size + self.payload_bytes:
            raise BlockFault("truncated", f"snapshot of {len(data)} B, expected "
                                          f"{HEADER.size + self.payload_bytes}")
        payload = memoryview(data)[HEADER.size:]
        if zlib.crc32(payload) != h.crc32:
            raise BlockFault("checksum", "payload checksum mismatch")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # one writable copy
        states, offset = [], 0
        for _ in range(self.num_layers):
            conv = raw[offset:offset + self._conv_bytes].clone()  # aligned for its dtype
            offset += self._conv_bytes
            ssm = raw[offset:offset + self._ssm_bytes].clone()
            offset += self._ssm_bytes
            states.append(LinearState(conv.view(self.conv_dtype).view(self.conv_shape),
                                      ssm.view(torch.float32).view(self.ssm_shape)))
        return states, h.crc32
