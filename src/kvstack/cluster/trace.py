"""A seeded multi-tenant workload for the routing simulator.

Most requests are a shared prefix (a document or system prompt, ~1,000 tokens) followed by a
short unique question; each tenant has its own Zipf-popular prefixes, plus a pool of texts
every tenant uses (a public document, a common system prompt) which, salted per tenant, still
never share KV blocks across tenants. The rest are unique prompts. Arrivals are Poisson.

Keys: a prefix's blocks are hashed with the engine's own code (`request_keys`: chained sha256,
fingerprint and tenant salt), once per (tenant, prefix). Blocks past a prefix's last full block
contain a unique question, and unique prompts are unique throughout: those blocks match nothing
anywhere, so they get fresh random 64-bit keys instead of sha256 (the same routing behaviour,
and no per-request hashing: 100,000 requests x ~70 blocks would take minutes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kvstack.cluster.events import BlockKey
from kvstack.cluster.router import request_keys
from kvstack.cluster.scoring import Layout


@dataclass(frozen=True)
class TraceConfig:
    docs_per_tenant: int = 40
    shared_docs: int = 10  # texts every tenant uses (salted apart per tenant)
    shared_fraction: float = 0.25  # of prefixed requests, how many use a shared text
    zipf_s: float = 1.0
    prefix_tokens: tuple[int, int] = (600, 1400)  # uniform range, inclusive
    question_tokens: tuple[int, int] = (20, 200)
    unique_fraction: float = 0.2
    unique_tokens: tuple[int, int] = (200, 1500)
    output_tokens_mean: float = 64.0  # geometric
    max_output_tokens: int = 512
    rate_per_replica: float = 0.15  # requests/s per replica, Poisson
    vocab_size: int = 49152


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    tenant: int
    group: int | None  # the prefix group (tenant, prefix) or None for a unique prompt
    num_prompt_tokens: int
    output_tokens: int
    keys: tuple[BlockKey, ...]  # salted, as the engine names the blocks
    text_keys: tuple[BlockKey, ...]  # unsalted: what a router reading prompt text sees


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]
    group_weights: list[float]  # expected prefill tokens per group, for the oracle's pinning
    num_groups: int


def tenant_salt(tenant: int) -> str:
    """Per-tenant cache salt, shaped like the server's (sha256 hex of the tenant's key)."""
    return hashlib.sha256(f"tenant-{tenant}\x00".encode()).hexdigest()


def _zipf(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return p / p.sum()


class _Prefixes:
    """Each (tenant, prefix) text's length, salted keys and unsalted text keys, hashed once.

    Private prefixes belong to one tenant; shared ones (doc >= docs_per_tenant) have the same
    text for every tenant, so their unsalted keys are shared and their salted keys are not."""

    def __init__(self, seed: int, config: TraceConfig, layout: Layout) -> None:
        self.seed = seed
        self.config = config
        self.layout = layout
        self.text_layout = Layout("text", layout.block_size, "")
        self._cache: dict[tuple[int, int], tuple[int, tuple[BlockKey, ...],
                                                 tuple[BlockKey, ...]]] = {}

    def owner(self, tenant: int, doc: int) -> int:
        return -1 if doc >= self.config.docs_per_tenant else tenant

    def text(self, tenant: int, doc: int) -> np.ndarray:
        cfg = self.config
        r = np.random.default_rng([self.seed, 7, self.owner(tenant, doc) + 1, doc])
        n = int(r.integers(cfg.prefix_tokens[0], cfg.prefix_tokens[1] + 1))
        return r.integers(0, cfg.vocab_size, n)

    def get(self, tenant: int, doc: int) -> tuple[int, tuple[BlockKey, ...],
                                                  tuple[BlockKey, ...]]:
        got = self._cache.get((tenant, doc))
        if got is None:
            tokens = self.text(tenant, doc).tolist()
            salted = tuple(request_keys(tokens, self.layout, tenant_salt(tenant)))
            owner = self.owner(tenant, doc)
            text = self._cache.get((owner, doc))  # unsalted keys depend only on the text
            text_keys = text[2] if text else tuple(request_keys(tokens, self.text_layout, None))
            got = (len(tokens), salted, text_keys)
            self._cache[(tenant, doc)] = got
            if owner == -1:
                self._cache.setdefault((owner, doc), got)
        return got


@dataclass(frozen=True)
class _Draws:
    """Every random choice of a trace, drawn up front in one fixed order (the seed's trace)."""

    arrivals: np.ndarray
    tenants: np.ndarray
    unique: np.ndarray
    docs: np.ndarray  # the prefix of each request (private or shared)
    questions: np.ndarray
    unique_lens: np.ndarray
    outputs: np.ndarray
    tail_keys: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, n: int, num_replicas: int, num_tenants: int,
             cfg: TraceConfig, block_size: int) -> _Draws:
        arrivals = np.cumsum(rng.exponential(1.0 / (cfg.rate_per_replica * num_replicas), n))
        tenants = rng.integers(0, num_tenants, n)
        unique = rng.random(n) < cfg.unique_fraction
        shared = rng.random(n) < cfg.shared_fraction
        private_doc = rng.choice(cfg.docs_per_tenant, n, p=_zipf(cfg.docs_per_tenant, cfg.zipf_s))
        shared_doc = cfg.docs_per_tenant + rng.choice(
            cfg.shared_docs, n, p=_zipf(cfg.shared_docs, cfg.zipf_s)) if cfg.shared_docs else \
            np.zeros(n, dtype=np.int64)
        use_shared = shared & (cfg.shared_docs > 0)
        questions = rng.integers(cfg.question_tokens[0], cfg.question_tokens[1] + 1, n)
        unique_lens = rng.integers(cfg.unique_tokens[0], cfg.unique_tokens[1] + 1, n)
        outputs = np.minimum(rng.geometric(1.0 / cfg.output_tokens_mean, n),
                             cfg.max_output_tokens)
        longest = max(cfg.unique_tokens[1], cfg.prefix_tokens[1] + cfg.question_tokens[1])
        tail_keys = rng.integers(0, 2**63, (n, longest // block_size + 1), dtype=np.int64)
        return cls(arrivals, tenants, unique, np.where(use_shared, shared_doc, private_doc),
                   questions, unique_lens, outputs, tail_keys)


def make_trace(num_requests: int, num_replicas: int, num_tenants: int, seed: int,
               config: TraceConfig, layout: Layout) -> Trace:
    rng = np.random.default_rng([seed, num_replicas, num_tenants])
    cfg = config
    docs = cfg.docs_per_tenant + cfg.shared_docs  # per tenant: private ones, then shared ones
    bs = layout.block_size
    prefixes = _Prefixes(seed, cfg, layout)
    d = _Draws.draw(rng, num_requests, num_replicas, num_tenants, cfg, bs)
    weights = [0.0] * (num_tenants * docs)
    requests = []
    for i in range(num_requests):
        tenant = int(d.tenants[i])
        fresh = d.tail_keys[i].tolist()
        arrival, output = float(d.arrivals[i]), int(d.outputs[i])
        if d.unique[i]:
            num_tokens = int(d.unique_lens[i])
            keys = tuple(fresh[: num_tokens // bs])
            # Unsalted text keys of a unique prompt are as unique: reuse the same fresh keys.
            requests.append(TraceRequest(arrival, tenant, None, num_tokens, output, keys, keys))
            continue
        doc = int(d.docs[i])
        plen, salted, text_keys = prefixes.get(tenant, doc)
        num_tokens = plen + int(d.questions[i])
        full = plen // bs
        tail = tuple(fresh[: num_tokens // bs - full])
        group = tenant * docs + doc
        weights[group] += plen
        requests.append(TraceRequest(arrival, tenant, group, num_tokens, output,
                                     salted[:full] + tail, text_keys[:full] + tail))
    return Trace(requests, weights, num_tenants * docs)
