"""llama.cpp's row of `kvstack eval ppl`: the same held-out windows and chat prompts, scored by
llama.cpp (llama-cpp-python, the optional `llamacpp` extra) on the model's GGUF file.

For a GGUF model this puts the quality of our `gguf` row (the file's blocks through our
kernels) beside llama.cpp's on the same weights: both round activations to int8 per block, in
different orders, so neither is the other's reference; the float32 row is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstack.eval.quality import text_windows


def unavailable_reason(model: str) -> str | None:
    """Why llama.cpp cannot score `model` here (not installed, not a GGUF file), or None."""
    from kvstack.bench.peers.llamacpp import unavailable_reason as reason

    return reason(model)


class LlamaCppScorer:
    """A llama.cpp context (`bench/peers/llamacpp.py`'s peer) that keeps every position's
    logits, so a window evaluated once gives the log-probability of each of its tokens."""

    def __init__(self, model: str, n_ctx: int, threads: int | None, llama: Any = None) -> None:
        """`llama`: the `Llama` class (llama_cpp's by default)."""
        from kvstack.bench.peers.llamacpp import LlamaCppPeer

        self.peer = LlamaCppPeer(model, n_ctx, threads, logits_all=True, llama=llama)

    @property
    def num_weight_bytes(self) -> int:
        return self.peer.num_weight_bytes

    def perplexity(self, token_ids: Sequence[int], window: int) -> float:
        """Perplexity over `text_windows(token_ids, window)`, as `quality.perplexity` scores
        them: each window from an empty cache, its first token unscored."""
        llm = self.peer.llm
        nll, count = 0.0, 0
        for w in text_windows(token_ids, window):
            llm.reset()
            llm.eval(w)
            # Row p holds the logits after token p: it predicts token p + 1.
            logits = torch.from_numpy(np.array(llm.scores[: len(w) - 1], np.float32))
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            nll -= float(logprobs.gather(1, torch.tensor(w[1:])[:, None]).sum())
            count += len(w) - 1
        return math.exp(nll / count)

    def greedy(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuations of `max_tokens` tokens each (never stopping at EOS), each
        prompt from an empty cache."""
        return [self.peer.generate(prompt, max_tokens).token_ids[0] for prompt in prompts]
