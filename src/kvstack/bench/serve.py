"""`bench serve`: `kvstack serve` under load over HTTP, as a client sees it.

The case starts the server as a subprocess on a free loopback port (or, with `--url`, loads
one already running) and streams `/v1/chat/completions` (greedy, `ignore_eos`, a fixed
`max_tokens`, usage in the last chunk). At each concurrency c, c clients send requests back to
back until the level's requests are done. Every level runs twice: with no system prompt, and
with one ~500-token system prompt (Python's reference docs) shared by all requests, which a
warm-up request has put in the prefix cache. Each request asks its own numbered question, so
nothing beyond the system prompt is shared; a per-run `cache_salt` keeps earlier runs against
the same server from counting as hits. The server and the clients live in `http_load`; this
module holds the workload and turns the requests' timings into the case's numbers.

TTFT is the time from sending a request to its first content chunk; TPOT is (last content
chunk - first content chunk) / (completion tokens - 1).
"""

from __future__ import annotations

import asyncio
import functools
import math
import uuid
from collections.abc import Sequence
from typing import Any

from kvstack.bench.common import BenchOptions, CaseResult, Subject, TableRow, progress, topic_texts
from kvstack.bench.format import fmt, per_second
from kvstack.bench.http_load import LoadTest, Sample, server
from kvstack.bench.plots import new_figure, save_figure
from kvstack.engine.chat import chat_token_ids
from kvstack.errors import InvalidRequestError
from kvstack.units import common_prefix_len, format_ms

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
    shared_prefix, longest = _prompt_lengths(subject, system, max_tokens)
    subject.require_context(longest, "the serve benchmark")
    # Room for every request of the top level at once, plus slack for the cached prefix.
    kv_bytes = subject.kv_shape().bytes_for(longest + 16, max(levels) + 2)
    total = sum(num_requests(c, options.quick) for c in levels) * len(VARIANTS) + len(VARIANTS)
    salt = f"bench-serve-{uuid.uuid4().hex}"

    with server(options, kv_bytes, max(levels)) as url, progress(options, total, "serve") as bar:
        load = LoadTest(url, functools.partial(_request_messages, system), max_tokens, salt, bar)
        timings = asyncio.run(load.run(levels, list(VARIANTS),
                                       lambda c: num_requests(c, options.quick)))
    rows = [_level_row(level, max_tokens) for level in timings]
    for row in rows:
        for variant in VARIANTS:
            print(row[variant]["summary"], flush=True)

    plot = _plot(options, rows, system_len, max_tokens)
    overall = _overall(rows)
    return CaseResult(
        case="serve",
        summary=_summary(rows, levels, max_tokens, overall),
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


def _prompt_lengths(subject: Subject, system: str, max_tokens: int) -> tuple[int, int]:
    """(prompt tokens every shared-prompt request can reuse, longest prompt + answer)."""
    # Two requests' prompts share exactly the tokens every shared-prompt request can reuse.
    first, second = (chat_token_ids(subject.tokenizer, _messages(system, i)) for i in (0, 1))
    shared_prefix = common_prefix_len(first, second)
    longest = max_tokens + max(len(chat_token_ids(subject.tokenizer, _messages(system, n)))
                               for n in range(10**6, 10**6 + len(QUESTIONS)))
    return shared_prefix, longest


def _summary(rows: list[dict[str, Any]], levels: Sequence[int], max_tokens: int,
             overall: dict[str, Any]) -> str:
    by_level = "/".join(str(c) for c in levels)

    def series(variant: str, key: str, show: Any) -> str:
        return "/".join(show(r[variant][key]) for r in rows)

    return (
        f"serve: HTTP streaming chat, {max_tokens} tokens per answer, {by_level} clients"
        f" | req/s none {series('no_system_prompt', 'requests_per_s', fmt)}, "
        f"shared {series('shared_system_prompt', 'requests_per_s', fmt)}"
        f" | TTFT p50 none {series('no_system_prompt', 'ttft_p50_s', format_ms)}, "
        f"shared {series('shared_system_prompt', 'ttft_p50_s', format_ms)}"
        f" | shared prompt: {fmt(overall['shared_mean_cached_tokens'], 0)} of "
        f"{fmt(overall['shared_mean_prompt_tokens'], 0)} prompt tokens cached (mean)"
        f" | {overall['num_complete']}/{overall['num_requests']} requests complete"
    )


def _table_row(row: dict[str, Any], max_tokens: int, system_len: int) -> TableRow:
    none, shared = row["no_system_prompt"], row["shared_system_prompt"]
    return TableRow(
        f"HTTP streaming chat, {row['concurrency']} clients, {max_tokens}-token answers: "
        f"req/s and TTFT p50, no system prompt / shared ~{system_len}-token system prompt",
        f"{fmt(none['requests_per_s'], 2)} req/s, {format_ms(none['ttft_p50_s'])} / "
        f"{fmt(shared['requests_per_s'], 2)} req/s, {format_ms(shared['ttft_p50_s'])}",
    )


def system_prompt(subject: Subject, num_tokens: int) -> str:
    """About `num_tokens` tokens of instructions and reference text."""
    ids: list[int] = []
    for text in topic_texts():
        ids += subject.encode(text)
        if len(ids) >= num_tokens:
            break
    assert subject.tokenizer is not None
    return ("Answer questions about Python using this reference.\n\n"
            + subject.tokenizer.decode(ids[:num_tokens]))


def _messages(system: str | None, number: int) -> list[dict[str, str]]:
    # The number comes first, so two questions share no tokens after the system prompt.
    question = f"Request {number}: {QUESTIONS[number % len(QUESTIONS)]}"
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": question}]


def _request_messages(system: str, variant: str, number: int) -> list[dict[str, str]]:
    """Request `number`'s messages in `variant`: the system prompt only when shared."""
    return _messages(system if variant == "shared_system_prompt" else None, number)


def _level_row(timings: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """One level's row: {"concurrency": c, variant: its numbers} from the requests' timings."""
    c = timings["concurrency"]
    row: dict[str, Any] = {"concurrency": c}
    for variant in VARIANTS:
        samples, elapsed = timings[variant]
        row[variant] = _row(samples, elapsed, variant, c, max_tokens)
    return row


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


def _row(samples: list[Sample], elapsed: float, variant: str, concurrency: int,
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
        f" | TTFT p50 {format_ms(row['ttft_p50_s'])}, p99 {format_ms(row['ttft_p99_s'])}"
        f" | TPOT p50 {format_ms(row['tpot_p50_s'])}, p99 {format_ms(row['tpot_p99_s'])}"
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
