"""Per-request matchers and the step's masks, computed while the model runs.

A `Guide` follows one request: it consumes the request's output tokens as they appear and
answers `allowed_tokens` for the sampler. The engine calls `StructuredBackend.prepare` with
the step's guides right after scheduling; one background thread then catches every guide up
on its new tokens and fills all their masks in one llguidance call (which releases the GIL
and spreads the matchers over its own threads), while the engine thread runs the forward
pass. The sampler's first `allowed_tokens` waits for that work, so the masks cost the step
only what outlasts the forward pass.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvstack.errors import InvalidRequestError
from kvstack.sampling_params import StructuredOutputsParams
from kvstack.structured.grammars import Grammar, compile_grammar, llguidance

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)
MAX_CACHED_GRAMMARS = 64


class _MaskBatch:
    """The bitmasks of one step's guides: [rows, ceil(V / 32)] int32, one bit per token."""

    def __init__(self, num_rows: int, num_words: int) -> None:
        self.bits = torch.zeros((num_rows, num_words), dtype=torch.int32)
        self.done: Future[None] | None = None

    def row(self, index: int, vocab_size: int) -> torch.Tensor:
        if self.done is not None:
            self.done.result()  # re-raises a failure of the background job
        words = self.bits[index]
        return ((words.unsqueeze(-1) >> _BITS) & 1).flatten()[:vocab_size].bool()


class Guide:
    """One request's matcher (a `layers.sampler.TokenGuide`). `output_token_ids` is the
    request's own list; the guide consumes what it has not seen yet before each mask."""

    def __init__(self, matcher: Any, output_token_ids: list[int], eos_token_id: int) -> None:
        self.matcher = matcher
        self.output_token_ids = output_token_ids
        self.eos_token_id = eos_token_id
        self.num_consumed = 0
        self._batch: tuple[_MaskBatch, int] | None = None

    def catch_up(self) -> None:
        """Consume the output tokens appended since the last mask."""
        new = self.output_token_ids[self.num_consumed:]
        self.num_consumed += len(new)
        if new and not self.matcher.is_error() and not self.matcher.consume_tokens(new):
            logger.warning("structured output: token outside the constraint (%s)",
                           self.matcher.get_error())

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        if self._batch is None:  # not prepared this step: compute it now
            self._batch = (_MaskBatch(1, -(-vocab_size // 32)), 0)
            self.catch_up()
            _fill(self._batch[0], [self], None)
        batch, index = self._batch
        self._batch = None
        return batch.row(index, vocab_size)


class StructuredBackend:
    """llguidance bound to one engine's tokenizer: compiles constraints (cached) into guides,
    and computes a step's masks in the background."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        llg = llguidance()
        from llguidance.hf import from_tokenizer

        # Converting the vocabulary takes about a second: done once, on the first constraint.
        self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._executor = llg.LLExecutor()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstack-masks")
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        # Off: `prepare` does nothing and each guide computes its mask on the engine thread
        # when the sampler asks (`bench structured` measures what the overlap saves).
        self.overlap = True

    @classmethod
    def for_tokenizer(cls, tokenizer: Any | None, vocab_size: int,
                      eos_token_ids: Iterable[int]) -> StructuredBackend:
        """The backend of an engine's tokenizer (its own end-of-sequence token first)."""
        if tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        eos = tokenizer.eos_token_id
        return cls(tokenizer, vocab_size, eos if eos is not None else min(eos_token_ids))

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The checked grammar of a constraint (`InvalidRequestError` if bad); the last
        MAX_CACHED_GRAMMARS are kept, so a tool's schema compiles once."""
        key = repr((spec.kind, spec.json, spec.regex, spec.choice, spec.grammar, spec.strict))
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = compile_grammar(spec, self.tokenizer)
            self._grammars[key] = grammar
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return grammar

    def guide(self, grammar: Grammar, request: Any) -> Guide:
        """A guide for `request` (anything with an `output_token_ids` list it appends to)."""
        return Guide(grammar.template.deep_copy(), request.output_token_ids, self.eos_token_id)

    def prepare(self, guides: list[Guide]) -> None:
        """Start computing these guides' next masks; each guide's `allowed_tokens` waits."""
        if not guides or not self.overlap:
            return
        batch = _MaskBatch(len(guides), -(-self.vocab_size // 32))
        for i, guide in enumerate(guides):
            guide._batch = (batch, i)
        batch.done = self._thread.submit(_catch_up_and_fill, batch, guides, self._executor)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _catch_up_and_fill(batch: _MaskBatch, guides: list[Guide], executor: Any) -> None:
    for guide in guides:
        guide.catch_up()
    _fill(batch, guides, executor)


def _fill(batch: _MaskBatch, guides: list[Guide], executor: Any) -> None:
    """Fill the batch's rows, one per guide; a matcher in an error state allows only the
    end-of-sequence token, so its request ends instead of sampling from nothing."""
    bits = batch.bits
    pairs = [(g.matcher, i) for i, g in enumerate(guides) if not g.matcher.is_error()]
    if executor is not None and pairs:
        executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), bits.shape[1] * 4,
                                         bits.shape[0])
    else:
        for matcher, i in pairs:
            row = bits[i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    empty = (bits == 0).all(dim=1).nonzero().flatten().tolist()
    for i in empty:
        eos = guides[i].eos_token_id
        bit = eos % 32
        bits[i, eos // 32] = -(1 << 31) if bit == 31 else 1 << bit  # int32: bit 31 is the sign
