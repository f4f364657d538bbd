"""`bench cluster --simulate`: the pure scorer on simulated clusters of 16-256 replicas.

A seeded trace (100,000 requests by default; `cluster.trace`) over many tenants drives the
same `CacheAwareRouter` the Ray router uses, against round-robin and a text-trie policy (Ray's
PrefixCacheAffinityRouter, modelled), on replicas whose KV capacity and prefill/decode costs
come from this machine: `calibrate` measures the model's prefill and decode rates at the
benchmark's thread count (or reads them from a real `bench cluster` run in --out). Reports hit
rate, modelled TTFT, load imbalance, decision time and the index's size per replica as the
replica count and the tenant count grow. The cost model ranks routers; it does not predict a
deployment's latencies (see docs/scaling.md).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, fields, replace
from typing import Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow
from kvstack.cluster.scoring import Layout
from kvstack.cluster.simulate import CostModel, SimResult, ingress_hash_us, simulate
from kvstack.cluster.trace import TraceConfig

SIM_POLICIES = ("cache-aware", "round-robin", "text-trie")
# Offered prefill work as a multiple of the cluster's prefill capacity if nothing hit: above 1,
# a cluster that does not reuse the cache falls behind; one that does keeps up.
LOAD_IF_NOTHING_HIT = 1.3
_COLUMNS = [
    ("policy", "{}"), ("replicas", "{}"), ("tenants", "{}"), ("hit_rate", "{:.1%}"),
    ("ttft_p50_s", "{:.2f}"), ("ttft_p99_s", "{:.1f}"), ("imbalance", "{:.2f}"),
    ("decision_us_mean", "{:.0f}"), ("decision_us_p99", "{:.0f}"), ("guarded", "{:.1%}"),
    ("overpredicted", "{:.1%}"), ("index_blocks_per_replica", "{:.0f}"),
    ("index_bytes_per_replica", "{:.0f}"), ("event_bytes_per_replica_s", "{:.0f}"),
    ("sim_seconds", "{:.1f}"),
]
assert {c for c, _ in _COLUMNS} <= {f.name for f in fields(SimResult)}


def format_row(result: SimResult) -> str:
    return " | ".join(fmt.format(getattr(result, name)) for name, fmt in _COLUMNS)


def mean_prompt_tokens(config: TraceConfig) -> float:
    prefixed = sum(config.prefix_tokens) / 2 + sum(config.question_tokens) / 2
    unique = sum(config.unique_tokens) / 2
    return config.unique_fraction * unique + (1 - config.unique_fraction) * prefixed


def calibrate(subject: Subject, options: BenchOptions) -> tuple[dict[str, float], Layout]:
    """Prefill and decode tokens/s of one engine at the benchmark's thread count (what each
    replica runs): a ~1,000-token prompt, then 32 tokens decoded alone; and the layout its
    blocks are hashed under (the replicas run the same engine)."""
    from kvstack.sampling_params import SamplingParams

    llm = subject.llm(kv_cache_memory="256MiB")
    info = llm.info
    layout = Layout(info.fingerprint, info.block_size, info.kv_cache_dtype)
    vocab = subject.checkpoint.config.vocab_size
    low = min(100, vocab // 2)  # clear of the special tokens
    length = min(1000, subject.max_model_len - 40)
    prompt = [low + (i * 7919) % (vocab - low) for i in range(length)]
    started = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    prefill = len(prompt) / (time.perf_counter() - started)
    out = llm.generate({"prompt_token_ids": prompt[:min(50, length)]},
                       SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    decode = out.metrics.decode_rate(len(out.outputs[0].token_ids)) or 1.0
    llm.close()
    return {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
            "threads": options.threads}, layout


def machine_rates(subject: Subject, options: BenchOptions) -> tuple[dict[str, float], str]:
    """This machine's rates: from a real `bench cluster` run in --out, else measured now."""
    path = options.out / "cluster.json"
    if path.exists():
        try:
            saved = json.loads(path.read_text())["results"]["calibration"]
            return saved, f"measured by `bench cluster` ({path})"
        except (KeyError, ValueError):
            pass
    return calibrate(subject, options)[0], "measured now"


def run_simulation(subject: Subject, options: BenchOptions) -> CaseResult:
    rates, source = machine_rates(subject, options)
    kv_blocks = subject.kv_shape().num_blocks_for_budget(2**30)  # a 1 GiB pool per replica
    cost = CostModel(prefill_tokens_per_s=rates["prefill_tokens_per_s"],
                     decode_tokens_per_s=rates["decode_tokens_per_s"], kv_blocks=kv_blocks)
    base = TraceConfig()
    trace = replace(base, rate_per_replica=LOAD_IF_NOTHING_HIT * cost.prefill_tokens_per_s /
                    mean_prompt_tokens(base))
    requests = options.requests or (2000 if options.quick else 100_000)
    replicas = options.sim_replicas or ((16,) if options.quick else (16, 64, 256))
    tenants = options.sim_tenants or ((8,) if options.quick else (8, 32))

    def progress(result: SimResult) -> None:
        if options.show_progress:
            print("  " + format_row(result), file=sys.stderr, flush=True)

    if options.show_progress:
        print("  " + " | ".join(name for name, _ in _COLUMNS), file=sys.stderr, flush=True)
    results = simulate(requests, replicas, tenants, seed=0, policies=SIM_POLICIES, cost=cost,
                       trace=trace, progress=progress)
    rows = [asdict(r) for r in results]
    return CaseResult(
        "cluster-sim", _summary(results),
        {"requests": requests, "replicas": list(replicas), "tenants": list(tenants),
         "policies": list(SIM_POLICIES), "cost_model": asdict(cost), "rates_source": source,
         "trace": asdict(trace), "load_if_nothing_hit": LOAD_IF_NOTHING_HIT,
         "publish_period_s": 1.0, "record_ttl_s": 5.0},
        {"rows": rows, "calibration": rates, "ingress_hash_us_per_1100_tokens":
         ingress_hash_us()},
        table=[TableRow(f"simulated {r.replicas} replicas, {r.tenants} tenants: "
                        f"{r.policy} hit rate", f"{r.hit_rate:.1%}") for r in results])


def _summary(results: list[SimResult]) -> str:
    by = {(r.policy, r.replicas, r.tenants): r for r in results}
    parts = []
    for (policy, replicas, tenants), r in sorted(by.items(), key=lambda x: (x[0][1], x[0][2])):
        if policy != "cache-aware":
            continue
        rr = by.get(("round-robin", replicas, tenants))
        trie = by.get(("text-trie", replicas, tenants))
        parts.append(f"{replicas}x{tenants}t: hit {r.hit_rate:.0%} vs rr "
                     f"{rr.hit_rate if rr else 0:.0%} / trie {trie.hit_rate if trie else 0:.0%}, "
                     f"TTFT p50 {r.ttft_p50_s:.1f} s, decision p99 {r.decision_us_p99:.0f} us")
    return "cluster-sim: " + "; ".join(parts)


def describe(results: list[dict[str, Any]]) -> str:
    """Markdown table of simulation rows (for the docs)."""
    head = "| " + " | ".join(n for n, _ in _COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(_COLUMNS)]
    for row in results:
        lines.append("| " + " | ".join(fmt.format(row[n]) for n, fmt in _COLUMNS) + " |")
    return "\n".join(lines)
