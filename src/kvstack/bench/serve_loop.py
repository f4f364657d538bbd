"""`bench serve_loop`: what the serving loop adds per token, in one run.

The engine's own per-token time beside the inter-token latency a streaming client sees through
`kvstack serve`: same model, weight format (GGUF files: `gguf`, as `bench load` runs them),
threads, prompts (~800 tokens), batch (1 and 4) and greedy 64-token answers.

- engine: `LLMEngine.step` back to back on b requests added together, in a thread of its own
  as `AsyncLLM` runs it, the building thread's OpenMP workers handed back first as `AsyncLLM`
  does (kernels/openmp.py), so like is compared with like; the wall time of each step in which
  all b decode (each gains one token per step).
- serve: `kvstack serve` started as a subprocess with the same flags; b clients stream
  `/v1/completions` of the same prompts (token ids, `ignore_eos`) at once. ITL: the gaps
  between a request's content events once all b have their first (from then on every step is
  a decode step of all b, as in the engine's); TPOT: (last event - first) / (tokens - 1) per
  request, which is what guidellm reports as ITL (at b > 1 it includes the steps that
  prefilled the other requests, so it is shown, not compared).

At batch 1 both sides run the same steps and must give the same greedy text: the case checks
it. At larger batches the server admits requests as they arrive, so a step may mix one
request's decode with another's prefill, which in GGUF weights takes the dequantized matmul
path instead of the int8 kernel (approximate either way): texts may differ there, and
`same_text` is reported, not required.
Ratios are serve / engine; 1.0 means the loop adds nothing. The client shares the machine's
CPUs with the server: its CPU time per event is reported beside the figures, and so is the
load average before and after each side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    distinct_prompts,
    progress,
)
from kvstack.bench.format import fmt, fmt_x, ratio
from kvstack.bench.http_load import READ_TIMEOUT_S, server_process, sse_chunks
from kvstack.bench.serve import percentile
from kvstack.kernels.openmp import release_pool
from kvstack.sampling_params import SamplingParams
from kvstack.weights import is_gguf_model

BATCHES, QUICK_BATCHES = (1, 4), (1, 2)
ROUNDS = 3  # per batch and side; the first warms up and is not counted


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int


def sizes(quick: bool) -> Sizes:
    return Sizes(QUICK_BATCHES, 64, 8) if quick else Sizes(BATCHES, 800, 64)


def run(subject: Subject, options: BenchOptions) -> CaseResult:
    quantization = options.quantization or ("gguf" if is_gguf_model(options.model) else None)
    options = dataclasses.replace(options, quantization=quantization)
    size = sizes(options.quick)
    subject.require_context(size.prompt_tokens + size.max_tokens + 8, "the serve_loop benchmark")
    batch_max = max(size.batches)
    prompts = distinct_prompts(subject, ROUNDS * sum(size.batches), size.prompt_tokens)
    kv_bytes = subject.kv_shape().bytes_for(size.prompt_tokens + size.max_tokens + 16,
                                            batch_max + 2)
    total = 2 * ROUNDS * len(size.batches)
    with progress(options, total, "serve_loop") as bar:
        engine = _engine_side(subject, options, size, prompts, kv_bytes, bar)
        with server_process(options, kv_bytes, batch_max) as (url, _):
            served = asyncio.run(_serve_side(url, size, prompts, bar))
    rows = [_row(b, e, s) for b, e, s in zip(size.batches, engine, served, strict=True)]
    for row in rows:
        print(row["summary"], flush=True)
    return CaseResult(
        case="serve_loop",
        summary=_summary(rows, size),
        config={"model": options.model, "quick": options.quick, "threads": options.threads,
                "weights": subject.weight_format if quantization is None else quantization,
                "batches": list(size.batches), "prompt_tokens": size.prompt_tokens,
                "max_tokens": size.max_tokens, "rounds": ROUNDS, "warm_up_rounds": 1,
                "greedy": True, "ignore_eos": True, "route": "/v1/completions",
                "kv_cache_memory": kv_bytes},
        results={"batches": rows},
        table=[_table_row(r, size) for r in rows],
    )


def _rounds(prompts: list[list[int]], sizes_: Sizes) -> list[list[list[list[int]]]]:
    """Per batch size, per round, that round's prompts (every prompt used once per side)."""
    out, at = [], 0
    for b in sizes_.batches:
        out.append([prompts[at + r * b: at + (r + 1) * b] for r in range(ROUNDS)])
        at += ROUNDS * b
    return out


# -- the engine's own loop ------------------------------------------------------------------


def _engine_side(subject: Subject, options: BenchOptions, size: Sizes,
                 prompts: list[list[int]], kv_bytes: int, bar: Any) -> list[dict[str, Any]]:
    llm = subject.llm(quantization=options.quantization, kv_cache_memory=kv_bytes,
                      max_num_seqs=max(size.batches))
    params = SamplingParams(temperature=0, max_tokens=size.max_tokens, ignore_eos=True)
    try:
        # One worker thread steps the engine, as AsyncLLM's thread does in the server, after
        # this thread hands back its OpenMP workers as AsyncLLM does (kernels/openmp.py).
        release_pool()
        with ThreadPoolExecutor(1, thread_name_prefix="kvstack-bench-engine") as pool:
            return [pool.submit(_engine_batch, llm, rounds, params, b, bar).result()
                    for b, rounds in zip(size.batches, _rounds(prompts, size), strict=True)]
    finally:
        llm.close()


def _engine_batch(llm: Any, rounds: list[list[list[int]]], params: SamplingParams, b: int,
                  bar: Any) -> dict[str, Any]:
    """One batch size's rounds on the engine (the first warms up)."""
    load = [os.getloadavg()[0]]
    steps: list[float] = []
    texts: list[str] = []
    for r, batch in enumerate(rounds):
        timed, done = _engine_round(llm, batch, params, f"b{b}r{r}")
        if r > 0:
            steps += timed
            texts += done
        bar.update(1)
    load.append(os.getloadavg()[0])
    return {"step_s": steps, "texts": texts, "load_average": load}


def _engine_round(llm: Any, batch: list[list[int]], params: SamplingParams,
                  tag: str) -> tuple[list[float], list[str]]:
    """The wall time of each step in which every request decodes, and the answers' texts."""
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(prompt, params, request_id=rid)
    steps: list[float] = []
    texts: dict[str, str] = {}
    started: set[str] = set()
    while engine.has_unfinished():
        begin = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - begin
        # A step that only decodes: every request already had its first token before it.
        if len(started) == len(batch) and len(outputs) == len(batch):
            steps.append(elapsed)
        for out in outputs:
            started.add(out.request_id)
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return steps, [texts[rid] for rid in ids]


# -- through kvstack serve ------------------------------------------------------------------


async def _serve_side(url: str, size: Sizes, prompts: list[list[int]],
                      bar: Any) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=max(size.batches) + 2)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        return [await _serve_batch(client, model, rounds, size.max_tokens, bar)
                for rounds in _rounds(prompts, size)]


async def _serve_batch(client: httpx.AsyncClient, model: str, rounds: list[list[list[int]]],
                       max_tokens: int, bar: Any) -> dict[str, Any]:
    """One batch size's rounds: each round's requests streamed at once."""
    load = [os.getloadavg()[0]]
    side: dict[str, Any] = {"gap_s": [], "tpot_s": [], "texts": [], "events": 0, "tokens": 0,
                            "client_cpu_s": 0.0}
    for r, batch in enumerate(rounds):
        cpu_before = time.process_time()
        streams = await asyncio.gather(*(_stream(client, model, p, max_tokens) for p in batch))
        if r > 0:
            side["client_cpu_s"] += time.process_time() - cpu_before
            side["gap_s"] += _steady_gaps([s["times"] for s in streams])
            side["tpot_s"] += [_tpot(s) for s in streams]
            side["texts"] += [s["text"] for s in streams]
            side["events"] += sum(len(s["times"]) for s in streams)
            side["tokens"] += sum(s["tokens"] for s in streams)
        bar.update(1)
    load.append(os.getloadavg()[0])
    return side | {"load_average": load}


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int],
                  max_tokens: int) -> dict[str, Any]:
    """One streamed completion: each content event's arrival time, the text, the tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "semantic_cache": False}
    times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] | None = None
    async for chunk in sse_chunks(client, "/v1/completions", body):
        usage = chunk.get("usage") or usage
        delta = "".join(c["text"] for c in chunk["choices"])
        if delta:
            times.append(time.perf_counter())
            text.append(delta)
    if usage is None or not times:
        raise RuntimeError("a stream ended without text or usage")
    return {"times": times, "text": "".join(text), "tokens": usage["completion_tokens"]}


def _steady_gaps(times: Sequence[Sequence[float]]) -> list[float]:
    """Gaps between consecutive events of each stream, from the moment every stream has had
    its first event (before it, other requests' prefills share the steps)."""
    since = max(t[0] for t in times)
    return [b - a for t in times for a, b in zip(t, t[1:], strict=False) if a >= since]


def _tpot(stream: dict[str, Any]) -> float:
    times = stream["times"]
    return (times[-1] - times[0]) / max(stream["tokens"] - 1, 1)


# -- figures --------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _row(batch: int, engine: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    steps, gaps, tpots = engine["step_s"], served["gap_s"], served["tpot_s"]
    e50, e95 = _ms(percentile(steps, 50)), _ms(percentile(steps, 95))
    s50, s95 = _ms(percentile(gaps, 50)), _ms(percentile(gaps, 95))
    e_mean, s_mean, tpot_mean = (_ms(sum(v) / len(v)) if v else None
                                 for v in (steps, gaps, tpots))
    row: dict[str, Any] = {
        "batch": batch,
        "engine": {"step_p50_ms": e50, "step_p95_ms": e95, "step_mean_ms": e_mean,
                   "num_steps": len(steps), "load_average": engine["load_average"]},
        "serve": {"itl_p50_ms": s50, "itl_p95_ms": s95, "itl_mean_ms": s_mean,
                  "tpot_mean_ms": tpot_mean,
                  "tpot_p50_ms": _ms(percentile(tpots, 50)), "num_gaps": len(gaps),
                  "tokens_per_event": served["tokens"] / served["events"],
                  "client_cpu_ms_per_event": served["client_cpu_s"] * 1000 / served["events"],
                  "load_average": served["load_average"]},
        "ratio_p50": ratio(s50, e50), "ratio_p95": ratio(s95, e95),
        "ratio_mean": ratio(s_mean, e_mean),
        "same_text": engine["texts"] == served["texts"],
    }
    row["summary"] = (
        f"serve_loop: batch {batch} | engine step p50 {fmt(e50, 2)} ms, p95 {fmt(e95, 2)} ms"
        f" | serve ITL p50 {fmt(s50, 2)} ms, p95 {fmt(s95, 2)} ms, mean {fmt(s_mean, 2)} ms"
        f" (TPOT mean {fmt(tpot_mean, 2)} ms, the others' prefills included)"
        f" | serve/engine p50 {fmt_x(row['ratio_p50'])}, p95 {fmt_x(row['ratio_p95'])}, "
        f"mean {fmt_x(row['ratio_mean'])}"
        f" | {fmt(row['serve']['tokens_per_event'], 2)} tokens/event, client "
        f"{fmt(row['serve']['client_cpu_ms_per_event'], 2)} ms CPU/event"
        f" | same text {'yes' if row['same_text'] else 'no'}"
        f" | load {fmt(engine['load_average'][0], 1)}/{fmt(served['load_average'][-1], 1)}"
    )
    return row


def _summary(rows: list[dict[str, Any]], size: Sizes) -> str:
    parts = [f"batch {r['batch']}: engine {fmt(r['engine']['step_p50_ms'], 2)} ms, serve ITL "
             f"p50 {fmt(r['serve']['itl_p50_ms'], 2)} ms ({fmt_x(r['ratio_p50'])}), p95 "
             f"{fmt_x(r['ratio_p95'])}" for r in rows]
    same = all(r["same_text"] for r in rows if r["batch"] == 1)
    return (f"serve_loop: ~{size.prompt_tokens}-token prompts, {size.max_tokens} tokens | "
            + " | ".join(parts) + f" | same text at batch 1: {'yes' if same else 'NO'}")


def _table_row(row: dict[str, Any], size: Sizes) -> TableRow:
    return TableRow(
        f"per-token time, ~{size.prompt_tokens}-token context, batch {row['batch']}: "
        f"ITL p50 through `kvstack serve` / the engine's own step",
        f"{fmt(row['serve']['itl_p50_ms'], 2)} ms / {fmt(row['engine']['step_p50_ms'], 2)} ms",
        "", fmt_x(row["ratio_p50"]))
