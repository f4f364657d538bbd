"""A sparse mixture-of-experts MLP (Qwen3-MoE's): a router picks the top-k of N SiLU-gated
expert MLPs per row, and the row's output is their weighted sum.

A step groups its rows by expert: each expert chosen by any row runs once, on all the rows
that chose it, so its weights are streamed once per step however many rows share it, and an
expert no row chose is never read. Each expert's linears are whatever the model built (a
`Linear` in the model dtype or int8, a `GGUFLinear` on its slice of the file's 3-D expert
blocks): decode-sized groups take their C kernels -- GGUF blocks all chosen experts in one
call per product (`gemv_many`: two parallel regions per layer, not two per expert) --, larger
ones PyTorch's matmul.

The math and its order are transformers' (Qwen3MoeTopKRouter, Qwen3MoeExperts): router logits
in the model dtype, softmax in float32, top-k, optional renormalization, weights cast back to
the model dtype; experts accumulated in increasing expert index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from kvstack.kernels.gguf import GGUFLinear, gemv_many


class ExpertLinear(Protocol):
    """A linear layer (x [T, in] -> [T, out]) and the bytes it holds."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def num_bytes(self) -> int: ...


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SparseMoE:
    """router: [num_experts, hidden] in the model dtype; experts: per expert (gate_up
    [2 I, hidden], down [hidden, I])."""

    def __init__(self, router: torch.Tensor, experts: Sequence[tuple[ExpertLinear, ExpertLinear]],
                 top_k: int, norm_topk_prob: bool,
                 act: Callable[[torch.Tensor], torch.Tensor] = silu_mul) -> None:
        if router.shape[0] != len(experts):
            raise ValueError(f"router has {router.shape[0]} rows for {len(experts)} experts")
        if not 0 < top_k <= len(experts):
            raise ValueError(f"top_k={top_k} must be in 1..{len(experts)}")
        self.router = router.contiguous()
        self.experts = list(experts)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = act

    @property
    def num_bytes(self) -> int:
        total = self.router.numel() * self.router.element_size()
        return total + sum(g.num_bytes + d.num_bytes for g, d in self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        logits = F.linear(x, self.router.to(x.dtype))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]: each chosen expert run once on its rows."""
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        picks = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        chosen = [e for e, n in enumerate(counts) if n]
        rows = torch.div(picks, self.top_k, rounding_mode="floor")
        offsets = [0]
        for e in chosen:
            offsets.append(offsets[-1] + counts[e])
        y = self._grouped(x[rows], chosen, offsets)
        if y is None:
            y = torch.cat([self._expert(e, x[rows[a:b]])
                           for e, a, b in zip(chosen, offsets, offsets[1:], strict=False)])
        y = y * weights.reshape(-1)[picks, None]
        out = torch.zeros_like(x)
        out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.experts[e]
        return down(self.act(gate_up(x).contiguous()).contiguous())

    def _grouped(self, x: torch.Tensor, chosen: list[int], offsets: list[int]
                 ) -> torch.Tensor | None:
        """Every chosen expert's products in two C calls (GGUF x8 blocks at decode size:
        `gemv_many`), each row's bits those of the per-expert calls; None: not applicable."""
        if not all(isinstance(lin, GGUFLinear) for e in chosen for lin in self.experts[e]):
            return None
        gate_ups = [cast(GGUFLinear, self.experts[e][0]) for e in chosen]
        hidden = gemv_many(gate_ups, x, offsets)
        if hidden is None:
            return None
        downs = [cast(GGUFLinear, self.experts[e][1]) for e in chosen]
        return gemv_many(downs, self.act(hidden).contiguous(), offsets)
