"""Attention groups: a model's layers grouped by how far back they attend (full attention, or
a sliding window of W positions, the query's own included, exact as trained). Pure arithmetic.

The engine today allocates every layer's K/V for every token (exact, but a sliding layer keeps
blocks it can never read again). `tokens_reachable` is what a hybrid allocator would keep for
a window group: the blocks covering the last window, plus the block being filled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return "full" if self.window is None else f"sliding {self.window}"

    def blocks_reachable(self, seq_len: int, block_size: int) -> int:
        """Blocks of a seq_len-token sequence this group's next query can still read: all of
        them for full attention; for a window, at most ceil(W / block_size) + 1 (the window's
        first position may sit anywhere in its block)."""
        blocks = -(-seq_len // block_size)
        if self.window is None:
            return blocks
        return min(blocks, -(-self.window // block_size) + 1)


def attention_groups(layer_windows: Sequence[int | None]) -> list[AttentionGroup]:
    """Layers grouped by window, full attention first, then windows by size."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    return [AttentionGroup(w, tuple(by_window[w])) for w in order]
