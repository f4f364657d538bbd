"""guidellm (the vLLM project's load generator, unmodified) as the client of `bench load`.

One call runs one workload against one server: it writes a guidellm scenario (synthetic text
with shared prefixes, a concurrent profile, one benchmark per concurrency level, each level
bounded by a duration), runs `guidellm run` in a subprocess with a Hugging Face tokenizer folder
of the same model, and reads guidellm's JSON report back into one `LevelStats` per level.

The numbers are guidellm's own: TTFT, ITL (time between output tokens after the first) and
TPOT percentiles over the level's successful requests, its server throughput (output tokens
per second, mean over the level), and its request counts (successful, errored, incomplete:
still running when the level's time ran out).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstack.bench.common import MissingBenchDependencyError

INSTALL_HINT = "pip install 'kvstack[bench]' (guidellm)"
# guidellm's own start-up (dataset synthesis, tokenizer load) on top of the levels' durations.
STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Workload:
    """A guidellm synthetic-text workload: each request is `prompt` fresh tokens behind one of
    `prefixes` shared `prefix`-token prefixes, answered with exactly `output` tokens
    (guidellm sends `ignore_eos`); `turns` > 1 makes each conversation multi-turn (every turn
    resends the history, which a prefix cache serves)."""

    route: str  # "/v1/completions" or "/v1/chat/completions"
    prompt: int
    prefix: int
    prefixes: int
    output: int
    turns: int = 1

    @property
    def context(self) -> int:
        """Tokens of context at the end of the longest request."""
        return self.prefix + self.turns * (self.prompt + self.output)


@dataclass(frozen=True)
class LevelStats:
    """One concurrency level of one guidellm run (times in seconds)."""

    concurrency: int
    successful: int
    errored: int
    incomplete: int
    requests_per_s: float
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    tpot_p50_s: float | None
    tpot_p95_s: float | None
    mean_prompt_tokens: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("guidellm") is None:
        return f"guidellm is not installed; {INSTALL_HINT}"
    return None


def scenario(workload: Workload, levels: Sequence[int], seconds: float,
             max_requests: int | None = None) -> dict[str, Any]:
    """guidellm's scenario file for `workload` at each of `levels` concurrent streams, each
    level ending after `seconds` (or, given, once `max_requests` requests are done)."""
    data: dict[str, Any] = {"kind": "synthetic_text", "prompt_tokens": workload.prompt,
                            "output_tokens": workload.output, "prefix_tokens": workload.prefix,
                            "prefix_count": workload.prefixes}
    if workload.turns > 1:
        data["turns"] = workload.turns
    return {
        "spec": {
            "backend": {"kind": "openai_http", "request_format": workload.route},
            "profile": {"kind": "concurrent"},
            "data": [data],
            "constraints": [{"kind": "max_duration", "seconds": seconds}, *(
                [{"kind": "max_requests", "count": max_requests}] if max_requests else [])],
        },
        "benchmarks": [{"profile.streams": c} for c in levels],
    }


def run_guidellm(url: str, model: str, tokenizer_dir: Path, workload: Workload,
                 levels: Sequence[int], seconds: float, folder: Path,
                 max_requests: int | None = None) -> list[LevelStats]:
    """Run guidellm against the OpenAI server at `url`; its files go to `folder`."""
    reason = unavailable_reason()
    if reason:
        raise MissingBenchDependencyError(reason)
    folder.mkdir(parents=True, exist_ok=True)
    scenario_path, report_path = folder / "scenario.json", folder / "guidellm.json"
    scenario_path.write_text(json.dumps(scenario(workload, levels, seconds, max_requests),
                                        indent=1))
    cmd = [sys.executable, "-m", "guidellm", "run", "--scenario", str(scenario_path),
           "--backend", f"kind=openai_http,target={url},model={model}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--seed", "kind=static,value=1234",
           "--output", f"kind=json,path={report_path}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    timeout = STARTUP_TIMEOUT_S + len(levels) * (seconds + 120)
    with (folder / "guidellm.log").open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, check=False)
    if done.returncode != 0 or not report_path.exists():
        tail = (folder / "guidellm.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"guidellm exited with {done.returncode} against {url}:\n{tail}")
    return parse_report(json.loads(report_path.read_text()))


def parse_report(report: dict[str, Any]) -> list[LevelStats]:
    """guidellm's JSON report -> one LevelStats per benchmark, in concurrency order."""
    levels = []
    for bench in report["benchmarks"]:
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        levels.append(LevelStats(
            concurrency=int(bench["config"]["strategy"]["streams"]),
            successful=int(totals["successful"]),
            errored=int(totals["errored"]),
            incomplete=int(totals["incomplete"]),
            requests_per_s=float(metrics["requests_per_second"]["successful"]["mean"]),
            output_tok_s=float(metrics["output_tokens_per_second"]["total"]["mean"]),
            ttft_p50_s=_ms_percentile(metrics, "time_to_first_token_ms", "p50"),
            ttft_p95_s=_ms_percentile(metrics, "time_to_first_token_ms", "p95"),
            itl_p50_s=_ms_percentile(metrics, "inter_token_latency_ms", "p50"),
            itl_p95_s=_ms_percentile(metrics, "inter_token_latency_ms", "p95"),
            tpot_p50_s=_ms_percentile(metrics, "time_per_output_token_ms", "p50"),
            tpot_p95_s=_ms_percentile(metrics, "time_per_output_token_ms", "p95"),
            mean_prompt_tokens=_mean(metrics, "prompt_token_count"),
        ))
    return sorted(levels, key=lambda s: s.concurrency)


def _ms_percentile(metrics: dict[str, Any], name: str, which: str) -> float | None:
    """A percentile of the successful requests' `name` (milliseconds) in seconds."""
    dist = (metrics.get(name) or {}).get("successful") or {}
    if not dist.get("count"):
        return None
    value = (dist.get("percentiles") or {}).get(which)
    return None if value is None else float(value) / 1000


def _mean(metrics: dict[str, Any], name: str) -> float | None:
    dist = (metrics.get(name) or {}).get("successful") or {}
    return float(dist["mean"]) if dist.get("count") else None
