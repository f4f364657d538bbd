"""`bench cluster --simulate --pd`: the best prefill:decode ratio on 16-256 simulated replicas.

The replicas' prefill and decode rates are this machine's (`cluster_sim.machine_rates`: the
calibration of a real `bench cluster` run in --out, else measured now on one engine), the KV
bytes per token the model's. For each replica count and each mix (`simulate_pd.MIXES`:
chat-heavy, rag-heavy) `best_ratio` sweeps the prefill replicas at `NETWORK_GBIT` and
`handoff_bound` replays the ratio it picks over 1-100 Gbit/s links. The simulator models
steps, queues and NICs, not a deployment: its figures rank ratios and show where the handoff
starts to cost (see docs/scaling.md), they do not predict latencies.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from kvstack.bench.cluster_sim import machine_rates
from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow
from kvstack.cluster.simulate import CostModel
from kvstack.cluster.simulate_pd import MIXES, PDConfig
from kvstack.cluster.simulate_pd_search import (
    REPLICAS,
    HandoffBound,
    RatioResult,
    best_ratio,
    chosen,
    handoff_bound,
)
from kvstack.errors import InvalidRequestError

NETWORK_GBIT = 10.0  # the link the ratio is picked on
QUICK_REQUESTS_PER_REPLICA = 10


def run_pd_simulation(subject: Subject, options: BenchOptions) -> CaseResult:
    rates, source = machine_rates(subject, options)
    cost = CostModel(prefill_tokens_per_s=rates["prefill_tokens_per_s"],
                     decode_tokens_per_s=rates["decode_tokens_per_s"])
    base = PDConfig()
    config = PDConfig(kv_bytes_per_token=subject.kv_shape().bytes_per_token,
                      network_gbit_s=NETWORK_GBIT, load=options.load or base.load,
                      requests_per_replica=QUICK_REQUESTS_PER_REPLICA if options.quick
                      else base.requests_per_replica)
    replicas = options.sim_replicas or ((16,) if options.quick else REPLICAS)
    if min(replicas) < 2:
        raise InvalidRequestError("--simulate --pd needs at least 2 replicas per cluster")
    rows = []
    for num_replicas in replicas:
        for mix in MIXES:
            ratio = best_ratio(cost, config, num_replicas, mix, options.requests)
            bound = handoff_bound(cost, config, num_replicas, chosen(ratio).prefill_replicas,
                                  mix, num_requests=options.requests)
            rows.append(_row(ratio, bound))
            if options.show_progress:
                print(f"  {_line(rows[-1])}", file=sys.stderr, flush=True)
    return CaseResult(
        "cluster-pd-sim", "cluster-pd-sim: " + "; ".join(_line(r) for r in rows),
        {"replicas": list(replicas), "mixes": MIXES, "cost_model": asdict(cost),
         "pd": asdict(config), "rates_source": source, "requests": options.requests,
         "quick": options.quick},
        {"rows": rows, "calibration": rates},
        table=[row for r in rows for row in _table(r)])


def _row(ratio: RatioResult, bound: HandoffBound) -> dict[str, Any]:
    pick = chosen(ratio)
    return {"replicas": ratio.replicas, "mix": ratio.mix, "targets_met": ratio.best is not None,
            "prefill_replicas": pick.prefill_replicas,
            "decode_replicas": ratio.replicas - pick.prefill_replicas,
            "tpot_p99_gain": ratio.tpot_p99_gain, "tpot_target_met": ratio.tpot_target_met,
            "colocated": asdict(ratio.colocated), "chosen": asdict(pick),
            "runs": [asdict(r) for r in ratio.runs], "handoff": asdict(bound)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _versus(pick: dict[str, Any], colocated: dict[str, Any]) -> str:
    """Colocated -> the chosen ratio, on the figures the issue's targets name."""
    chat, doc = (colocated["chat"], pick["chat"]), (colocated["doc"], pick["doc"])
    throughput = pick["throughput_tokens_per_s"] / colocated["throughput_tokens_per_s"]
    return (f"chat TPOT p99 {_ms(chat[0]['tpot_p99_s'])} -> {_ms(chat[1]['tpot_p99_s'])}, "
            f"chat TTFT p50 {_ms(chat[0]['ttft_p50_s'])} -> {_ms(chat[1]['ttft_p50_s'])}, "
            f"doc TTFT p50 {doc[0]['ttft_p50_s']:.1f} -> {doc[1]['ttft_p50_s']:.1f} s, "
            f"tokens/s {throughput:.2f}x")


def _line(row: dict[str, Any]) -> str:
    verdict = "best" if row["targets_met"] else "no ratio met the targets; closest"
    enough = row["handoff"]["enough_gbit_s"]
    link = (f"links from {enough:g} Gbit/s carry the handoff" if enough is not None
            else "the handoff slows it on every swept link")
    return (f"{row['replicas']} {row['mix']}: {verdict} {row['prefill_replicas']}P:"
            f"{row['decode_replicas']}D ({_versus(row['chosen'], row['colocated'])}), {link}")


def _table(row: dict[str, Any]) -> list[TableRow]:
    """The chosen ratio against colocated on chat TPOT p99 (> 1: disaggregation wins), and
    the handoff."""
    where = f"simulated {row['replicas']} replicas, {row['mix']}, chat TPOT p99"
    ratio = f"{row['prefill_replicas']}:{row['decode_replicas']}"
    if not row["targets_met"]:
        ratio += ", no ratio met the targets"
    gain = row["tpot_p99_gain"]
    handoff = row["handoff"]
    enough = handoff["enough_gbit_s"]
    return [TableRow(f"{where} ({ratio})", _ms(row["chosen"]["chat"]["tpot_p99_s"]),
                     f"colocated {_ms(row['colocated']['chat']['tpot_p99_s'])}",
                     f"{gain:.1f}x" if gain else ""),
            TableRow(f"simulated {row['replicas']} replicas, {row['mix']}: KV per document",
                     f"{handoff['bytes_per_request']['doc'] / 1e6:.0f} MB, "
                     + ("every swept link slows the handoff" if enough is None
                        else f"links from {enough:g} Gbit/s carry it"))]


def describe(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows (for the docs)."""
    lines = ["| replicas | mix | P:D | chat TPOT p99 colocated / P:D | chat TTFT p50 | "
             f"doc TTFT p50 | tokens/s | handoff mean at {NETWORK_GBIT:g} Gbit/s | link enough |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        co, pick = row["colocated"], row["chosen"]
        enough = row["handoff"]["enough_gbit_s"]
        lines.append(
            f"| {row['replicas']} | {row['mix']} | {row['prefill_replicas']}:"
            f"{row['decode_replicas']}{'' if row['targets_met'] else ' (none met)'} | "
            f"{_ms(co['chat']['tpot_p99_s'])} / {_ms(pick['chat']['tpot_p99_s'])} | "
            f"{_ms(co['chat']['ttft_p50_s'])} / {_ms(pick['chat']['ttft_p50_s'])} | "
            f"{co['doc']['ttft_p50_s']:.1f} / {pick['doc']['ttft_p50_s']:.1f} s | "
            f"{pick['throughput_tokens_per_s'] / co['throughput_tokens_per_s']:.2f}x | "
            f"{_ms(pick['handoff_s_mean'])} | {'-' if enough is None else f'{enough:g} Gbit/s'} |")
    return "\n".join(lines)

