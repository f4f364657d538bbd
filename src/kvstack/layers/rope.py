"""Rotary position embeddings (HF "rotate_half" convention), incl. llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvstack.errors import UnsupportedModelError


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], float32, computed as transformers does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (llama3, linear)")


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables, indexed by absolute position."""

    def __init__(
        self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_len, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, D]
        self.cos = emb.cos()
        self.sin = emb.sin()
        self.half = head_dim // 2

    def table(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, D]: looked up once per step, used by all layers."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, H_kv, D], cos/sin from `table` -> rotated (q, k)."""
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)
