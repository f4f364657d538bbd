"""`bench soak --minutes N`: N minutes of mixed traffic (`traffic.py`) on one `kvstack serve`
with a disk tier and a Responses database, restarted (SIGTERM, then started on the same
folder) halfway. Every interval (a minute; a twelfth of a short run) the server's RSS, KV
blocks in use and pinned, open files, threads and the interval's TTFT / ITL percentiles are
sampled (`samples.py`). At the end the traffic stops, the pins' TTL is let pass, and the KV
blocks and pins must come back to 0.

The summary (`summary.py`): requests, 5xx, blocks and pins when idle, the RSS slope after
warm-up (MiB/hour), ITL p99 drift from the first to the last third after warm-up, and how
many acknowledged stored responses the restarted server lost. Targets (issue 57): 0 5xx,
blocks and pins 0 when idle, slope < 20 MiB/hour, drift < 10%, 0 lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow
from kvstack.bench.soak.samples import kv_gauges, sample
from kvstack.bench.soak.server import SoakServer
from kvstack.bench.soak.summary import failures, itl_drift, plot, rss_slope, warmup_min
from kvstack.bench.soak.traffic import Traffic

DEFAULT_MINUTES = 60.0
QUICK_MINUTES = 0.5
WORKERS = 3
IDLE_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 180.0


def intervals(minutes: float) -> float:
    """Seconds between samples: a minute, or a twelfth of a shorter run."""
    return min(60.0, max(1.0, minutes * 60 / 12))


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    minutes = options.minutes or (QUICK_MINUTES if options.quick else DEFAULT_MINUTES)
    # Pins lapse within seconds of a short run's end; 30 s on a real one.
    pin_ttl_s, ttl_scale = (2, 0.01) if minutes < 5 else (30, 0.1)
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-soak-") as tmp:
        server = SoakServer(options, Path(tmp), pin_ttl_s, ttl_scale)
        server.start()
        try:
            outcome = asyncio.run(_drive(server, minutes, max(pin_ttl_s, 300 * ttl_scale)))
        finally:
            server.stop()
    return _result(options, minutes, outcome)


async def _drive(server: SoakServer, minutes: float, ttl_s: float) -> dict[str, Any]:
    server.ready.set()  # started before this loop existed
    probe = Traffic(server, "", seed=0)
    models = (await probe.http.get("/v1/models")).raise_for_status().json()
    await probe.close()
    traffic = Traffic(server, models["data"][0]["id"], seed=int.from_bytes(os.urandom(4)))
    stop = asyncio.Event()
    workers = [asyncio.create_task(traffic.worker(stop)) for _ in range(WORKERS)]
    samples: list[dict[str, Any]] = []
    restart: dict[str, Any] = {}
    interval, end = intervals(minutes), minutes * 60
    restart_task = asyncio.create_task(_restart_midway(server, traffic, end / 2, restart))
    since = 0.0
    while (now := traffic.now()) < end:
        await asyncio.sleep(min(interval, end - now))
        await server.ready.wait()
        t = traffic.now()
        samples.append(await sample(traffic.http, server.pid, server.lives, t,
                                    traffic.records, since))
        since = t
    stop.set()
    _, pending = await asyncio.wait(workers, timeout=DRAIN_TIMEOUT_S)
    for task in pending:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await restart_task
    idle = await _idle(traffic, ttl_s)
    lost = await traffic.lost_responses()
    await traffic.close()
    return {"samples": samples, "records": traffic.records, "restart": restart,
            "idle": idle, "acked": len(traffic.acked), "lost": lost,
            "agent_requests": len(traffic.agent)}


async def _restart_midway(server: SoakServer, traffic: Traffic, at_s: float,
                          into: dict[str, Any]) -> None:
    await asyncio.sleep(at_s)
    acked_before = list(traffic.acked)
    into["at_min"] = traffic.now() / 60
    into["down_s"] = await server.restart()
    into["acked_before"] = len(acked_before)
    into["lost"] = [r for r in await traffic.lost_responses() if r in acked_before]


async def _idle(traffic: Traffic, ttl_s: float) -> dict[str, Any]:
    """The KV gauges once the traffic has stopped and the pins' TTL has passed. Pins lapse
    before the engine schedules, so one tiny request is sent first; then the gauges are read
    until both are 0 (or IDLE_TIMEOUT_S passes)."""
    await asyncio.sleep(ttl_s + 1)
    await traffic.http.post("/v1/completions", json={"model": traffic.model, "prompt": "idle",
                                                     "max_tokens": 1})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + IDLE_TIMEOUT_S
    while True:
        gauges = await kv_gauges(traffic.http)
        if not gauges.get("blocks_used") and not gauges.get("pins") \
                or loop.time() > deadline:
            return gauges
        await asyncio.sleep(1.0)


def _result(options: BenchOptions, minutes: float, outcome: dict[str, Any]) -> CaseResult:
    samples, records = outcome["samples"], outcome["records"]
    warmup = warmup_min(minutes)
    slope = rss_slope(samples, warmup)
    early, late, drift = itl_drift(records, warmup, minutes)
    failed = failures(records)
    idle = outcome["idle"]
    lost = len(outcome["lost"])
    load = [s["load_average"] for s in samples]
    by_kind: dict[str, int] = {}
    for r in records:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    summary = (
        f"soak {minutes:g} min ({options.model}, {options.threads_text}): {len(records)} "
        f"requests, {failed['5xx']} 5xx, {failed['transport_errors']} transport errors; idle "
        f"KV blocks {idle.get('blocks_used', 0):.0f}, pins {idle.get('pins', 0):.0f}; RSS "
        f"slope {_fmt(slope, '+.1f')} MiB/hour after {warmup:g} min; ITL p99 "
        f"{_fmt(early and early * 1000, '.0f')} -> {_fmt(late and late * 1000, '.0f')} ms "
        f"({_fmt(drift and drift * 100, '+.0f')}%); {lost} of {outcome['acked']} acknowledged "
        f"responses lost over a restart; load average {_fmt(_mean(load), '.1f')}")
    plots = [plot(options, samples, outcome["restart"].get("at_min", minutes / 2))] \
        if samples else []
    results = {"samples": samples, "failures": failed, "idle": idle, "requests": by_kind,
               "rss_slope_mib_per_hour": slope, "itl_p99_early_s": early,
               "itl_p99_late_s": late, "itl_p99_drift": drift, "restart": outcome["restart"],
               "acknowledged_responses": outcome["acked"], "lost_responses": outcome["lost"],
               "errors": [r for r in records if r["status"] >= 500 or r.get("error")][:50]}
    return CaseResult(
        case="soak", summary=summary, results=results, plots=plots,
        config={"model": options.model, "minutes": minutes, "warmup_min": warmup,
                "workers": WORKERS, "agent_requests": outcome["agent_requests"],
                "quick": options.quick},
        table=[TableRow(f"soak {minutes:g} min: 5xx, idle blocks/pins, RSS slope, ITL p99 "
                        "drift", f"{failed['5xx']}, {idle.get('blocks_used', 0):.0f}/"
                        f"{idle.get('pins', 0):.0f}, {_fmt(slope, '+.1f')} MiB/h, "
                        f"{_fmt(drift and drift * 100, '+.0f')}%")])


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
