"""`kvstack bench CASE`: run benchmark cases, one summary line each, JSON and plots in --out."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstack.argtypes import DEFAULT_MODEL, name_list, positive_float, positive_int

# name -> help; `all` runs them in this order. Each lives in kvstack.bench.<name> as
# `run(subject, options) -> CaseResult`, imported only when run (transformers loads slowly).
CASES = {
    "cache": "decode tok/s and per-token latency with and without the KV cache",
    "throughput": "offline output tok/s vs concurrency (1-64), against batched generate",
    "prefix": "TTFT with a ~2,000-token shared document cold vs cached",
    "pressure": "throughput in a third of the KV memory needed: preemptions, correctness",
    "tiers": "TTFT of a ~2,000-token document cold vs from disk / Redis in fresh processes",
    "serve": "HTTP load on `kvstack serve`: req/s, TTFT and TPOT at 1-32 streaming clients",
    "serve_loop": "what serving adds per token: the engine's own step time vs ITL through "
                  "`kvstack serve` (streamed completions), ~800-token context, batch 1 and 4",
    "ttft": "TTFT vs prompt length (128-4096 tokens), cold and with a prefix hit",
    "peers": "decode, prefill and batch-32 tok/s vs transformers and llama.cpp; decode "
             "memory bandwidth",
    "memory": "KV bytes and tokens per budget for each KV cache dtype, int8 vs float32 decode, "
              "window mode",
    "verify": "verified drafts: semantic cache off/trust/verify, acceptance over labelled "
              "pairs, prompt lookup on quoting and non-quoting answers",
    "cluster": "routing policies on a 2-replica Ray Serve cluster (hit rate by source, TTFT, "
               "TPOT, throughput, imbalance, decision time); --simulate: 16-256 replicas; "
               "--pd: prefill/decode disaggregation (with --simulate: the best ratio)",
    "ui": "what the live view (/ui) costs: decode tok/s with 0 vs 5 open pages, snapshot time",
    "parallel": "n=8 samples sharing a 1,000-token prompt's KV vs 8 separate requests: peak "
                "KV bytes and wall time",
    "structured": "decode time per token under a JSON-schema constraint vs unconstrained, "
                  "batch 1 and 16",
    "rag": "TTFT of 6 reordered ~300-token documents: full prefill vs prefix cache vs "
           "blending (approximate; KL vs full prefill)",
    "load": "guidellm load on `kvstack serve` and llama.cpp's server on the same GGUF file: "
            "TTFT, ITL, TPOT and tok/s at 1/4/16 streams, completions (~800 and ~2,000 tokens "
            "of context) and multi-turn chat behind shared prefixes",
    "score": "harness-shaped scoring: 4-choice questions behind a shared preamble, with and "
             "without the prefix cache vs transformers (tokens computed, wall, exactness)",
    "long_decode": "decode tok/s after 16k and 32k tokens per KV dtype (float32, int8) vs "
                   "llama.cpp's llama-bench on the same GGUF file; bytes read per step per part "
                   "(weights, head, K/V) against a read-bandwidth probe",
    "drafts": "suffix drafts vs prompt lookup vs none on agent sessions that repeat "
              "themselves (file edits, tool calls echoing results, plans; batch 1 and 4) and "
              "plain chat: decode tok/s up to the first loop, accepted tokens per step, the "
              "cost of a 1+k-token step",
    "agents": "Claude Code, Codex and Qwen Code (`make agent-clis`) run headless twice each "
              "against `kvstack serve`: pass/fail, wall time, TTFT and cached tokens per request",
    "agent": "an agent loop (~1,500-token system prompt + tools, 12 turns of ~150-token tool "
             "results, 4 conversations): Responses with previous_response_id vs chat resending "
             "the history, prefix cache on and off (TTFT per turn); idle ones resumed from disk",
    "soak": "mixed traffic for --minutes (agent-CLI replays, SDK chat and Responses chains, "
            "guidellm-style bursts, hostile bodies, disconnects, a restart halfway): RSS, KV "
            "blocks, pins, open files, threads and TTFT/ITL every minute; growth and drift",
}
# `all` runs these: the cluster case needs Ray and redis-server and takes most of an hour; load
# runs two servers under guidellm for about 20 minutes (`make bench-load`, with its peer);
# long_decode prefills 16k and 32k tokens in both engines for about 15 minutes; agents needs
# the npm CLIs (`make bench-agents`); soak runs for an hour by default.
ALL_CASES = [name for name in CASES
             if name not in ("cluster", "load", "long_decode", "agents", "soak")]
# bench cluster's runs, in order (kvstack.bench.cluster.RUNS; a test keeps both the same)
# `bench peers --isa`: kvstack.kernels.isa.ISAS (not imported here: `--help` stays light)
KERNEL_ISAS = ("avx512", "avx2")
CLUSTER_RUNS = ("round-robin", "pow2", "ray-prefix", "cache-aware", "oracle",
                "cache-aware+redis", "round-robin+redis")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks against transformers and llama.cpp, with JSON results and plots",
        description="Run a benchmark case on our engine and on its peers in the same run: "
        "Hugging Face transformers with the same weights, and in `peers` also llama.cpp on "
        "the GGUF file. Each case prints one summary line to stdout (progress goes to "
        "stderr) and writes <out>/<case>.json plus PNG plots; `report` turns them into the "
        "docs' benchmark page and the README's headline table.",
        epilog="example: kvstack bench cache --threads 2   (kvstack bench all --quick for a "
        "smoke run in seconds)",
    )
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--model", default=DEFAULT_MODEL,
                        help="smollm2-135m (embedded), gemma3-270m, a .gguf file or an HF folder")
    shared.add_argument("--threads", type=positive_int, default=2, metavar="N",
                        help="CPU threads for our engine and every peer alike")
    shared.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR",
                        help="folder for <case>.json and the plots")
    shared.add_argument("--quick", action="store_true",
                        help="tiny sizes (few tokens, low concurrency): a smoke run")
    shared.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    shared.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="our engine's weights and KV dtype (transformers stays float32); "
                        "default float32, and `peers` runs every format")
    shared.add_argument("--quantization", default=None, metavar="NAME",
                        help="our engine's weight-only quantization, e.g. int8, where the "
                        "engine offers it")
    peer_batch = argparse.ArgumentParser(add_help=False)
    peer_batch.add_argument("--peer-max-batch", type=positive_int, default=None, metavar="N",
                            help="throughput: run transformers only up to this concurrency "
                            "(it is the slow side at large batches); default: all")
    serve_url = _url_flags()
    kernels = _kernel_flags()
    cluster = _cluster_flags()
    cases = parser.add_subparsers(title="cases", metavar="CASE", dest="case", required=True)
    for name, text in CASES.items():
        parents = [shared, *{"throughput": [peer_batch], "serve": [serve_url],
                             "cluster": [cluster], "ui": [serve_url],
                             "peers": [kernels], "score": [_score_flags()],
                             "load": [_load_flags()], "agents": [serve_url],
                             "soak": [_soak_flags()]}.get(name, [])]
        cases.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                         parents=parents)
    cases.add_parser("all", help="every case in order: " + ", ".join(ALL_CASES),
                     description="Run " + ", ".join(ALL_CASES) + " in order, loading the model "
                     "once (`cluster` runs on its own).",
                     parents=[shared, peer_batch])
    _add_report_parser(cases)
    parser.set_defaults(run=run)
    return parser


def _add_report_parser(cases: Any) -> None:
    report = cases.add_parser(
        "report", help="write the docs' benchmark page and the README's headline table from "
        "the JSON in --out",
        description="Read <out>/<case>.json of every case that ran, copy their plots to "
        "--plots-dir and write the docs page (default docs/benchmarks/main.md) whole: date, "
        "machine, threads, load and a table of the results; --out given again adds one table "
        "per folder, in order. The main report also rewrites the part of --readme between "
        "<!-- bench:start --> and <!-- bench:end --> with the first row of each case; "
        "--section NAME writes docs/benchmarks/NAME.md instead (another machine's results) "
        "and leaves the README alone.")
    report.add_argument("--out", type=Path, action="append", default=None, metavar="DIR",
                        help="folder holding the cases' JSON and plots (default bench-results); "
                        "again for another table, e.g. a `bench peers --isa avx2` run's folder")
    report.add_argument("--readme", type=Path, default=Path("README.md"), metavar="FILE",
                        help="the Markdown file whose headline table is rewritten")
    report.add_argument("--page", type=Path, default=None, metavar="FILE",
                        help="the docs page written (default docs/benchmarks/<section or "
                        "main>.md)")
    report.add_argument("--plots-dir", type=Path, default=Path("docs/bench"), metavar="DIR",
                        help="where the plots are copied, to be committed with the docs")
    report.add_argument("--section", default=None, metavar="NAME",
                        help="write the page of section NAME, e.g. another machine's results "
                        "beside the main page")


def _url_flags() -> argparse.ArgumentParser:
    serve_url = argparse.ArgumentParser(add_help=False)
    serve_url.add_argument("--url", default=None, metavar="URL",
                           help="load the kvstack server already running at URL (e.g. "
                           "http://127.0.0.1:8000) instead of starting one")
    return serve_url


def _kernel_flags() -> argparse.ArgumentParser:
    kernels = argparse.ArgumentParser(add_help=False)
    kernels.add_argument("--isa", choices=KERNEL_ISAS, default=None,
                         help="run our C kernels' AVX-512 or AVX2 implementation (sets "
                         "KVSTACK_KERNELS; AVX2 runs on AVX-512 CPUs too; one the CPU lacks is "
                         "an error); default: KVSTACK_KERNELS, else the best this CPU runs")
    return kernels


def _score_flags() -> argparse.ArgumentParser:
    score = argparse.ArgumentParser(add_help=False)
    score.add_argument("--questions", type=positive_int, default=None, metavar="N",
                       dest="requests", help="4-choice questions scored (default 200)")
    return score


def _load_flags() -> argparse.ArgumentParser:
    load = argparse.ArgumentParser(add_help=False)
    load.add_argument("--duration", type=positive_float, default=None, metavar="S",
                      help="seconds guidellm runs each concurrency level (default 60)")
    return load


def _soak_flags() -> argparse.ArgumentParser:
    soak = argparse.ArgumentParser(add_help=False)
    soak.add_argument("--minutes", type=positive_float, default=None, metavar="N",
                      help="how long the traffic runs (default 60; --quick 0.5)")
    return soak


def _cluster_flags() -> argparse.ArgumentParser:
    cluster = argparse.ArgumentParser(add_help=False)
    cluster.add_argument("--simulate", action="store_true",
                         help="drive the pure scorer on simulated clusters (16-256 replicas, "
                         "costs calibrated on this machine) instead of a real 2-replica one; "
                         "with --pd: the best prefill:decode ratio and the network the KV "
                         "handoff needs, on simulated clusters")
    cluster.add_argument("--pd", action="store_true",
                         help="1 prefill + 1 decode replica against 2 colocated ones, on one "
                         "seeded trace of chat turns and long documents (TTFT, TPOT per class); "
                         "with --simulate: P prefill + N-P decode replicas, modelled")
    cluster.add_argument("--policies", type=name_list(CLUSTER_RUNS, "policy"), default=None,
                         metavar="LIST", help="comma-separated runs, from "
                         f"{', '.join(CLUSTER_RUNS)} (default: all; --quick: round-robin, "
                         "cache-aware, cache-aware+redis)")
    cluster.add_argument("--requests", type=positive_int, default=None, metavar="N",
                         help="requests in the trace (default 120; --simulate 100000; "
                         "--simulate --pd 40 per replica)")
    cluster.add_argument("--load", type=positive_float, default=None, metavar="X",
                         help="arrival rate as a fraction of the cluster's probed capacity "
                         "with every prefix computed once (default 0.8; above 1 overloads; "
                         "--pd: one prefill replica's busy share with the documents alone, "
                         "default 0.5; --simulate --pd: of the colocated cluster's modelled "
                         "capacity, default 0.7)")
    cluster.add_argument("--rate", type=positive_float, default=None, metavar="R",
                         help="arrival rate in requests/s, instead of --load's fraction of "
                         "the probed capacity (the probe still runs and is reported)")
    cluster.add_argument("--sim-replicas", type=positive_int, nargs="+", default=None,
                         metavar="N", help="--simulate: replica counts (default 16 64 256; "
                         "--quick 16)")
    cluster.add_argument("--sim-tenants", type=positive_int, nargs="+", default=None,
                         metavar="N", help="--simulate: tenant counts (default 8 32)")
    return cluster


def run(args: argparse.Namespace) -> int:
    if args.case == "report":
        from kvstack.bench.report import default_page, write_report

        outs = args.out or [Path("bench-results")]
        page = args.page or default_page(Path("docs"), args.section)
        print(write_report(outs, args.readme, page, args.plots_dir, list(CASES), args.section))
        return 0
    from kvstack.bench.common import BenchOptions, Subject, check_dependencies, report

    check_dependencies()
    options = BenchOptions(
        model=args.model,
        threads=args.threads,
        out=args.out,
        quick=args.quick,
        peer_max_batch=getattr(args, "peer_max_batch", None),
        show_progress=not args.no_progress,
        url=getattr(args, "url", None),
        dtype=args.dtype,
        quantization=args.quantization,
        simulate=getattr(args, "simulate", False),
        pd=getattr(args, "pd", False),
        requests=getattr(args, "requests", None),
        policies=tuple(getattr(args, "policies", None) or ()),
        load=getattr(args, "load", None),
        rate=getattr(args, "rate", None),
        sim_replicas=tuple(getattr(args, "sim_replicas", None) or ()),
        sim_tenants=tuple(getattr(args, "sim_tenants", None) or ()),
        duration=getattr(args, "duration", None),
        minutes=getattr(args, "minutes", None),
    )
    names = ALL_CASES if args.case == "all" else [args.case]
    with _kernels(getattr(args, "isa", None)):
        subject = Subject(options)
        for name in names:
            case = importlib.import_module(f"kvstack.bench.{name}")
            report(case.run(subject, options), options)
    return 0


@contextmanager
def _kernels(isa: str | None) -> Iterator[None]:
    """KVSTACK_KERNELS=isa while the cases run (engines read it as they load), checked before
    any model loads: a CPU without `isa` stops here with the one-line error. The previous
    setting comes back afterwards (the command may run inside a longer-lived process)."""
    if isa is None:
        yield
        return
    from kvstack.kernels import build
    from kvstack.kernels.isa import ENV

    before = os.environ.get(ENV)
    os.environ[ENV] = isa
    try:
        build.load()
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before
