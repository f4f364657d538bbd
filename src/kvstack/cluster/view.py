"""The router's picture of the replicas, shared by the Ray request router and the ingress.

It holds the `CacheAwareRouter` (resident-block index, decision record, loads), fed by each
replica's routing stats (`update`) and, when a router fell behind, by snapshots the ingress
fetches (`needs_snapshot`, `apply_snapshot`); it ranks replicas for a request under one of the
policies (`choose`), remembers where each request went and what it predicted (`routed`), and
scores the prediction against the engine's own `num_cached_tokens` (`outcome`).

Ray runs a handle's router in an event loop of its own thread while the ingress reads and
feeds the view from its loop, so every public method holds one lock (they are all short).
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstack.cluster.events import BlockKey, Snapshot
from kvstack.cluster.index import held_prefix, prefix_lengths
from kvstack.cluster.router import CacheAwareRouter, LoadReport
from kvstack.cluster.scoring import Layout, ScoringConfig, cacheable_blocks
from kvstack.cluster.wire import ReplicaRequest, decode_report, report_bytes
from kvstack.errors import InvalidRequestError

POLICIES = ("cache-aware", "round-robin", "pow2", "oracle")
UNKNOWN = Layout("unknown", 0, "")  # a replica that has not reported: load only, no affinity
_KEEP_DECISIONS = 4096  # decisions awaiting their outcome, and decision times kept


@dataclass
class _Member:
    name: str
    layout: Layout = UNKNOWN
    capacity_blocks: int = 0
    routed: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    reports: int = 0  # distinct reports received (Ray re-sends unchanged ones)
    report_bytes: int = 0
    last_as_of: float = 0.0


@dataclass
class Accuracy:
    """Predicted cached tokens (at routing) against the engine's `num_cached_tokens`."""

    requests: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    over_tokens: int = 0  # predicted but not hit
    under_tokens: int = 0  # hit but not predicted (e.g. restored from Redis)
    exact: int = 0  # requests predicted within one block

    def add(self, predicted: int, actual: int, block_size: int) -> None:
        self.requests += 1
        self.predicted_tokens += predicted
        self.actual_tokens += actual
        self.over_tokens += max(predicted - actual, 0)
        self.under_tokens += max(actual - predicted, 0)
        self.exact += abs(predicted - actual) < max(block_size, 1)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.requests, 1)
        return {"requests": self.requests, "predicted_tokens": self.predicted_tokens,
                "actual_tokens": self.actual_tokens, "over_tokens": self.over_tokens,
                "under_tokens": self.under_tokens, "exact_fraction": self.exact / n,
                "mean_abs_error_tokens": (self.over_tokens + self.under_tokens) / n}


class ClusterView:
    def __init__(self, policy: str = "cache-aware", layout: Layout | None = None,
                 scoring: ScoringConfig | None = None, *, max_blocks_per_replica: int = 1 << 20,
                 record_ttl_s: float = 5.0, oracle_pins: Mapping[BlockKey, int] | None = None,
                 seed: int = 0) -> None:
        if policy not in POLICIES:
            raise InvalidRequestError(f"unknown router {policy!r}; use one of "
                                      f"{', '.join(POLICIES)}")
        self.policy = policy
        self.layout = layout
        self.scoring = scoring or ScoringConfig()
        self.max_blocks = max_blocks_per_replica
        self.record_ttl_s = record_ttl_s
        self.oracle_pins = dict(oracle_pins or {})
        self.router: CacheAwareRouter | None = None
        self._lock = threading.RLock()
        self._members: dict[str, _Member] = {}
        self._pending: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (name, pred)
        self._rng = random.Random(seed)
        self._turn = 0
        self.accuracy = Accuracy()
        self.decision_cpu_ns: deque[int] = deque(maxlen=_KEEP_DECISIONS)
        self.decision_wall_ns: deque[int] = deque(maxlen=_KEEP_DECISIONS)
        self.report_age_ns: deque[int] = deque(maxlen=_KEEP_DECISIONS)
        self.num_decisions = self.num_guarded = self.num_snapshots = 0
        self.num_removed = 0
        if layout is not None:
            self._build_router(layout)

    def set_layout(self, layout: Layout) -> None:
        """The layout requests are hashed under (the ingress learns it from a replica)."""
        with self._lock:
            if self.router is None:
                self._build_router(layout)

    def _build_router(self, layout: Layout) -> None:
        self.layout = layout
        self.router = CacheAwareRouter(layout, self.scoring,
                                       max_blocks_per_replica=self.max_blocks,
                                       record_ttl_s=self.record_ttl_s,
                                       use_record=self.policy == "cache-aware")
        for name in self._members:
            self.router.add_replica(name, UNKNOWN)

    # --- membership and reports ------------------------------------------------------------

    def update(self, stats: Mapping[str, Mapping[str, Any] | None],
               now: float | None = None) -> None:
        """The live replicas and their latest routing stats (Ray re-sends all of them on any
        change); departed replicas are forgotten."""
        now = time.time() if now is None else now
        with self._lock:
            for name in set(self._members) - set(stats):
                self._remove(name)
            for name, raw in stats.items():
                self._apply(name, raw, now)

    def _apply(self, name: str, raw: Mapping[str, Any] | None, now: float) -> None:
        report = decode_report(raw)
        if self.router is None and report is not None:
            self._build_router(report.layout)
        member = self._members.get(name)
        if member is None:
            member = self._members[name] = _Member(name)
            if self.router is not None:
                self.router.add_replica(name, UNKNOWN)
        if report is None or self.router is None:
            return
        if member.layout != report.layout or name not in self.router.index:
            member.layout = report.layout
            if name in self.router.index:
                self.router.remove_replica(name)
            self.router.add_replica(name, report.layout)
        member.capacity_blocks = report.capacity_blocks
        if report.load.as_of > member.last_as_of:
            # How old a replica's report is when it reaches the router: the view's staleness
            # (the poll period plus Ray's broadcast; one clock on one machine).
            member.last_as_of = report.load.as_of
            member.reports += 1
            member.report_bytes += report_bytes(raw or {})
            self.report_age_ns.append(int(max(now - report.load.as_of, 0.0) * 1e9))
        for batch in report.batches:
            self.router.index.apply_events(name, batch)
        load = report.load
        self.router.report(name, LoadReport(load.queued_prefill_tokens, load.queued_requests,
                                            load.running_requests, min(load.as_of, now)))

    def remove(self, name: str) -> None:
        """The replica died (Ray tells its router before the next update)."""
        with self._lock:
            self._remove(name)

    def _remove(self, name: str) -> None:
        if self._members.pop(name, None) is None:
            return
        self.num_removed += 1
        if self.router is not None and name in self.router.index:
            self.router.remove_replica(name)

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._members)

    def needs_snapshot(self) -> list[str]:
        """Replicas that reported but whose resident set the index may have wrong."""
        with self._lock:
            router = self.router
            if router is None:
                return []
            return [n for n, m in self._members.items()
                    if m.layout != UNKNOWN and n in router.index and router.index.needs_snapshot(n)]

    def apply_snapshot(self, name: str, snapshot: Snapshot) -> None:
        with self._lock:
            if self.router is not None and name in self._members and name in self.router.index:
                self.router.index.apply_snapshot(name, snapshot)
                self.num_snapshots += 1

    # --- routing ---------------------------------------------------------------------------

    def choose(self, request: ReplicaRequest, candidates: Sequence[str],
               now: float | None = None) -> list[list[str]]:
        """Ranks of candidate names, best first (within a rank, the caller picks the least
        busy); never one in `request.exclude` unless nothing else is left."""
        now = time.time() if now is None else now
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        with self._lock:
            allowed = [c for c in candidates if c not in request.exclude] or list(candidates)
            ranks = self._rank(request, allowed, now) if allowed else []
            self.num_decisions += 1
            # Under the lock: summaries read these deques from another thread.
            self.decision_cpu_ns.append(time.thread_time_ns() - cpu0)
            self.decision_wall_ns.append(time.perf_counter_ns() - wall0)
        return ranks

    def _rank(self, request: ReplicaRequest, allowed: list[str], now: float) -> list[list[str]]:
        router = self.router
        self._turn += 1
        if self.policy == "cache-aware" and router is not None:
            for name in allowed:
                if name not in router.index:
                    router.add_replica(name, UNKNOWN)
            choice = router.choose(request.keys, request.num_prompt_tokens, now, allowed,
                                   request.request_id)
            self.num_guarded += choice.guarded
            names = [router.index.name(s) for s in choice.ranking]
            ranked = [n for n in names if n is not None]
            if ranked and ranked[0] == names[0] and choice.cached_tokens and not choice.guarded:
                # Only the replica holding the prefix: Ray waits for room there rather than
                # sending the request to the next one to compute it again (`waiting`).
                router.hold(request.request_id, choice, request.num_prompt_tokens, now)
                return [[ranked[0]]]
            return [[n] for n in ranked + [a for a in allowed if a not in ranked]]
        ordered = sorted(allowed)
        if self.policy == "pow2" and len(ordered) > 1:
            return [self._rng.sample(ordered, 2), ordered]
        start = self._turn % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        if self.policy == "oracle" and request.keys:
            pinned = self.oracle_pins.get(request.keys[0])
            members = sorted(self._members)
            if pinned is not None and pinned < len(members) and members[pinned] in ordered:
                return [[members[pinned]]]  # whatever the load: Ray waits for room there
            return [self._least_loaded(rotated)]
        return [[n] for n in rotated]

    def _least_loaded(self, names: list[str]) -> list[str]:
        router = self.router
        if router is None:
            return names
        loads = router.loads()
        ongoing = loads.ongoing_requests()
        slot = {n: router.index.slot(n) for n in names if n in router.index}
        return sorted(names, key=lambda n: ongoing[slot[n]] if n in slot else 0)

    def routed(self, request: ReplicaRequest, name: str, now: float | None = None) -> int:
        """The request went to `name`; returns the cached tokens predicted there."""
        now = time.time() if now is None else now
        with self._lock:
            router = self.router
            member = self._members.get(name)
            if router is None or member is None or name not in router.index:
                return 0
            slot = router.index.slot(name)
            if self.policy == "cache-aware":
                router.held.release(request.request_id)
                predicted = router.commit(slot, request.keys, request.num_prompt_tokens, now)
            else:
                held = held_prefix(slot, request.keys, [router.index.table])
                bs = router.layout.block_size
                predicted = min(held, cacheable_blocks(request.num_prompt_tokens, bs)) * bs
            if member.layout != router.layout:
                predicted = 0
            member.routed += 1
            member.predicted_tokens += predicted
            self._pending[request.request_id] = (name, predicted)
            while len(self._pending) > _KEEP_DECISIONS:
                self._pending.popitem(last=False)
            return predicted

    def outcome(self, request_id: str, name: str, num_cached_tokens: int) -> None:
        """The engine's `num_cached_tokens` for a request this view routed."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is None or pending[0] != name:
                return
            member = self._members.get(name)
            if member is not None:
                member.actual_tokens += num_cached_tokens
            bs = self.layout.block_size if self.layout is not None else 1
            self.accuracy.add(pending[1], num_cached_tokens, bs)

    def routed_to(self, request_id: str) -> str | None:
        with self._lock:
            pending = self._pending.get(request_id)
            return pending[0] if pending else None

    def holder(self, keys: Sequence[BlockKey]) -> str | None:
        """The compatible replica holding the longest prefix of `keys`, if any holds one."""
        with self._lock:
            router = self.router
            if router is None or not keys:
                return None
            found = prefix_lengths(keys, [router.index.table])
            compatible = {s: n for s, n in found.items()
                          if (name := router.index.name(s)) in self._members
                          and self._members[name].layout == router.layout}
            if not compatible:
                return None
            return router.index.name(max(compatible, key=compatible.__getitem__))

    # --- what /v1/cluster shows ------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        with self._lock:
            router = self.router
            loads = router.loads() if router is not None else None
            replicas = []
            for name, m in sorted(self._members.items()):
                entry: dict[str, Any] = {
                    "name": name, "compatible": router is not None and m.layout == router.layout,
                    "capacity_blocks": m.capacity_blocks, "routed": m.routed,
                    "predicted_cached_tokens": m.predicted_tokens,
                    "actual_cached_tokens": m.actual_tokens, "reports": m.reports,
                    "report_key_bytes": m.report_bytes}
                if router is not None and name in router.index:
                    slot = router.index.slot(name)
                    entry["cached_blocks"] = router.index.num_blocks(name)
                    entry["index_stale"] = router.index.needs_snapshot(name)
                    if loads is not None and slot < loads.num_slots:
                        entry["load"] = {
                            "queued_prefill_tokens": float(loads.queued_prefill_tokens[slot]),
                            "queued_requests": int(loads.queued_requests[slot]),
                            "running_requests": int(loads.running_requests[slot])}
                replicas.append(entry)
            return {"policy": self.policy, "replicas": replicas,
                    "router": {"decisions": self.num_decisions, "guarded": self.num_guarded,
                               "snapshots_applied": self.num_snapshots,
                               "replicas_removed": self.num_removed,
                               "decision_us": _percentiles(self.decision_cpu_ns),
                               "decision_wall_us": _percentiles(self.decision_wall_ns),
                               "report_age_us": _percentiles(self.report_age_ns),
                               "prediction": self.accuracy.as_dict()}}


_VIEWS: dict[tuple[str, str], ClusterView] = {}
_VIEWS_LOCK = threading.Lock()


def register_view(app_name: str, deployment_name: str, view: ClusterView) -> None:
    """The view the routers made afterwards in this process for that deployment will use
    (the ingress registers its own before its handle makes a router)."""
    with _VIEWS_LOCK:
        _VIEWS[(app_name, deployment_name)] = view


def registered_view(app_name: str, deployment_name: str) -> ClusterView | None:
    with _VIEWS_LOCK:
        return _VIEWS.get((app_name, deployment_name))


def _percentiles(values: deque[int]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    arr = np.fromiter(values, dtype=np.float64) / 1e3
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
            "max": float(arr.max())}
