"""`bench agents`: Claude Code, Codex and Qwen Code, each run headless twice against one
`kvstack serve` (the second run a prefix-cache hit), every request through a recording proxy.

Per run: pass/fail (the CLI exits 0 and its last request is answered 200), wall time, and per
request its status, TTFT (first byte of the answer; the server sends nothing before the first
token), prompt and cached tokens. Codex's second run resumes the first session (`exec resume
--last`), so it is a continuation reading its history from the cache. The CLIs' prompts are
fixed ("say hello"); their output caps are set with `--agent-output-cap` (default 256 tokens:
the base models rarely stop by themselves; 0 leaves each CLI's own).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kvstack.bench.agents.clis import (
    DEFAULT_DIR,
    PROMPTS,
    VERSIONS,
    binary,
    command,
    environment,
    run_cli,
)
from kvstack.bench.agents.proxy import Recorder
from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow
from kvstack.bench.http_load import server
from kvstack.units import format_ms

CLIS = ("claude", "codex", "qwen")
RUN_TIMEOUT_S = 1800.0
OUTPUT_CAP = 256


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    clis_dir = DEFAULT_DIR
    for name in CLIS:
        binary(clis_dir, name)  # every CLI installed before anything starts
    context = subject.max_model_len
    kv_bytes = subject.kv_shape().bytes_for(context, 3)
    runs: dict[str, list[dict[str, Any]]] = {}
    with server(options, kv_bytes, 4) as url, tempfile.TemporaryDirectory(
            prefix="kvstack-bench-agents-") as tmp:
        for name in CLIS:
            runs[name] = [_one_run(name, url, options.model, Path(tmp) / name, second)
                          for second in (False, True)]
            for i, r in enumerate(runs[name]):
                print(_line(name, i + 1, r), flush=True)
    return CaseResult(
        case="agents", summary=_summary(runs),
        config={"model": options.model, "clis": {n: VERSIONS[n] for n in CLIS},
                "prompts": PROMPTS, "output_cap": OUTPUT_CAP, "context": context},
        results=runs,
        table=[TableRow(f"{name} run 2 (warm) wall, cached share of its prompt",
                        f"{runs[name][1]['wall_s']:.0f} s, "
                        f"{runs[name][1]['cached_share']:.0%}") for name in CLIS])


def _one_run(name: str, url: str, model: str, home: Path, second: bool) -> dict[str, Any]:
    workdir = home / "project"
    workdir.mkdir(parents=True, exist_ok=True)
    with Recorder(url) as recorder:
        env = environment(name, recorder.url, model, home, OUTPUT_CAP or None)
        argv = command(DEFAULT_DIR.resolve(), name, PROMPTS[name], resume=second and
                       name == "codex")
        done = run_cli(argv, env, workdir, RUN_TIMEOUT_S)
    requests = [e.as_json() for e in recorder.exchanges if e.method == "POST"]
    last_ok = bool(requests) and requests[-1]["status"] == 200
    prompt = sum(r["usage"]["prompt"] for r in requests)
    cached = sum(r["usage"]["cached"] for r in requests)
    return {"passed": done.returncode == 0 and last_ok, "returncode": done.returncode,
            "wall_s": done.wall_s, "requests": requests, "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_share": cached / prompt if prompt else 0.0,
            "result": done.result, "stderr": done.stderr if done.returncode else ""}


def _line(name: str, index: int, r: dict[str, Any]) -> str:
    per_request = "; ".join(
        f"{q['status']} TTFT {format_ms(q['ttft_s'] or 0.0)} "
        f"{q['usage']['cached']}/{q['usage']['prompt']} cached" for q in r["requests"])
    return (f"agents {name} run {index}: {'pass' if r['passed'] else 'FAIL'}, "
            f"{r['wall_s']:.1f} s; {per_request}")


def _summary(runs: dict[str, list[dict[str, Any]]]) -> str:
    parts = []
    for name, (cold, warm) in runs.items():
        parts.append(f"{name} {'pass' if cold['passed'] and warm['passed'] else 'FAIL'} "
                     f"{cold['wall_s']:.0f} s cold / {warm['wall_s']:.0f} s warm "
                     f"({warm['cached_share']:.0%} cached)")
    return "agents: " + "; ".join(parts)
