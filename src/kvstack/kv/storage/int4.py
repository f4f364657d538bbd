"""int4 K/V in the manner of KIVI: keys quantized per channel over a block, values per token.

Two 4-bit codes a byte, asymmetric, x ~ q * scale + zero with q in 0..15:

    keys:   a scale and a zero per (block, KV head, channel): an outlier channel gets its own
            range instead of stretching every token's
    values: a scale and a zero per (token, KV head)

A block's key ranges need all of its tokens, so a block being filled lives in full precision
(`compute_dtype`) in a small window pool and is quantized when its last slot is written: each
sequence's newest 0..block_size-1 tokens stay exact. The pool holds one block per running
sequence (`max_num_seqs`); `release` (a freed block) hands its window block back.

Which blocks a write fills and which window block each partial block uses depends only on the
step's slots, the same in every layer, so the plan is made once (layer 0) and reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstack.config import ModelConfig
from kvstack.kv.dtypes import check_int4_head_dim
from kvstack.kv.storage.base import KVCacheStorage, gather

MIN_SCALE = 2.0**-14  # float16's smallest normal; a flat range quantizes in steps of 6e-5


def quantize_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """Codes over `dim`: (q uint8 0..15, scale, zero), scale/zero float16 with `dim` kept (1)."""
    x = x.float()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((high - low) / 15).clamp_(min=MIN_SCALE).to(torch.float16)
    zero = low.to(torch.float16)
    q = ((x - zero.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
    return q, scale, zero


def pack(q: torch.Tensor) -> torch.Tensor:
    """[..., D] codes -> [..., D/2] bytes: element 2i in the low nibble, 2i+1 in the high."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


@dataclass
class _WritePlan:
    seal_blocks: torch.Tensor  # [n] blocks this write fills: quantized now
    seal_slots: torch.Tensor  # [n * bs] their slots
    new_pos: torch.Tensor  # where rows of k/v go in the [n * bs] staging of the filled blocks
    new_rows: torch.Tensor
    old_pos: torch.Tensor  # where their earlier tokens (from the window) go in the staging
    old_src: torch.Tensor  # window slots of those tokens
    window_rows: torch.Tensor  # rows of k/v that stay in the window
    window_slots: torch.Tensor


@dataclass
class _SealLists:
    new_pos: list[int] = field(default_factory=list)
    new_rows: list[int] = field(default_factory=list)
    old_pos: list[int] = field(default_factory=list)
    old_src: list[int] = field(default_factory=list)


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class Int4KVStorage(KVCacheStorage):
    """`k`, `v`: [slots, H_kv, D/2] uint8; `k_scale`, `k_zero`: [num_blocks, H_kv, D] float16;
    `v_scale`, `v_zero`: [slots, H_kv] float16; `window_k`, `window_v`: [max_num_seqs *
    block_size, H_kv, D] in `compute_dtype`."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 compute_dtype: torch.dtype, max_num_seqs: int) -> None:
        check_int4_head_dim(model.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = torch.uint8
        self.compute_dtype = compute_dtype
        heads, dim, layers = model.num_kv_heads, model.head_dim, range(model.num_layers)
        slots = num_blocks * block_size

        def zeros(*shape: int, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype) for _ in layers]

        self.k, self.v = zeros(slots, heads, dim // 2, dtype=torch.uint8), zeros(
            slots, heads, dim // 2, dtype=torch.uint8)
        self.k_scale, self.k_zero = zeros(num_blocks, heads, dim), zeros(num_blocks, heads, dim)
        self.v_scale, self.v_zero = zeros(slots, heads), zeros(slots, heads)
        window_slots = max_num_seqs * block_size
        self.window_k = zeros(window_slots, heads, dim, dtype=compute_dtype)
        self.window_v = zeros(window_slots, heads, dim, dtype=compute_dtype)
        self._window_of: dict[int, int] = {}  # block id -> window block
        self._free_windows = list(range(max_num_seqs - 1, -1, -1))
        self._window_index = torch.full((num_blocks,), -1, dtype=torch.int64)
        self._plan: _WritePlan | None = None
        # Per slots tensor read this step: (slots, blocks, in-window mask, window slots).
        self._reads: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def lossy(self) -> bool:
        return True

    def stored_tensors(self, layer: int) -> None:
        return None

    @property
    def num_window_blocks_used(self) -> int:
        return len(self._window_of)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v, *self.k_scale, *self.k_zero, *self.v_scale, *self.v_zero,
                *self.window_k, *self.window_v]

    # -- write ------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A step writes layer 0 first and the same slots in every layer (as the model does)."""
        if layer == 0:
            self._plan = self._make_plan(slots)
        plan = self._plan
        assert plan is not None and len(plan.new_rows) + len(plan.window_rows) == len(slots)
        # Filled blocks first: they read their earlier tokens from a window block that a new
        # partial block of this same step may then reuse.
        if plan.seal_blocks.numel():
            self._seal(layer, k, v, plan)
        if plan.window_rows.numel():
            self.window_k[layer].index_copy_(0, plan.window_slots, k[plan.window_rows])
            self.window_v[layer].index_copy_(0, plan.window_slots, v[plan.window_rows])

    def _make_plan(self, slots: torch.Tensor) -> _WritePlan:
        bs = self.block_size
        rows: dict[int, list[tuple[int, int]]] = {}  # block -> (row, offset), writes in order
        for row, slot in enumerate(slots.tolist()):
            rows.setdefault(slot // bs, []).append((row, slot % bs))
        filled = [b for b, entries in rows.items() if max(o for _, o in entries) == bs - 1]
        seal = _SealLists()
        for i, block in enumerate(filled):
            entries = rows.pop(block)
            first = min(o for _, o in entries)
            window = self._window_of.pop(block, None)
            for row, offset in entries:
                seal.new_pos.append(i * bs + offset)
                seal.new_rows.append(row)
            if first > 0:
                if window is None:
                    raise RuntimeError(f"int4 KV: block {block} continues at offset {first} "
                                       "but holds no earlier tokens")
                seal.old_pos += range(i * bs, i * bs + first)
                seal.old_src += range(window * bs, window * bs + first)
            if window is not None:
                self._free_windows.append(window)
            self._window_index[block] = -1
        window_rows: list[int] = []
        window_slots: list[int] = []
        for block, entries in rows.items():  # partial blocks: they stay in the window
            window = self._window_of.get(block)
            if window is None:
                window = self._take_window(block, min(o for _, o in entries))
            for row, offset in entries:
                window_rows.append(row)
                window_slots.append(window * bs + offset)
        self._reads.clear()
        seal_blocks = _long(filled)
        return _WritePlan(
            seal_blocks=seal_blocks,
            seal_slots=(seal_blocks[:, None] * bs + torch.arange(bs)).flatten(),
            new_pos=_long(seal.new_pos), new_rows=_long(seal.new_rows),
            old_pos=_long(seal.old_pos), old_src=_long(seal.old_src),
            window_rows=_long(window_rows), window_slots=_long(window_slots),
        )

    def _take_window(self, block: int, first: int) -> int:
        if first != 0:
            raise RuntimeError(f"int4 KV: block {block} continues at offset {first} but holds "
                               "no earlier tokens")
        if not self._free_windows:
            raise RuntimeError(f"int4 KV: all {len(self._window_of)} window blocks are in use; "
                               "more sequences are filling blocks than max_num_seqs")
        window = self._free_windows.pop()
        self._window_of[block] = window
        self._window_index[block] = window
        return window

    def _seal(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: _WritePlan) -> None:
        n, bs = plan.seal_blocks.numel(), self.block_size
        staged = []
        for x, window in ((k, self.window_k[layer]), (v, self.window_v[layer])):
            buf = x.new_empty((n * bs, *x.shape[1:]))
            buf[plan.new_pos] = x[plan.new_rows]
            if plan.old_pos.numel():
                buf[plan.old_pos] = window[plan.old_src].to(x.dtype)
            staged.append(buf)
        kb, vb = staged
        q, scale, zero = quantize_int4(kb.view(n, bs, *kb.shape[1:]), dim=1)  # per channel
        self.k[layer].index_copy_(0, plan.seal_slots, pack(q).flatten(0, 1))
        self.k_scale[layer].index_copy_(0, plan.seal_blocks, scale.squeeze(1))
        self.k_zero[layer].index_copy_(0, plan.seal_blocks, zero.squeeze(1))
        q, scale, zero = quantize_int4(vb, dim=-1)  # per token
        self.v[layer].index_copy_(0, plan.seal_slots, pack(q))
        self.v_scale[layer].index_copy_(0, plan.seal_slots, scale.squeeze(-1))
        self.v_zero[layer].index_copy_(0, plan.seal_slots, zero.squeeze(-1))

    # -- read -------------------------------------------------------------------------------

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._reads.get(id(slots))
        if cached is None or cached[0] is not slots:
            blocks = slots // self.block_size
            index = self._window_index[blocks]
            inside = index >= 0
            window_slots = index[inside] * self.block_size + slots[inside] % self.block_size
            cached = (slots, blocks, inside, window_slots)
            self._reads[id(slots)] = cached
        _, blocks, inside, window_slots = cached
        k = torch.addcmul(gather(self.k_zero[layer], blocks).float(),
                          unpack(gather(self.k[layer], slots)),
                          gather(self.k_scale[layer], blocks).float())
        v = torch.addcmul(gather(self.v_zero[layer], slots).float().unsqueeze(-1),
                          unpack(gather(self.v[layer], slots)),
                          gather(self.v_scale[layer], slots).float().unsqueeze(-1))
        k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        if window_slots.numel():
            k[inside] = self.window_k[layer][window_slots]
            v[inside] = self.window_v[layer][window_slots]
        return k, v

    # -- blocks -----------------------------------------------------------------------------

    def release(self, block_ids: Sequence[int]) -> None:
        for block in block_ids:
            window = self._window_of.pop(block, None)
            if window is not None:
                self._free_windows.append(window)
                self._window_index[block] = -1
        self._reads.clear()

    def copy_block(self, src: int, dst: int) -> None:
        """A partly filled block lives in its window block: the copy gets a window block of its
        own holding the same full-precision tokens."""
        super().copy_block(src, dst)
        window = self._window_of.get(src)
        if window is None:
            return
        copy = self._take_window(dst, 0)
        bs = self.block_size
        for tensors in (self.window_k, self.window_v):
            for t in tensors:
                t[copy * bs:(copy + 1) * bs] = t[window * bs:(window + 1) * bs]
        self._reads.clear()

    def _slot_tensors(self) -> None:
        return None  # K's scales and zeros are per block, not per slot

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        # Per layer: K codes, V codes, K scales, K zeros (per channel), V scales, V zeros.
        start, end = block_id * self.block_size, (block_id + 1) * self.block_size
        views = []
        for layer in range(len(self.k)):
            views += [self.k[layer][start:end], self.v[layer][start:end],
                      self.k_scale[layer][block_id], self.k_zero[layer][block_id],
                      self.v_scale[layer][start:end], self.v_zero[layer][start:end]]
        return views


