"""Prometheus metrics, in a registry of the app's own (two apps in one process never clash).

Engine gauges and counters are read from the engine's `stats()` at scrape time; latency
histograms are observed as requests finish. Over several replicas (`ReplicatedEngine`) every
engine gauge and counter carries a `replica` label, one sample per live replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstack.engine.stats import EngineStats
from kvstack.outputs import RequestOutput
from kvstack.server.engine_client import EngineClient, ReplicatedEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


_GAUGES = {
    "requests_running": ("requests being computed", lambda s: s.num_requests_running),
    "requests_waiting": ("requests queued for admission", lambda s: s.num_requests_waiting),
    "kv_cache_usage_ratio": ("share of KV blocks in use (pins included)",
                             lambda s: s.kv_cache_usage),
    "kv_blocks_total": ("KV blocks in the pool", lambda s: s.num_blocks_total),
    "kv_blocks_used": ("KV blocks in use by requests or pins", lambda s: s.num_blocks_used),
    "kv_blocks_pinned": ("KV blocks held by prompt-cache pins", lambda s: s.num_blocks_pinned),
    "kv_blocks_cached": ("free KV blocks still holding a reusable prefix",
                         lambda s: s.num_blocks_cached),
}
_COUNTERS = {
    "prefix_cache_queries": ("prompt tokens looked up in the prefix cache",
                             lambda s: s.prefix_cache_query_tokens),
    "prefix_cache_hits": ("prompt tokens found in the prefix cache",
                          lambda s: s.prefix_cache_hit_tokens),
    "preemptions": ("requests preempted for lack of KV blocks", lambda s: s.num_preemptions),
    "prompt_tokens": ("prompt tokens processed", lambda s: s.num_prompt_tokens),
    "generation_tokens": ("tokens generated", lambda s: s.num_generation_tokens),
    "draft_tokens": ("draft tokens verified (semantic cache, prompt lookup)",
                     lambda s: s.num_draft_tokens),
    "draft_accepted_tokens": ("draft tokens the model agreed with",
                              lambda s: s.num_accepted_tokens),
    "blend_chunks_hit": ("chunks of blended requests found in the chunk cache",
                         lambda s: s.blend_chunks_hit),
    "blend_chunks_missed": ("chunks of blended requests computed in context",
                            lambda s: s.blend_chunks_missed),
    "blend_reused_tokens": ("prompt tokens placed from chunk entries (approximate)",
                            lambda s: s.blend_reused_tokens),
    "blend_recomputed_tokens": ("placed tokens recomputed in context",
                                lambda s: s.blend_recomputed_tokens),
}


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # collected lazily: registering must not touch the engine

    def collect(self) -> Iterator[Metric]:
        if isinstance(self.engine, ReplicatedEngine):
            yield from _labelled(self.engine.replica_stats())
            return
        s = self.engine.stats()
        for name, (doc, read) in _GAUGES.items():
            yield GaugeMetricFamily(f"kvstack_{name}", doc, value=read(s))
        for name, (doc, read) in _COUNTERS.items():
            yield CounterMetricFamily(f"kvstack_{name}", doc, value=read(s))


def _labelled(by_replica: dict[str, EngineStats]) -> Iterator[Metric]:
    for kinds, family in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
        for name, (doc, read) in kinds.items():
            metric = family(f"kvstack_{name}", doc, labels=["replica"])
            for replica, s in sorted(by_replica.items()):
                metric.add_metric([replica], read(s))
            yield metric


class ServerMetrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("kvstack_time_to_first_token_seconds",
                              "time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvstack_time_per_output_token_seconds",
                              "mean time per output token after the first, per request",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvstack_e2e_request_latency_seconds",
                             "time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("kvstack_requests_finished", "requests finished, by reason",
                                ["finish_reason"], registry=self.registry)
        # Told of every finished request too (the live view's latency percentiles).
        self.listeners: list[Callable[[RequestOutput], None]] = []

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request and its timings."""
        m = out.metrics
        self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.last_token_time is not None:
            self.e2e.observe(m.last_token_time - m.arrival_time)
        for listener in self.listeners:
            listener(out)

    def observe_abort(self) -> None:
        self.finished.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
