"""Turns a scheduled step into tensors, runs the model and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvstack.blend.blender import Blender
from kvstack.drafts.verify import verify_greedy
from kvstack.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvstack.kv.groups import KVLayout
from kvstack.kv.storage.base import KVCacheStorage
from kvstack.kv.window import SlidingWindow
from kvstack.layers.attention import AttentionMetadata, PrefillSpan
from kvstack.layers.sampler import Sampler, top_logprobs
from kvstack.layers.window_attention import (
    SpanRequest,
    WindowRoPE,
    WindowSpan,
    build_span,
    key_positions,
)
from kvstack.models import CausalLM


@dataclass
class Sampled:
    """What one request gained in a step."""

    token_ids: list[int]  # accepted draft tokens (if any), then the model's own next token
    logprobs: list[float] | None  # of each token, when the request asked for logprobs
    num_rejected: int = 0  # draft tokens fed this step that the model did not accept
    # Per token, the `logprobs=k` most likely tokens at its position (k > 0 only).
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class StepResult:
    # One entry per scheduled request; None where the step did not reach a new token
    # (a prefill chunk that is not the last).
    samples: list[Sampled | None]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_storage: KVCacheStorage | None, sampler: Sampler,
                 window: SlidingWindow | None = None, blender: Blender | None = None,
                 layout: KVLayout | None = None) -> None:
        self.model = model
        self.layout = layout  # a hybrid layout: one block table per KV group
        # Per model layer: its place in a page and its KV group (fixed: computed once).
        self.layer_places = (list(zip(layout.tensor_of_layer(), layout.group_of_layer(),
                                      strict=True)) if layout is not None else [])
        self.blender = blender  # plans blended steps (`blend/`)
        self.kv_storage = kv_storage
        self.sampler = sampler
        self.block_size = kv_storage.block_size if kv_storage is not None else 0
        self._block_offsets = np.arange(self.block_size, dtype=np.int64)
        # A lossy cache is read back even by a prefill without a cached prefix (see attention).
        self.read_back = kv_storage is not None and kv_storage.lossy
        self.window = window
        self.window_rope = (WindowRoPE(model.config, model.dtype)
                            if window is not None else None)

    def run(self, batch: SchedulerOutput) -> StepResult:
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        if self.blender is not None:
            meta.blend = self.blender.plan_step(batch.scheduled, positions, meta)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_storage)
        result = StepResult([None] * len(batch.scheduled))
        if any(s.request.num_scored for s in batch.scheduled):
            self._record_scores(batch, hidden)
        if any(s.request.prompt_scores is not None for s in batch.scheduled):
            self._score_prompts(batch, hidden)
        if sample_rows.numel():
            self._sample(batch, self.model.compute_logits(hidden[sample_rows]), result)
        return result

    def _sample(self, batch: SchedulerOutput, logits: torch.Tensor, result: StepResult) -> None:
        """logits: one row per sampling request, or 1 + its draft tokens' rows for one that
        verifies drafts (`_prepare` lays them out in scheduled order)."""
        plain: list[int] = []  # indices into batch.scheduled
        plain_rows: list[int] = []
        row = 0
        for i, s in enumerate(batch.scheduled):
            if not s.samples:
                continue
            if s.num_draft_tokens:
                rows = logits[row:row + s.num_draft_tokens + 1]
                verified = verify_greedy(rows, s.draft_token_ids)
                result.samples[i] = Sampled(verified.token_ids,
                                            _logprobs(rows, verified.token_ids, s),
                                            verified.num_rejected,
                                            _top(rows[:len(verified.token_ids)], s))
                row += s.num_draft_tokens + 1
            else:
                plain.append(i)
                plain_rows.append(row)
                row += 1
        if not plain:
            return
        states = [batch.scheduled[i].request.sampling_state for i in plain]
        # Rows are taken in order, so all of them is the whole tensor: no copy (~70 us).
        rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
        tokens, logprobs = self.sampler(rows, states)
        ks = [s.sampling_params.logprobs or 0 for s in states]
        top = top_logprobs(rows, ks) if any(ks) else None
        for j, i in enumerate(plain):
            result.samples[i] = Sampled([tokens[j]],
                                        [logprobs[j]] if logprobs is not None else None,
                                        top_logprobs=[top[j]] if top and ks[j] else None)

    def _score_prompts(self, batch: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Each scoring request's rows of this step into its prompt scores (row p scores
        prompt token p + 1)."""
        row = 0
        for s in batch.scheduled:
            scores = s.request.prompt_scores
            if scores is not None and s.request.num_computed_tokens < scores.num_prompt_tokens:
                scores.score_step(s.request.num_computed_tokens,
                                  hidden[row:row + s.num_new_tokens], self.model.compute_logits)
            row += s.num_new_tokens

    def _record_scores(self, batch: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Log-prob rows of the scored prompt positions each request computed this step, into
        the request (`Request.record_scores`)."""
        row = 0
        for s in batch.scheduled:
            r = s.request
            first = r.num_prompt_tokens - r.num_scored
            lo = max(first, r.num_computed_tokens)
            hi = min(r.num_prompt_tokens, r.num_computed_tokens + s.num_new_tokens)
            if r.num_scored and lo < hi:
                rows = hidden[row + lo - r.num_computed_tokens: row + hi - r.num_computed_tokens]
                r.record_scores(lo - first, torch.log_softmax(self.model.compute_logits(rows), -1))
            row += s.num_new_tokens

    def _slots(self, block_ids: list[int], end: int) -> np.ndarray:
        """Slots of token positions [0, end) of a sequence with these blocks (int64). Built
        in NumPy: a decode step's bookkeeping is a handful of tiny arrays, where each torch
        op costs tens of microseconds of dispatch (a few percent of a GGUF token)."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        return (blocks[:, None] * self.block_size + self._block_offsets).ravel()[:end]

    def _prepare(
        self, batch: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        if self.window is not None:
            return self._prepare_window(batch)
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        for s in batch.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            row = len(ids)
            ids.extend(r.tokens_between(start, end - s.num_draft_tokens) + s.draft_token_ids)
            pos.extend(range(start, end))
            if s.samples:  # last known token's row, one per draft (a fork: its leader's)
                last = row + end - start - 1
                sample_rows.extend(range(last - s.num_draft_tokens, last + 1))
        meta = self._metadata(batch, lambda s: s.block_ids)
        if self.layout is not None and self.layout.is_hybrid:
            # One block table per KV group: each group's layers read theirs.
            metas = [meta] + [self._metadata(batch, _group_ids(g))
                              for g in range(1, self.layout.num_groups)]
            meta.layers = [(place, metas[group]) for place, group in self.layer_places]
        return (
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(pos, dtype=torch.int64),
            meta,
            torch.tensor(sample_rows, dtype=torch.int64),
        )

    def _metadata(self, batch: SchedulerOutput,
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
            use_kernels=getattr(self.model, "use_kernels", False),
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

    def _prepare_window(
        self, batch: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Window mode: every position is 0 for the model (RoPE at 0 is the identity, so K is
        stored unrotated); the spans carry the rotations attention applies."""
        assert self.window is not None and self.window_rope is not None
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
            slots = self._window_slots(s, keys)
            slot_parts.append(slots[len(keys) - (end - start):])
            part = SpanRequest(list(range(row, row + end - start)), start, keys, slots)
            if end - start == 1:
                decodes.append(part)
            else:
                spans.append(build_span(self.window, self.window_rope, [part]))
            if s.samples:
                sample_rows.append(row + end - start - 1)
        if decodes:
            spans.append(build_span(self.window, self.window_rope, decodes))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts), decode_rows=None, decode_slots=None,
            decode_mask=None, prefills=[], window=spans,
        )
        return (
            torch.tensor(ids, dtype=torch.int64),
            torch.zeros(len(ids), dtype=torch.int64),
            meta,
            torch.tensor(sample_rows, dtype=torch.int64),
        )

    def _window_slots(self, s: ScheduledRequest, positions: torch.Tensor) -> torch.Tensor:
        """Slots of live positions of a window-mode request (sinks, then its live blocks)."""
        assert self.window is not None
        bs = self.block_size
        logical = positions // bs
        index = torch.where(logical < self.window.num_sink_blocks, logical,
                            logical - s.num_dropped_blocks)
        block_ids = torch.tensor(s.block_ids, dtype=torch.int64)
        return block_ids[index] * bs + positions % bs


def _logprobs(logits: torch.Tensor, token_ids: list[int], s: ScheduledRequest
              ) -> list[float] | None:
    """Log-probabilities of the emitted tokens under the raw model distribution, row by row."""
    if s.request.sampling_params.logprobs is None:
        return None
    chosen = torch.tensor(token_ids)[:, None]
    rows = logits[: len(token_ids)]
    return torch.log_softmax(rows.float(), dim=-1).gather(1, chosen)[:, 0].tolist()


def _top(rows: torch.Tensor, s: ScheduledRequest) -> list[list[tuple[int, float]]] | None:
    """The top alternatives of each emitted token's row, when the request asked for k > 0."""
    k = s.request.sampling_params.logprobs
    return top_logprobs(rows, [k] * rows.shape[0]) if k else None


def _group_ids(group: int) -> Callable[[ScheduledRequest], list[int]]:
    """A scheduled request's block table in KV group `group` (> 0; group 0 is `block_ids`)."""
    return lambda s: s.group_block_ids[group - 1]
