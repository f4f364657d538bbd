"""What the soak samples every interval: the server process's RSS, open files and threads
(psutil), its KV blocks in use and pinned (`/metrics`), and the TTFT / ITL percentiles of the
requests sent since the last sample."""

from __future__ import annotations

import os
from typing import Any

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

GAUGES = {"kvstack_kv_blocks_used": "blocks_used", "kvstack_kv_blocks_pinned": "pins"}


async def kv_gauges(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).raise_for_status().text
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in GAUGES:
            found[GAUGES[family.name]] = sum(s.value for s in family.samples)
    return found


def process_figures(pid: int) -> dict[str, float]:
    proc = psutil.Process(pid)
    with proc.oneshot():
        return {"rss_mib": proc.memory_info().rss / 2**20, "open_files": proc.num_fds(),
                "threads": proc.num_threads()}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values), [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def latency(records: list[dict[str, Any]], since: float, until: float) -> dict[str, Any]:
    window = [r for r in records if since <= r["t"] < until]
    ttft = [r["ttft_s"] for r in window if r.get("ttft_s") is not None]
    itl = [gap for r in window for gap in r.get("itl_s", ())]
    return {"requests": len(window), "ttft": percentiles(ttft), "itl": percentiles(itl),
            "itl_count": len(itl)}


async def sample(http: httpx.AsyncClient, pid: int, life: int, t: float,
                 records: list[dict[str, Any]], since: float) -> dict[str, Any]:
    return {"t_min": t / 60, "life": life, **process_figures(pid), **await kv_gauges(http),
            **latency(records, since, t), "load_average": os.getloadavg()[0]}
