"""`bench tiers`: a ~2,000-token document's TTFT cold, then restored from the KV tiers by
processes that never computed it.

Cold: this process prefills document + question with a disk directory and a Redis server
attached, which writes every full block through to both. Disk hit: a fresh process with the
same directory asks the same prompt. Redis hit: a second fresh process that shares only the
Redis server does the same. Each process first runs a short warm-up request, so one-time costs
(first kernels) are not billed to the measured request. Load bandwidth is payload bytes over
the time the tier spent reading and checking them. Redis is a throwaway `redis-server` on a free
loopback port; without the binary the Redis run is skipped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    in_fresh_process,
    progress,
)
from kvstack.bench.format import fmt, fmt_x, ratio
from kvstack.bench.plots import log_scale_y, new_figure, save_figure
from kvstack.bench.prefix import document
from kvstack.engine.llm import LLM
from kvstack.sampling_params import SamplingParams
from kvstack.units import format_ms

QUESTION = "\n\nQ: What is this about?\nA:"

Row = dict[str, Any]  # one measured request: TTFT, cached tokens, tier load numbers


def sizes(quick: bool) -> tuple[int, int]:
    """(document tokens, new tokens per answer)."""
    return (64, 2) if quick else (2000, 4)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    doc_len, new_tokens = sizes(options.quick)
    doc = document(subject, doc_len)
    prompt = doc + subject.encode(QUESTION)
    subject.require_context(len(prompt) + new_tokens, "the tiers benchmark")
    spec = _spec(subject, options, prompt, new_tokens)

    cold, disk, redis = _measure_tiers(subject, options, spec)
    rows = {"cold": cold, "disk": disk, "redis": redis}
    for row in (disk, redis):
        if row is not None:
            row["speedup"] = ratio(cold["ttft_s"], row["ttft_s"])
            row["equals_cold"] = row["token_ids"] == cold["token_ids"]
    plot = _plot(options, rows, len(doc))
    return CaseResult(
        case="tiers",
        summary=_summary(len(doc), len(prompt), cold, disk, redis),
        config={"model": options.model, "quick": options.quick, "document_tokens": len(doc),
                "prompt_tokens": len(prompt), "question": QUESTION, "new_tokens": new_tokens,
                "document_source": "pydoc_data.topics", "greedy": True,
                "weights": subject.weight_format,
                "redis": "redis-server on loopback" if redis is not None else None},
        results={name: _public(row) for name, row in rows.items()},
        plots=[plot],
        table=[_table_row(len(doc), cold, disk, redis)],
    )


def _spec(subject: Subject, options: BenchOptions, prompt: list[int],
          new_tokens: int) -> dict[str, Any]:
    """What every process needs to build the engine and measure: JSON, for the probes."""
    return {
        "model": options.model,
        "threads": options.threads,
        "skip_tokenizer_init": subject.tokenizer is None,
        "engine": {"dtype": options.dtype or "float32",
                   "max_num_batched_tokens": max(2048, len(prompt)),
                   "kv_cache_memory": subject.kv_shape().bytes_for(len(prompt) + 64, 2)}
        | ({"quantization": options.quantization} if options.quantization else {}),
        "prompt": prompt,
        "warmup": prompt[-8:],
        "max_tokens": new_tokens,
    }


def _measure_tiers(subject: Subject, options: BenchOptions,
                   spec: dict[str, Any]) -> tuple[Row, Row, Row | None]:
    """(cold here, disk hit in a fresh process, Redis hit in another: None without Redis)."""
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-tiers-") as tmp, \
            _redis_server(Path(tmp)) as redis_url, progress(options, 3, "tiers") as bar:
        disk_dir = str(Path(tmp) / "kv")
        cold = _cold(subject, spec, disk_dir, redis_url)
        bar.update(1)
        disk = _in_fresh_process(spec | {"tiers": {"kv_disk_dir": disk_dir}, "tier": "disk"})
        bar.update(1)
        redis = None
        if redis_url is not None:
            redis = _in_fresh_process(spec | {"tiers": {"kv_redis_url": redis_url},
                                              "tier": "redis"})
        bar.update(1)
    return cold, disk, redis


def _cold(subject: Subject, spec: dict[str, Any], disk_dir: str,
          redis_url: str | None) -> Row:
    """The cold request in this process, writing its blocks through to both tiers."""
    llm = subject.llm(**spec["engine"], kv_disk_dir=disk_dir, kv_redis_url=redis_url)
    cold = _measure(llm, spec, None)
    start = time.perf_counter()
    llm.close()  # wait for the write-through to land
    cold["flush_s"] = time.perf_counter() - start
    written = llm.tier_stats()
    cold["stored"] = {name: {"blocks": s.stores, "bytes": s.bytes_stored,
                             "faults": s.faults} for name, s in written.items()}
    return cold


def _summary(doc_len: int, prompt_len: int, cold: Row, disk: Row, redis: Row | None) -> str:
    hits = [r for r in (disk, redis) if r is not None]
    redis_text = ("redis n/a (redis-server not installed)" if redis is None else
                  f"redis hit (second process) {format_ms(redis['ttft_s'])} "
                  f"({fmt_x(redis['speedup'])}, {redis['num_cached_tokens']} tokens cached, "
                  f"load {fmt(redis['load_mb_per_s'], 0)} MB/s)")
    return (
        f"tiers: {doc_len}-token document + question ({prompt_len} tokens), TTFT"
        f" | cold {format_ms(cold['ttft_s'])}"
        f" | disk hit (fresh process) {format_ms(disk['ttft_s'])} ({fmt_x(disk['speedup'])}, "
        f"{disk['num_cached_tokens']} tokens cached, load {fmt(disk['load_mb_per_s'], 0)} MB/s)"
        f" | {redis_text}"
        f" | outputs equal cold: {sum(r['equals_cold'] for r in hits)}/{len(hits)}"
    )


def _table_row(doc_len: int, cold: Row, disk: Row, redis: Row | None) -> TableRow:
    hits = [r for r in (disk, redis) if r is not None]
    return TableRow(
        f"TTFT, {doc_len}-token document + question: cold / disk hit / Redis hit "
        "(fresh processes)",
        " / ".join([format_ms(cold["ttft_s"]), format_ms(disk["ttft_s"]),
                    "n/a" if redis is None else format_ms(redis["ttft_s"])]),
        speedup=" / ".join(fmt_x(r["speedup"]) for r in hits) + " vs cold",
    )


def _measure(llm: LLM, spec: dict[str, Any], tier: str | None) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate({"prompt_token_ids": spec["warmup"]}, params)
    out = llm.generate({"prompt_token_ids": spec["prompt"]}, params)[0]
    row: dict[str, Any] = {"ttft_s": out.metrics.ttft, "num_cached_tokens": out.num_cached_tokens,
                           "token_ids": out.outputs[0].token_ids}
    if tier is not None:
        stats = llm.tier_stats()[tier]
        rate = stats.load_bytes_per_s
        row |= {"bytes_loaded": stats.bytes_loaded, "load_s": stats.load_seconds,
                "load_mb_per_s": rate / 1e6 if rate else None, "faults": stats.faults}
    return row


def _public(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {k: v for k, v in row.items() if k != "token_ids"}


def _in_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    return in_fresh_process("kvstack.bench.tiers", spec, "tiers benchmark probe", 1800)


def _probe(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured request in this (fresh) process, with only the tier under test."""
    import torch

    torch.set_num_threads(spec["threads"])
    with LLM(model=spec["model"], num_threads=spec["threads"],
             skip_tokenizer_init=spec["skip_tokenizer_init"], **spec["engine"],
             **spec["tiers"]) as llm:
        return _measure(llm, spec, spec["tier"])


@contextlib.contextmanager
def _redis_server(directory: Path) -> Iterator[str | None]:
    """A throwaway redis-server on a free loopback port (None where it is not installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(directory), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _pong(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start for the tiers benchmark")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _plot(options: BenchOptions, rows: dict[str, dict[str, Any] | None], doc_len: int) -> str:
    fig, ax = new_figure(f"TTFT of a {doc_len}-token document ({options.threads_text})",
                         "where its KV came from", "time to first token (ms, log scale)")
    labels = {"cold": "computed (cold)", "disk": "disk tier\n(fresh process)",
              "redis": "Redis tier\n(second process)"}
    shown = [(labels[name], row["ttft_s"] * 1000) for name, row in rows.items()
             if row is not None and row["ttft_s"] is not None]
    ax.bar([label for label, _ in shown], [ms for _, ms in shown],
           color=[f"C{i}" for i in range(len(shown))])
    log_scale_y(ax)
    return save_figure(fig, options, "tiers_ttft.png")


if __name__ == "__main__":
    print(json.dumps(_probe(json.loads(sys.argv[1]))))
