"""A scheduled step into the model's inputs, one builder per KV mode.

Each builder turns a `SchedulerOutput` into token ids, positions, the mode's attention
metadata (`layers/attention.py`) and the rows to sample, reading each request's opaque
`KVBlocks` its own way. `engine/builder.py` picks the builder with the KV mode; the runner
calls `prepare` and never asks which it got. A new KV mode adds its builder here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kvstack.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvstack.kv.groups import KVLayout
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.window import SlidingWindow
from kvstack.layers.attention import (
    AttentionMetadata,
    GroupedMetadata,
    PrefillSpan,
    StepMetadata,
    WindowModeMetadata,
)
from kvstack.layers.window_attention import (
    SpanRequest,
    WindowRoPE,
    WindowSpan,
    build_span,
    key_positions,
)
from kvstack.models import CausalLM

# input ids [T], positions [T], the step's attention metadata, rows to sample [S]
StepInputs = tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]


class StepBuilder(Protocol):
    def prepare(self, batch: SchedulerOutput) -> StepInputs: ...


class PagedSteps:
    """Block tables, one per request (full attention; `kv_storage` None: no KV cache, every
    span computed whole)."""

    def __init__(self, model: CausalLM, kv_storage: KVCacheStorage | None) -> None:
        self.kv_storage = kv_storage
        self.use_kernels = getattr(model, "use_kernels", False)
        self.prefill_dtype = getattr(model, "prefill_dtype", None)
        self.block_size = kv_storage.block_size if kv_storage is not None else 0
        self._block_offsets = np.arange(self.block_size, dtype=np.int64)
        # A lossy cache is read back even by a prefill without a cached prefix (see attention).
        self.read_back = kv_storage is not None and kv_storage.lossy

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        ids, pos, sample_rows = _rows(batch)
        return ids, pos, self.metadata(batch, lambda s: s.blocks.block_ids), sample_rows

    def _slots(self, block_ids: list[int], end: int) -> np.ndarray:
        """Slots of token positions [0, end) of a sequence with these blocks (int64). Built
        in NumPy: a decode step's bookkeeping is a handful of tiny arrays, where each torch
        op costs tens of microseconds of dispatch (a few percent of a GGUF token)."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        return (blocks[:, None] * self.block_size + self._block_offsets).ravel()[:end]

    def metadata(self, batch: SchedulerOutput,
                 block_ids: Callable[[ScheduledRequest], list[int]]) -> AttentionMetadata:
        """Where the step's K/V go and what each row reads, through these block tables."""
        slot_parts: list[np.ndarray] = []
        decode_rows: list[int] = []
        decode_ctx: list[np.ndarray] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for s in batch.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            known_end = end - s.num_draft_tokens
            if self.kv_storage is not None:
                seq_slots = self._slots(block_ids(s), end)
                slot_parts.append(seq_slots[start:end])
                # Decode rows: a lone known token past position 0, and every draft token, each
                # reading its own context exactly as a decode step would (so verifying a draft
                # computes what decoding it would); the rest is a prefill span.
                first_decode = start if known_end - start == 1 and start > 0 else known_end
                if first_decode > start:
                    read_back = start > 0 or self.read_back
                    context = torch.from_numpy(seq_slots[:first_decode]) if read_back else None
                    prefills.append(PrefillSpan(row, row + first_decode - start, first_decode,
                                                context))
                for position in range(first_decode, end):
                    decode_rows.append(row + position - start)
                    decode_ctx.append(seq_slots[:position + 1])
            else:
                prefills.append(PrefillSpan(row, row + end - start, end, None))
            row += end - start
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)) if slot_parts else None,
            decode_rows=None, decode_slots=None, decode_mask=None, prefills=prefills,
            use_kernels=self.use_kernels, prefill_dtype=self.prefill_dtype,
        )
        if decode_rows:
            lens = np.array([len(c) for c in decode_ctx], dtype=np.int64)
            slots = np.zeros((len(decode_ctx), int(lens.max())), dtype=np.int64)
            for i, c in enumerate(decode_ctx):
                slots[i, : len(c)] = c
            mask = (np.arange(slots.shape[1]) < lens[:, None]).reshape(len(lens), 1, 1, -1)
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.int64)
            meta.decode_slots = torch.from_numpy(slots)
            meta.decode_mask = torch.from_numpy(mask)
            meta.decode_lens = torch.from_numpy(lens)
        return meta


class GroupedSteps(PagedSteps):
    """A hybrid KV layout: one block table per KV group; each group's layers read theirs."""

    def __init__(self, model: CausalLM, kv_storage: KVCacheStorage, layout: KVLayout) -> None:
        super().__init__(model, kv_storage)
        self.num_groups = layout.num_groups
        # Per model layer: its place in a page and its KV group (fixed: computed once).
        self.layer_places = list(zip(layout.tensor_of_layer(), layout.group_of_layer(),
                                     strict=True))

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        ids, pos, sample_rows = _rows(batch)
        metas = [self.metadata(batch, lambda s: s.blocks.block_ids)]
        metas += [self.metadata(batch, _group_ids(g)) for g in range(1, self.num_groups)]
        meta = GroupedMetadata([(place, metas[group]) for place, group in self.layer_places])
        return ids, pos, meta, sample_rows


class WindowSteps:
    """The approximate window mode: every position is 0 for the model (RoPE at 0 is the
    identity, so K is stored unrotated); the spans carry the rotations attention applies."""

    def __init__(self, model: CausalLM, kv_storage: KVCacheStorage,
                 window: SlidingWindow) -> None:
        self.block_size = kv_storage.block_size
        self.window = window
        self.rope = WindowRoPE(model.config, model.dtype)

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decodes: list[SpanRequest] = []
        spans: list[WindowSpan] = []
        for s in batch.scheduled:
            if s.num_new_tokens == 0:  # a parallel sample forked this step: its leader's row
                sample_rows.append(len(ids) - 1)
                continue
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            row = len(ids)
            ids.extend(r.tokens_between(start, end))
            keys = key_positions(self.window, start, end)  # the new tokens are the last keys
            slots = self._slots(s, keys)
            slot_parts.append(slots[len(keys) - (end - start):])
            part = SpanRequest(list(range(row, row + end - start)), start, keys, slots)
            if end - start == 1:
                decodes.append(part)
            else:
                spans.append(build_span(self.window, self.rope, [part]))
            if s.samples:
                sample_rows.append(row + end - start - 1)
        if decodes:
            spans.append(build_span(self.window, self.rope, decodes))
        return (
            torch.tensor(ids, dtype=torch.int64),
            torch.zeros(len(ids), dtype=torch.int64),
            WindowModeMetadata(torch.cat(slot_parts), spans),
            torch.tensor(sample_rows, dtype=torch.int64),
        )

    def _slots(self, s: ScheduledRequest, positions: torch.Tensor) -> torch.Tensor:
        """Slots of live positions of a window-mode request (sinks, then its live blocks)."""
        bs = self.block_size
        logical = positions // bs
        index = torch.where(logical < self.window.num_sink_blocks, logical,
                            logical - s.blocks.num_dropped_blocks)
        block_ids = torch.tensor(s.blocks.block_ids, dtype=torch.int64)
        return block_ids[index] * bs + positions % bs


def _rows(batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's token ids and positions, and the rows to sample: each sampling request's
    last known token's row, one more per draft (a fork: its leader's)."""
    ids: list[int] = []
    pos: list[int] = []
    sample_rows: list[int] = []
    for s in batch.scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        row = len(ids)
        ids.extend(r.tokens_between(start, end - s.num_draft_tokens) + s.draft_token_ids)
        pos.extend(range(start, end))
        if s.samples:
            last = row + end - start - 1
            sample_rows.extend(range(last - s.num_draft_tokens, last + 1))
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
            torch.tensor(sample_rows, dtype=torch.int64))


def _group_ids(group: int) -> Callable[[ScheduledRequest], list[int]]:
    """A scheduled request's block table in KV group `group` (> 0; group 0 is `block_ids`)."""
    return lambda s: s.blocks.group_block_ids[group - 1]
