"""How close decode attention runs to the machine's bandwidth: `python -m
kvstack.bench.attention_kernel`.

For each layout (SmolLM2's GQA: 9 query heads over 3 KV heads of 64; Gemma 3's MQA: 4 over 1
of 256), KV dtype and context, one sequence's query attends over `--layers` layers' caches in
turn (together far larger than the CPU's caches, as in a model's step, where the weights
streamed between two layers evict them), its slots in 16-slot blocks scattered over the pool.
Per call: microseconds, per cached position, the bytes it must read (K and V rows, plus the
quantized caches' scales) and their rate against this machine's read bandwidth probed in the
same run (`bench peers`' probe); `x probe` = time / (bytes / probe bandwidth), 1.0 being the
bandwidth bound. Wall-clock, best of `--repeats` rounds: compare columns of one run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from kvstack.bench.peers.workloads import measure_read_bandwidth
from kvstack.config import ModelConfig
from kvstack.kernels import build
from kvstack.kernels import ops as kops
from kvstack.kv.storage import make_kv_storage

BLOCK = 16
LAYOUTS = {"llama": (9, 3, 64), "gemma": (4, 1, 256)}  # heads, kv_heads, head_dim
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


@dataclass(frozen=True)
class Figure:
    layout: str
    kv_dtype: str
    context: int
    us: float
    bytes: int

    def line(self, bandwidth: float) -> str:
        bound = self.bytes / bandwidth * 1e6
        return (f"{self.layout:6} {self.kv_dtype:9} ctx {self.context:5}: {self.us:8.1f} us  "
                f"{self.us / self.context * 1e3:6.1f} ns/pos  {self.bytes / self.us / 1e3:5.1f} "
                f"GB/s  {self.us / bound:4.2f}x probe")


def _model(layout: str, layers: int) -> ModelConfig:
    heads, kv_heads, dim = LAYOUTS[layout]
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256,
                       hidden_size=heads * dim, intermediate_size=64, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                       max_model_len=1 << 16)


def measure(layout: str, kv_dtype: str, context: int, layers: int, repeats: int,
            seed: int = 0) -> Figure:
    """One (layout, KV dtype, context) figure: the best round's mean time per call."""
    heads, kv_heads, dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (context + BLOCK - 1) // BLOCK
    pool = num_blocks * 2  # a sequence's blocks are half the pool, in random order
    store = make_kv_storage(_model(layout, layers), pool, BLOCK, kv_dtype, torch.float32, 1)
    blocks = torch.randperm(pool, generator=gen)[:num_blocks]
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(1, -1)[:, :context]
    k = torch.randn(pool * BLOCK, kv_heads, dim, generator=gen)
    v = torch.randn(pool * BLOCK, kv_heads, dim, generator=gen)
    every = torch.arange(pool * BLOCK)
    for layer in range(layers):
        store.write(layer, every, k, v)
    q = torch.randn(1, heads, dim, generator=gen)
    lens = torch.tensor([context])
    calls = [_call(store, layer, q, slots.contiguous(), lens, dim**-0.5)
             for layer in range(layers)]
    for call in calls:
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - start) / layers)
    row = kv_heads * dim * (1 if kv_dtype in ("int8", "fp8") else store.dtype.itemsize)
    scales = 2 * kv_heads * 2 if kv_dtype in ("int8", "fp8") else 0
    return Figure(layout, kv_dtype, context, best * 1e6, context * (2 * row + scales))


def _call(store, layer: int, q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
          scale: float):
    quantized = store.quantized_tensors(layer)
    if quantized is not None:
        rotate = store.basis is not None
        codes, scales = quantized
        return lambda: kops.decode_attention_quant(q, codes, scales, rotate, slots, lens, scale)
    k, v = store.k[layer], store.v[layer]  # bfloat16 under float32 queries too
    return lambda: kops.decode_attention(q, k, v, slots, lens, scale)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--kv", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    parser.add_argument("--contexts", nargs="+", type=int, default=[1000, 4000])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(build.status(), f"threads {args.threads}")
    figures = [measure(layout, kv, ctx, args.layers, args.repeats)
               for layout in args.layouts for kv in args.kv for ctx in args.contexts]
    bandwidth = measure_read_bandwidth(1 << 30)
    print(f"probe {bandwidth / 1e9:.1f} GB/s")
    for figure in figures:
        print(figure.line(bandwidth))


if __name__ == "__main__":
    main()
