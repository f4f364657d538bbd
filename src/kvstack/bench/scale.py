"""kvstack at real model shapes: `python -m kvstack.bench.scale`.

Random-weight Q4_0 GGUF files of real shapes (`scale_files.py`; fewer layers with --layers,
cached between runs) run as their blocks (`quantization="gguf"`), batch 1, on --threads
threads: prefill tok/s of a --prompt-token prompt (one step; best time to first token),
then decode tok/s after it (the median gap between tokens), and
the bytes a decode token reads (every weight once, but the embedding table, and for a MoE only
the router's top-k experts per layer) against this machine's read bandwidth probed in the same
run. Random weights measure speed only, never quality. Wall-clock, best of --repeats: compare
rows of one run (e.g. the MoE against the dense model of its active parameter count).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvstack.bench.peers.workloads import measure_read_bandwidth
from kvstack.bench.scale_files import SHAPES, scale_file
from kvstack.kernels.gguf import GGUFLinear
from kvstack.layers.moe import SparseMoE


@dataclass(frozen=True)
class Figure:
    shape: str
    layers: int
    file_bytes: int
    decode_bytes: int  # read per decode token
    prompt_tokens: int
    prefill_tok_s: float
    decode_tok_s: float

    def line(self, bandwidth: float) -> str:
        share = self.decode_bytes * self.decode_tok_s / bandwidth
        return (f"{self.shape:28} {self.layers:2}L {self.file_bytes / 1e9:5.2f} GB  prefill "
                f"{self.prompt_tokens} {self.prefill_tok_s:7.1f} tok/s  decode "
                f"{self.decode_tok_s:6.2f} tok/s  {self.decode_bytes / 1e6:6.0f} MB/token  "
                f"{share:4.0%} of probe")


def decode_bytes(model: Any) -> int:
    """Bytes one decode token reads: all weights but the embedding table (one row), and of a
    MoE layer's experts only the top-k (the average expert's bytes each)."""
    total = int(model.num_weight_bytes)
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if isinstance(embed, GGUFLinear) and embed is not head:
        total -= embed.num_bytes
    elif isinstance(embed, torch.Tensor):
        total -= embed.numel() * embed.element_size()
    for layer in getattr(model, "layers", []):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SparseMoE):
            experts = sum(g.num_bytes + d.num_bytes for g, d in mlp.experts)
            total -= experts - experts * mlp.top_k // len(mlp.experts)
    return total


def measure(name: str, layers: int | None, prompt_tokens: int, new_tokens: int,
            repeats: int) -> Figure:
    from kvstack.engine.llm import LLM
    from kvstack.sampling_params import SamplingParams

    path = scale_file(name, layers)
    llm = LLM(model=str(path), quantization="gguf", skip_tokenizer_init=True,
              enable_prefix_caching=False, kv_cache_memory="1GiB",
              max_num_batched_tokens=max(prompt_tokens, 256))
    prompt = {"prompt_token_ids": torch.randint(0, 1000, (prompt_tokens,),
                                                generator=torch.Generator().manual_seed(0)
                                                ).tolist()}

    params = SamplingParams(temperature=0, max_tokens=1 + new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    ttfts, gaps = [], []
    for _ in range(repeats):
        metrics = llm.generate([prompt], params)[0].metrics
        assert metrics.ttft is not None
        ttfts.append(metrics.ttft)
        gaps += metrics.inter_token_latencies
    gap = statistics.median(gaps)  # robust to other processes' bursts on a shared machine
    model: Any = llm.engine.model
    return Figure(name, len(model.layers), path.stat().st_size,
                  decode_bytes(model), prompt_tokens, prompt_tokens / min(ttfts), 1 / gap)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        default=["qwen3-30b-a3b", "qwen3-30b-a3b-active-dense"])
    parser.add_argument("--layers", type=int, default=2,
                        help="layers per file (0: the real model's count)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[512])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bandwidth = measure_read_bandwidth(1 << 30)
    print(f"read bandwidth probe: {bandwidth / 1e9:.1f} GB/s on {args.threads} threads")
    figures = []
    for name in args.shapes:
        for n in args.prompt_tokens:
            fig = measure(name, args.layers or None, n, args.new_tokens, args.repeats)
            figures.append(fig)
            print(fig.line(bandwidth), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bandwidth": bandwidth, "figures": [asdict(x) for x in figures]}, f,
                      indent=1)


if __name__ == "__main__":
    main()
