"""Chained, content-addressed block hashes.

block_hash = sha256(parent_hash || token ids || extra keys). Chaining makes a block's hash
name its whole prefix, so equal token blocks at different depths never collide; sha256 keeps
a collision (one tenant served another's cache) out of reach.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes

_ROOT = b"kvstack-root-v1"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...],
    known: list[BlockHash],
) -> list[BlockHash]:
    """Extend `known` (the hashes already computed for this sequence) to every full block."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra_keys))
    return hashes


def request_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    cache_salt: str | None,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """The hashes of a request's full blocks, as every holder of the prefix cache names them.

    The extra keys are the model's fingerprint and the request's cache salt, so blocks are
    shared only within one model and one tenant. The KV manager and the cluster router both
    call this: a router that hashed otherwise would predict hits no replica has.
    """
    return hash_full_blocks(token_ids, block_size, (fingerprint, cache_salt or ""), list(known))
