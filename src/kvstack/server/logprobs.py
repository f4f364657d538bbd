"""OpenAI's log-probability shapes: chat (`logprobs.content[i]` with its `top_logprobs`) and
legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), the echoed
prompt's in the legacy shape, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from typing import Any

from kvstack.outputs import CompletionOutput, PromptLogprobs


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: each printable stand-in char -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTES = _byte_decoder()


class TokenText:
    """A token's text (as the tokenizer decodes it alone) and its exact bytes: a byte-level
    BPE token may hold part of a UTF-8 character, which its text shows as U+FFFD."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._cache.get(token_id)
        if known is None:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in _BYTES for c in piece):
                raw = [_BYTES[c] for c in piece]
            else:
                raw = list(text.encode("utf-8"))
            known = self._cache[token_id] = (text, raw)
        return known

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(tokens: TokenText, completion: CompletionOutput,
                  start: int) -> dict[str, Any] | None:
    """`choices[i].logprobs` of a chat completion for the tokens from `start` on."""
    if completion.logprobs is None:
        return None
    ids, values = completion.token_ids[start:], completion.logprobs[start:]
    tops = (completion.top_logprobs or [])[start:] or [[] for _ in ids]
    content = [tokens.entry(t, lp) | {"top_logprobs": [tokens.entry(i, v) for i, v in top]}
               for t, lp, top in zip(ids, values, tops, strict=True)]
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: TokenText, completion: CompletionOutput, start: int,
                        offset: int) -> dict[str, Any] | None:
    """`choices[i].logprobs` of a completion from token `start` on; `offset`: characters of
    the text before it. `top_logprobs` maps each alternative's text to its log-probability,
    the chosen token included (so up to k + 1 entries), as OpenAI does."""
    if completion.logprobs is None:
        return None
    ids, values = completion.token_ids[start:], completion.logprobs[start:]
    texts = [tokens(t)[0] for t in ids]
    offsets = _offsets(texts, offset)
    top = None
    if completion.top_logprobs is not None:
        top = [{tokens(i)[0]: v for i, v in alternatives} | {text: lp}
               for alternatives, text, lp in zip(completion.top_logprobs[start:], texts, values,
                                                 strict=True)]
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": top,
            "text_offset": offsets}


def echo_logprobs(tokens: TokenText, prompt_ids: list[int],
                  prompt_logprobs: PromptLogprobs | None, k: int) -> dict[str, Any]:
    """A completion's `logprobs` for its echoed prompt (OpenAI's legacy shape): the first
    token's entries are null; each other's `top_logprobs` maps the k most likely tokens'
    texts and the token's own to their log-probabilities."""
    texts = [tokens(t)[0] for t in prompt_ids]
    entries = prompt_logprobs or [None] * len(prompt_ids)
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token, text, entry in zip(prompt_ids, texts, entries, strict=True):
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry[token].logprob)
        top = {tokens(t)[0]: v.logprob for t, v in entry.items()
               if t != token and v.rank is not None and v.rank <= k}
        tops.append(top | {text: entry[token].logprob})
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": _offsets(texts, 0)}


def joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two consecutive runs of legacy logprobs as one (`then`'s offsets already absolute)."""
    if then is None:
        return first
    return {key: first[key] + (then[key] or []) for key in first}


def vllm_prompt_logprobs(prompt_logprobs: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's JSON for prompt logprobs: per position null, or token id -> logprob, rank and
    decoded text."""
    return [None if entry is None else
            {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
             for t, v in entry.items()} for entry in prompt_logprobs]


def _offsets(texts: list[str], offset: int) -> list[int]:
    out = []
    for text in texts:
        out.append(offset)
        offset += len(text)
    return out
