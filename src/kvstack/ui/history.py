"""The charts' data: one point per tick over the last minutes, from `EngineStats` deltas and
the latencies of requests that finished.

Rates (tokens/s, preemptions, tier and semantic-cache counts) are per interval between two
ticks; the prefix hit rate is over the last `HIT_RATE_WINDOW_S` seconds (prompt tokens found
in the cache / prompt tokens looked up), since admissions are too sparse for a per-second
rate. TTFT and TPOT percentiles are exact (linear interpolation between order
statistics) over the requests that finished in the last `LATENCY_WINDOW_S` seconds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstack.engine.stats import EngineStats
from kvstack.outputs import RequestOutput

LATENCY_WINDOW_S = 60.0
HIT_RATE_WINDOW_S = 10.0
PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between order statistics."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class SemanticCounts:
    lookups: int
    hits: int


class LatencyWindow:
    """TTFT and TPOT of recently finished requests (seconds), by finish time."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_samples: int = 10_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float | None, float | None]] = deque(
            maxlen=max_samples)

    def observe(self, out: RequestOutput, now: float) -> None:
        self._samples.append((now, out.metrics.ttft, out.metrics.tpot))

    def percentiles(self, now: float) -> dict[str, list[float] | None]:
        """{"ttft": [p50, p90, p99] in ms, "tpot": ...}; None where no request finished."""
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        out: dict[str, list[float] | None] = {}
        for i, name in ((1, "ttft"), (2, "tpot")):
            values = [v * 1000 for s in self._samples if (v := s[i]) is not None]
            out[name] = [round(percentile(values, q), 2) for q in PERCENTILES] if values else None
        return out


class History:
    """The last `max_points` points; `add` turns two consecutive stats into one point."""

    def __init__(self, max_points: int = 600) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=max_points)
        self._last: tuple[float, EngineStats, SemanticCounts | None] | None = None
        self._lookups: deque[tuple[float, int, int]] = deque()  # (t, queried, hit) totals

    def _hit_rate(self, now: float, stats: EngineStats) -> float | None:
        """Hit rate over the window: from the newest totals at least a window old."""
        lookups = self._lookups
        lookups.append((now, stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens))
        while len(lookups) > 1 and lookups[1][0] <= now - HIT_RATE_WINDOW_S:
            lookups.popleft()
        _, queried, hit = lookups[0]
        queries = stats.prefix_cache_query_tokens - queried
        return round((stats.prefix_cache_hit_tokens - hit) / queries, 4) if queries else None

    def add(self, now: float, stats: EngineStats, semantic: SemanticCounts | None,
            latency: dict[str, list[float] | None]) -> dict[str, Any]:
        last = self._last
        self._last = (now, stats, semantic)
        if last is None:
            last = (now, stats, semantic)
        then, before, semantic_before = last
        dt = now - then
        generated = stats.num_generation_tokens - before.num_generation_tokens
        tiers_before = {t.name: t for t in before.tiers}
        point: dict[str, Any] = {
            "t": round(now, 3),
            "hit_rate": self._hit_rate(now, stats),
            "hit_rate_total": round(stats.prefix_cache_hit_rate, 4),
            "tok_s": round(generated / dt, 2) if dt > 0 else 0.0,
            "blocks_used": stats.num_blocks_used - stats.num_blocks_pinned,
            "blocks_cached": stats.num_blocks_cached,
            "blocks_pinned": stats.num_blocks_pinned,
            "blocks_total": stats.num_blocks_total,
            "running": stats.num_requests_running,
            "waiting": stats.num_requests_waiting,
            "preemptions": stats.num_preemptions - before.num_preemptions,
            "tiers": {t.name: [t.hits - tiers_before[t.name].hits if t.name in tiers_before
                               else 0,
                               t.misses - tiers_before[t.name].misses if t.name in tiers_before
                               else 0] for t in stats.tiers},
            "semantic": None if semantic is None or semantic_before is None else
            [semantic.lookups - semantic_before.lookups, semantic.hits - semantic_before.hits],
            **latency,
        }
        self.points.append(point)
        return point
