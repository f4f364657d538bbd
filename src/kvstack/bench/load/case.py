"""`bench load`: guidellm against `kvstack serve` and llama.cpp's server, same file and trace.

Both servers run the model's GGUF file (kvstack natively, `--quantization gguf`) on the same
threads, one after the other, and guidellm drives each through the same seeded workloads at
each concurrency level: completions behind one of 4 shared 512-token prefixes (~800 tokens of
context, and a ~2,000-token variant) and multi-turn chat over the same prefixes. Ratios are
kvstack / peer from the same run: below 1 is better for latencies, above 1 for throughput.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    MissingBenchDependencyError,
    Subject,
    TableRow,
)
from kvstack.bench.format import fmt, fmt_x, ratio
from kvstack.bench.http_load import server_process
from kvstack.bench.load import guidellm_driver, peer_server
from kvstack.bench.load.guidellm_driver import LevelStats, Workload
from kvstack.bench.plots import new_figure, save_figure
from kvstack.errors import InvalidRequestError
from kvstack.units import format_ms
from kvstack.weights import resolve_model

WORKLOADS = {
    "completions": Workload("/v1/completions", prompt=256, prefix=512, prefixes=4, output=64),
    "completions_2k": Workload("/v1/completions", prompt=1424, prefix=512, prefixes=4,
                               output=64),
    "chat_multiturn": Workload("/v1/chat/completions", prompt=256, prefix=512, prefixes=4,
                               output=64, turns=3),
}
QUICK_WORKLOADS = {
    "completions": Workload("/v1/completions", prompt=48, prefix=32, prefixes=2, output=8),
    "chat_multiturn": Workload("/v1/chat/completions", prompt=48, prefix=32, prefixes=2,
                               output=8, turns=2),
}
LEVELS, QUICK_LEVELS = (1, 4, 16), (1, 2)
SECONDS = 60.0
# --quick: each level ends after this many requests (a duration would end a level on a slow or
# busy machine before any request finished), within a generous time limit.
QUICK_REQUESTS, QUICK_SECONDS = 4, 300.0


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    gguf = resolve_model(options.model)
    if gguf.suffix != ".gguf":
        raise InvalidRequestError(f"bench load runs both servers on one GGUF file and "
                                  f"{options.model} is not one")
    if subject.tokenizer is None:
        raise InvalidRequestError("bench load needs a model with a tokenizer (guidellm "
                                  "counts tokens with it)")
    reason = guidellm_driver.unavailable_reason()
    if reason:
        raise MissingBenchDependencyError(reason)
    ours = dataclasses.replace(options, quantization=options.quantization or "gguf")
    workloads = QUICK_WORKLOADS if options.quick else WORKLOADS
    levels = QUICK_LEVELS if options.quick else LEVELS
    seconds = QUICK_SECONDS if options.quick else (options.duration or SECONDS)
    context = max(w.context for w in workloads.values()) + 64
    subject.require_context(context, "the load benchmark")
    peer_missing = peer_server.unavailable_reason()

    kv_bytes = subject.kv_shape().bytes_for(context, max(levels) + 2)
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-load-") as tmp:
        folder = Path(tmp)
        subject.tokenizer.save_pretrained(folder / "tokenizer")
        plan = _Plan(folder, workloads, levels, seconds,
                     QUICK_REQUESTS if options.quick else None)
        with server_process(ours, kv_bytes, max(levels)) as (url, _):
            kvstack_runs = plan.drive(url, "kvstack")
        peer_runs: dict[str, list[LevelStats]] = {}
        peer_name = None
        if peer_missing is None:
            with peer_server.peer_server(gguf, options.threads, max(levels),
                                         context) as (url, peer_name):
                peer_runs = plan.drive(url, "peer")

    results = {name: _workload_result(kvstack_runs[name], peer_runs.get(name))
               for name in workloads}
    return CaseResult(
        case="load",
        summary=_summary(results, peer_name, peer_missing, options),
        config={"model": options.model, "gguf": gguf.name, "quick": options.quick,
                "levels": list(levels), "seconds_per_level": seconds,
                "requests_per_level": QUICK_REQUESTS if options.quick else None,
                "workloads": {n: dataclasses.asdict(w) for n, w in workloads.items()},
                "client": "guidellm (unmodified), seeded synthetic text, ignore_eos",
                "kvstack": {"weights": ours.quantization, "threads": options.threads},
                "peer": {"server": peer_name, "threads": options.threads,
                         "slots": max(levels), "slot_context": context}
                if peer_name else {"not_run": peer_missing}},
        results=results,
        plots=[_plot(options, results, peer_name)],
        table=_table(results, peer_name),
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The run's workloads and levels, and the folder guidellm's files go to."""

    folder: Path  # holds the tokenizer folder guidellm counts tokens with
    workloads: dict[str, Workload]
    levels: tuple[int, ...]
    seconds: float
    max_requests: int | None

    def drive(self, url: str, side: str) -> dict[str, list[LevelStats]]:
        """Every workload through guidellm against the server at `url`."""
        model = _served_model(url)
        runs = {}
        for name, workload in self.workloads.items():
            print(f"load: {side}, {name} at {'/'.join(map(str, self.levels))} streams",
                  file=sys.stderr, flush=True)
            runs[name] = guidellm_driver.run_guidellm(
                url, model, self.folder / "tokenizer", workload, self.levels, self.seconds,
                self.folder / side / name, self.max_requests)
        return runs


def _served_model(url: str) -> str:
    models = httpx.get(f"{url}/v1/models", timeout=10).raise_for_status().json()
    return str(models["data"][0]["id"])


def _workload_result(ours: list[LevelStats], peer: list[LevelStats] | None) -> dict[str, Any]:
    """The two servers' levels side by side, with kvstack / peer ratios per level."""
    result: dict[str, Any] = {"kvstack": [s.as_dict() for s in ours]}
    if peer is None:
        return result
    result["peer"] = [s.as_dict() for s in peer]
    result["ratios"] = [
        {"concurrency": a.concurrency,
         "itl_p50": ratio(a.itl_p50_s, b.itl_p50_s),
         "tpot_p50": ratio(a.tpot_p50_s, b.tpot_p50_s),
         "ttft_p50": ratio(a.ttft_p50_s, b.ttft_p50_s),
         "output_tok_s": ratio(a.output_tok_s, b.output_tok_s)}
        for a, b in zip(ours, peer, strict=True)]
    return result


def _level(result: dict[str, Any], side: str, concurrency: int) -> dict[str, Any]:
    return next(s for s in result[side] if s["concurrency"] == concurrency)


def _summary(results: dict[str, Any], peer_name: str | None, peer_missing: str | None,
             options: BenchOptions) -> str:
    parts = []
    for name, result in results.items():
        cells = []
        for level in result["kvstack"]:
            c = level["concurrency"]
            cell = (f"c{c} ITL p50 {format_ms(level['itl_p50_s'])}, "
                    f"{fmt(level['output_tok_s'])} tok/s, TTFT {format_ms(level['ttft_p50_s'])}"
                    f", {level['errored']} errors")
            if "peer" in result:
                peer = _level(result, "peer", c)
                cell += (f" (peer {format_ms(peer['itl_p50_s'])}, {fmt(peer['output_tok_s'])} "
                         f"tok/s, {format_ms(peer['ttft_p50_s'])}, {peer['errored']} errors)")
            cells.append(cell)
        parts.append(f"{name}: " + "; ".join(cells))
    peer_text = f"peer {peer_name}" if peer_name else f"no peer ({peer_missing})"
    return (f"load: guidellm on kvstack serve (gguf) vs {peer_text}, same GGUF file, "
            f"{options.threads_text} | " + " | ".join(parts))


def _table(results: dict[str, Any], peer_name: str | None) -> list[TableRow]:
    rows = []
    for name, result in results.items():
        for level in result["kvstack"]:
            c = level["concurrency"]
            ours = (f"ITL p50 {format_ms(level['itl_p50_s'])}, {fmt(level['output_tok_s'])} "
                    f"tok/s, TTFT p50 {format_ms(level['ttft_p50_s'])}")
            peer = speedup = ""
            if "peer" in result:
                p = _level(result, "peer", c)
                peer = (f"ITL p50 {format_ms(p['itl_p50_s'])}, {fmt(p['output_tok_s'])} tok/s, "
                        f"TTFT p50 {format_ms(p['ttft_p50_s'])} ({peer_name})")
                speedup = fmt_x(ratio(level["output_tok_s"], p["output_tok_s"]))
            rows.append(TableRow(f"guidellm {name}, {c} stream{'s' if c > 1 else ''}",
                                 ours, peer, speedup))
    return rows


def _plot(options: BenchOptions, results: dict[str, Any], peer_name: str | None) -> str:
    fig, ax = new_figure(f"guidellm: inter-token latency ({options.threads_text}, same GGUF)",
                         "concurrent streams", "ITL p50 (ms)")
    for name, result in results.items():
        for side, style, label in (("kvstack", "o-", "kvstack"), ("peer", "s--", peer_name)):
            if side in result:
                levels = result[side]
                ax.plot([s["concurrency"] for s in levels],
                        [(s["itl_p50_s"] or 0) * 1000 for s in levels], style,
                        label=f"{label}, {name}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return save_figure(fig, options, "load_itl.png")
