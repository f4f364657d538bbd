"""The soak's verdict from its samples: RSS growth after warm-up, ITL p99 drift, 5xx count,
whether KV blocks and pins came back to 0 when idle; and its plot."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstack.bench.common import BenchOptions
from kvstack.bench.plots import save_figure
from kvstack.bench.soak.samples import percentiles

WARMUP_MIN = 10.0  # growth is measured after this, or after the first 20% of a shorter run
WARMUP_SHARE = 0.2


def warmup_min(minutes: float) -> float:
    return min(WARMUP_MIN, WARMUP_SHARE * minutes)


def rss_slope(samples: list[dict[str, Any]], warmup: float) -> float | None:
    """MiB/hour: one least-squares slope over the samples after warm-up, each server life
    with its own intercept (a restart starts the RSS afresh); warm-up counts from each
    life's start."""
    num = den = 0.0
    for life in {s["life"] for s in samples}:
        own = [s for s in samples if s["life"] == life]
        start = own[0]["t_min"]
        kept = [s for s in own if s["t_min"] - start >= warmup]
        if len(kept) < 2:
            continue
        t = np.array([s["t_min"] for s in kept]) / 60
        r = np.array([s["rss_mib"] for s in kept])
        num += float(((t - t.mean()) * (r - r.mean())).sum())
        den += float(((t - t.mean()) ** 2).sum())
    return num / den if den > 0 else None


def itl_drift(records: list[dict[str, Any]], warmup: float, minutes: float
              ) -> tuple[float | None, float | None, float | None]:
    """(early p99, late p99, relative drift): ITL p99 of the first and last third of the run
    after warm-up."""
    start, end = warmup * 60, minutes * 60
    third = (end - start) / 3

    def p99(lo: float, hi: float) -> float | None:
        gaps = [g for r in records if lo <= r["t"] < hi for g in r.get("itl_s", ())]
        return percentiles(gaps)["p99"]

    early, late = p99(start, start + third), p99(end - third, end + 1)
    drift = (late - early) / early if early and late is not None else None
    return early, late, drift


def failures(records: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "5xx": sum(r["status"] >= 500 for r in records),
        "transport_errors": sum(r["status"] == 0 and not r.get("during_restart")
                                for r in records),
        "interrupted_by_restart": sum(bool(r.get("during_restart")) for r in records),
        "client_errors": sum(r["status"] == -1 for r in records),
        "hostile_not_4xx": sum(r["kind"] == "hostile" and not 400 <= r["status"] < 500
                               for r in records),
        "stream_errors": sum(r["status"] == 200 and bool(r.get("error")) for r in records),
    }


def plot(options: BenchOptions, samples: list[dict[str, Any]], restart_min: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    t = [s["t_min"] for s in samples]
    panels = (
        (axes[0][0], "server RSS (MiB)", [("rss_mib", "RSS")]),
        (axes[0][1], "KV blocks", [("blocks_used", "in use"), ("pins", "pinned")]),
        (axes[1][0], "open files, threads", [("open_files", "open files"),
                                             ("threads", "threads")]),
    )
    for ax, title, series in panels:
        for key, label in series:
            ax.plot(t, [s.get(key) for s in samples], marker=".", label=label)
        ax.set_title(title)
        ax.legend()
    ax = axes[1][1]
    for what in ("ttft", "itl"):
        for q in ("p50", "p99"):
            ax.plot(t, [_ms(s[what][q]) for s in samples], marker=".", label=f"{what} {q}")
    ax.set_yscale("log")
    ax.set_title("latency per interval (ms)")
    ax.legend()
    for ax in axes.flat:
        ax.axvline(restart_min, color="grey", linestyle="--", alpha=0.6)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minutes (dashed: restart)")
    fig.suptitle(f"bench soak: {options.model}, {options.threads_text}")
    return save_figure(fig, options, "soak.png")


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000
