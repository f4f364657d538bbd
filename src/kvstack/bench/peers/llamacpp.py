"""llama.cpp as a peer, through llama-cpp-python (the optional `llamacpp` extra).

It runs the model's GGUF file in llama.cpp's own formats (the embedded model: Q4_1 weights, an
f16 KV cache, int8 dot products), so it is a different-weights comparison: the same network and
token ids, not the same arithmetic. Its greedy outputs track ours closely but not exactly.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.bench.peers.hf import PeerRun
from kvstack.errors import KvstackError
from kvstack.weights import resolve_model

INSTALL_HINT = "pip install 'kvstack[llamacpp]' (or `make bench-peers`; it compiles for minutes)"


def unavailable_reason(model: str) -> str | None:
    """Why llama.cpp cannot run `model` here, or None when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    try:
        path = resolve_model(model)
    except KvstackError as err:
        return str(err)
    if path.suffix != ".gguf":
        return f"llama.cpp needs a GGUF file and {model} is not one"
    return None


class LlamaCppPeer:
    """One llama.cpp context on a GGUF file; every run starts from an empty KV cache."""

    def __init__(self, model: str, n_ctx: int, threads: int | None, logits_all: bool = False,
                 llama: Any = None) -> None:
        """`logits_all`: keep every position's logits (`llm.scores`), as perplexity needs;
        `llama`: the `Llama` class (llama_cpp's by default)."""
        if llama is None:
            import llama_cpp  # the optional extra: only this peer needs it
            llama = llama_cpp.Llama
        self.path: Path = resolve_model(model)
        self.llm: Any = llama(model_path=str(self.path), n_ctx=n_ctx, n_threads=threads,
                              n_threads_batch=threads, logits_all=logits_all, verbose=False)

    @property
    def num_weight_bytes(self) -> int:
        """The GGUF file's size: its tensors, plus a header that is small beside them."""
        return self.path.stat().st_size

    @property
    def weight_type(self) -> str:
        """The tensor type holding most of the file's bytes, e.g. Q4_1."""
        import gguf

        by_type: dict[str, int] = {}
        for tensor in gguf.GGUFReader(self.path).tensors:
            name = tensor.tensor_type.name
            by_type[name] = by_type.get(name, 0) + int(tensor.n_bytes)
        return max(by_type, key=lambda name: by_type[name])

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> PeerRun:
        """Greedy decoding of `max_new_tokens` tokens (never stopping at EOS)."""
        self.llm.reset()  # no reuse of the previous run's tokens: a cold prefill
        token_ids: list[int] = []
        times: list[float] = []
        start = time.perf_counter()
        for token in self.llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            token_ids.append(int(token))
            if len(token_ids) == max_new_tokens:
                break
        return PeerRun([token_ids], start, times)
