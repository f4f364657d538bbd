"""One blended step: place the hit chunks' K/V, compute, choose the placed tokens to
recompute, and carry on with those rows only (the model's layer loop calls `select`).

Before the forward, every hit chunk's K (rotated to its new positions) and V are written into
the request's slots for the layers past the check layer. The layers up to the check layer run
on every row, their fresh K/V overwriting the placed ones. At the check layer the selector
picks the placed tokens to recompute; from there on only those rows, the rest of the region
(template, missed chunks, question) and every row of other requests in the batch are
computed: their attention reads the placed K/V of the dropped tokens from the cache, with an
exact causal mask (a key is seen only by queries at or after its position; `PrefillSpan.
positions`). Hidden states come back for every row; dropped rows hold zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvstack.blend.rotary import Rotary
from kvstack.blend.selectors import (
    DYNAMIC,
    FIRST_K_DEFAULT,
    STATIC,
    Check,
    keep_count,
    stages,
    static_choice,
    top,
)
from kvstack.blend.state import BlendState, Placement
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.attention import AttentionMetadata
from kvstack.outputs import BlendUsage


@dataclass
class Region:
    """The blended request's rows in the step."""

    row0: int  # its first row in the batch
    num_rows: int
    start: int  # position of its first row
    slots: torch.Tensor  # [start + num_rows] slots of its positions from 0
    placements: list[Placement]
    placed: torch.Tensor  # [n] positions of the placed tokens, chunk after chunk
    forced: torch.Tensor  # [n] bool: placed tokens always computed (sampled or scored rows)
    question: torch.Tensor  # positions of the question's tokens
    num_prompt_rows: int  # rows before the prompt's end (outputs and drafts come after)


class BlendPlan:
    """The `LayerHook` of a blended step (see the module docstring)."""

    def __init__(self, state: BlendState, region: Region, meta: AttentionMetadata,
                 positions: torch.Tensor, rotary: Rotary, num_layers: int,
                 on_usage: Callable[[BlendUsage], None] | None = None) -> None:
        self.state = state
        self.on_usage = on_usage  # hears the request's usage after its first blended step
        self.region = region
        self.rotary = rotary
        self.num_layers = num_layers
        self.positions = positions
        self.meta0 = _reading_back(meta, region)
        self.meta = self.meta0
        self.alive = torch.arange(positions.shape[0])  # batch rows still computed
        self.placed_rows = region.row0 + region.placed - region.start
        self.placed_alive = torch.ones(region.placed.shape[0], dtype=torch.bool)
        params = state.params
        self.target = keep_count(params.recompute_ratio, region.placed.shape[0])
        fixed_k = params.selector == "first_k" and params.first_k is not None
        everything = self.target >= region.placed.shape[0] and not fixed_k
        static = params.selector in STATIC or self.target == 0
        # The layer that drops rows first (None: every placed token is recomputed: full
        # prefill), and each layer that drops rows -> placed tokens kept from there on.
        self.check_layer: int | None = None if everything else (
            0 if static else params.check_layer)
        self.stages = {} if self.check_layer is None else stages(
            params.selector, self.check_layer, params.recompute_ratio, region.placed.shape[0],
            num_layers)
        self.row_layers = 0  # region prompt rows computed, summed over layers
        self._pre: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- placement --------------------------------------------------------------------------

    def _entry_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Placed tokens' K (before RoPE) and V at `layer`, chunk after chunk."""
        if layer not in self._pre:
            p = self.region.placements
            k = torch.cat([c.entry.k[layer, c.offset:c.offset + c.count] for c in p])
            v = torch.cat([c.entry.v[layer, c.offset:c.offset + c.count] for c in p])
            self._pre = {layer: (k, v)}  # one layer at a time: entries are large
        return self._pre[layer]

    def placed_kv(self, layer: int, which: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._entry_kv(layer)
        return self.rotary.rotate(k[which], self.region.placed[which]), v[which]

    def place(self, kv_storage: KVCacheStorage) -> None:
        """Write the placed K/V for every layer past the check layer."""
        if self.check_layer is None:
            return
        every = torch.arange(self.region.placed.shape[0])
        slots = self.region.slots[self.region.placed]
        for layer in range(self.check_layer + 1, self.num_layers):
            k, v = self.placed_kv(layer, every)
            kv_storage.write(layer, slots, k, v)

    # -- the layer loop's hook --------------------------------------------------------------

    def after_qkv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_storage: KVCacheStorage | None) -> torch.Tensor | None:
        kept = None
        if layer in self.stages and kv_storage is not None:
            kept = self._check(layer, q, k, v, kv_storage, self.stages[layer])
        region = self.region
        in_prompt = (self.alive >= region.row0) & (self.alive < region.row0
                                                   + region.num_prompt_rows)
        self.row_layers += int(in_prompt.sum())
        if layer == self.num_layers - 1:
            self._record()
        return kept

    def _check(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_storage: KVCacheStorage, target: int) -> torch.Tensor | None:
        # Every current row's fresh K/V at this layer, the rows about to stop included.
        assert self.meta.slot_mapping is not None
        kv_storage.write(layer, self.meta.slot_mapping, k, v)
        keep = self._choose(layer, q, k, v, kv_storage, target) | self.region.forced
        drop = self.placed_alive & ~keep
        if not bool(drop.any()):
            return None
        self.placed_alive &= keep
        gone = torch.zeros(self.positions.shape[0], dtype=torch.bool)
        gone[self.placed_rows[drop]] = True
        kept = torch.nonzero(~gone[self.alive]).flatten()
        self.alive = self.alive[kept]
        self.meta = shrink(self.meta0, self.alive, self.positions)
        return kept

    def _choose(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_storage: KVCacheStorage, target: int) -> torch.Tensor:
        """[n] bool over the placed tokens: the `target` to recompute from `layer` on."""
        params, n = self.state.params, self.region.placed.shape[0]
        keep = torch.zeros(n, dtype=torch.bool)
        if target == 0 and not (params.selector == "first_k" and params.first_k):
            return keep
        if params.selector in STATIC:
            sizes = [c.count for c in self.region.placements]
            keep[static_choice(params.selector, params.recompute_ratio, params.first_k,
                               params.seed, sizes)] = True
            return keep
        pre = self.region.forced.clone()
        if params.selector == "first_k_deviation":  # each chunk's first tokens, then deviation
            sizes = [c.count for c in self.region.placements]
            pre[static_choice("first_k", 0.0, params.first_k or FIRST_K_DEFAULT, 0, sizes)] = True
            keep |= pre & ~self.region.forced
        candidates = torch.nonzero(self.placed_alive & ~pre).flatten()
        num = max(0, target - int(pre.sum()))
        rows = torch.searchsorted(self.alive, self.placed_rows[candidates])
        placed_k, placed_v = self.placed_kv(layer, candidates)
        check = Check(k[rows], v[rows], placed_k, placed_v,
                      lambda: self._attention(layer, q, kv_storage, candidates))
        keep[candidates[top(DYNAMIC[params.selector](check), num)]] = True
        return keep

    def _attention(self, layer: int, q: torch.Tensor, kv_storage: KVCacheStorage,
                   candidates: torch.Tensor) -> torch.Tensor:
        """[H_kv, n]: attention the question's queries pay each candidate at `layer`."""
        region = self.region
        q_rows = torch.searchsorted(self.alive, region.row0 + region.question - region.start)
        qq = q[q_rows].float()  # [m, H, D]
        context = int(region.question.max()) + 1
        keys, _ = kv_storage.read(layer, region.slots[:context])  # [N, H_kv, D]
        if kv_storage.basis is not None:
            qq = qq @ kv_storage.basis
        rep = qq.shape[1] // keys.shape[1]
        logits = torch.einsum("mhd,nhd->hmn", qq, keys.float().repeat_interleave(rep, dim=1))
        mask = torch.arange(context)[None, :] <= region.question[:, None]
        probs = torch.softmax((logits * qq.shape[-1] ** -0.5).masked_fill(~mask, -torch.inf),
                              dim=-1)
        mass = probs[:, :, region.placed[candidates]].sum(1)  # [H, n]
        return mass.view(keys.shape[1], rep, -1).sum(1)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.alive.shape[0] == self.positions.shape[0]:
            return hidden
        out = hidden.new_zeros(self.positions.shape[0], hidden.shape[1])
        out[self.alive] = hidden
        return out

    def _record(self) -> None:
        reused = self.region.placed[~self.placed_alive].tolist()
        usage = self.state.record(self.num_layers, reused, int(self.placed_alive.sum()),
                                  self.row_layers)
        if usage is not None and self.on_usage is not None:
            self.on_usage(usage)


def _reading_back(meta: AttentionMetadata, region: Region) -> AttentionMetadata:
    """The metadata with the region's span reading its context back from the cache (where
    the dropped tokens' placed K/V are)."""
    spans = []
    for span in meta.prefills:
        if span.start == region.row0 and span.slots is None:
            span = replace(span, slots=region.slots[:span.context_len])
        spans.append(span)
    return replace(meta, prefills=spans)


def shrink(meta: AttentionMetadata, alive: torch.Tensor,
           positions: torch.Tensor) -> AttentionMetadata:
    """`meta` (for every row of the step) for the rows `alive` (ascending batch rows)."""
    index = torch.full((positions.shape[0],), -1, dtype=torch.int64)
    index[alive] = torch.arange(alive.shape[0])
    spans = []
    for span in meta.prefills:
        rows = alive[(alive >= span.start) & (alive < span.end)]
        if rows.numel() == 0:
            continue
        start = int(index[rows[0]])
        whole = rows.numel() == span.end - span.start
        spans.append(replace(span, start=start, end=start + rows.numel(),
                             positions=span.positions if whole else positions[rows]))
    decode_rows = index[meta.decode_rows] if meta.decode_rows is not None else None
    assert meta.slot_mapping is not None
    return replace(meta, slot_mapping=meta.slot_mapping[alive], decode_rows=decode_rows,
                   prefills=spans)
