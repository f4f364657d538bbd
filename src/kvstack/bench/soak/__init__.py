"""`bench soak`: mixed traffic on one `kvstack serve` for N minutes, with a restart in the middle,
sampled every minute for growth (RSS, KV blocks, pins, open files, threads) and latency drift."""

from kvstack.bench.soak.case import run

__all__ = ["run"]
