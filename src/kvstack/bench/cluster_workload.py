"""The seeded multi-tenant workload of `bench cluster`, and the open-loop client that plays it.

Tenants are API keys. Each tenant sends a few long prefixes (~1,000 tokens: documents and
system prompts) with Zipf popularity, each followed by a short unique question, plus unique
prompts; arrivals are Poisson. One document text is sent by every tenant: the same text, so a
text-reading router believes it is cached wherever any tenant sent it, but salted apart per
tenant, so it never is. Prompts are token ids (the completions API takes them), drawn from
the vocabulary's ordinary range, so lengths are exact.

The client sends each request at its arrival time whatever the server's state (open loop), as
a streaming completion, and records TTFT (to the first content chunk), TPOT, the output and
cached token counts from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from kvstack.cluster.router import request_keys
from kvstack.cluster.scoring import Layout, pin_groups
from kvstack.server.auth import Tenant

PROBE_STREAMS = 2  # one per replica
CAPACITY_STREAMS = 8  # max_num_seqs on each of two replicas
CAPACITY_ROUNDS = 3


@dataclass(frozen=True)
class WorkloadConfig:
    tenants: int = 3
    shared_docs: int = 1  # texts every tenant sends (salted apart per tenant)
    private_docs: int = 1  # per tenant
    prefix_tokens: tuple[int, int] = (900, 1100)
    question_tokens: tuple[int, int] = (10, 60)
    unique_fraction: float = 0.2
    unique_tokens: tuple[int, int] = (200, 600)
    output_tokens: tuple[int, int] = (8, 16)
    zipf_s: float = 1.0
    token_range: tuple[int, int] = (100, 49_000)  # clear of the special tokens

    @property
    def docs_per_tenant(self) -> int:
        return self.shared_docs + self.private_docs


@dataclass(frozen=True)
class BenchRequest:
    arrival: float
    tenant: int
    group: int | None  # the salted prefix (tenant * docs_per_tenant + doc); None: unique
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    requests: list[BenchRequest]
    keys: list[str]  # API key of each tenant
    prefixes: dict[int, list[int]]  # group -> its prefix tokens

    @property
    def distinct_prefix_tokens(self) -> int:
        return sum(len(p) for p in self.prefixes.values())

    def oracle_pins(self, layout: Layout, num_replicas: int) -> dict[int, int]:
        """First block key of each salted prefix -> a replica index: prefixes pinned by
        expected prefill tokens, heaviest first onto the lightest replica (LPT)."""
        weights = {g: 0.0 for g in self.prefixes}
        for r in self.requests:
            if r.group is not None:
                weights[r.group] += len(self.prefixes[r.group])
        groups = sorted(weights)
        assignment = pin_groups([weights[g] for g in groups], num_replicas)
        pins = {}
        for group, replica in zip(groups, assignment, strict=True):
            salt = Tenant(self.keys[group // self.config.docs_per_tenant]).cache_salt(None)
            first = request_keys(self.prefixes[group][: layout.block_size], layout, salt)
            pins[first[0]] = replica
        return pins


def make_workload(config: WorkloadConfig, num_requests: int, rate_per_s: float,
                  seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    cfg = config
    low, high = cfg.token_range

    def tokens(n: int, r: np.random.Generator = rng) -> list[int]:
        return r.integers(low, high, n).tolist()

    texts = [tokens(int(rng.integers(cfg.prefix_tokens[0], cfg.prefix_tokens[1] + 1)))
             for _ in range(cfg.shared_docs)]
    prefixes: dict[int, list[int]] = {}
    for tenant in range(cfg.tenants):
        for doc in range(cfg.docs_per_tenant):
            own = doc >= cfg.shared_docs
            length = int(rng.integers(cfg.prefix_tokens[0], cfg.prefix_tokens[1] + 1))
            prefixes[tenant * cfg.docs_per_tenant + doc] = tokens(length) if own else texts[doc]
    popularity = 1.0 / np.arange(1, len(prefixes) + 1) ** cfg.zipf_s
    order = rng.permutation(len(prefixes))  # which prefix is most popular: seeded
    weights = np.empty(len(prefixes))
    weights[order] = popularity / popularity.sum()
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests))
    requests = []
    for i in range(num_requests):
        out = int(rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1))
        if rng.random() < cfg.unique_fraction:
            n = int(rng.integers(cfg.unique_tokens[0], cfg.unique_tokens[1] + 1))
            tenant = int(rng.integers(cfg.tenants))
            requests.append(BenchRequest(float(arrivals[i]), tenant, None, tokens(n), out))
            continue
        group = int(rng.choice(len(prefixes), p=weights))
        question = tokens(int(rng.integers(cfg.question_tokens[0], cfg.question_tokens[1] + 1)))
        requests.append(BenchRequest(float(arrivals[i]), group // cfg.docs_per_tenant, group,
                                     prefixes[group] + question, out))
    keys = [f"sk-bench-tenant-{t}" for t in range(cfg.tenants)]
    return Workload(config, requests, keys, prefixes)


def probe_workloads(config: WorkloadConfig, seed: int = 1) -> tuple[Workload, Workload]:
    """Requests to calibrate the arrival rate on the running cluster, in streams (a stream is
    the requests of one `BenchRequest.group` value, sent one after another; streams run side
    by side). First, one stream per replica, each on its own new prefix: a miss, a hit (a
    new question) and a unique prompt. Then `CAPACITY_STREAMS` streams of the workload's mix
    (hits on those prefixes, unique prompts) keep every replica's batch full: a closed loop
    whose rate is what the cluster serves when everything that can hit does. Mid-range
    lengths, outputs of the mean length."""
    rng = np.random.default_rng(seed)
    cfg = config
    low, high = cfg.token_range

    def mid(bounds: tuple[int, int]) -> int:
        return sum(bounds) // 2

    def draw(n: int) -> list[int]:
        return rng.integers(low, high, n).tolist()

    out = mid(cfg.output_tokens)
    prefixes = {stream: draw(mid(cfg.prefix_tokens)) for stream in range(PROBE_STREAMS)}

    def ask(stream: int, prefix: int | None) -> BenchRequest:
        prompt = draw(mid(cfg.unique_tokens)) if prefix is None else \
            prefixes[prefix] + draw(mid(cfg.question_tokens))
        return BenchRequest(0.0, 0, stream, prompt, out)

    timed = [ask(s, p) for s in range(PROBE_STREAMS) for p in (s, s, None)]
    mix = [ask(s, None if rng.random() < cfg.unique_fraction else
               int(rng.integers(PROBE_STREAMS))) for s in range(CAPACITY_STREAMS)
           for _ in range(CAPACITY_ROUNDS)]
    keys = ["sk-bench-tenant-0"]
    return Workload(cfg, timed, keys, prefixes), Workload(cfg, mix, keys, prefixes)


# -- the client --------------------------------------------------------------------------------


async def play(url: str, model: str, workload: Workload, timeout_s: float = 1800.0
               ) -> tuple[list[dict[str, Any]], float]:
    """Send every request at its arrival time; (one sample per request, seconds from the
    first send to the last answer)."""
    limits = httpx.Limits(max_connections=len(workload.requests) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        samples = await asyncio.gather(*(_one(client, model, workload, r, start)
                                         for r in workload.requests))
        return list(samples), time.perf_counter() - start


async def play_streams(url: str, model: str, workload: Workload, timeout_s: float = 600.0
                       ) -> list[dict[str, Any]]:
    """The requests of each group in turn (each after the previous one's answer), the groups
    side by side; arrival times ignored. Samples in the workload's order."""
    streams: dict[int | None, list[int]] = {}
    for i, request in enumerate(workload.requests):
        streams.setdefault(request.group, []).append(i)
    samples: list[dict[str, Any]] = [{} for _ in workload.requests]
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        async def stream(indices: list[int]) -> None:
            for i in indices:
                request = workload.requests[i]
                samples[i] = await _one(client, model, workload, request,
                                        time.perf_counter() - request.arrival)

        await asyncio.gather(*(stream(indices) for indices in streams.values()))
    return samples


async def _one(client: httpx.AsyncClient, model: str, workload: Workload, request: BenchRequest,
               start: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start + request.arrival - time.perf_counter()))
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"authorization": f"Bearer {workload.keys[request.tenant]}"}
    sent = time.perf_counter()
    first = last = None
    gap_max = 0.0  # the longest wait between two streamed tokens
    usage: dict[str, Any] = {}
    error = None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"].get("message")
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                gap_max = max(gap_max, now - (last or now))
                last = now
    completion = usage.get("completion_tokens", 0)
    return {"tenant": request.tenant, "group": request.group, "prompt_tokens":
            len(request.prompt), "completion_tokens": completion,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "arrival_s": request.arrival, "ttft_s": None if first is None else first - sent,
            "tpot_s": (last - first) / (completion - 1) if first and last and completion > 1
            else None, "itl_max_s": gap_max, "latency_s": time.perf_counter() - sent,
            "done_s": time.perf_counter() - start, "error": error}
