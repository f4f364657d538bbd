"""`bench cluster --simulate --pd`: the prefill/decode simulator, its searches, and the command,
without a model (rates and KV shape stand in for the engine's)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstack.bench import common
from kvstack.cli.main import main
from kvstack.cluster.simulate import CostModel
from kvstack.cluster.simulate_pd import (
    PDConfig,
    Trace,
    cluster_trace,
    make_trace,
    simulate_pd,
    step_fixed_s,
)
from kvstack.cluster.simulate_pd_search import (
    best_ratio,
    handoff_bound,
    meets_targets,
    prefill_grid,
)
from kvstack.kv.sizing import KVShape

COST = CostModel(prefill_tokens_per_s=950.0, decode_tokens_per_s=56.0, chunk_tokens=512)
CONFIG = PDConfig(kv_bytes_per_token=46_080.0, network_gbit_s=10.0, handoff_latency_s=0.003)


def one_request(prompt: int, output: int, arrival: float = 1.0) -> Trace:
    return Trace("chat-heavy", 1.0, np.array([arrival]), np.array([prompt > 1000]),
                 np.array([prompt]), np.array([output]))


def test_a_lone_request_takes_the_cost_models_closed_form_time_both_ways() -> None:
    prompt, output = 1300, 20  # three chunks: 512 + 512 + 276
    fixed = step_fixed_s(COST)
    ttft = 3 * fixed + prompt / COST.prefill_tokens_per_s
    per_token = 1 / COST.decode_tokens_per_s  # fixed + 1 row: one sequence decodes alone
    trace = one_request(prompt, output)
    colocated = simulate_pd(trace, COST, CONFIG, 4, 0)
    assert colocated.doc.ttft_p50_s == pytest.approx(ttft)
    assert colocated.doc.tpot_p50_s == pytest.approx(per_token)
    assert colocated.handoff_s_mean == 0.0

    disaggregated = simulate_pd(trace, COST, CONFIG, 4, 1)
    handoff = prompt * 46_080.0 / (10e9 / 8) + 0.003
    assert disaggregated.doc.ttft_p50_s == pytest.approx(ttft)  # the prefill replica's
    assert disaggregated.handoff_s_mean == pytest.approx(handoff)
    assert disaggregated.handoff_wait_s_mean == pytest.approx(0.0, abs=1e-12)
    assert disaggregated.doc.tpot_p50_s == pytest.approx(
        (handoff + (output - 1) * per_token) / (output - 1))
    assert disaggregated.doc_ready_p50_s == pytest.approx(ttft + handoff)


def test_long_prompts_slow_colocated_decodes_and_too_few_prefill_replicas_slow_documents(
) -> None:
    trace = cluster_trace(COST, CONFIG, 16, "rag-heavy", num_requests=400)
    colocated = simulate_pd(trace, COST, CONFIG, 16, 0)
    enough_decode = simulate_pd(trace, COST, CONFIG, 16, 12)
    # The interference disaggregation exists to remove: document chunks in a chat's steps.
    assert colocated.chat.tpot_p99_s > 2 * enough_decode.chat.tpot_p99_s
    starved = simulate_pd(trace, COST, CONFIG, 16, 2)
    assert starved.doc.ttft_p50_s > 5 * colocated.doc.ttft_p50_s
    assert starved.throughput_tokens_per_s < 0.5 * colocated.throughput_tokens_per_s
    assert not meets_targets(starved, colocated)


def test_a_slow_network_makes_the_handoff_the_bottleneck() -> None:
    trace = cluster_trace(COST, CONFIG, 16, "rag-heavy", num_requests=300)
    runs = {gbit: simulate_pd(trace, COST, PDConfig(network_gbit_s=gbit), 16, 12)
            for gbit in (100.0, 25.0, 1.0)}
    doc_bytes = float(np.mean(trace.prompt[trace.doc])) * PDConfig().kv_bytes_per_token
    # Unqueued, a handoff takes ~its bytes over the link: 4x slower link, ~4x longer.
    fast, mid = runs[100.0], runs[25.0]
    latency = PDConfig().handoff_latency_s
    assert 3.0 < (mid.handoff_s_mean - latency) / (fast.handoff_s_mean - latency) < 5.0
    # At 1 Gbit/s a document's 100+ MB take ~1 s each and the NICs queue them.
    slow = runs[1.0]
    assert slow.handoff_s_mean > 0.5 * doc_bytes / 1.25e8
    assert slow.handoff_wait_s_mean > 10 * fast.handoff_wait_s_mean
    assert slow.handoff_queue_max > fast.handoff_queue_max
    assert slow.doc_ready_p50_s > fast.doc_ready_p50_s + 0.5
    bound = handoff_bound(COST, CONFIG, 16, 12, "rag-heavy", (1.0, 10.0, 100.0),
                          num_requests=300)
    by_link = {row.network_gbit_s: row for row in bound.rows}
    assert by_link[1.0].degraded and not by_link[100.0].degraded
    assert bound.enough_gbit_s in (10.0, 100.0)
    assert bound.bytes_per_request["doc"] == pytest.approx(3000 * 46_080.0)
    assert by_link[1.0].nic_utilisation == pytest.approx(10 * by_link[10.0].nic_utilisation)


def test_best_ratio_stays_in_range_and_keeps_to_its_targets() -> None:
    result = best_ratio(COST, CONFIG, 16, "chat-heavy", num_requests=400)
    assert all(1 <= r.prefill_replicas <= 15 for r in result.runs)
    assert {r.prefill_replicas for r in result.runs} >= set(prefill_grid(16))
    if result.best is None:
        assert not any(meets_targets(r, result.colocated) for r in result.runs)
        assert result.tpot_p99_gain is None and not result.tpot_target_met
    else:
        best = result.best
        assert meets_targets(best, result.colocated)
        assert best.throughput_tokens_per_s >= 0.9 * result.colocated.throughput_tokens_per_s
        assert best.chat.ttft_p50_s <= 1.3 * result.colocated.chat.ttft_p50_s
        met = [r for r in result.runs if meets_targets(r, result.colocated)]
        assert best.chat.tpot_p99_s == min(r.chat.tpot_p99_s for r in met)
    assert prefill_grid(2) == [1]
    with pytest.raises(ValueError, match="at least 2"):
        best_ratio(COST, CONFIG, 1, "chat-heavy")


def test_seeded_runs_repeat_and_seeds_differ() -> None:
    first = simulate_pd(cluster_trace(COST, CONFIG, 8, "rag-heavy", 200, seed=3), COST, CONFIG,
                        8, 5)
    again = simulate_pd(cluster_trace(COST, CONFIG, 8, "rag-heavy", 200, seed=3), COST, CONFIG,
                        8, 5)
    other = simulate_pd(cluster_trace(COST, CONFIG, 8, "rag-heavy", 200, seed=4), COST, CONFIG,
                        8, 5)
    assert replace(first, sim_seconds=0.0) == replace(again, sim_seconds=0.0)
    assert first.chat != other.chat
    trace = make_trace(2000, 5.0, "chat-heavy", seed=1)
    assert 0.07 < trace.doc.mean() < 0.13 and math.isclose(
        trace.arrival[-1], 2000 / 5.0, rel_tol=0.1)


class _NoModel:
    """What the simulation reads of the model under test: its KV shape (the embedded model's,
    float32: 46,080 bytes a token)."""

    def __init__(self, options: common.BenchOptions) -> None:
        self.options = options

    def kv_shape(self) -> KVShape:
        return KVShape(30, 3, 64, "float32")


def test_the_command_runs_on_saved_rates_without_a_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rates = {"prefill_tokens_per_s": 950.0, "decode_tokens_per_s": 56.0, "threads": 1}
    (tmp_path / "cluster.json").write_text(json.dumps({"results": {"calibration": rates}}))
    monkeypatch.setattr(common, "Subject", _NoModel)
    code = main(["bench", "cluster", "--simulate", "--pd", "--quick", "--out", str(tmp_path),
                 "--no-progress"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and len(lines) == 1
    assert lines[0].startswith("cluster-pd-sim: 16 chat-heavy: ") and "16 rag-heavy" in lines[0]
    data: dict[str, Any] = json.loads((tmp_path / "cluster-pd-sim.json").read_text())
    assert data["config"]["pd"]["kv_bytes_per_token"] == 46_080
    assert data["config"]["cost_model"]["prefill_tokens_per_s"] == 950.0
    rows = data["results"]["rows"]
    assert [(r["replicas"], r["mix"]) for r in rows] == [(16, "chat-heavy"), (16, "rag-heavy")]
    assert all(1 <= r["prefill_replicas"] <= 15 and r["handoff"]["rows"] for r in rows)
