"""Quality measures shared by the evaluations: perplexity on a held-out text and greedy
agreement with a reference run.

The held-out text is Python's own documentation (`pydoc_data.topics`, shipped with CPython), so
it needs no download and is the same on every machine. Perplexity comes from the engine's
`prompt_logprobs`, i.e. the same forward pass that serves requests: build the `LLM` with a small
`max_num_batched_tokens` and each window is prefilled in chunks whose attention reads the
earlier chunks back from the KV cache, so a lossy cache (quantized, windowed) shows in the score.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstack.argtypes import DEFAULT_MODEL, positive_int
from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM

# A fixed prompt set for greedy agreement: short chat questions of different kinds.
AGREEMENT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three uses of copper.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)


def heldout_text() -> str:
    """The documentation topics of this Python, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def heldout_token_ids(tokenizer: Any, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of `heldout_text()` (no special tokens)."""
    if num_tokens < 2:
        raise InvalidRequestError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    if tokenizer is None:
        raise InvalidRequestError("perplexity on text needs a model with a tokenizer")
    text = heldout_text()
    # Tokenizing the whole text takes seconds; a prefix 8 chars per token is ample.
    ids = tokenizer.encode(text[: num_tokens * 8], add_special_tokens=False)
    if len(ids) < num_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
    return list(ids[:num_tokens])


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_tokens: int  # tokens scored (each window's first token has no context and is skipped)


def text_windows(token_ids: Sequence[int], window: int) -> list[list[int]]:
    """`token_ids` in consecutive windows of `window` tokens, each scored as one prompt (a
    last window under 2 tokens has nothing to score and is dropped)."""
    if window < 2:
        raise InvalidRequestError(f"window must be at least 2 tokens, got {window}")
    windows = [list(token_ids[i : i + window]) for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise InvalidRequestError("perplexity needs at least 2 tokens of text")
    return windows


def perplexity(llm: LLM, token_ids: Sequence[int], window: int = 1024) -> PerplexityResult:
    """Perplexity of `token_ids` split into `text_windows` (all windows in one batch)."""
    windows = text_windows(token_ids, window)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    scores = [lp for out in outputs for lp in (out.prompt_token_logprobs or [])[1:]]
    if any(lp is None for lp in scores):
        raise AssertionError("engine left a prompt position unscored")
    mean_nll = -math.fsum(lp for lp in scores if lp is not None) / len(scores)
    return PerplexityResult(math.exp(mean_nll), mean_nll, len(scores))


@dataclass(frozen=True)
class Agreement:
    token_agreement: float  # share of reference tokens reproduced before the first divergence
    exact_matches: int  # prompts whose whole continuation is identical
    num_prompts: int


def agreement_prompt_ids(tokenizer: Any, prompts: Sequence[str] = AGREEMENT_PROMPTS
                         ) -> list[list[int]]:
    """The prompts as one-message chats through the model's chat template (as `LLM.chat`)."""
    return [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]


def greedy_outputs(llm: LLM, prompts: Sequence[str] = AGREEMENT_PROMPTS,
                   max_tokens: int = 64) -> list[list[int]]:
    """Greedy continuations of the chat-templated prompts (ignore_eos: fixed length)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = agreement_prompt_ids(llm.get_tokenizer(), prompts)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    return [out.outputs[0].token_ids for out in outputs]


def greedy_agreement(reference: Sequence[Sequence[int]],
                     candidate: Sequence[Sequence[int]]) -> Agreement:
    """Compare continuations prompt by prompt; after a first divergence the rest of that
    continuation counts as disagreeing (it conditions on different text)."""
    if len(reference) != len(candidate):
        raise InvalidRequestError("reference and candidate cover different prompt sets")
    agreed = total = exact = 0
    for ref, cand in zip(reference, candidate, strict=True):
        common = 0
        for a, b in zip(ref, cand, strict=False):
            if a != b:
                break
            common += 1
        agreed += common
        total += len(ref)
        exact += int(list(ref) == list(cand))
    return Agreement(agreed / total if total else 1.0, exact, len(reference))


# -- what `kvstack eval ppl` and `kvstack eval kv` share -----------------------------------


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    """The flags of an evaluation that compares LLM settings on the held-out text."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="smollm2-135m (embedded), gemma3-270m, a .gguf file or an HF folder")
    parser.add_argument("--tokens", type=positive_int, default=4096, metavar="N",
                        help="held-out tokens scored")
    parser.add_argument("--window", type=positive_int, default=1024, metavar="N",
                        help="tokens per scored window (each window is one prompt)")
    parser.add_argument("--agreement-tokens", type=positive_int, default=64, metavar="N",
                        help="greedy tokens generated per agreement prompt")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="also write the table as JSON here")


@dataclass(frozen=True)
class Scores:
    perplexity: float
    perplexity_change: float  # relative to the reference, e.g. 0.002 = +0.2%
    token_agreement: float
    exact_prompts: int
    num_prompts: int


# The score columns both `eval ppl` and `eval kv` print after their own.
SCORE_HEADER = f"{'perplexity':>10} {'change':>8} {'agreement':>9} {'identical':>9}"


def score_columns(s: Scores) -> str:
    return (f"{s.perplexity:10.4f} {100 * s.perplexity_change:+7.2f}% "
            f"{100 * s.token_agreement:8.1f}% {s.exact_prompts:>5}/{s.num_prompts}")


class AgainstReference:
    """Scores LLMs one after another; the first one scored is the reference. Its tokenizer
    also gives the held-out and prompt token ids that a peer outside the engine scores
    (`compare`)."""

    def __init__(self, num_tokens: int, window: int, agreement_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.window = window
        self.agreement_tokens = agreement_tokens
        self._reference: tuple[float, list[list[int]]] | None = None
        self.tokenizer: Any = None  # the reference's, once it is scored

    def score(self, llm: LLM) -> Scores:
        ids = heldout_token_ids(llm.get_tokenizer(), self.num_tokens)
        ppl = perplexity(llm, ids, window=self.window).perplexity
        outputs = greedy_outputs(llm, max_tokens=self.agreement_tokens)
        if self._reference is None:
            self.tokenizer = llm.get_tokenizer()
        return self.compare(ppl, outputs)

    def compare(self, ppl: float, outputs: list[list[int]]) -> Scores:
        """Scores of a perplexity on the held-out ids and greedy continuations of the
        agreement prompts (the first call sets the reference)."""
        if self._reference is None:
            self._reference = (ppl, outputs)
        agreement = greedy_agreement(self._reference[1], outputs)
        return Scores(ppl, ppl / self._reference[0] - 1, agreement.token_agreement,
                      agreement.exact_matches, agreement.num_prompts)


def write_eval_json(path: Path | None, payload: dict[str, Any]) -> None:
    """Write an evaluation's table (with the load it ran under) as JSON, if asked."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload | {"load_average": os.getloadavg()[0]}, indent=2) + "\n")
