"""How fast the GGUF kernels stream weights: `python -m kvstack.kernels.gguf_bench`.

For each type, a weight of about `--mib` MiB of random blocks (far larger than the caches) is
multiplied by 1 and 8 rows; the figure is weight bytes per second of the best of `--repeats`
calls, next to this machine's read bandwidth measured in the same run the way `bench peers`
does (a torch.sum over a large tensor, best of 3). Wall-clock time by default: other jobs on
the machine lower every figure, so compare the columns of one run, not runs with each other.
`--cpu-time` (one thread only) times this thread's CPU time instead, which a busy machine
disturbs less.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import gguf
import numpy as np
import torch

from kvstack.kernels import build
from kvstack.kernels.gguf import KERNEL_TYPES, GGUFLinear


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, k: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Random bytes as `rows` rows of blocks, with small finite fp16 scales where the type
    keeps them (any bit pattern is a valid quant), so products stay finite."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    for lo in _fp16_fields(qtype):
        scales = rng.uniform(1e-3, 2e-2, size=(rows, k // elems)).astype(np.float16)
        raw[..., lo : lo + 2] = scales.view(np.uint8).reshape(rows, k // elems, 2)
    return raw.reshape(rows, -1)


def _fp16_fields(qtype: gguf.GGMLQuantizationType) -> tuple[int, ...]:
    """Byte offsets of each block's fp16 scale/min fields."""
    q = gguf.GGMLQuantizationType
    return {q.Q4_1: (0, 2), q.Q5_1: (0, 2), q.Q4_K: (0, 2), q.Q6_K: (208,)}.get(qtype, (0,))


def _best_seconds(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def read_bandwidth(num_bytes: int, clock: Callable[[], float]) -> float:
    """Bytes per second torch.sum reads from a tensor far larger than the caches (best of 3),
    as `bench peers` probes it."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _best_seconds(x.sum, 3, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64, help="weight size per type")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="time CPU, not wall (1 thread)")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time counts this thread only: use --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    print(build.status(), f"| {args.threads} threads | {'CPU' if args.cpu_time else 'wall'} time")
    probe = read_bandwidth(256 << 20, clock)
    print(f"read bandwidth probe (torch.sum over 256 MiB): {probe / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    k = 4096  # a multiple of every block size
    for qtype, _ in KERNEL_TYPES.items():
        elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        out = (args.mib << 20) // (k // elems * nbytes)
        lin = GGUFLinear(random_blocks(qtype, out, k, rng), qtype, (out, k))
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k)
            rate = lin.num_bytes / _best_seconds(partial(lin, x), args.repeats, clock)
            cells.append(f"{rows} row{'s' if rows > 1 else ''}: {rate / 1e9:5.1f} GB/s "
                         f"({rate / probe:4.0%})")
        print(f"{qtype.name:5s} {lin.num_bytes >> 20} MiB  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
