"""Attention groups and the hybrid KV layout. Pure arithmetic.

An attention type is a set of layers that look back equally far: full attention, or a sliding
window of W positions (the query's own included, exact as the model was trained). A sliding
layer never reads a key more than W - 1 positions back, so keeping its older blocks wastes memory.

The hybrid layout (vLLM's "hybrid allocator") splits each type's layers into *KV groups* of
`page_layers` layers; one block id then names a page of `page_layers` layers' K/V, and every
group has its own block table per request, drawn from the one pool. A full-attention group keeps
a block for every token; a window group frees the blocks that slid out of its window. A model
with one attention type (Llama) has a single group of every layer: the classic layout.
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


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a query at position `num_computed` (or any later one) can still read:
    the blocks before it lie wholly before `num_computed - window + 1`."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


@dataclass(frozen=True)
class KVLayout:
    """Which layers share a block table, and where each layer's K/V sit in a page.

    `groups[0]` is a full-attention group whenever the model has full-attention layers: its
    block hashes are the classic ones (what the cluster router and older tier files know).
    """

    groups: tuple[AttentionGroup, ...]
    page_layers: int  # layers one page (block id) holds: the storage's tensors per K and V
    num_layers: int

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """Every layer in one group: every layer keeps every token."""
        return cls((AttentionGroup(None, tuple(range(num_layers))),), num_layers, num_layers)

    @classmethod
    def hybrid(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """Each attention type's layers in groups of as many layers as the smallest type has
        (Gemma 3 270M: 3 full layers, 15 sliding ones -> 1 full group and 5 window groups
        of 3 layers); a type whose count does not divide leaves its last group shorter."""
        types = attention_groups(layer_windows)
        if len(types) == 1:
            return cls.single(len(layer_windows))
        page = min(len(t.layers) for t in types)
        groups = tuple(AttentionGroup(t.window, t.layers[i:i + page])
                       for t in types for i in range(0, len(t.layers), page))
        return cls(groups, page, len(layer_windows))

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], kv_cache_dtype: str) -> KVLayout:
        """The engine's layout: hybrid for a model with sliding-window layers, except under int4
        storage, which plans a step's writes once for every layer and so keeps one table for
        all of them (exact as well, with the all-global memory)."""
        if kv_cache_dtype == "int4":
            return cls.single(len(layer_windows))
        return cls.hybrid(layer_windows)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its group's window."""
        return tuple(self.groups[g].window for g in self.group_of_layer())

    def group_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return tuple(out)

    def tensor_of_layer(self) -> tuple[int, ...]:
        """Per layer, its place in a page (the storage tensor it reads and writes)."""
        out = [0] * self.num_layers
        for group in self.groups:
            for place, layer in enumerate(group.layers):
                out[layer] = place
        return tuple(out)

    def blocks_held(self, seq_len: int, block_size: int) -> int:
        """Most pages one sequence of seq_len tokens holds while decoding, over all groups."""
        return sum(g.blocks_reachable(seq_len, block_size) for g in self.groups)

    def describe(self) -> str:
        """'1 full + 5 sliding 512 groups of 3 layers' (for fingerprints and reports)."""
        names: dict[str, int] = {}
        for group in self.groups:
            names[group.name] = names.get(group.name, 0) + 1
        kinds = " + ".join(f"{n} {name}" for name, n in names.items())
        return f"{kinds} groups of {self.page_layers} layers"
