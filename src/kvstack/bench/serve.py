"""`bench serve`: `kvstack serve` under load over HTTP, as a client sees it.

The case starts the server as a subprocess on a free loopback port (or, with `--url`, loads
one already running) and streams `/v1/chat/completions` (greedy, `ignore_eos`, a fixed
`max_tokens`, usage in the last chunk). At each concurrency c, c clients send requests back to
back until the level's requests are done. Every level runs twice: with no system prompt, and
with one ~500-token system prompt (Python's reference docs) shared by all requests, which a
warm-up request has put in the prefix cache. Each request asks its own numbered question, so
nothing beyond the system prompt is shared; a per-run `cache_salt` keeps earlier runs against
the same server from counting as hits.

TTFT is the time from sending a request to its first content chunk; TPOT is (last content
chunk - first content chunk) / (completion tokens - 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    fmt,
    fmt_ms,
    new_figure,
    per_second,
    progress,
    save_figure,
    topic_texts,
)
from kvstack.engine.chat import chat_token_ids, common_prefix_len
from kvstack.errors import InvalidRequestError, KvstackError

LEVELS = (1, 8, 32)
QUICK_LEVELS = (1, 2)
VARIANTS = {"no_system_prompt": "no system prompt",
            "shared_system_prompt": "shared system prompt"}
QUESTIONS = (
    "What does the with statement do?",
    "How is an assert statement evaluated?",
    "When does the else clause of a for loop run?",
    "What is the difference between is and ==?",
    "What does the global statement change?",
    "How are default argument values evaluated?",
)
START_TIMEOUT_S = 300.0  # model load included
READ_TIMEOUT_S = 300.0  # longest silence on one stream
STOP_TIMEOUT_S = 30.0  # SIGTERM drains in-flight requests; then SIGKILL


class ServerUnavailableError(KvstackError):
    """The server given with --url does not answer."""


def sizes(quick: bool) -> tuple[tuple[int, ...], int, int]:
    """(concurrency levels, system prompt tokens, max_tokens per request)."""
    return (QUICK_LEVELS, 128, 4) if quick else (LEVELS, 500, 32)


def num_requests(concurrency: int, quick: bool) -> int:
    return 2 if quick else max(4, 2 * concurrency)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    if subject.tokenizer is None:
        raise InvalidRequestError(f"bench serve needs a model with a tokenizer and a chat "
                                  f"template; {options.model} has no tokenizer")
    levels, system_len, max_tokens = sizes(options.quick)
    system = system_prompt(subject, system_len)
    # Two requests' prompts share exactly the tokens every shared-prompt request can reuse.
    first, second = (chat_token_ids(subject.tokenizer, _messages(system, i)) for i in (0, 1))
    shared_prefix = common_prefix_len(first, second)
    longest = max_tokens + max(len(chat_token_ids(subject.tokenizer, _messages(system, n)))
                               for n in range(10**6, 10**6 + len(QUESTIONS)))
    subject.require_context(longest, "the serve benchmark")
    # Room for every request of the top level at once, plus slack for the cached prefix.
    kv_bytes = subject.kv_shape().bytes_for(longest + 16, max(levels) + 2)
    total = sum(num_requests(c, options.quick) for c in levels) * len(VARIANTS) + len(VARIANTS)
    salt = f"bench-serve-{uuid.uuid4().hex}"

    with _target(options, kv_bytes, max(levels)) as url, progress(options, total, "serve") as bar:
        load = _LoadTest(url, system, max_tokens, salt, bar)
        rows = asyncio.run(load.run(levels, options.quick))
    for row in rows:
        for variant in VARIANTS:
            print(row[variant]["summary"], flush=True)

    plot = _plot(options, rows, system_len, max_tokens)
    overall = _overall(rows)
    by_level = "/".join(str(c) for c in levels)

    def series(variant: str, key: str, show: Any) -> str:
        return "/".join(show(r[variant][key]) for r in rows)

    summary = (
        f"serve: HTTP streaming chat, {max_tokens} tokens per answer, {by_level} clients"
        f" | req/s none {series('no_system_prompt', 'requests_per_s', fmt)}, "
        f"shared {series('shared_system_prompt', 'requests_per_s', fmt)}"
        f" | TTFT p50 none {series('no_system_prompt', 'ttft_p50_s', fmt_ms)}, "
        f"shared {series('shared_system_prompt', 'ttft_p50_s', fmt_ms)}"
        f" | shared prompt: {fmt(overall['shared_mean_cached_tokens'], 0)} of "
        f"{fmt(overall['shared_mean_prompt_tokens'], 0)} prompt tokens cached (mean)"
        f" | {overall['num_complete']}/{overall['num_requests']} requests complete"
    )
    return CaseResult(
        case="serve",
        summary=summary,
        config={"model": options.model, "quick": options.quick, "levels": list(levels),
                "requests_per_level": [num_requests(c, options.quick) for c in levels],
                "max_tokens": max_tokens, "system_prompt_tokens": system_len,
                "shared_prefix_tokens": shared_prefix, "system_prompt_source":
                "pydoc_data.topics", "questions": list(QUESTIONS), "greedy": True,
                "ignore_eos": True, "stream": True,
                "server": {"url": options.url.rstrip("/")} if options.url else {
                    "started_by_benchmark": True, "threads": options.threads,
                    "kv_cache_memory": kv_bytes, "weights": subject.weight_format}},
        results={"levels": rows, "overall": overall},
        plots=[plot],
        table=[_table_row(r, max_tokens, system_len) for r in rows],
    )


def _table_row(row: dict[str, Any], max_tokens: int, system_len: int) -> TableRow:
    none, shared = row["no_system_prompt"], row["shared_system_prompt"]
    return TableRow(
        f"HTTP streaming chat, {row['concurrency']} clients, {max_tokens}-token answers: "
        f"req/s and TTFT p50, no system prompt / shared ~{system_len}-token system prompt",
        f"{fmt(none['requests_per_s'], 2)} req/s, {fmt_ms(none['ttft_p50_s'])} / "
        f"{fmt(shared['requests_per_s'], 2)} req/s, {fmt_ms(shared['ttft_p50_s'])}",
    )


def system_prompt(subject: Subject, num_tokens: int) -> str:
    """About `num_tokens` tokens of instructions and reference text."""
    ids: list[int] = []
    for text in topic_texts():
        ids += subject.encode(text)
        if len(ids) >= num_tokens:
            break
    return ("Answer questions about Python using this reference.\n\n"
            + subject.tokenizer.decode(ids[:num_tokens]))


def _messages(system: str | None, number: int) -> list[dict[str, str]]:
    # The number comes first, so two questions share no tokens after the system prompt.
    question = f"Request {number}: {QUESTIONS[number % len(QUESTIONS)]}"
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": question}]


# -- the server ------------------------------------------------------------------------------


@contextlib.contextmanager
def _target(options: BenchOptions, kv_bytes: int, max_num_seqs: int) -> Iterator[str]:
    """The server's base URL: --url as given, or a `kvstack serve` started (and always
    stopped) here."""
    if options.url:
        url = options.url.rstrip("/")
        if not _healthy(url):
            raise ServerUnavailableError(f"no kvstack server answers at {url}/health; start one "
                                         "with `kvstack serve` or leave out --url")
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-serve-") as tmp:
        log_path = Path(tmp) / "server.log"
        for _ in range(3):  # the free port may be taken before the server binds it
            port = _free_port()
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvstack", "serve", "--model", options.model,
                     "--host", "127.0.0.1", "--port", str(port),
                     "--threads", str(options.threads), "--kv-cache-memory", str(kv_bytes),
                     "--max-num-seqs", str(max_num_seqs), "--log-level", "warning",
                     *_format_flags(options)],
                    stdout=log, stderr=subprocess.STDOUT, env=_same_kvstack_env())
            try:
                url = f"http://127.0.0.1:{port}"
                if _wait_healthy(url, proc):
                    yield url
                    return
                text = log_path.read_text(errors="replace")
                if "address already in use" not in text.lower():
                    raise RuntimeError(f"kvstack serve did not come up; log:\n{text[-4000:]}")
            finally:
                _stop(proc)
        raise RuntimeError("no free port found for kvstack serve")


def _format_flags(options: BenchOptions) -> list[str]:
    """`kvstack serve` flags for the run's weight format (none: the server's default)."""
    flags = ["--dtype", options.dtype] if options.dtype else []
    return flags + (["--quantization", options.quantization] if options.quantization else [])


def _same_kvstack_env() -> dict[str, str]:
    """The environment with this kvstack first on the path, so the server runs this code."""
    import kvstack

    src = str(Path(kvstack.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if _healthy(url):
            return True
        time.sleep(0.25)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the load --------------------------------------------------------------------------------


class _LoadTest:
    """Closed-loop clients on one connection pool; requests are numbered across the run."""

    def __init__(self, url: str, system: str, max_tokens: int, salt: str, bar: Any) -> None:
        self.url = url
        self.system = system
        self.max_tokens = max_tokens
        self.salt = salt
        self.bar = bar
        self.model = ""
        self.next_number = 0

    async def run(self, levels: Sequence[int], quick: bool) -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=max(levels) + 2)
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            models = (await client.get("/v1/models")).raise_for_status().json()
            self.model = models["data"][0]["id"]
            for variant in VARIANTS:  # warms the server; caches the shared system prompt
                await self._one(client, variant)
                self.bar.update(1)
            rows = []
            for c in levels:
                row: dict[str, Any] = {"concurrency": c}
                for variant in VARIANTS:
                    row[variant] = await self._level(client, variant, c,
                                                     num_requests(c, quick))
                rows.append(row)
        return rows

    async def _level(self, client: httpx.AsyncClient, variant: str, concurrency: int,
                     num: int) -> dict[str, Any]:
        samples: list[dict[str, Any]] = []
        left = iter(range(num))

        async def client_loop() -> None:
            for _ in left:  # shared: each client takes the next request when its last is done
                samples.append(await self._one(client, variant))
                self.bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return _row(samples, time.perf_counter() - start, variant, concurrency,
                    self.max_tokens)

    async def _one(self, client: httpx.AsyncClient, variant: str) -> dict[str, Any]:
        system = self.system if variant == "shared_system_prompt" else None
        body = {"model": self.model, "messages": _messages(system, self.next_number),
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, "max_tokens": self.max_tokens, "ignore_eos": True,
                "cache_salt": self.salt, "semantic_cache": False}
        self.next_number += 1
        first = last = None
        usage: dict[str, Any] | None = None
        start = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"the server answered {response.status_code}: "
                                   f"{response.text[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise RuntimeError(f"the server failed mid-stream: {chunk['error']}")
                if any(choice["delta"].get("content") for choice in chunk["choices"]):
                    last = time.perf_counter()
                    first = first or last
                usage = chunk.get("usage") or usage
        if usage is None or first is None or last is None:
            raise RuntimeError("a stream ended without content or usage")
        num_tokens = usage["completion_tokens"]
        return {
            "ttft_s": first - start,
            "tpot_s": (last - first) / (num_tokens - 1) if num_tokens > 1 else None,
            "completion_tokens": num_tokens,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        }


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated between the nearest ranks as numpy does."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    pos = (len(known) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(known) - 1)
    return known[lo] + (known[hi] - known[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _row(samples: list[dict[str, Any]], elapsed: float, variant: str, concurrency: int,
         max_tokens: int) -> dict[str, Any]:
    ttft = [s["ttft_s"] for s in samples]
    tpot = [s["tpot_s"] for s in samples]
    row: dict[str, Any] = {
        "num_requests": len(samples),
        "num_complete": sum(s["completion_tokens"] == max_tokens for s in samples),
        "elapsed_s": elapsed,
        "requests_per_s": per_second(len(samples), elapsed),
        "output_tok_s": per_second(sum(s["completion_tokens"] for s in samples), elapsed),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "mean_prompt_tokens": _mean([s["prompt_tokens"] for s in samples]),
        "mean_cached_tokens": _mean([s["cached_tokens"] for s in samples]),
    }
    row["summary"] = (
        f"serve: {concurrency} client{'s' if concurrency > 1 else ''}, {VARIANTS[variant]}"
        f" | {len(samples)} requests, {fmt(row['requests_per_s'], 2)} req/s, "
        f"{fmt(row['output_tok_s'])} output tok/s"
        f" | TTFT p50 {fmt_ms(row['ttft_p50_s'])}, p99 {fmt_ms(row['ttft_p99_s'])}"
        f" | TPOT p50 {fmt_ms(row['tpot_p50_s'])}, p99 {fmt_ms(row['tpot_p99_s'])}"
        f" | cached {fmt(row['mean_cached_tokens'], 0)} of "
        f"{fmt(row['mean_prompt_tokens'], 0)} prompt tokens (mean)"
    )
    return row


def _overall(rows: list[dict[str, Any]]) -> dict[str, Any]:
    shared = [r["shared_system_prompt"] for r in rows]
    runs = [r[v] for r in rows for v in VARIANTS]
    return {
        "num_requests": sum(r["num_requests"] for r in runs),
        "num_complete": sum(r["num_complete"] for r in runs),
        "shared_mean_cached_tokens": _weighted(shared, "mean_cached_tokens"),
        "shared_mean_prompt_tokens": _weighted(shared, "mean_prompt_tokens"),
        "no_prompt_mean_cached_tokens": _weighted([r["no_system_prompt"] for r in rows],
                                                  "mean_cached_tokens"),
    }


def _weighted(runs: list[dict[str, Any]], key: str) -> float | None:
    """A per-run mean over all the runs' requests."""
    num = sum(r["num_requests"] for r in runs)
    return sum(r[key] * r["num_requests"] for r in runs) / num if num else None


def _plot(options: BenchOptions, rows: list[dict[str, Any]], system_len: int,
          max_tokens: int) -> str:
    fig, ax = new_figure(f"kvstack serve: TTFT under load ({max_tokens}-token answers, "
                         f"{options.threads_text})", "concurrent clients",
                         "median time to first token (ms)")
    lines = (("no_system_prompt", "o-", "no system prompt"),
             ("shared_system_prompt", "s--", f"shared ~{system_len}-token system prompt "
              "(prefix cache)"))
    levels = [r["concurrency"] for r in rows]
    for variant, style, label in lines:
        ax.plot(levels, [r[variant]["ttft_p50_s"] * 1000 for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_ylim(bottom=0)
    ax.legend()
    return save_figure(fig, options, "serve_ttft.png")
