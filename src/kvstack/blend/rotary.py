"""Moving keys between positions: RoPE applied to keys stored before RoPE, and undone.

The tables are the model's own (`layers/rope.py`, same inverse frequencies), computed in
float32; rotating by a position and back is exact up to float rounding for fixed frequencies
(llama3 and linear scaling included).
"""

from __future__ import annotations

import torch

from kvstack.config import ModelConfig
from kvstack.layers.rope import RotaryEmbedding


class Rotary:
    def __init__(self, config: ModelConfig) -> None:
        self.rope = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta,
                                    config.rope_scaling)
        self.half = config.head_dim // 2

    def _turn(self, k: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        """k: [..., T, H, D] keys at `positions` [T] -> rotated by sign * position."""
        cos = self.rope.cos[positions][:, None, :]  # [T, 1, D]
        sin = self.rope.sin[positions][:, None, :] * sign
        x = k.float()
        turned = torch.cat((-x[..., self.half:], x[..., :self.half]), dim=-1)
        return (x * cos + turned * sin).to(k.dtype)

    def rotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys before RoPE -> the keys RoPE gives at `positions`."""
        return self._turn(k, positions, 1.0)

    def unrotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys after RoPE at `positions` -> before RoPE."""
        return self._turn(k, positions, -1.0)
