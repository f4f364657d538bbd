"""`bench cluster`: routing policies on a real 2-replica Ray Serve cluster, same trace each.

Each policy gets a fresh deployment (cold caches, Redis flushed) of the same replicas (the
model, one thread each unless --threads, KV pool sized so the distinct salted prefixes are
~1.4x one replica's pool and ~0.7x the cluster's) and plays the same seeded workload
(`cluster_workload`) over HTTP through the ingress. Routing alone (no Redis): round-robin,
pow2 (Ray Serve's default policy), Ray's own PrefixCacheAffinityRouter, cache-aware, and an
oracle pinning each prefix to one replica; then with Redis: cache-aware and round-robin.

The arrival rate is set from this machine's measured prefill and decode rates (also recorded
to calibrate `--simulate`): `LOAD` of what two replicas can serve when every prefix hits,
i.e. a load at which caching decides whether the cluster keeps up. `--simulate` runs the
scorer on a simulated cluster of 16-256 replicas instead (`cluster_sim`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from kvstack.bench.cluster_sim import calibrate, run_simulation
from kvstack.bench.cluster_workload import Workload, WorkloadConfig, make_workload, play
from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow
from kvstack.bench.format import ratio
from kvstack.errors import InvalidRequestError

LOAD = 0.85
NUM_REPLICAS = 2
MAX_NUM_SEQS = 4


@dataclass(frozen=True)
class Run:
    name: str
    router: str
    redis: bool


RUNS = (Run("round-robin", "round-robin", False), Run("pow2", "pow2", False),
        Run("ray-prefix", "ray-prefix", False), Run("cache-aware", "cache-aware", False),
        Run("oracle", "oracle", False), Run("cache-aware+redis", "cache-aware", True),
        Run("round-robin+redis", "round-robin", True))
QUICK_RUNS = (RUNS[0], RUNS[3], RUNS[5])


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    if options.simulate:
        return run_simulation(subject, options)
    from kvstack.cluster.launch import LocalRedis, RayInstance, free_port, start_http

    if subject.tokenizer is None:
        raise InvalidRequestError(f"bench cluster serves HTTP, which needs a tokenizer; "
                                  f"{options.model} has none")
    rates, layout = calibrate(subject, options)
    vocab = subject.checkpoint.config.vocab_size
    config = WorkloadConfig(tenants=2 if options.quick else 3,
                            token_range=(min(100, vocab // 2), min(49_000, vocab)))
    num_requests = options.requests or (10 if options.quick else 60)
    rate = _arrival_rate(config, rates)
    workload = make_workload(config, num_requests, rate, seed=0)
    shape = subject.kv_shape()
    kv_blocks = int(workload.distinct_prefix_tokens / 1.4 / shape.block_size) + 1
    results = {}
    with LocalRedis() as redis, RayInstance(num_cpus=NUM_REPLICAS * options.threads,
                                            log_to_driver=False):
        url = f"http://127.0.0.1:{free_port()}"
        start_http("127.0.0.1", int(url.rsplit(":", 1)[1]))
        for spec in _runs(options):
            pins = workload.oracle_pins(layout, NUM_REPLICAS) if spec.router == "oracle" else {}
            results[spec.name] = _run_policy(spec, options, url, workload, redis.url if
                                             spec.redis else None, kv_blocks * shape.
                                             bytes_per_block, pins, redis)
            _progress(options, spec.name, results[spec.name])
    config_out = {"model": options.model, "quick": options.quick, "replicas": NUM_REPLICAS,
                  "threads_per_replica": options.threads, "max_num_seqs": MAX_NUM_SEQS,
                  "requests": num_requests, "rate_per_s": rate, "load": LOAD,
                  "workload": config.__dict__, "kv_blocks_per_replica": kv_blocks,
                  "distinct_prefix_tokens": workload.distinct_prefix_tokens,
                  "prefixes_over_replica_kv": workload.distinct_prefix_tokens /
                  (kv_blocks * shape.block_size),
                  "prefixes_over_cluster_kv": workload.distinct_prefix_tokens /
                  (NUM_REPLICAS * kv_blocks * shape.block_size)}
    verdict = _targets(results)
    return CaseResult("cluster", _summary(results, verdict), config_out,
                      {"calibration": rates, "policies": results, "targets": verdict},
                      table=_table(results))


def _runs(options: BenchOptions) -> tuple[Run, ...]:
    if options.policies:
        return tuple(r for r in RUNS if r.name in options.policies)
    return QUICK_RUNS if options.quick else RUNS


def _arrival_rate(config: WorkloadConfig, rates: dict[str, float]) -> float:
    """`LOAD` x the requests/s two replicas serve when every prefix hits: each request then
    computes its question (or a whole unique prompt) and decodes its answer."""
    cfg = config
    question = (1 - cfg.unique_fraction) * sum(cfg.question_tokens) / 2
    unique = cfg.unique_fraction * sum(cfg.unique_tokens) / 2
    out = sum(cfg.output_tokens) / 2
    seconds = (question + unique) / rates["prefill_tokens_per_s"] + \
        out / rates["decode_tokens_per_s"] / 2  # two sequences share a decode step, about
    return LOAD * NUM_REPLICAS / seconds


def _run_policy(spec: Run, options: BenchOptions, url: str, workload: Workload,
                redis_url: str | None, kv_bytes: int, pins: dict[int, int],
                redis: Any) -> dict[str, Any]:
    from kvstack.cluster.deployments import ClusterSpec, build_app
    from kvstack.cluster.launch import deploy, undeploy
    from kvstack.server.state import ServerConfig

    llm_kwargs = {"model": options.model, "kv_cache_memory": kv_bytes,
                  "kv_redis_url": redis_url, "dtype": options.dtype or "float32",
                  "quantization": options.quantization}
    app_name = f"bench-{spec.name.replace('+', '-')}"
    cluster = ClusterSpec(NUM_REPLICAS, llm_kwargs, replica_threads=options.threads,
                          max_num_seqs=MAX_NUM_SEQS, router=spec.router,
                          api_keys=tuple(workload.keys), app_name=app_name,
                          server_config=ServerConfig(model_name="bench"), oracle_pins=pins)
    redis.flush()
    started = time.perf_counter()
    deploy(build_app(cluster), app_name, url)
    deploy_s = time.perf_counter() - started
    try:
        samples, elapsed = asyncio.run(play(url, "bench", workload))
        time.sleep(2.5)  # the ingress polls replica stats every second
        state = httpx.get(f"{url}/v1/cluster", timeout=60,
                          headers={"authorization": f"Bearer {workload.keys[0]}"}).json()
    finally:
        undeploy(app_name)
    return {**_figures(samples, elapsed, state), "deploy_s": deploy_s, "samples": samples}


def _figures(samples: list[dict[str, Any]], elapsed: float,
             state: dict[str, Any]) -> dict[str, Any]:
    ok = [s for s in samples if s["error"] is None and s["ttft_s"] is not None]
    ttft = np.array([s["ttft_s"] for s in ok]) if ok else np.zeros(1)
    tpot = [s["tpot_s"] for s in ok if s["tpot_s"] is not None]
    out_tokens = sum(s["completion_tokens"] for s in ok)
    hit = state["hit_tokens"]
    total = sum(hit.values())
    source = "replicas' engine counters"
    if not total:
        # Ray's own router bypasses our view, which then polls no replica: count what the
        # engines reported to the clients instead (no tier in that run: every hit is memory).
        cached = sum(s["cached_tokens"] for s in ok)
        total = sum(s["prompt_tokens"] for s in ok)
        hit = {"memory": cached, "disk": 0, "redis": 0, "computed": total - cached}
        source = "usage.cached_tokens of the answers"
    computed = [r["engine"]["hit_tokens"]["computed"] for r in state["replicas"]
                if "engine" in r]
    router = state["router"]
    ours = state["policy"] != "round-robin" or router["decisions"] > 0
    return {
        "requests": len(samples), "errors": len(samples) - len(ok),
        "hit_rate": (total - hit["computed"]) / total if total else 0.0,
        "hit_rate_by_source": {k: v / total if total else 0.0 for k, v in hit.items()},
        "hit_counts_from": source,
        "client_cached_fraction": sum(s["cached_tokens"] for s in ok) /
        max(sum(s["prompt_tokens"] for s in ok), 1),
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_mean_s": float(np.mean(tpot)) if tpot else None,
        "throughput_tokens_per_s": out_tokens / elapsed,
        "throughput_requests_per_s": len(ok) / elapsed, "makespan_s": elapsed,
        "queue_imbalance": max(computed) / (sum(computed) / len(computed))
        if computed and sum(computed) else None,
        # Per replica: prompt tokens it received and computed (Ray's own router bypasses the
        # view, so these come from the engines, not from the router's decision counts).
        "replicas": {r["name"]: {"prompt_tokens": r["engine"]["hit_tokens"],
                                 "routed_by_view": r["routed"]}
                     for r in state["replicas"] if "engine" in r},
        "decision_us": router["decision_us"] if ours and router["decisions"] else None,
        "prediction": router["prediction"], "ingress": state["ingress"],
        "report_age_us": router.get("report_age_us"),
        "report_key_bytes_per_report": sum(r["report_key_bytes"] for r in state["replicas"]) /
        max(sum(r["reports"] for r in state["replicas"]), 1),
    }


def _targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def get(name: str, key: str) -> Any:
        return results.get(name, {}).get(key)

    ca, rr = "cache-aware", "round-robin"
    out: dict[str, Any] = {
        "hit_points_below_oracle": None if get("oracle", "hit_rate") is None else
        100 * (get("oracle", "hit_rate") - get(ca, "hit_rate")),
        "ttft_p50_vs_round_robin": ratio(get(rr, "ttft_p50_s"), get(ca, "ttft_p50_s")),
        "throughput_vs_round_robin": ratio(get(ca, "throughput_tokens_per_s"),
                                           get(rr, "throughput_tokens_per_s")),
        "redis_ttft_p50_vs_round_robin_redis": ratio(get(rr + "+redis", "ttft_p50_s"),
                                                     get(ca + "+redis", "ttft_p50_s")),
        "decision_p99_us": (get(ca, "decision_us") or {}).get("p99"),
    }
    lost, back = get(rr, "ttft_p50_s"), get(rr + "+redis", "ttft_p50_s")
    best = get(ca, "ttft_p50_s")
    if None not in (lost, back, best) and lost > best:
        out["redis_recovers_of_round_robin_loss"] = (lost - back) / (lost - best)
    out["met"] = {
        "hit_within_5_points_of_oracle": out["hit_points_below_oracle"] is not None and
        out["hit_points_below_oracle"] <= 5,
        "ttft_p50_3x_lower": (out["ttft_p50_vs_round_robin"] or 0) >= 3,
        "throughput_1.3x": (out["throughput_vs_round_robin"] or 0) >= 1.3,
        "ahead_with_redis": (out["redis_ttft_p50_vs_round_robin_redis"] or 0) > 1,
        "decision_under_2ms_p99": (out["decision_p99_us"] or 1e9) < 2000,
    }
    return out


def _summary(results: dict[str, dict[str, Any]], verdict: dict[str, Any]) -> str:
    def pct(name: str) -> str:
        value = results.get(name, {}).get("hit_rate")
        return "n/a" if value is None else f"{value:.0%}"

    def x(value: float | None, digits: int = 1) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}x"

    decision = verdict["decision_p99_us"]
    return (f"cluster: 2 replicas, hit rate cache-aware {pct('cache-aware')} / oracle "
            f"{pct('oracle')} / round-robin {pct('round-robin')}; cache-aware vs round-robin "
            f"TTFT p50 {x(verdict['ttft_p50_vs_round_robin'])} lower, throughput "
            f"{x(verdict['throughput_vs_round_robin'], 2)}; with Redis TTFT p50 "
            f"{x(verdict['redis_ttft_p50_vs_round_robin_redis'])} lower; decision p99 "
            + ("n/a" if decision is None else f"{decision / 1000:.2f} ms"))


def _table(results: dict[str, dict[str, Any]]) -> list[TableRow]:
    rr = results.get("round-robin", {})
    rows = []
    for name, r in results.items():
        rows.append(TableRow(f"cluster {name}: hit {r['hit_rate']:.0%}, TTFT p50",
                             f"{r['ttft_p50_s']:.2f} s", f"{rr.get('ttft_p50_s', 0):.2f} s",
                             f"{ratio(rr.get('ttft_p50_s'), r['ttft_p50_s']) or 0:.2f}x"))
    return rows


def _progress(options: BenchOptions, name: str, r: dict[str, Any]) -> None:
    if options.show_progress:
        import sys

        print(f"  {name}: hit {r['hit_rate']:.0%} TTFT p50 {r['ttft_p50_s']:.2f} s p99 "
              f"{r['ttft_p99_s']:.2f} s, {r['throughput_tokens_per_s']:.1f} tok/s, "
              f"{r['errors']} errors, deploy {r['deploy_s']:.0f} s", file=sys.stderr, flush=True)
