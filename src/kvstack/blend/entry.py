"""One chunk's cached K/V and the key it is cached under.

An entry holds, for every layer, the chunk's keys BEFORE RoPE and its values, computed
canonically: the chunk alone behind a fixed sink preamble (`canonical.py`), so it depends on
nothing but the chunk's tokens, the model and the preamble, and is placed at any position by
rotating its keys there. The key is sha256 of (a version tag, the engine fingerprint, which
names weights, dtypes and the KV dtype, the cache salt, the sink preamble, the chunk's token
ids): not chained to what precedes the chunk, so it is position-independent, and salted, so
tenants never share entries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

VERSION_TAG = b"kvstack-chunk-v1"


def chunk_key(fingerprint: str, cache_salt: str | None, sink_ids: Sequence[int],
              token_ids: Sequence[int]) -> bytes:
    h = hashlib.sha256(VERSION_TAG)
    for part in (fingerprint, cache_salt or ""):
        h.update(b"\x00" + part.encode())
    h.update(b"\x00" + np.asarray(sink_ids, dtype=np.int64).tobytes())
    h.update(b"\x00" + np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(frozen=True)
class ChunkEntry:
    key: bytes
    k: torch.Tensor  # [num_layers, num_tokens, H_kv, D], before RoPE
    v: torch.Tensor  # [num_layers, num_tokens, H_kv, D]

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
