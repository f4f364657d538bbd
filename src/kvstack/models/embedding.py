"""The token embedding every family shares: its rows for a step and its bytes beside the head.

The embedding is a dense tensor, GGUF blocks (`GGUFLinear`, rows dequantized on demand), or
absent when it is tied to an int8 head, whose rows are then widened with their scales."""

from __future__ import annotations

import torch

from kvstack.kernels.gguf import GGUFLinear
from kvstack.kernels.linear import Linear
from kvstack.models.linears import AnyLinear

Embedding = torch.Tensor | GGUFLinear | None


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def embedding_nbytes(embed: Embedding, lm_head: AnyLinear) -> int:
    """Bytes the embedding adds to the head's: 0 when it is the head's own weight (tied)."""
    if isinstance(embed, GGUFLinear) and embed is not lm_head:
        return embed.num_bytes
    if isinstance(embed, torch.Tensor) and embed is not getattr(lm_head, "weight", None):
        return tensor_nbytes(embed)
    return 0


def embed_rows(embed: Embedding, lm_head: AnyLinear, input_ids: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """input_ids: [T] -> [T, hidden] in `dtype`."""
    if isinstance(embed, GGUFLinear):
        return embed.rows(input_ids, dtype)
    if embed is not None:
        return embed[input_ids]
    assert isinstance(lm_head, Linear) and lm_head.scale is not None
    return (lm_head.weight[input_ids].float() * lm_head.scale[input_ids, None]).to(dtype)
