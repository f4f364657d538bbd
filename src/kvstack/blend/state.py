"""One request's blending, from admission to its blended step: which chunks hit, where the
blended region starts, how the scheduler must cut its prefill, what it reused.

The region starts at the first hit chunk's first token past the exact prefix-cache hit (or at
the hit's end when a chunk straddles it). Before it, the prompt is an ordinary prefill (exact,
chunked as usual, published to the prefix cache). From it to the end of the prompt, one step
(whatever the step's token budget):
hit chunks are placed, everything else (template, missed chunks, question) is computed, and a
share of the placed tokens is recomputed. Nothing from the region on is exact, so nothing from
it on is ever published to the prefix cache or the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.blend.entry import ChunkEntry
from kvstack.blend.params import BlendParams, BlendSpec
from kvstack.outputs import BlendUsage


@dataclass(frozen=True)
class Placement:
    """Placed chunk tokens: positions [start, start + count) take entry tokens from `offset`."""

    start: int
    count: int
    entry: ChunkEntry
    offset: int


class BlendState:
    def __init__(self, spec: BlendSpec, num_prompt_tokens: int, keys: list[bytes],
                 num_scored: int = 0) -> None:
        self.params: BlendParams = spec.params
        self.chunks = list(spec.chunks)
        self.keys = keys  # each chunk's cache key
        self.num_prompt_tokens = num_prompt_tokens
        self.num_scored = num_scored  # last prompt positions that must be computed (scores)
        self.entries: list[ChunkEntry | None] | None = None  # None: not looked up yet
        self.prefix_len = 0  # exact prefix-cache hit at the latest admission
        self.region_start: int | None = None  # None: nothing to place (an ordinary prefill)
        self.usage: BlendUsage | None = None  # set by the first blended step
        # Prompt positions whose K/V stayed placed (reused, not recomputed), as [start, end)
        # runs; set with `usage` (the request's provenance shows them as `outputs.BLENDED`).
        self.reused_runs: list[tuple[int, int]] = []

    @property
    def resolved(self) -> bool:
        return self.entries is not None

    def admit(self, prefix_len: int) -> None:
        """The request is being admitted with this exact prefix hit: find its region."""
        self.prefix_len = prefix_len
        self.region_start = None
        for (start, end), entry in zip(self.chunks, self.entries or [], strict=False):
            if entry is not None and end > prefix_len:
                self.region_start = max(start, prefix_len)
                return

    @property
    def exact_limit(self) -> int | None:
        """Tokens whose K/V are exact, so publishable (None: all of them)."""
        return self.region_start

    def fit(self, start: int, num_new: int, num_rest: int, region_taken: bool) -> int:
        """How many tokens from `start` the request computes this step: `num_new` (what the
        budget allows) up to its region; at the region, all `num_rest` known tokens in one
        step, even past the budget (its placed tokens skip the layers above the check layer,
        so the step costs far less than its length), or none (wait) when another region runs
        this step."""
        region = self.region_start
        if region is None or start > region:
            return num_new
        if start < region:
            return min(num_new, region - start)
        return 0 if region_taken else num_rest

    def is_region_step(self, start: int) -> bool:
        return self.region_start is not None and start == self.region_start

    def placements(self) -> list[Placement]:
        """Hit chunk tokens in the region, in order."""
        out: list[Placement] = []
        first = self.region_start
        if first is None or self.entries is None:
            return out
        for (start, end), entry in zip(self.chunks, self.entries, strict=True):
            if entry is None or end <= first:
                continue
            begin = max(start, first)
            out.append(Placement(begin, end - begin, entry, begin - start))
        return out

    @property
    def question_start(self) -> int:
        """First prompt position after the last chunk (the question); the last prompt
        position when the prompt ends with a chunk."""
        end = self.chunks[-1][1] if self.chunks else 0
        return min(end, self.num_prompt_tokens - 1)

    def final_usage(self) -> BlendUsage | None:
        """The usage of a request that ran: its blended step's, or, when no chunk past the
        exact prefix hit (an ordinary exact prefill), the misses alone; None before it ran."""
        if self.usage is not None or self.entries is None:
            return self.usage
        past = [e for (_, end), e in zip(self.chunks, self.entries, strict=True)
                if end > self.prefix_len]
        return BlendUsage(0, len(past), 0, 0, 1 - self.prefix_len / self.num_prompt_tokens)

    def record(self, num_layers: int, reused: list[int], num_recomputed: int,
               region_row_layers: int) -> BlendUsage | None:
        """What the first blended step did (a resumed request's rerun changes nothing);
        returns the usage when it is new."""
        if self.usage is not None or self.entries is None or self.region_start is None:
            return None
        past = [entry for (_, end), entry in zip(self.chunks, self.entries, strict=True)
                if end > self.prefix_len]
        exact_rows = (self.region_start - self.prefix_len) * num_layers
        num_reused = len(reused) + num_recomputed
        for p in reused:  # ascending positions of the placed tokens kept as placed
            if self.reused_runs and self.reused_runs[-1][1] == p:
                self.reused_runs[-1] = (self.reused_runs[-1][0], p + 1)
            else:
                self.reused_runs.append((p, p + 1))
        self.usage = BlendUsage(
            chunks_hit=sum(e is not None for e in past),
            chunks_missed=sum(e is None for e in past),
            reused_tokens=num_reused,
            recomputed_tokens=num_recomputed,
            compute=(exact_rows + region_row_layers) / (num_layers * self.num_prompt_tokens),
        )
        return self.usage
