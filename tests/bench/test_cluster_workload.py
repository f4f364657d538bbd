"""`bench cluster`'s workload, its calibration probe and the arrival rate it sets (pure parts;
the benchmark itself needs a Ray cluster and runs by hand: `kvstack bench cluster`)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstack.bench import cluster
from kvstack.bench.cluster_workload import (
    CAPACITY_ROUNDS,
    CAPACITY_STREAMS,
    PROBE_STREAMS,
    WorkloadConfig,
    make_workload,
    probe_workloads,
)

CONFIG = WorkloadConfig(tenants=4, private_docs=2)
PROBE = {"miss_s": 7.0, "hit_s": 2.0, "unique_s": 3.0, "capacity_per_s": 0.7}


def test_the_workload_salts_one_text_per_tenant_and_sizes_prefixes() -> None:
    w = make_workload(CONFIG, 200, rate_per_s=2.0, seed=0)
    assert len(w.prefixes) == CONFIG.tenants * CONFIG.docs_per_tenant == 12
    # The shared document is the same text for every tenant (salted apart by their keys).
    shared = [w.prefixes[t * CONFIG.docs_per_tenant] for t in range(CONFIG.tenants)]
    assert all(p == shared[0] for p in shared)
    assert len({tuple(p) for p in w.prefixes.values()}) == 1 + CONFIG.tenants * 2
    for r in w.requests:
        if r.group is not None:
            assert r.prompt[: len(w.prefixes[r.group])] == w.prefixes[r.group]
            assert r.tenant == r.group // CONFIG.docs_per_tenant
    arrivals = [r.arrival for r in w.requests]
    assert arrivals == sorted(arrivals) and 200 / arrivals[-1] == pytest.approx(2.0, rel=0.3)
    again = make_workload(CONFIG, 200, rate_per_s=1.0, seed=0)
    assert [r.prompt for r in again.requests] == [r.prompt for r in w.requests]  # rate aside


def test_the_probe_times_a_miss_then_a_hit_per_stream_then_a_closed_loop_mix() -> None:
    timed, mix = probe_workloads(CONFIG)
    assert len(timed.requests) == 3 * PROBE_STREAMS
    for stream in range(PROBE_STREAMS):
        miss, hit, unique = timed.requests[3 * stream: 3 * stream + 3]
        assert miss.group == hit.group == unique.group == stream
        prefix = timed.prefixes[stream]
        assert miss.prompt[: len(prefix)] == hit.prompt[: len(prefix)] == prefix
        assert miss.prompt != hit.prompt and unique.prompt[: len(prefix)] != prefix
    assert Counter(r.group for r in mix.requests) == {
        s: CAPACITY_ROUNDS for s in range(CAPACITY_STREAMS)}
    hits = [r for r in mix.requests if any(r.prompt[: len(p)] == p
                                           for p in timed.prefixes.values())]
    assert 0 < len(hits) < len(mix.requests)  # the workload's mix: hits and unique prompts


def test_the_arrival_rate_is_a_fraction_of_the_probed_capacity() -> None:
    rate = cluster._arrival_rate(CONFIG, PROBE, num_prefixes=0, num_requests=100)
    assert rate == pytest.approx(cluster.LOAD * PROBE["capacity_per_s"])
    # Each prefix's first miss costs time: more prefixes, or fewer requests, lower the rate.
    some = cluster._arrival_rate(CONFIG, PROBE, num_prefixes=12, num_requests=120)
    fewer = cluster._arrival_rate(CONFIG, PROBE, num_prefixes=12, num_requests=60)
    assert fewer < some < rate
    free_misses = {**PROBE, "miss_s": PROBE["hit_s"]}
    assert cluster._arrival_rate(CONFIG, free_misses, 12, 120) == pytest.approx(rate)
    # --load scales the rate linearly.
    assert cluster._arrival_rate(CONFIG, PROBE, 12, 120, load=1.2) == pytest.approx(
        some * 1.2 / cluster.LOAD)


def _policy(hit: float, ttft: float, tok_s: float) -> dict[str, object]:
    return {"hit_rate": hit, "ttft_p50_s": ttft, "throughput_tokens_per_s": tok_s,
            "decision_us": {"p99": 800.0}}


def test_targets_are_judged_from_the_policies_that_ran() -> None:
    both = cluster._targets({"round-robin": _policy(0.63, 50.0, 4.4),
                             "cache-aware": _policy(0.75, 4.0, 5.8),
                             "oracle": _policy(0.77, 30.0, 5.2)})
    assert both["hit_points_below_oracle"] == pytest.approx(2.0)
    assert both["ttft_p50_vs_round_robin"] == pytest.approx(12.5)
    assert both["met"]["hit_within_5_points_of_oracle"] and both["met"]["throughput_1.3x"]
    assert not both["met"]["ahead_with_redis"]  # the Redis pair did not run
    # A run of one policy (here the oracle alone) judges nothing and does not fail.
    alone = cluster._targets({"oracle": _policy(0.77, 30.0, 5.2)})
    assert alone["hit_points_below_oracle"] is None and alone["ttft_p50_vs_round_robin"] is None
    assert not any(alone["met"].values())
