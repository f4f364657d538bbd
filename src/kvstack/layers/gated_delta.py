"""Gated DeltaNet (linear attention) math for one sequence's span or a batch of decode rows.

A Gated DeltaNet layer keeps no per-token K/V: each sequence carries a fixed-size state, the
tail of its short causal convolution (the last kernel - 1 inputs) and the delta-rule matrix
S [value heads, key dim, value dim] (float32). Per token t (transformers' modeling_qwen3_5
is the reference): S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t,
with q and k L2-normed and q scaled by 1/sqrt(key dim). A prefill span runs the chunked
form (the UT transform over chunks of 64, then a scan over chunks), a decode row the
recurrent step; both start from, and leave, the sequence's state. `span` can stop at given
offsets and hand back the state there (block boundaries: the prefix cache's snapshots).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.recurrent.plan import LinearState

CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] after `tail` [C, K-1] -> (silu(depthwise conv) [T, C], the new tail)."""
    k = weight.shape[-1]
    full = torch.cat([tail, x.t().to(tail.dtype)], dim=-1)  # [C, K-1+T]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])
    return F.silu(out[0]).t().to(x.dtype), full[:, full.shape[1] - (k - 1):].clone()


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, Dk] (normed, q scaled), v [T, H, Dv], g, beta [T, H] (float32), state
    [H, Dk, Dv] -> (out [T, H, Dv], final state): the chunked form, as transformers'."""
    t = q.shape[0]
    pad = (CHUNK - t % CHUNK) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, T', D]
    beta, g = (F.pad(x.t(), (0, pad)) for x in (beta, g))  # [H, T']
    h = q.shape[0]
    n = q.shape[1] // CHUNK
    k_beta = (k * beta[..., None]).reshape(h, n, CHUNK, -1)
    v_beta = (v * beta[..., None]).reshape(h, n, CHUNK, -1)
    q, k = q.reshape(h, n, CHUNK, -1), k.reshape(h, n, CHUNK, -1)
    decay = g.reshape(h, n, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None],
                                          upper=False, unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    s = state
    for i in range(n):
        v_new = new_values[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, n * CHUNK, -1)[:, :t].transpose(0, 1), s


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state
    [B, H, Dk, Dv] -> (out [B, H, Dv], new state)."""
    s = state * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


@dataclass
class GatedDeltaWeights:
    """A layer's small tensors (the projections are the model's linears)."""

    conv: torch.Tensor  # [C, K]
    a_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    norm: torch.Tensor  # [Dv], the gated RMSNorm's weight
    num_k_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    eps: float


def split_heads(w: GatedDeltaWeights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
    """Convolved q/k/v channels [T, C] and gate inputs -> q, k [T, Hv, Dk] (normed, q
    scaled, key heads repeated to the value heads), v [T, Hv, Dv], g, beta [T, Hv]."""
    t, hk, dk, dv = mixed.shape[0], w.num_k_heads, w.key_dim, w.value_dim
    q, k, v = torch.split(mixed.float(), [hk * dk, hk * dk, mixed.shape[1] - 2 * hk * dk], -1)
    hv = v.shape[1] // dv
    q, k = l2norm(q.reshape(t, hk, dk)), l2norm(k.reshape(t, hk, dk))
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
    g = -w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias.float())
    return q * dk ** -0.5, k, v.reshape(t, hv, dv), g, b.float().sigmoid()


def gated_norm(w: GatedDeltaWeights, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """out [T, Hv, Dv] float32, z [T, Hv * Dv] -> RMSNorm(out) * w * silu(z), [T, Hv * Dv]."""
    x = out.to(dtype).float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + w.eps)).to(dtype)
    x = w.norm * x
    return (x.float() * F.silu(z.float().reshape(out.shape))).to(dtype).reshape(out.shape[0], -1)


def span(w: GatedDeltaWeights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         state: LinearState, stops: Sequence[int] = ()) -> tuple[torch.Tensor, list[LinearState]]:
    """One sequence's new rows (projected q/k/v channels `mixed` [T, C], gate inputs a, b
    [T, Hv]) from `state` (updated in place) -> (core output [T, Hv, Dv] float32, the state
    after each offset in `stops`, ascending within 1..T)."""
    conv_out, tail = causal_conv(mixed, state.conv, w.conv)
    q, k, v, g, beta = split_heads(w, conv_out, a, b)
    outs: list[torch.Tensor] = []
    snaps: list[LinearState] = []
    s, lo, t = state.ssm, 0, mixed.shape[0]
    for hi in sorted({*stops, t}):
        if hi - lo == 1:
            o, s1 = recurrent_step(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s[None])
            s = s1[0]
        else:
            o, s = chunked_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s)
        outs.append(o)
        if hi in stops:
            snaps.append(LinearState(_tail_at(state.conv, mixed, hi), s.clone()))
        lo = hi
    state.conv, state.ssm = tail, s
    return torch.cat(outs), snaps


def _tail_at(tail: torch.Tensor, mixed: torch.Tensor, offset: int) -> torch.Tensor:
    """The conv tail after the first `offset` new rows."""
    full = torch.cat([tail, mixed[:offset].t().to(tail.dtype)], dim=-1)
    return full[:, full.shape[1] - tail.shape[1]:].clone()


def decode(w: GatedDeltaWeights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           states: Sequence[LinearState]) -> torch.Tensor:
    """One new row per sequence (row i: `states[i]`, updated) -> core output [B, Hv, Dv]."""
    tails = torch.stack([st.conv for st in states])  # [B, C, K-1]
    full = torch.cat([tails, mixed[:, :, None].to(tails.dtype)], dim=-1)  # [B, C, K]
    conv = F.silu((full.to(w.conv.dtype) * w.conv).sum(-1)).to(mixed.dtype)
    q, k, v, g, beta = split_heads(w, conv, a, b)
    out, s = recurrent_step(q, k, v, g, beta, torch.stack([st.ssm for st in states]))
    for i, st in enumerate(states):
        st.conv, st.ssm = full[i, :, 1:].clone(), s[i]
    return out
