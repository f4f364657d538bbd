"""Which reused (placed) tokens a blended step recomputes.

Static selectors choose before the first layer, from positions alone:
- `first_k` (EPIC): the first tokens of each chunk (`first_k` of each, or the ratio of each).
- `random`: a seeded random share (a control).
Dynamic selectors choose at `check_layer`, after every token went through the layers up to
it, from the fresh K/V there against the placed ones:
- `kv_deviation` (CacheBlend): the tokens whose K and V deviate most (squared L2).
- `attention` (question-aware, as ProphetKV): the tokens the question's queries attend to
  most at that layer (summed over heads and question tokens).
- `first_k_deviation`: each chunk's first `first_k` tokens (default 4: a chunk's first tokens
  deviate most, they played the sink role when it was computed alone), then the rest of the
  budget by `kv_deviation`.
- `impact`: attention times value deviation: for each KV head, the attention the question
  pays a token times how far its placed value is from the fresh one, summed over heads: an
  estimate of how much the question's attention output moves when the token is not
  recomputed.
- `gradual` (CacheBlend's gradual filtering): `kv_deviation` twice: at `check_layer` it keeps
  `GRADUAL_WIDEN` times the ratio, and `GRADUAL_GAP` layers later, from the deviations there
  (the kept tokens were recomputed up to it), the ratio. A token that only looks unimportant
  at the first check layer gets a second look at a deeper one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

STATIC = ("first_k", "random")
FIRST_K_DEFAULT = 4  # first_k_deviation's tokens per chunk when first_k is not given
# `gradual`: keep GRADUAL_WIDEN x the ratio at the check layer, the ratio from GRADUAL_GAP
# layers later on.
GRADUAL_WIDEN = 2.0
GRADUAL_GAP = 3


@dataclass
class Check:
    """What a dynamic selector sees of the candidates (placed tokens still computed) at the
    check layer; tensors are computed on first use."""

    fresh_k: torch.Tensor  # [n, H_kv, D] after RoPE, at the candidates' positions
    fresh_v: torch.Tensor
    placed_k: torch.Tensor  # the placed ones, rotated to the same positions
    placed_v: torch.Tensor
    # -> [H_kv, n] attention mass the question's queries put on each candidate
    attention: Callable[[], torch.Tensor]


def _deviation(check: Check) -> torch.Tensor:
    dk = (check.fresh_k.float() - check.placed_k.float()).pow(2).sum((1, 2))
    dv = (check.fresh_v.float() - check.placed_v.float()).pow(2).sum((1, 2))
    return dk + dv


def _attention(check: Check) -> torch.Tensor:
    return check.attention().sum(0)


def _impact(check: Check) -> torch.Tensor:
    dv = (check.fresh_v.float() - check.placed_v.float()).norm(dim=-1)  # [n, H_kv]
    impact: torch.Tensor = (check.attention() * dv.T).sum(0)  # torch types `*` loosely
    return impact


DYNAMIC: dict[str, Callable[[Check], torch.Tensor]] = {
    "kv_deviation": _deviation,
    "first_k_deviation": _deviation,
    "attention": _attention,
    "impact": _impact,
    "gradual": _deviation,
}


def stages(selector: str, check_layer: int, ratio: float, num: int, num_layers: int
           ) -> dict[int, int]:
    """Each layer where placed tokens stop being computed -> how many of `num` are kept from
    there on: one stage at `check_layer`, two for `gradual`."""
    final = keep_count(ratio, num)
    later = check_layer + GRADUAL_GAP
    if selector != "gradual" or later >= num_layers:
        return {check_layer: final}
    return {check_layer: keep_count(min(1.0, GRADUAL_WIDEN * ratio), num), later: final}


def top(scores: torch.Tensor, num: int) -> torch.Tensor:
    """Indices of the `num` highest scores, ties to the earlier index, in ascending order."""
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:num].sort().values


def static_choice(selector: str, ratio: float, first_k: int | None, seed: int,
                  chunk_sizes: list[int]) -> torch.Tensor:
    """Candidates (indices over the placed tokens, chunk after chunk) a static selector keeps."""
    total = sum(chunk_sizes)
    if selector == "random":
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(total, generator=generator)[:keep_count(ratio, total)].sort().values
    picks, start = [], 0
    for size in chunk_sizes:
        num = min(first_k, size) if first_k is not None else keep_count(ratio, size)
        picks.append(torch.arange(start, start + num))
        start += size
    return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.int64)


def keep_count(ratio: float, num: int) -> int:
    """Tokens recomputed out of `num` at this ratio (rounded half up)."""
    return min(num, math.floor(ratio * num + 0.5))
