"""Sliding-window KV with attention sinks (StreamingLLM), as block arithmetic. Pure Python.

APPROXIMATE by design: a token attends to the first `sink_tokens` tokens of its sequence and
to the `recent = window - sink_tokens` most recent ones (itself included), nothing between, so
a conversation can run past the model's context in constant memory at some cost in quality.

    position   0 .. S-1 | S ...... (dropped) ...... | p-recent+1 ........ p
    attended     sinks                                recent window      (the query at p)

Blocks are the unit of memory: the sink blocks (`ceil(S / block_size)`) are kept for the whole
request; a later block is freed as soon as no present or future query can see it, i.e. its
last position is at or before `p - recent` for the next query position p. A request's block
table then holds its sink blocks followed by its live blocks; its `num_dropped_blocks` counts
the logical blocks between them that were freed ("dropped": they never enter the prefix
cache, unlike blocks the pool evicts).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlidingWindow:
    window: int  # tokens each query attends to, sinks included
    sink_tokens: int
    block_size: int

    @property
    def recent(self) -> int:
        return self.window - self.sink_tokens

    @property
    def num_sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    @property
    def max_chunk(self) -> int:
        """Most new tokens a request computes in one step (it bounds the blocks it holds)."""
        return self.window

    @property
    def max_blocks(self) -> int:
        """Most blocks a request ever holds: sinks, the recent window ahead of a chunk of
        `max_chunk` tokens, the chunk, and one block of rounding."""
        return self.num_sink_blocks + -(-(self.recent + self.max_chunk) // self.block_size) + 1

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Non-sink logical blocks that the next query (at position num_computed_tokens) and
        every later one can no longer see."""
        first_visible = num_computed_tokens - self.recent + 1
        return max(0, first_visible // self.block_size - self.num_sink_blocks)
