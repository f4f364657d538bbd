"""KV-cache memory arithmetic: K and V of every layer, KV head and token, in the KV dtype, with
the scales a quantized dtype stores beside them (`kv/dtypes.py`).

The engine sizes its pool with `num_blocks_for_budget`, so an estimate for a budget is what
gets allocated, not an approximation of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvstack.config import ModelConfig
from kvstack.errors import InvalidRequestError
from kvstack.kv.dtypes import FLOAT_BYTES, layer_block_bytes, window_pool_blocks
from kvstack.kv.groups import AttentionGroup, KVLayout


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the KV dtype, resolved (no "auto"): float32, bfloat16, float16, int8, fp8, int4
    block_size: int = 16
    model_dtype: str = "float32"  # int4 keeps the blocks being filled in this dtype
    # Sliding-window mode: each token attends to `sink_tokens` first tokens and the most recent
    # `window - sink_tokens`; older blocks are freed, so a sequence holds at most `window_blocks`.
    window: int | None = None
    sink_tokens: int = 4
    # Hybrid layout (`kv/groups.py`): per KV group, its window (None: full attention) and
    # layers; a block is then a page of `page_layers` layers and each group has its own table.
    kv_groups: tuple[tuple[int | None, int], ...] = ()
    page_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer")
        if self.model_dtype not in FLOAT_BYTES:
            raise InvalidRequestError(f"unknown model dtype {self.model_dtype!r}")
        layer_block_bytes(self.dtype, self.num_kv_heads, self.head_dim, self.block_size)

    @classmethod
    def of(cls, model: ModelConfig, dtype: str, layout: KVLayout | None = None,
           **kwargs: Any) -> KVShape:
        if layout is not None and layout.is_hybrid:
            kwargs |= {"kv_groups": tuple((g.window, len(g.layers)) for g in layout.groups),
                       "page_layers": layout.page_layers}
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, dtype, **kwargs)

    @property
    def layers_per_block(self) -> int:
        return self.page_layers or self.num_layers

    @property
    def _layer_block_bytes(self) -> int:
        return layer_block_bytes(self.dtype, self.num_kv_heads, self.head_dim, self.block_size)

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer (a hybrid layout: of a page's layers), K and V, scales
        included: the unit the pool allocates."""
        return self.layers_per_block * self._layer_block_bytes

    @property
    def bytes_per_token(self) -> float:
        """One token in every layer (an int unless int4 key scales split unevenly)."""
        whole, rest = divmod(self.num_layers * self._layer_block_bytes, self.block_size)
        return whole if not rest else self.num_layers * self._layer_block_bytes / self.block_size

    @property
    def window_blocks(self) -> int | None:
        """Most blocks a sequence holds in window mode: the sink blocks, the blocks of the
        recent tokens, and the one being filled."""
        if self.window is None:
            return None
        bs = self.block_size
        return -(-self.sink_tokens // bs) + -(-(self.window - self.sink_tokens) // bs) + 1

    def blocks_for(self, seq_len: int) -> int:
        """Blocks one sequence of seq_len tokens holds while it decodes (whole blocks; bounded
        in window mode; a hybrid layout: pages over every group)."""
        if self.kv_groups:
            return sum(self.group_blocks(w, seq_len) for w, _ in self.kv_groups)
        blocks = -(-seq_len // self.block_size)
        return blocks if self.window_blocks is None else min(blocks, self.window_blocks)

    def group_blocks(self, window: int | None, seq_len: int) -> int:
        """Blocks a hybrid layout's group holds: all, or those its window still reaches."""
        return AttentionGroup(window, ()).blocks_reachable(seq_len, self.block_size)

    def tokens_held(self, seq_len: int) -> int:
        """Tokens of a seq_len-token sequence whose K/V are kept (in every layer)."""
        if self.window_blocks is None:
            return seq_len
        return min(seq_len, self.window_blocks * self.block_size)

    def bytes_for(self, seq_len: int, batch: int = 1) -> int:
        """K/V bytes of `batch` sequences of seq_len tokens (exact tokens, not whole blocks;
        a hybrid layout's window group keeps at most its reachable blocks' tokens)."""
        if self.kv_groups:
            per_layer_token = self._layer_block_bytes / self.block_size
            # A group shorter than a page still takes whole pages.
            held = sum(self.layers_per_block
                       * min(seq_len, self.group_blocks(w, seq_len) * self.block_size)
                       for w, _ in self.kv_groups)
            return round(per_layer_token * held * batch)
        return round(self.bytes_per_token * self.tokens_held(seq_len) * batch)

    def window_pool_bytes(self, max_num_seqs: int) -> int:
        """int4's full-precision blocks for the blocks being filled; 0 for other dtypes."""
        per_block = (2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size
                     * FLOAT_BYTES[self.model_dtype])
        return window_pool_blocks(self.dtype, max_num_seqs) * per_block

    def num_blocks_for_budget(self, budget_bytes: int, block_size: int | None = None,
                              max_num_seqs: int = 64) -> int:
        shape = self._with_block_size(block_size)
        pool = budget_bytes - shape.window_pool_bytes(max_num_seqs)
        return max(pool, 0) // shape.bytes_per_block

    def max_tokens_for_budget(self, budget_bytes: int, block_size: int | None = None,
                              max_num_seqs: int = 64) -> int:
        """Tokens the pool holds (a hybrid layout: with every group keeping each token, as
        sequences shorter than the windows do; a lower bound for longer ones)."""
        shape = self._with_block_size(block_size)
        pages = shape.num_blocks_for_budget(budget_bytes, None, max_num_seqs)
        return pages // max(len(shape.kv_groups), 1) * shape.block_size

    def max_sequences_for_budget(self, budget_bytes: int, block_size: int | None,
                                 seq_len: int, max_num_seqs: int = 64) -> int:
        """Sequences of seq_len tokens that fit at once (each rounds up to whole blocks)."""
        shape = self._with_block_size(block_size)
        blocks = shape.num_blocks_for_budget(budget_bytes, None, max_num_seqs)
        return blocks // shape.blocks_for(seq_len)

    def _with_block_size(self, block_size: int | None) -> KVShape:
        if block_size is None or block_size == self.block_size:
            return self
        return replace(self, block_size=block_size)
