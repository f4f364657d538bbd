"""Computing chunk entries canonically: each chunk alone, right after a fixed sink preamble,
at positions len(sink) onward; so an entry depends only on the chunk, the model and the
preamble, never on the request or tenant that computed it.

The preamble matters: computed alone, a chunk's first token would take the attention-sink role
the real prompt's first token plays (every query dumps spare attention there), and its K/V
would be off for every later position; the preamble (the model's BOS token) takes that role.

Keys are captured after RoPE, as the model writes them into a scratch KV storage, and turned
back to before RoPE by the inverse rotation (exact up to float rounding; no hook in the model
is needed). Several chunks share one forward, each its own causal span.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstack.blend.entry import ChunkEntry
from kvstack.blend.rotary import Rotary
from kvstack.kv.storage import KVCacheStorage
from kvstack.layers.attention import AttentionMetadata, PrefillSpan
from kvstack.models.base import CausalLM

_BLOCK = 16  # scratch storage granularity; any size works


def compute_entries(model: CausalLM, rotary: Rotary, sink_ids: Sequence[int],
                    chunks: Sequence[tuple[bytes, Sequence[int]]]) -> list[ChunkEntry]:
    """Entries of (key, token ids) chunks, computed in one forward."""
    sink = list(sink_ids)
    seqs = [sink + list(ids) for _, ids in chunks]
    total = sum(len(s) for s in seqs)
    storage = KVCacheStorage(model.config, -(-total // _BLOCK), _BLOCK, model.dtype)
    spans, start = [], 0
    for seq in seqs:
        spans.append(PrefillSpan(start, start + len(seq), len(seq), None))
        start += len(seq)
    meta = AttentionMetadata(slot_mapping=torch.arange(total), decode_rows=None,
                             decode_slots=None, decode_mask=None, prefills=spans)
    ids = torch.tensor([t for seq in seqs for t in seq], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(seq)) for seq in seqs])
    model.forward(ids, positions, meta, storage)
    entries = []
    for (key, _), span in zip(chunks, spans, strict=True):
        first = span.start + len(sink)
        rows = slice(first, span.end)
        k = torch.stack([layer_k[rows] for layer_k in storage.k])
        v = torch.stack([layer_v[rows] for layer_v in storage.v])
        k = rotary.unrotate(k, positions[rows])
        entries.append(ChunkEntry(key, k.contiguous(), v.contiguous()))
    return entries
