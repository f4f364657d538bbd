"""The handoff counters in /metrics (prometheus_client, in the app's own registry), read from
the ingress's `HandoffCounters` at scrape time like the engine figures."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstack.cluster.pd.handoff import HandoffCounters


class _HandoffCollector(Collector):
    def __init__(self, counters: HandoffCounters) -> None:
        self.counters = counters

    def describe(self) -> list[Metric]:
        return []  # collected lazily

    def collect(self) -> Iterator[Metric]:
        c = self.counters
        yield CounterMetricFamily("kvstack_handoffs", "KV handoffs from a prefill replica to "
                                  "a decode replica", value=c.count)
        yield CounterMetricFamily("kvstack_handoff_bytes", "encoded KV block bytes handed "
                                  "over", value=c.bytes)
        yield CounterMetricFamily("kvstack_handoff_seconds", "decode-side time fetching "
                                  "handoffs", value=c.seconds)
        yield CounterMetricFamily("kvstack_handoff_whole_requests", "requests a decode "
                                  "replica served alone (not handed over)", value=c.whole)
        yield CounterMetricFamily("kvstack_handoff_local_prefills", "prompts short enough "
                                  "to prefill on a decode replica", value=c.local)
        fallbacks = CounterMetricFamily("kvstack_handoff_fallbacks", "handoffs recomputed "
                                        "in part or whole, by why", labels=["kind"])
        for kind, n in sorted(c.fallbacks.items()):
            fallbacks.add_metric([kind], n)
        yield fallbacks


def add_handoff_metrics(app: FastAPI, counters: HandoffCounters) -> None:
    app.state.kvstack.metrics.registry.register(_HandoffCollector(counters))
