"""Searches over the prefill/decode simulator (`simulate_pd`): the best ratio, the link bound.

`best_ratio` plays one seeded trace on N colocated replicas and on P prefill + N - P decode
replicas for P over a grid of P/N (then the midpoints beside the best), and picks the P with
the lowest chat TPOT p99 among those meeting the issue's targets (throughput within 10% of
colocated, chat TTFT p50 at most 1.3x colocated's). `handoff_bound` replays that P over links
of 1-100 Gbit/s against an infinitely fast one: the bandwidth below which the KV handoff shows
in what a user sees. Figures are the model's (see `simulate_pd`), not a deployment's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvstack.cluster.simulate import CostModel
from kvstack.cluster.simulate_pd import (
    CHAT,
    DOC,
    MIXES,
    PDConfig,
    PDRun,
    cluster_trace,
    mean_tokens,
    simulate_pd,
)

REPLICAS = (16, 64, 256)
BANDWIDTHS_GBIT = (1.0, 10.0, 25.0, 100.0)
# P/N swept first; then the midpoints either side of the best
PREFILL_FRACTIONS = tuple(k / 16 for k in (1, 2, 4, 6, 8, 10, 12, 14, 15))
THROUGHPUT_TOLERANCE = 0.1  # the targets: throughput within 10% of colocated,
TTFT_LIMIT = 1.3  # chat TTFT p50 at most 1.3x colocated's,
TPOT_TARGET = 2.0  # chat TPOT p99 at least 2x lower
DEGRADED = 1.1  # a link "costs" once a figure is 10% worse than over an infinitely fast one


def meets_targets(run: PDRun, colocated: PDRun) -> bool:
    """Throughput within 10% of colocated (or above) and chat TTFT p50 <= 1.3x colocated's."""
    return (run.throughput_tokens_per_s >= (1 - THROUGHPUT_TOLERANCE)
            * colocated.throughput_tokens_per_s
            and run.chat.ttft_p50_s <= TTFT_LIMIT * colocated.chat.ttft_p50_s)


@dataclass(frozen=True)
class RatioResult:
    mix: str
    replicas: int
    colocated: PDRun
    runs: list[PDRun]  # by prefill replicas
    best: PDRun | None  # the lowest chat TPOT p99 among the runs meeting the targets
    tpot_p99_gain: float | None  # colocated's chat TPOT p99 / best's
    tpot_target_met: bool  # best exists and gains >= 2x


def prefill_grid(replicas: int) -> list[int]:
    return sorted({min(max(round(f * replicas), 1), replicas - 1) for f in PREFILL_FRACTIONS})


def best_ratio(cost: CostModel, config: PDConfig, replicas: int, mix: str,
               num_requests: int | None = None, seed: int = 0) -> RatioResult:
    """Colocated against each prefill count of the grid, then the midpoints beside the best;
    the best meets the issue's throughput and TTFT targets at the lowest chat TPOT p99."""
    if replicas < 2:
        raise ValueError("disaggregation needs at least 2 replicas")
    trace = cluster_trace(cost, config, replicas, mix, num_requests, seed)
    colocated = simulate_pd(trace, cost, config, replicas, 0)
    runs: dict[int, PDRun] = {}
    grid = prefill_grid(replicas)
    for p in grid:
        runs[p] = simulate_pd(trace, cost, config, replicas, p)
    pick = _pick(list(runs.values()), colocated)
    centre = pick.prefill_replicas if pick else _fallback(list(runs.values())).prefill_replicas
    at = grid.index(centre)
    for near in (grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]):
        mid = (centre + near) // 2
        if mid not in runs:
            runs[mid] = simulate_pd(trace, cost, config, replicas, mid)
    ordered = [runs[p] for p in sorted(runs)]
    best = _pick(ordered, colocated)
    gain = colocated.chat.tpot_p99_s / best.chat.tpot_p99_s if best else None
    return RatioResult(mix, replicas, colocated, ordered, best, gain,
                       gain is not None and gain >= TPOT_TARGET)


def _pick(runs: Sequence[PDRun], colocated: PDRun) -> PDRun | None:
    met = [r for r in runs if meets_targets(r, colocated)]
    return min(met, key=lambda r: r.chat.tpot_p99_s) if met else None


def _fallback(runs: Sequence[PDRun]) -> PDRun:
    """Where no ratio meets the targets: the one closest to them on throughput."""
    return max(runs, key=lambda r: (r.throughput_tokens_per_s, -r.chat.tpot_p99_s))


def chosen(result: RatioResult) -> PDRun:
    """The best run, or the fallback where none met the targets."""
    return result.best or _fallback(result.runs)


@dataclass(frozen=True)
class LinkRow:
    network_gbit_s: float
    run: PDRun
    nic_utilisation: float  # the busiest NIC's offered bytes/s over its bandwidth
    ratios: dict[str, float]  # figure -> this link's over the infinitely fast link's
    degraded: bool  # see `_degraded`


@dataclass(frozen=True)
class HandoffBound:
    mix: str
    replicas: int
    prefill_replicas: int
    kv_bytes_per_token: float
    bytes_per_request: dict[str, float]  # mean, by class and over the mix
    saturating_gbit_s: float  # the busiest NIC is full at this bandwidth
    infinite: PDRun
    rows: list[LinkRow]
    enough_gbit_s: float | None  # lowest swept bandwidth from which nothing degrades


def handoff_bound(cost: CostModel, config: PDConfig, replicas: int, prefill_replicas: int,
                  mix: str, bandwidths_gbit: Sequence[float] = BANDWIDTHS_GBIT,
                  num_requests: int | None = None, seed: int = 0) -> HandoffBound:
    """The same configuration over each link against an infinitely fast one: where the
    handoff starts to show in a document's time to its second token or in TPOT p99."""
    if not 1 <= prefill_replicas < replicas:
        raise ValueError(f"prefill replicas must be in 1..{replicas - 1}")
    trace = cluster_trace(cost, config, replicas, mix, num_requests, seed)
    infinite = simulate_pd(trace, cost, replace(config, network_gbit_s=None), replicas,
                           prefill_replicas)
    prompt, _ = mean_tokens(MIXES[mix])
    decode = replicas - prefill_replicas
    busiest = trace.rate_per_s * prompt * config.kv_bytes_per_token / min(prefill_replicas,
                                                                             decode)
    rows = []
    for gbit in sorted(bandwidths_gbit):
        run = simulate_pd(trace, cost, replace(config, network_gbit_s=gbit), replicas,
                          prefill_replicas)
        ratios = {name: _ratio(getattr(run, name), getattr(infinite, name)) for name in
                  ("doc_ready_p50_s", "doc_ready_p99_s", "throughput_tokens_per_s")}
        ratios |= {f"{c}_tpot_p99_s": _ratio(getattr(run, c).tpot_p99_s,
                                             getattr(infinite, c).tpot_p99_s)
                   for c in ("chat", "doc")}
        rows.append(LinkRow(gbit, run, busiest * 8 / (gbit * 1e9), ratios, _degraded(ratios)))
    enough = None
    for row in reversed(rows):
        if row.degraded:
            break
        enough = row.network_gbit_s
    kv = config.kv_bytes_per_token
    per_request = {"chat": sum(CHAT[0]) / 2 * kv, "doc": sum(DOC[0]) / 2 * kv, "mix": prompt * kv}
    return HandoffBound(mix, replicas, prefill_replicas, kv, per_request, busiest * 8 / 1e9,
                        infinite, rows, enough)


def _ratio(value: float, baseline: float) -> float:
    """1 where either is missing (nan: a class absent from a short trace)."""
    return value / baseline if baseline > 0 and value == value else 1.0


def _degraded(ratios: dict[str, float]) -> bool:
    """The handoff costs the user: a document's time to its second token (p50 or p99) or chat
    TPOT p99 10% worse, or throughput 10% lower. A document's own TPOT is left out: over its
    15 later tokens even an unqueued transfer weighs ~1/15 of its handoff per token."""
    slower = ("doc_ready_p50_s", "doc_ready_p99_s", "chat_tpot_p99_s")
    return (max(ratios[k] for k in slower) > DEGRADED
            or ratios["throughput_tokens_per_s"] < 1 - THROUGHPUT_TOLERANCE)
