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
from kvstack.weights import resolve_model


def unavailable_reason(model: str) -> str | None:
    """Why llama.cpp cannot score `model` here (not installed, not a GGUF file), or None."""
    from kvstack.bench.peers.llamacpp import unavailable_reason as reason

    return reason(model)


class LlamaCppScorer:
    """One llama.cpp context that keeps every position's logits (`logits_all`), so a window
    evaluated once gives the log-probability of each of its tokens."""

    def __init__(self, model: str, n_ctx: int, threads: int | None, llama: Any = None) -> None:
        """`llama`: the `Llama` class (llama_cpp's by default)."""
        if llama is None:
            from llama_cpp import Llama as llama
        self.path = resolve_model(model)
        self.llm = llama(model_path=str(self.path), n_ctx=n_ctx, logits_all=True,
                         n_threads=threads, n_threads_batch=threads, verbose=False)

    @property
    def num_weight_bytes(self) -> int:
        """The GGUF file's size (its tensors and a small header)."""
        return self.path.stat().st_size

    def perplexity(self, token_ids: Sequence[int], window: int) -> float:
        """Perplexity over `text_windows(token_ids, window)`, as `quality.perplexity` scores
        them: each window from an empty cache, its first token unscored."""
        nll, count = 0.0, 0
        for w in text_windows(token_ids, window):
            self.llm.reset()
            self.llm.eval(w)
            # Row p holds the logits after token p: it predicts token p + 1.
            logits = torch.from_numpy(np.array(self.llm.scores[: len(w) - 1], np.float32))
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            nll -= float(logprobs.gather(1, torch.tensor(w[1:])[:, None]).sum())
            count += len(w) - 1
        return math.exp(nll / count)

    def greedy(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuations of `max_tokens` tokens each (never stopping at EOS), each
        prompt from an empty cache."""
        outputs = []
        for prompt in prompts:
            self.llm.reset()
            tokens: list[int] = []
            for token in self.llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0):
                tokens.append(int(token))
                if len(tokens) == max_tokens:
                    break
            outputs.append(tokens)
        return outputs
