"""KV-cache memory arithmetic: bytes = 2 (K and V) x tokens x layers x H_kv x D_head x bytes/elem.

The engine sizes its pool with `num_blocks_for_budget`, so an estimate for a budget is what
gets allocated, not an approximation of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.config import DTYPE_BYTES, ModelConfig
from kvstack.errors import InvalidRequestError


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            known = ", ".join(DTYPE_BYTES)
            raise InvalidRequestError(f"unknown KV dtype {self.dtype!r}; use one of {known}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer")

    @classmethod
    def of(cls, model: ModelConfig, dtype: str) -> KVShape:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def bytes_for(self, seq_len: int, batch: int = 1) -> int:
        return self.bytes_per_token * seq_len * batch

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        return budget_bytes // (self.bytes_per_token * block_size)

    def max_tokens_for_budget(self, budget_bytes: int, block_size: int) -> int:
        return self.num_blocks_for_budget(budget_bytes, block_size) * block_size

    def max_sequences_for_budget(self, budget_bytes: int, block_size: int, seq_len: int) -> int:
        """Sequences of seq_len tokens that fit at once (each rounds up to whole blocks)."""
        blocks_per_seq = -(-seq_len // block_size)
        return self.num_blocks_for_budget(budget_bytes, block_size) // blocks_per_seq


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}".replace(".00 ", " ")
        n /= 1024
    raise AssertionError("unreachable")
