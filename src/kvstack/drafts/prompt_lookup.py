"""Prompt lookup: drafts copied from the request's own text.

Answers that quote their context (RAG, summaries with citations, code edits) repeat long spans
of the prompt. When the last few tokens of the sequence (an n-gram, longest first from
MAX_NGRAM down to MIN_NGRAM) occurred earlier in the prompt or output, the tokens that
followed that occurrence (the most recent one) are a cheap guess at what comes next. The
engine verifies every draft (`verify.py`), so a wrong guess costs one wider step, never a
different token.
"""

from __future__ import annotations

from array import array
from typing import Protocol

from kvstack.drafts.state import DraftState
from kvstack.sampling_params import SamplingParams

# An n-gram of one token matches almost anywhere and drafts noise; past four, matches get rare
# without drafting better.
MAX_NGRAM = 4
MIN_NGRAM = 2
_ITEM = 4  # bytes per token id in the search buffer (array 'i')


class DraftingRequest(Protocol):
    sampling_params: SamplingParams

    def token_ids(self) -> list[int]: ...


def propose_drafts(request: DraftingRequest, state: DraftState) -> None:
    """Give a request that asked for prompt lookup its next draft (in its draft `state`),
    unless it still has one."""
    sp = request.sampling_params
    if not sp.prompt_lookup or state.draft_token_ids or not sp.verifies_drafts:
        return
    state.draft_token_ids = lookup(request.token_ids(), sp.prompt_lookup)


def lookup(tokens: list[int], max_draft: int, max_ngram: int = MAX_NGRAM,
           min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to `max_draft` tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens, trying n from `max_ngram` down to `min_ngram`; [] if none."""
    data = array("i", tokens).tobytes()  # bytes.rfind searches in C
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        start = _last_occurrence(data, data[-n * _ITEM:], len(tokens) - 1)
        if start is not None:
            return tokens[start + n:start + n + max_draft]
    return []


def _last_occurrence(data: bytes, pattern: bytes, end_token: int) -> int | None:
    """Token index of the last occurrence of `pattern` lying wholly before token `end_token`
    (so at least one token follows it), aligned to whole tokens."""
    stop = end_token * _ITEM
    while True:
        pos = data.rfind(pattern, 0, stop)
        if pos < 0:
            return None
        if pos % _ITEM == 0:
            return pos // _ITEM
        stop = pos + len(pattern) - 1  # a misaligned hit: look again, strictly before it
