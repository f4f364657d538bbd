"""Turning output tokens into text one token at a time, and finding stop strings in it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded in front of the first output token. Sentencepiece-style tokenizers
# drop the leading space of the first token of a decode; with a little context in front the
# first output token keeps it, as the text continues the prompt.
_PROMPT_CONTEXT_TOKENS = 5

# What a byte-level decoder shows for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """The one tokenizer method the detokenizer needs (transformers tokenizers have it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class NullDecoder:
    """Stands in for a tokenizer when an engine runs on token ids only: no text."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class IncrementalDetokenizer:
    """Streams the text of a request's output tokens, one delta per added token.

    Each `add` decodes a short window (a few tokens already emitted, then the tokens not yet
    emitted) twice, with and without the new part, and returns the difference, so its cost
    does not grow with the length of the output (vLLM's prefix_offset / read_offset scheme).

    Contracts:
    - A delta never ends inside a UTF-8 character: while the window's text ends with U+FFFD
      (a byte-level BPE token can carry part of a character) the text is held back and comes
      out with the token that completes it. Held bytes are never emitted if no token does.
    - For byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) the deltas join to
      `tokenizer.decode(output_ids, skip_special_tokens=...)`. Sentencepiece tokenizers keep
      the first token's leading space, which a standalone decode of the output drops.
    """

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the tail of the prompt is ever decoded; keep just that.
        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # token ids index map:  [ ... | prefix_offset ... read_offset | read_offset ... end ]
        #                                 already emitted, decoded        not yet emitted
        #                                 again as context
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes ('' while a character or a
        token boundary is still pending)."""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self._text += delta
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        # Drop tokens that will never be decoded again, so memory stays O(window).
        del self._token_ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that overlaps its last `new_chars` characters.

    Returns (index in `text` where the stop begins, the stop string), or None. Matches lying
    wholly before the new characters are ignored: they were checked when those arrived. Among
    stops beginning at the same index the one listed first wins. Empty stops never match.
    """
    best: tuple[int, str] | None = None
    new_start = len(text) - new_chars
    for stop in stops:
        if not stop:
            continue
        # A match ending after new_start begins no earlier than this.
        index = text.find(stop, max(0, new_start - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string.

    A streaming front end emits all but these, since the next tokens may complete a stop that
    must not be shown. A complete stop at the end is `find_stop`'s business, not counted here.
    """
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[len(text) - size :]):
                longest = size
                break
    return longest
