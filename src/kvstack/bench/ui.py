"""`bench ui`: what the live view (`/ui`) costs the engine.

End to end: `kvstack serve` (a subprocess, the default 1 GiB pool) with a few hundred cached
prefix blocks; one long streamed completion (greedy, `ignore_eos`) at a time, its decode
tok/s = (tokens - 1) / (last chunk - first chunk). Runs alternate between no page open and
five pages' event streams open (ABBA order, so drift in the machine's load hits both arms
alike); the figure is the median of the per-pair ratios, with every pair's ratio kept.

Directly: in this process, the same cache state, the time `cache_snapshot()` holds the engine
(it runs under the engine lock once a tick, however many pages are open) and the time a
tick's rendering takes off the lock.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import httpx

from kvstack.bench.common import (
    BenchOptions,
    CaseResult,
    Subject,
    TableRow,
    fmt,
    fmt_x,
    progress,
    topic_texts,
)
from kvstack.bench.http_load import server
from kvstack.errors import InvalidRequestError

NUM_PAGES = 5
POOL_BYTES = 1024**3  # `kvstack serve`'s default --kv-cache-memory


def sizes(quick: bool) -> tuple[int, int, int]:
    """(cached prompts, tokens per measured answer, ABBA pairs of runs)."""
    return (4, 24, 1) if quick else (48, 256, 4)


class Pages:
    """`n` open pages: threads reading `/ui/api/events` until stopped."""

    def __init__(self, url: str, n: int) -> None:
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


def decode_rate(url: str, prompt: str, max_tokens: int) -> float:
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
    return (num_tokens - 1) / (last - first)


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
    texts = TextCache(lambda ids: subject.tokenizer.decode(list(ids), skip_special_tokens=False))
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
    rates: dict[int, list[float]] = {0: [], NUM_PAGES: []}
    order = [arm for _ in range(pairs) for arm in (0, NUM_PAGES, NUM_PAGES, 0)]
    with server(options, POOL_BYTES, 8) as url, progress(options, len(order) + 1, "ui") as bar:
        fill_cache(url, num_prompts)
        decode_rate(url, prompt, 8)  # warm-up
        bar.update(1)
        for arm in order:
            if arm:
                with Pages(url, arm):
                    rates[arm].append(decode_rate(url, prompt, max_tokens))
            else:
                rates[arm].append(decode_rate(url, prompt, max_tokens))
            bar.update(1)
    direct = direct_costs(subject, num_prompts)
    return _result(options, rates, direct, num_prompts, max_tokens, pairs)


def _result(options: BenchOptions, rates: dict[int, list[float]], direct: dict[str, Any],
            num_prompts: int, max_tokens: int, pairs: int) -> CaseResult:
    closed, open_ = rates[0], rates[NUM_PAGES]
    ratios = [o / c for o, c in zip(open_, closed, strict=True)]
    ratio = statistics.median(ratios)
    share = direct["snapshot_ms"] / 1000  # one snapshot a second
    summary = (
        f"ui: decode tok/s of a {max_tokens}-token answer with 0 / {NUM_PAGES} open /ui pages "
        f"({direct['num_blocks']}-block pool, {direct['cached_blocks']} cached blocks, "
        f"{2 * pairs} runs each, ABBA) | median {fmt(statistics.median(closed))} / "
        f"{fmt(statistics.median(open_))} tok/s | {NUM_PAGES} pages / none "
        f"{fmt_x(ratio)} (pairs {', '.join(f'{r:.3f}' for r in ratios)}) | snapshot under the "
        f"engine lock {direct['snapshot_ms']:.2f} ms a tick ({share:.3%} of a second), render "
        f"off the lock {direct['render_ms']:.1f} ms")
    return CaseResult(
        case="ui", summary=summary,
        config={"model": options.model, "quick": options.quick, "pages": NUM_PAGES,
                "max_tokens": max_tokens, "pairs": pairs, "order": "ABBA",
                "cached_prompts": num_prompts, "kv_cache_memory": POOL_BYTES,
                "threads": options.threads},
        results={"decode_tok_s_no_pages": closed, "decode_tok_s_pages": open_,
                 "ratios": ratios, "median_ratio": ratio, **direct},
        table=[TableRow(f"decode tok/s of a {max_tokens}-token answer, {NUM_PAGES} open /ui "
                        f"pages vs none ({direct['cached_blocks']} cached blocks)",
                        fmt(statistics.median(open_)),
                        f"no page {fmt(statistics.median(closed))}", fmt_x(ratio))],
    )
