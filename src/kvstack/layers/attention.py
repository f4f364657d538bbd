"""Attention over the paged KV cache, and the per-step metadata that drives it.

The linear layers run on all new tokens of a step flattened to [T, hidden] (no padding).
Attention groups them: all single-token decodes share one batched call; each prefill chunk
gets its own call (its queries attend causally to the cached prefix plus themselves). With a
lossy KV cache (quantized or cast) a prefill reads its own K/V back from the cache too, so every
query attends to exactly what later steps will read. Each KV mode has its own metadata type,
which attends its own way: block tables (`AttentionMetadata`), the approximate window mode
(`WindowModeMetadata`, `window_attention.py`) and a hybrid layout's groups
(`GroupedMetadata`); `paged_attention` asks none of them which it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvstack.kernels import ops as kernel_ops
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.layers.window_attention import WindowSpan, window_attention


@dataclass
class PrefillSpan:
    start: int  # first row of this sequence's new tokens in the flattened batch
    end: int
    context_len: int  # tokens in the sequence after this step (cached + new)
    slots: torch.Tensor | None  # [context_len] slots to read back; None: no cached prefix
    # [end - start] each query's position when they are not the span's last positions in a
    # row (a blended step keeps only some rows; `blend/`); None: context_len - (end - start) on.
    positions: torch.Tensor | None = None


class LayerHook(Protocol):
    """A feature's part in a step's layer loop, called by every model the same way: after
    each layer's Q/K/V it may keep only some rows from there on (blending's selective
    recompute, `blend/`), and it turns the last hidden states back into the step's rows."""

    meta: AttentionMetadata  # the metadata of the rows still computed

    def after_qkv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_storage: KVCacheStorage | None) -> torch.Tensor | None:
        """After layer `layer`'s Q/K/V of the current rows: the rows (indices into them) that
        go on from here, `meta` updated to them; None: all of them."""
        ...

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the rows computed to the end -> one row per original row."""
        ...


@dataclass
class AttentionMetadata:
    """A step over block tables (full attention; no KV cache: `slot_mapping` None)."""

    slot_mapping: torch.Tensor | None  # [T] where each new token's K/V go; None: no KV cache
    decode_rows: torch.Tensor | None  # [B_d] rows of decode tokens in the flattened batch
    decode_slots: torch.Tensor | None  # [B_d, max_ctx] slots to read (padded with slot 0)
    decode_mask: torch.Tensor | None  # [B_d, 1, 1, max_ctx] True where a key is real
    prefills: list[PrefillSpan]
    decode_lens: torch.Tensor | None = None  # [B_d] real keys per decode row (int64)
    use_kernels: bool = False  # the C decode kernel may run (False: PyTorch ops only)
    # The dtype prefill spans attend in when not q's (quantized weights' bf16 prefill,
    # `kernels.linear.prefill_attention_dtype`); the cache keeps K/V as written.
    prefill_dtype: torch.dtype | None = None
    # window -> (decode slots, lens) narrowed to it, filled on first use within the step
    window_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def decodes_only(self, num_rows: int) -> bool:
        """Every row of the step is one sequence's next token, in row order, over a cache
        (what the models' one-call decode steps take)."""
        rows = self.decode_rows
        return (rows is not None and not self.prefills and rows.numel() == num_rows
                and self.decode_lens is not None and self.slot_mapping is not None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_storage: KVCacheStorage | None, window: int | None,
               scale: float | None) -> torch.Tensor:
        if (kv_storage is not None and self.slot_mapping is not None
                and not _store_kernel(layer, k, v, self, kv_storage)):
            kv_storage.write(layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        if kv_storage is None or kv_storage.basis is None:
            return _attend(layer, q, k, v, self, kv_storage, window, scale, out)
        # K/V come back in the storage's orthonormal basis: meet them there (every span reads
        # them back, the cache being lossy), then turn the output back. The C decode kernel
        # does both turns itself, so a step of decodes only needs no product here.
        decoded = _decode_kernel(layer, q, out, self, kv_storage, window, scale)
        if decoded and not self.prefills:
            return out
        qb, turned = q @ kv_storage.basis, torch.empty_like(q)
        if not decoded:
            _decode_torch(layer, qb, turned, self, kv_storage, window, scale)
        _prefill_spans(layer, qb, k, v, self, kv_storage, window, scale, turned)
        turned = turned @ kv_storage.basis.T
        if decoded:
            turned[self.decode_rows] = out[self.decode_rows]
        return turned


@dataclass
class WindowModeMetadata:
    """A step in the approximate window mode (`window_attention.py`): every query goes
    through the spans, which carry the rotations attention applies."""

    slot_mapping: torch.Tensor  # [T] where each new token's (unrotated) K/V go
    spans: list[WindowSpan]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_storage: KVCacheStorage | None, window: int | None,
               scale: float | None) -> torch.Tensor:
        assert kv_storage is not None and window is None and scale is None
        kv_storage.write(layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        for span in self.spans:
            window_attention(layer, q, out, span, kv_storage)
        return out


@dataclass
class GroupedMetadata:
    """A step over a hybrid KV layout (`kv/groups.py`): per model layer, its place in a page
    (the storage layer it reads and writes) and the metadata of its group's block table."""

    layers: list[tuple[int, AttentionMetadata]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_storage: KVCacheStorage | None, window: int | None,
               scale: float | None) -> torch.Tensor:
        place, meta = self.layers[layer]
        return meta.attend(place, q, k, v, kv_storage, window, scale)


# What a model's forward gets for a step: one value per KV mode, each attending its own way.
StepMetadata = AttentionMetadata | WindowModeMetadata | GroupedMetadata


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: StepMetadata,
    kv_storage: KVCacheStorage | None,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, H_kv, D] for the step's new tokens -> out [T, H, D].

    `window`: the layer's own sliding window (a query sees its `window` most recent positions,
    itself included; exact, as the model was trained); `scale`: the score scale (default
    head_dim ** -0.5). Either one sends decodes through PyTorch rather than the C kernel.
    """
    return meta.attend(layer, q, k, v, kv_storage, window, scale)


def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            meta: AttentionMetadata, kv_storage: KVCacheStorage | None, window: int | None,
            scale: float | None, out: torch.Tensor) -> torch.Tensor:
    """Fills `out` (and returns it): the decode rows (the C kernel where it applies) and
    every prefill span."""
    if meta.decode_rows is not None:
        assert kv_storage is not None
        if not _decode_kernel(layer, q, out, meta, kv_storage, window, scale):
            _decode_torch(layer, q, out, meta, kv_storage, window, scale)
    _prefill_spans(layer, q, k, v, meta, kv_storage, window, scale, out)
    return out


def _decode_torch(layer: int, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
                  kv_storage: KVCacheStorage, window: int | None, scale: float | None) -> None:
    """The decode rows of `out` through PyTorch (a gathered copy of each row's context)."""
    if meta.decode_rows is None:
        return
    slots, mask = _decode_window(meta, window)
    kd, vd = kv_storage.read(layer, slots)  # [B, S, H_kv, D]
    qd = q[meta.decode_rows].unsqueeze(2)  # [B, H, 1, D]
    od = F.scaled_dot_product_attention(
        qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=True,
    )
    out[meta.decode_rows] = od.squeeze(2)


def _prefill_spans(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   meta: AttentionMetadata, kv_storage: KVCacheStorage | None,
                   window: int | None, scale: float | None, out: torch.Tensor) -> None:
    """Every prefill span's rows of `out`."""
    dtype = meta.prefill_dtype or q.dtype
    for span in meta.prefills:
        # 4-D [1, H, q, D] inputs: 3-D ones miss SDPA's fused CPU kernel (5x slower).
        qs = q[span.start : span.end].transpose(0, 1)[None].to(dtype)
        num_q = span.end - span.start
        if span.slots is None:
            ks = k[span.start : span.end].transpose(0, 1)[None].to(dtype)
            vs = v[span.start : span.end].transpose(0, 1)[None].to(dtype)
            if window is None or num_q <= window:
                os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                     enable_gqa=True)
            else:
                os_ = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=_prefill_mask(num_q, num_q, window), scale=scale,
                    enable_gqa=True)
        else:
            assert kv_storage is not None
            # A window layer reads only the keys its first query can still see. A blended step's
            # queries carry their own positions (`span.positions`): masked by position.
            if span.positions is None:
                first = 0 if window is None else max(0, span.context_len - num_q - window + 1)
                mask = _prefill_mask(num_q, span.context_len, window)[:, first:]
            else:
                first = 0
                mask = _position_mask(span.positions, span.context_len, window)
            kc, vc = kv_storage.read(layer, span.slots[first:])
            os_ = F.scaled_dot_product_attention(
                qs, kc.transpose(0, 1)[None].to(dtype), vc.transpose(0, 1)[None].to(dtype),
                attn_mask=mask, scale=scale, enable_gqa=True,
            )
        out[span.start : span.end] = os_[0].transpose(0, 1)


def _prefill_mask(num_q: int, context_len: int, window: int | None) -> torch.Tensor:
    """[num_q, context_len] True where a query sees a key: query i sits at position
    context_len - num_q + i and sees keys up to there (and, with a window, after
    position - window)."""
    return _position_mask(torch.arange(context_len - num_q, context_len), context_len, window)


def _position_mask(q_pos: torch.Tensor, context_len: int, window: int | None) -> torch.Tensor:
    """[len(q_pos), context_len] True where a query at position q_pos[i] sees a key: keys up to
    its position (and, with a window, after position - window)."""
    k_pos = torch.arange(context_len)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    return mask


def _decode_window(meta: AttentionMetadata, window: int | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode rows' slots and mask, narrowed to each row's window: columns no row can see
    are not read at all (decode slots are in position order from 0, so a key's column is its
    position, and a row's query sits at decode_lens - 1)."""
    assert meta.decode_slots is not None
    if window is None:
        return meta.decode_slots, meta.decode_mask
    assert meta.decode_mask is not None and meta.decode_lens is not None
    first = max(0, int(meta.decode_lens.min()) - window)
    k_pos = torch.arange(first, meta.decode_mask.shape[-1])[None, :]
    recent = k_pos > (meta.decode_lens[:, None] - 1 - window)
    return (meta.decode_slots[:, first:],
            meta.decode_mask[..., first:] & recent[:, None, None, :])


def _store_kernel(layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                  kv_storage: KVCacheStorage) -> bool:
    """`kv_storage.write` as one C call (two index_copy_ per layer cost more than the copy itself at
    decode sizes); False where it does not apply."""
    if not meta.use_kernels or meta.slot_mapping is None:
        return False
    tensors = kv_storage.layer_tensors(layer)
    if tensors is None or tensors[0].dtype != k.dtype or not kernel_ops.available(k.dtype):
        return False
    if k.stride()[1:] != (k.shape[2], 1) or v.stride() != k.stride():
        return False
    kernel_ops.store_kv(k, v, meta.slot_mapping, *tensors)
    return True


def _decode_kernel(layer: int, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
                   kv_storage: KVCacheStorage, window: int | None = None,
                   scale: float | None = None) -> bool:
    """Decode rows through the C kernel, reading K/V slots in place (no gathered copy of the
    context per step); a window layer gets each row's last `window` slots. Plain caches of
    q's dtype (or bfloat16 under float32), int8 / fp8 ones (dequantized in the kernel); False
    where it does not apply (other storages, kernels off)."""
    rows, slots, lens = meta.decode_rows, meta.decode_slots, meta.decode_lens
    if (not meta.use_kernels or rows is None or slots is None or lens is None
            or not kernel_ops.available(q.dtype)):
        return False
    tensors = kv_storage.stored_tensors(layer)  # a bfloat16 cache widens exactly, as `read`
    quantized = kv_storage.quantized_tensors(layer)
    if not (tensors is not None and kernel_ops.cache_readable(q.dtype, tensors[0].dtype)
            or quantized is not None):
        return False
    only_decodes = not meta.prefills and rows.numel() == q.shape[0]
    qd = (q if only_decodes else q[rows]).contiguous()
    if window is not None:
        slots, lens = window_slots(meta, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if quantized is not None:  # q and the output in the model's basis: the kernel turns them
        od = kernel_ops.decode_attention_quant(qd, *quantized, kv_storage.basis is not None,
                                               slots, lens, scale)
    else:
        assert tensors is not None
        od = kernel_ops.decode_attention(qd, *tensors, slots, lens, scale)
    if only_decodes:
        out.copy_(od)
    else:
        out[rows] = od
    return True


def window_slots(meta: AttentionMetadata, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode row's last `window` slots, left-aligned, and their counts: built once per
    step and window (every sliding layer of the step shares them)."""
    cached = meta.window_slots.get(window)
    if cached is None:
        assert meta.decode_slots is not None and meta.decode_lens is not None
        lens = meta.decode_lens.clamp(max=window)
        first = meta.decode_lens - lens
        width = max(int(lens.max()), 1)
        index = (first[:, None] + torch.arange(width)[None, :]).clamp(
            max=meta.decode_slots.shape[1] - 1)
        cached = meta.window_slots[window] = (
            meta.decode_slots.gather(1, index).contiguous(), lens.contiguous())
    return cached
