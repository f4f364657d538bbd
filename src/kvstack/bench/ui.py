"""`bench ui`: what the live view (`/ui`) costs the engine.

End to end: `kvstack serve` (a subprocess, the default 1 GiB pool) with a few hundred cached
prefix blocks; one long streamed completion (greedy, `ignore_eos`) at a time, its decode
tok/s = (tokens - 1) / (last chunk - first chunk). Runs alternate between no page open and
five pages' event streams open (ABBA order, so drift in the machine's load hits both arms
alike); the figure is the median of the per-pair ratios, with every pair's ratio kept.
Wall-clock rates on a shared machine move by more than 1% from run to run, so the server's
own CPU time is measured too (/proc/<pid>/stat, every thread): per generated token in each
run, and per second with the server idle and 0 or 5 pages open. CPU time does not depend on
how busy the other cores are, so it resolves the view's cost where tok/s cannot.

Directly: in this process, the same cache state, the time `cache_snapshot()` holds the engine
(it runs under the engine lock once a tick, however many pages are open) and the time a
tick's rendering takes off the lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    progress,
    topic_texts,
)
from kvstack.bench.format import fmt, fmt_x
from kvstack.bench.http_load import server_process
from kvstack.errors import InvalidRequestError

NUM_PAGES = 5
POOL_BYTES = 1024**3  # `kvstack serve`'s default --kv-cache-memory


def sizes(quick: bool) -> tuple[int, int, int]:
    """(cached prompts, tokens per measured answer, ABBA pairs of runs)."""
    return (4, 24, 1) if quick else (48, 256, 4)


class Pages:
    """`n` open pages: threads reading `/ui/api/events` until stopped."""

    def __init__(self, url: str, n: int) -> None:
        if n < 1:
            raise ValueError("Pages needs at least one page")
        self.url = url
        self.stop = threading.Event()
        self.ticks = [0] * n
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True)
                        for i in range(n)]

    def _read(self, i: int) -> None:
        with httpx.stream("GET", self.url + "/ui/api/events", timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("event: tick"):
                    self.ticks[i] += 1
                if self.stop.is_set():
                    return

    def __enter__(self) -> Pages:
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 30
        while min(self.ticks) < 2:  # every page connected and past its first snapshot
            if time.monotonic() > deadline:
                raise RuntimeError("the /ui event streams did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process, all its threads (None: not readable)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(url: str, pid: int | None, seconds: float, pairs: int) -> dict[str, Any]:
    """The idle server's CPU milliseconds per second with no page and with five open."""
    per_s: dict[int, list[float]] = {0: [], NUM_PAGES: []}
    for arm in [a for _ in range(pairs) for a in (0, NUM_PAGES, NUM_PAGES, 0)]:
        with Pages(url, arm) if arm else contextlib.nullcontext():
            before, start = cpu_seconds(pid), time.monotonic()
            time.sleep(seconds)
            after, elapsed = cpu_seconds(pid), time.monotonic() - start
        if before is not None and after is not None:
            per_s[arm].append((after - before) / elapsed * 1000)
    return {"idle_cpu_ms_per_s": {str(k): v for k, v in per_s.items()},
            "idle_cpu_ms_per_s_median": {str(k): statistics.median(v) if v else None
                                         for k, v in per_s.items()}}


def decode_rate(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """Decode tok/s of one streamed greedy completion: (completion tokens - 1) over the time
    from the first to the last chunk with text, as the client sees them."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "semantic_cache": False}
    first = last = None
    num_tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if first is None or last is None or num_tokens < 2 or last == first:
        raise RuntimeError("the measured completion streamed too few tokens")
    return (num_tokens - 1) / (last - first), num_tokens


def fill_cache(url: str, num_prompts: int) -> None:
    """Distinct ~200-token chats with a shared head: a tree of a few hundred cached blocks."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    for text in topic_texts()[:num_prompts]:
        httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": 1, "temperature": 0, "semantic_cache": False,
            "messages": [{"role": "system", "content": "Summarise the reference below."},
                         {"role": "user", "content": text[:900]}]}).raise_for_status()


def direct_costs(subject: Subject, num_prompts: int) -> dict[str, Any]:
    """Milliseconds a snapshot holds the engine, and a render takes, on the same cache state."""
    from kvstack.engine.chat import chat_token_ids
    from kvstack.sampling_params import SamplingParams
    from kvstack.ui.access import OPEN, Viewer
    from kvstack.ui.views import TextCache, render

    llm = subject.llm(kv_cache_memory=POOL_BYTES)
    prompts = [{"prompt_token_ids": chat_token_ids(subject.tokenizer, [
        {"role": "system", "content": "Summarise the reference below."},
        {"role": "user", "content": text[:900]}])} for text in topic_texts()[:num_prompts]]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    tokenizer = subject.tokenizer
    assert tokenizer is not None
    texts = TextCache(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False))
    viewer = Viewer(OPEN, "public", None)
    snap_s, render_s = [], []
    for _ in range(20):
        start = time.perf_counter()
        snap = llm.cache_snapshot()
        snap_s.append(time.perf_counter() - start)
        assert snap is not None
        start = time.perf_counter()
        render(snap, viewer, texts, {None: "public"})
        render_s.append(time.perf_counter() - start)
    stats = llm.stats()
    return {"snapshot_ms": statistics.median(snap_s) * 1000,
            "render_ms": statistics.median(render_s[1:]) * 1000,  # the first decodes texts
            "num_blocks": stats.num_blocks_total, "cached_blocks": stats.num_blocks_cached}


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    if subject.tokenizer is None:
        raise InvalidRequestError(f"bench ui needs a model with a tokenizer; {options.model} "
                                  "has none")
    num_prompts, max_tokens, pairs = sizes(options.quick)
    prompt = "Write a long story about a lighthouse keeper and the sea."
    runs: list[dict[str, Any]] = []
    order = [arm for _ in range(pairs) for arm in (0, NUM_PAGES, NUM_PAGES, 0)]
    with server_process(options, POOL_BYTES, 8) as (url, proc), \
            progress(options, len(order) + 2, "ui") as bar:
        pid = proc.pid if proc is not None else None
        fill_cache(url, num_prompts)
        decode_rate(url, prompt, 8)  # warm-up
        bar.update(1)
        for arm in order:
            with Pages(url, arm) if arm else contextlib.nullcontext():
                before = cpu_seconds(pid)
                rate, num_tokens = decode_rate(url, prompt, max_tokens)
                after = cpu_seconds(pid)
            cpu = None if before is None or after is None else (after - before) / num_tokens
            runs.append({"pages": arm, "tok_s": rate, "cpu_ms_per_token":
                         None if cpu is None else cpu * 1000})
            bar.update(1)
        idle = idle_cpu(url, pid, 2.0 if options.quick else 10.0, 1 if options.quick else 2)
        bar.update(1)
    direct = direct_costs(subject, num_prompts)
    return _result(options, runs, idle, direct, num_prompts, max_tokens, pairs)


def _arm(runs: list[dict[str, Any]], pages: int, key: str) -> list[float]:
    return [r[key] for r in runs if r["pages"] == pages and r[key] is not None]


def _result(options: BenchOptions, runs: list[dict[str, Any]], idle: dict[str, Any],
            direct: dict[str, Any], num_prompts: int, max_tokens: int,
            pairs: int) -> CaseResult:
    closed, open_ = _arm(runs, 0, "tok_s"), _arm(runs, NUM_PAGES, "tok_s")
    ratios = [o / c for o, c in zip(open_, closed, strict=True)]
    ratio = statistics.median(ratios)
    cpu_closed, cpu_open = _arm(runs, 0, "cpu_ms_per_token"), _arm(runs, NUM_PAGES,
                                                                   "cpu_ms_per_token")
    cpu_ratio = (statistics.median(cpu_open) / statistics.median(cpu_closed)
                 if cpu_closed and cpu_open else None)
    idle_ms = idle["idle_cpu_ms_per_s_median"]
    share = direct["snapshot_ms"] / 1000  # one snapshot a second
    summary = (
        f"ui: {max_tokens}-token answers with 0 / {NUM_PAGES} open /ui pages "
        f"({direct['num_blocks']}-block pool, {direct['cached_blocks']} cached blocks, "
        f"{2 * pairs} runs each, ABBA) | decode {fmt(statistics.median(closed))} / "
        f"{fmt(statistics.median(open_))} tok/s, {NUM_PAGES} pages / none {fmt_x(ratio)} "
        f"(pairs {', '.join(f'{r:.3f}' for r in ratios)}) | server CPU per token "
        f"{fmt(statistics.median(cpu_closed) if cpu_closed else None, 2)} / "
        f"{fmt(statistics.median(cpu_open) if cpu_open else None, 2)} ms "
        f"({fmt_x(cpu_ratio)}) | idle server CPU {fmt(idle_ms['0'], 1)} / "
        f"{fmt(idle_ms[str(NUM_PAGES)], 1)} ms a second | snapshot under the engine lock "
        f"{direct['snapshot_ms']:.2f} ms a tick ({share:.3%} of a second), render off the "
        f"lock {direct['render_ms']:.1f} ms")
    return CaseResult(
        case="ui", summary=summary,
        config={"model": options.model, "quick": options.quick, "pages": NUM_PAGES,
                "max_tokens": max_tokens, "pairs": pairs, "order": "ABBA",
                "cached_prompts": num_prompts, "kv_cache_memory": POOL_BYTES,
                "threads": options.threads},
        results={"runs": runs, "ratios": ratios, "median_ratio": ratio,
                 "cpu_per_token_ratio": cpu_ratio, **idle, **direct},
        table=[TableRow(f"decode tok/s of a {max_tokens}-token answer, {NUM_PAGES} open /ui "
                        f"pages vs none ({direct['cached_blocks']} cached blocks); server CPU "
                        "per token", f"{fmt(statistics.median(open_))}, "
                        f"{fmt(statistics.median(cpu_open) if cpu_open else None, 2)} ms",
                        f"no page {fmt(statistics.median(closed))}, "
                        f"{fmt(statistics.median(cpu_closed) if cpu_closed else None, 2)} ms",
                        fmt_x(ratio))],
    )
