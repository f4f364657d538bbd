"""`bench cluster --pd`'s trace and verdict, without a cluster."""

from __future__ import annotations

import pytest

from kvstack.bench.cluster_pd import (
    CHAT_TOKENS,
    DOC_FRACTION,
    DOC_PROMPT,
    DOC_TOKENS,
    _targets,
    default_rate,
    pd_workload,
)


def test_the_trace_mixes_chat_turns_and_long_documents_reproducibly() -> None:
    workload = pd_workload(200, 0.5, (100, 1000), quick=False, seed=3)
    again = pd_workload(200, 0.5, (100, 1000), quick=False, seed=3)
    assert [r.prompt for r in workload.requests] == [r.prompt for r in again.requests]
    docs = [r for r in workload.requests if r.group == 1]
    chats = [r for r in workload.requests if r.group == 0]
    assert 0.15 < len(docs) / 200 < 0.35
    assert all(DOC_PROMPT[0] <= len(r.prompt) <= DOC_PROMPT[1] and r.max_tokens == DOC_TOKENS
               for r in docs)
    assert all(len(r.prompt) < DOC_PROMPT[0] and r.max_tokens == CHAT_TOKENS for r in chats)
    arrivals = [r.arrival for r in workload.requests]
    assert arrivals == sorted(arrivals) and 300 < arrivals[-1] < 500  # ~200 / 0.5 s


def _config(tpot_p99: float, ttft_p50: float, tokens_per_s: float) -> dict[str, object]:
    return {"classes": {"chat": {"tpot_p99_s": tpot_p99, "ttft_p50_s": ttft_p50}},
            "throughput_tokens_per_s": tokens_per_s}


def test_the_verdict_reads_the_issues_targets_for_each_disaggregated_config() -> None:
    verdict = _targets({"colocated": _config(0.2, 0.1, 10.0),
                        "disaggregated": _config(0.11, 0.14, 8.0),
                        "disaggregated-local": _config(0.09, 0.12, 9.5)})
    assert set(verdict) == {"disaggregated", "disaggregated-local"}
    met = verdict["disaggregated-local"]
    assert met["tpot_target_met"] and met["ttft_target_met"] and met["equal_throughput"]
    missed = verdict["disaggregated"]
    assert not (missed["tpot_target_met"] or missed["ttft_target_met"]
                or missed["equal_throughput"])
    assert _targets({"disaggregated": _config(0.09, 0.12, 9.5)}) == {}


def test_the_default_rate_keeps_one_prefill_replica_busy_the_asked_share_with_documents() -> None:
    rate = default_rate(200.0, 0.5, quick=False)
    workload = pd_workload(4000, rate, (100, 1000), quick=False, seed=1)
    docs = [r for r in workload.requests if r.group == 1]
    busy = sum(len(r.prompt) for r in docs) / 200.0 / workload.requests[-1].arrival
    assert 0.45 < busy < 0.55
    assert default_rate(200.0, 0.5, quick=True) == 8 * rate  # quick documents are 8x shorter
    assert DOC_FRACTION * rate * sum(DOC_PROMPT) / 2 / 200.0 == pytest.approx(0.5)
