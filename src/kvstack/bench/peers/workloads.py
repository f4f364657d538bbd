"""What `bench peers` runs: its sizes, the prompts of its workloads (decode also at long
contexts), and the machine's read bandwidth they are measured against."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

BANDWIDTH_REPEATS = 3


@dataclass(frozen=True)
class Sizes:
    repeats: int  # runs of each workload on each engine; the best counts
    decode_new_tokens: int
    prefill_tokens: int
    batch: int
    batch_prompt_tokens: int
    batch_new_tokens: int
    bandwidth_probe_bytes: int
    # decode again after prompts of these many tokens (a long chat, an agent, RAG), with
    # this many new tokens: attention then reads as many KV bytes as the weights or more
    long_contexts: tuple[int, ...] = ()
    long_new_tokens: int = 0


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes(1, 4, 48, 2, 16, 4, 64 << 20, (80,), 4)
    return Sizes(2, 128, 1800, 32, 128, 64, 1 << 30, (1000, 4000), 32)


def long_workload(context: int) -> str:
    """The workload name of decode after a `context`-token prompt."""
    return f"decode_{context}"


@dataclass
class Workloads:
    chat: list[int]
    document: list[int]
    batch: list[list[int]]
    sizes: Sizes
    long: dict[int, list[int]] = field(default_factory=dict)  # context -> its prompt

    @property
    def max_len(self) -> int:
        return max(len(self.chat) + self.sizes.decode_new_tokens, len(self.document) + 1,
                   max(len(p) for p in self.batch) + self.sizes.batch_new_tokens,
                   *(len(p) + self.sizes.long_new_tokens for p in self.long.values()))


def measure_read_bandwidth(num_bytes: int, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Bytes per second that torch reads from memory on the current threads: a sum over a
    tensor far larger than the caches, best of `repeats`."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best
