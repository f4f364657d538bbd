"""Attention in sliding-window mode (StreamingLLM, APPROXIMATE; geometry in `kv/window.py`).

Keys are stored without RoPE (the model rotates at position 0, the identity) and rotated here,
at read time, by their index in the query's retained cache: sinks at 0..S-1, the recent window
after them, the query last. For a recent key that index differs from the true position by the
same amount as the query's, so recent keys are rotated at their true position and queries at
theirs (minus a per-span shift that keeps angles small); only sinks need the query at another
index (min(p, S + recent - 1)). The two query rotations share one SDPA call by stacking them
along the head dimension against keys zero-padded on the other half:

    q_ext = [rot(q, sink index) | rot(q, p - shift)]        [.., 2D]
    k_ext = [rot(k, s) | 0]  for sinks,  [0 | rot(k, j - shift)]  for recent keys
    q_ext . k_ext = the score each key would get in its own part

Before anything slides out (p < window) every index equals the true position: full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.config import ModelConfig
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.window import SlidingWindow
from kvstack.layers.rope import inv_frequencies


@dataclass
class WindowSpan:
    """B sequences with m new queries each (decodes share one span, m = 1; a prefill chunk
    is a span of its own) and their n candidate keys (padded with slot 0, masked)."""

    rows: torch.Tensor  # [B, m] rows of the queries in the flattened batch
    slots: torch.Tensor  # [B, n] cache slots of the keys
    sink: torch.Tensor  # [B, n, 1, 1] True where the key is a sink
    key_cos: torch.Tensor  # [B, n, 1, D] (and key_sin): each key's rotation
    key_sin: torch.Tensor
    q_cos: torch.Tensor  # [B, m, 1, D] (and q_sin): the queries' rotation against recent keys
    q_sin: torch.Tensor
    q_sink_cos: torch.Tensor  # [B, m, 1, D] (and q_sink_sin): against the sinks
    q_sink_sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, m, n] True where the query sees the key


@dataclass(frozen=True)
class SpanRequest:
    """What the runner knows of one sequence this step."""

    rows: list[int]  # rows of its new tokens in the flattened batch
    start: int  # position of its first new token
    key_positions: torch.Tensor  # [n] positions its queries may see
    key_slots: torch.Tensor  # [n] their slots


class WindowRoPE:
    """cos/sin at any position, negative ones included, computed as `RotaryEmbedding`'s
    tables are (same float32 ops), in the model dtype."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.dtype = dtype

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [*P] -> cos, sin [*P, 1, D]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def key_positions(window: SlidingWindow, start: int, end: int) -> torch.Tensor:
    """Positions a query in [start, end) may see: the sinks, then the recent window of the
    first query through the last new token."""
    sinks = torch.arange(min(window.sink_tokens, end))
    # A sequence still shorter than the sinks (a first chunk of 1-3 tokens) has no recent part.
    low = min(max(window.sink_tokens, start - window.recent + 1), end)
    return torch.cat((sinks, torch.arange(low, end)))


def build_span(window: SlidingWindow, rope: WindowRoPE, parts: list[SpanRequest]) -> WindowSpan:
    """One span of sequences with the same number of new tokens."""
    num_q, num_k = len(parts[0].rows), max(len(p.key_positions) for p in parts)
    keys = torch.zeros(len(parts), num_k, dtype=torch.int64)
    slots = torch.zeros(len(parts), num_k, dtype=torch.int64)
    real = torch.zeros(len(parts), num_k, dtype=torch.bool)
    for i, p in enumerate(parts):
        n = len(p.key_positions)
        keys[i, :n], slots[i, :n], real[i, :n] = p.key_positions, p.key_slots, True
    queries = torch.tensor([[p.start + j for j in range(num_q)] for p in parts])  # [B, m]
    sinks, recent = window.sink_tokens, window.recent
    # Shift so the last query sits at index <= window - 1: small angles, any sequence length.
    shift = (queries[:, -1:] + 1 - window.window).clamp(min=0)  # [B, 1]
    sink = keys < sinks
    key_cos, key_sin = rope.table(torch.where(sink, keys, keys - shift))
    q_cos, q_sin = rope.table(queries - shift)
    q_sink_cos, q_sink_sin = rope.table(queries.clamp(max=window.window - 1))
    k, q = keys[:, None, :], queries[:, :, None]
    mask = real[:, None, :] & (k <= q) & (sink[:, None, :] | (k > q - recent))
    return WindowSpan(torch.tensor([p.rows for p in parts]), slots, sink[..., None, None],
                      key_cos, key_sin, q_cos, q_sin, q_sink_cos, q_sink_sin, mask[:, None])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def window_attention(
    layer: int, q: torch.Tensor, out: torch.Tensor, span: WindowSpan, kv_storage: KVCacheStorage
) -> None:
    """q, out: [T, H, D] of the whole step; fills the span's rows of `out`."""
    qs = q[span.rows]  # [B, m, H, D]
    k, v = kv_storage.read(layer, span.slots)  # [B, n, H_kv, D], unrotated
    if kv_storage.basis is not None:  # RoPE needs K in the model's basis
        k, v = k @ kv_storage.basis.T, v @ kv_storage.basis.T
    k = _rotate(k, span.key_cos, span.key_sin)
    zero = k.new_zeros(())
    k_ext = torch.cat((torch.where(span.sink, k, zero), torch.where(span.sink, zero, k)), dim=-1)
    q_ext = torch.cat((_rotate(qs, span.q_sink_cos, span.q_sink_sin),
                       _rotate(qs, span.q_cos, span.q_sin)), dim=-1)
    o = F.scaled_dot_product_attention(
        q_ext.transpose(1, 2), k_ext.transpose(1, 2), v.transpose(1, 2), attn_mask=span.mask,
        scale=q.shape[-1] ** -0.5, enable_gqa=True,
    )
    out[span.rows] = o.transpose(1, 2)
