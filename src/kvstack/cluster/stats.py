"""Figures over replicas: summed engine stats, prompt tokens by where their K/V came from, and
the body of GET /v1/cluster."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvstack.engine.stats import EngineStats
from kvstack.kv.tiers.base import TierStats

SOURCES = ("memory", "disk", "redis", "computed")
_SUMMED = [f.name for f in dataclasses.fields(EngineStats)
           if f.name not in ("block_size", "tiers")]


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Counters and pool sizes added up; tier counters added per tier name."""
    if not stats:
        return EngineStats(0, 0, 0, 0, 0, 0)
    totals: dict[str, Any] = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    tiers: dict[str, TierStats] = {}
    for s in stats:
        for tier in s.tiers:
            into = tiers.setdefault(tier.name, TierStats(tier.name))
            into.add(hits=tier.hits, misses=tier.misses, stores=tier.stores,
                     bytes_loaded=tier.bytes_loaded, bytes_stored=tier.bytes_stored,
                     load_seconds=tier.load_seconds)
            for kind, count in tier.faults.items():
                into.faults[kind] = into.faults.get(kind, 0) + count
    return EngineStats(block_size=stats[0].block_size,
                       tiers=tuple(t.snapshot() for t in tiers.values()), **totals)


def hit_tokens_by_source(stats: EngineStats) -> dict[str, int]:
    """Prompt tokens looked up, split by where their K/V came from: the replica's own memory,
    its disk tier, the shared Redis tier, or computed (a miss)."""
    by_tier = {t.name: t.hits * stats.block_size for t in stats.tiers}
    tiers = stats.tier_hit_tokens
    return {"memory": stats.prefix_cache_hit_tokens - tiers,
            "disk": by_tier.get("disk", 0), "redis": by_tier.get("redis", 0),
            "computed": stats.prefix_cache_query_tokens - stats.prefix_cache_hit_tokens}


def rates(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {k: v / total if total else 0.0 for k, v in tokens.items()}


def cluster_summary(header: dict[str, Any], view: dict[str, Any],
                    by_replica: dict[str, EngineStats], ingress: dict[str, Any]) -> dict[str, Any]:
    """The view's summary with each replica's engine figures, the cluster's hit tokens by
    source, and the ingress's own counters."""
    for entry in view["replicas"]:
        s = by_replica.get(entry["name"])
        if s is None:
            continue
        tokens = hit_tokens_by_source(s)
        entry["engine"] = {"requests_running": s.num_requests_running,
                           "requests_waiting": s.num_requests_waiting,
                           "kv_blocks_total": s.num_blocks_total,
                           "kv_blocks_used": s.num_blocks_used,
                           "kv_blocks_cached": s.num_blocks_cached,
                           "prompt_tokens": s.num_prompt_tokens,
                           "generation_tokens": s.num_generation_tokens,
                           "hit_tokens": tokens, "hit_rates": rates(tokens)}
    total = hit_tokens_by_source(sum_stats(list(by_replica.values())))
    return {"object": "cluster", **header, **view, "hit_tokens": total,
            "hit_rates": rates(total), "ingress": ingress}
