"""Compare routing policies on a simulated cluster: hit rate, modelled TTFT, balance, cost.

Each replica has an LRU of KV blocks (`CostModel.kv_blocks`) and serves prefills FIFO at a
rate that drops a little with each running decode; its TTFT is queueing plus its own uncached
prefill. The cost model is deliberately coarse (parameters to be calibrated from `kvstack
bench` figures): it is there to rank routers, not to predict a deployment.

What each policy sees, as it would in Ray Serve:
- cache-aware: the resident-block index and load reports, published every `publish_period_s`
  (0: instantly), plus its own decision record;
- pow2, text-trie, oracle: live ongoing-request counts (Ray probes queue lengths);
- text-trie: in addition, the prompts it routed, unsalted, never forgotten;
- oracle: each prefix group pinned to one replica (LPT on the trace's own group weights).

Run: `kvstack bench cluster --simulate` (bench/cluster_sim.py prints and records the table).
"""

from __future__ import annotations

import heapq
import random
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstack.cluster.events import KEY_BYTES, BlockKey
from kvstack.cluster.index import ResidentIndex
from kvstack.cluster.residency import ResidencyLog
from kvstack.cluster.router import CacheAwareRouter, LoadReport, request_keys
from kvstack.cluster.scoring import (
    Choice,
    Layout,
    ReplicaLoads,
    ScoringConfig,
    cacheable_blocks,
    pin_groups,
    rank_oracle,
    rank_power_of_two,
    rank_round_robin,
)
from kvstack.cluster.text_trie import TextTriePolicy
from kvstack.cluster.trace import Trace, TraceConfig, TraceRequest, make_trace

POLICIES = ("cache-aware", "round-robin", "pow2", "text-trie", "oracle")
ALL_POLICIES = (*POLICIES, "cache-aware-no-record")
LAYOUT = Layout("simulated-model", 16, "float32")


@dataclass(frozen=True)
class CostModel:
    """Per replica. Defaults: the brief's rough 2-thread figures for this machine; calibrate."""

    prefill_tokens_per_s: float = 150.0
    decode_tokens_per_s: float = 10.0  # one sequence alone
    chunk_tokens: int = 512  # prefill tokens per engine step
    kv_blocks: int = 1536  # 1 GiB of float32 KV for the embedded model holds ~1,456 blocks

    def prefill_rate(self, running: int) -> float:
        """Tokens/s of prefill while `running` sequences decode in the same steps.

        A step costs a fixed weight-read time plus its tokens at prefill speed; each step
        carries one token per running sequence besides the prefill chunk.
        """
        fixed = max(1.0 / self.decode_tokens_per_s - 1.0 / self.prefill_tokens_per_s, 0.0)
        step = fixed + (running + self.chunk_tokens) / self.prefill_tokens_per_s
        return self.chunk_tokens / step

    def decode_seconds(self, output_tokens: int, running: int) -> float:
        fixed = max(1.0 / self.decode_tokens_per_s - 1.0 / self.prefill_tokens_per_s, 0.0)
        return output_tokens * (fixed + max(running, 1) / self.prefill_tokens_per_s)


@dataclass
class SimResult:
    policy: str
    replicas: int
    tenants: int
    requests: int
    hit_rate: float  # prompt tokens served from the prefix cache / prompt tokens
    ttft_p50_s: float
    ttft_p99_s: float
    imbalance: float  # busiest replica's prefill seconds / the mean
    decision_us_mean: float  # CPU time per routing decision (index, record, scoring)
    decision_us_p99: float
    guarded: float = 0.0  # fraction of decisions the load guard overrode
    overpredicted: float = 0.0  # predicted hit tokens that did not hit / predicted
    index_blocks_per_replica: float = 0.0  # keys the router's index holds, mean per replica
    index_bytes_per_replica: float = 0.0  # Python memory of that index, per replica
    snapshot_bytes_per_replica: float = 0.0  # one snapshot on the wire
    event_bytes_per_replica_s: float = 0.0  # event batches on the wire, per replica-second
    sim_seconds: float = 0.0  # CPU time of this policy's run


class _Replica:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[BlockKey, None] = OrderedDict()
        self.log = ResidencyLog(epoch="0")
        self.busy_until = 0.0
        self.prefill_seconds = 0.0

    def admit(self, keys: Sequence[BlockKey], num_prompt_tokens: int) -> int:
        """Prefix-hit tokens of a request scheduled now; its blocks become resident.

        Blocks are touched tail first so the head is most recent, as the engine frees them.
        """
        lru = self.lru
        limit = cacheable_blocks(num_prompt_tokens, LAYOUT.block_size)
        hit = 0
        for key in keys[:limit]:
            if key not in lru:
                break
            hit += 1
        stored = []
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                stored.append(key)
        self.log.stored(stored)
        if len(lru) > self.capacity:
            evicted = [lru.popitem(last=False)[0] for _ in range(len(lru) - self.capacity)]
            self.log.removed(evicted)
        return hit * LAYOUT.block_size


@dataclass
class _Cluster:
    """Ground truth per replica slot, and what the policies have been told."""

    replicas: list[_Replica]
    cost: CostModel
    queued_tokens: np.ndarray = field(init=False)
    queued_requests: np.ndarray = field(init=False)
    running: np.ndarray = field(init=False)
    available: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.replicas)
        self.queued_tokens = np.zeros(n)
        self.queued_requests = np.zeros(n, dtype=np.int64)
        self.running = np.zeros(n, dtype=np.int64)
        self.available = np.ones(n, dtype=bool)

    def live_loads(self) -> ReplicaLoads:
        return ReplicaLoads(self.queued_tokens, self.queued_requests, self.running,
                            self.available)


_PREFILL_END, _DECODE_END = 0, 1
_Event = tuple[float, int, int, int, float, int]  # when, seq, kind, slot, tokens, output


class _Sim:
    """One policy's run over a trace: the cluster's ground truth, the event queue, and what
    the policy is told (publications every `publish_period_s`)."""

    def __init__(self, policy: str, trace: Trace, num_replicas: int, cost: CostModel,
                 scoring: ScoringConfig, publish_period_s: float, record_ttl_s: float,
                 seed: int) -> None:
        self.policy = policy
        self.trace = trace
        self.cost = cost
        self.cluster = _Cluster([_Replica(cost.kv_blocks) for _ in range(num_replicas)], cost)
        self.names = [f"r{i}" for i in range(num_replicas)]
        self.router: CacheAwareRouter | None = None
        if policy.startswith("cache-aware"):
            self.router = CacheAwareRouter(LAYOUT, scoring, max_blocks_per_replica=cost.kv_blocks,
                                           record_ttl_s=record_ttl_s,
                                           use_record=policy == "cache-aware")
            for name in self.names:
                self.router.add_replica(name, LAYOUT)
                self.router.index.apply_snapshot(name, self.cluster.replicas[0].log.snapshot())
        self.trie = TextTriePolicy() if policy == "text-trie" else None
        self.assignment = (pin_groups(trace.group_weights, num_replicas) if policy == "oracle"
                           else [])
        self.rng = random.Random(seed)
        self.period = publish_period_s
        self.next_tick = publish_period_s if publish_period_s > 0 else float("inf")
        self.events: list[_Event] = []
        self.seq = 0
        self.dirty: set[int] = set()
        self.event_bytes = 0
        self.hit_tokens = self.prompt_tokens = self.predicted_tokens = 0
        self.over_tokens = self.guarded = 0

    def publish(self, now: float) -> None:
        router, cluster = self.router, self.cluster
        if router is not None:
            for slot in self.dirty:
                batch = cluster.replicas[slot].log.drain()
                if batch is not None:
                    self.event_bytes += batch.num_bytes
                    router.index.apply_events(self.names[slot], batch)
                router.report(self.names[slot], LoadReport(
                    float(cluster.queued_tokens[slot]), int(cluster.queued_requests[slot]),
                    int(cluster.running[slot]), now))
        self.dirty.clear()

    def _handle(self, event: _Event) -> None:
        when, _, kind, slot, tokens, output = event
        cluster = self.cluster
        if kind == _PREFILL_END:
            cluster.queued_tokens[slot] -= tokens
            cluster.queued_requests[slot] -= 1
            cluster.running[slot] += 1
            done = when + self.cost.decode_seconds(output, int(cluster.running[slot]))
            self._push(done, _DECODE_END, slot, 0.0, 0)
        else:
            cluster.running[slot] -= 1
        self.dirty.add(slot)

    def _push(self, when: float, kind: int, slot: int, tokens: float, output: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, slot, tokens, output))

    def advance(self, now: float) -> None:
        """Apply every publication tick and completion up to `now`, in time order."""
        while True:
            head = self.events[0][0] if self.events else float("inf")
            if self.next_tick <= now and self.next_tick <= head:
                self.publish(self.next_tick)
                self.next_tick += self.period
            elif head <= now:
                self._handle(heapq.heappop(self.events))
            else:
                break
        if self.period <= 0:
            self.publish(now)

    def serve(self, request: TraceRequest, slot: int, predicted: int) -> float:
        """Admit `request` on `slot` now; returns its modelled TTFT."""
        now, cluster = request.arrival, self.cluster
        replica = cluster.replicas[slot]
        hit = replica.admit(request.keys, request.num_prompt_tokens)
        if self.router is not None:
            self.predicted_tokens += predicted
            self.over_tokens += max(predicted - hit, 0)
        uncached = request.num_prompt_tokens - hit
        start = max(now, replica.busy_until)
        service = uncached / self.cost.prefill_rate(int(cluster.running[slot]))
        replica.busy_until = start + service
        replica.prefill_seconds += service
        cluster.queued_tokens[slot] += uncached
        cluster.queued_requests[slot] += 1
        self.dirty.add(slot)
        self._push(replica.busy_until, _PREFILL_END, slot, float(uncached), request.output_tokens)
        self.hit_tokens += hit
        self.prompt_tokens += request.num_prompt_tokens
        return replica.busy_until - now

    def run(self) -> SimResult:
        started = time.process_time()
        n = len(self.trace.requests)
        ttft = np.empty(n)
        decision_ns = np.empty(n, dtype=np.int64)
        for i, request in enumerate(self.trace.requests):
            self.advance(request.arrival)
            # CPU time of this thread: the machine is shared, wall time would count other work.
            t0 = time.thread_time_ns()
            choice = _decide(self.policy, request, i, self.cluster, self.router, self.trie,
                             self.assignment, self.rng, request.arrival)
            decision_ns[i] = time.thread_time_ns() - t0
            self.guarded += choice.guarded
            ttft[i] = self.serve(request, choice.slot, choice.cached_tokens)
        result = self._result(ttft, decision_ns)
        result.sim_seconds = time.process_time() - started
        return result

    def _result(self, ttft: np.ndarray, decision_ns: np.ndarray) -> SimResult:
        n, num_replicas = len(ttft), len(self.names)
        busy = np.array([r.prefill_seconds for r in self.cluster.replicas])
        result = SimResult(
            self.policy, num_replicas, 0, n,
            hit_rate=self.hit_tokens / max(self.prompt_tokens, 1),
            ttft_p50_s=float(np.percentile(ttft, 50)),
            ttft_p99_s=float(np.percentile(ttft, 99)),
            imbalance=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            decision_us_mean=float(decision_ns.mean() / 1e3),
            decision_us_p99=float(np.percentile(decision_ns, 99) / 1e3),
            guarded=self.guarded / n,
        )
        router = self.router
        if router is not None:
            horizon = max(self.trace.requests[-1].arrival, 1e-9)
            self.publish(horizon)
            result.overpredicted = self.over_tokens / max(self.predicted_tokens, 1)
            result.index_blocks_per_replica = sum(
                router.index.num_blocks(x) for x in self.names) / num_replicas
            result.index_bytes_per_replica = _index_bytes(self.cluster) / num_replicas
            result.snapshot_bytes_per_replica = KEY_BYTES * result.index_blocks_per_replica
            result.event_bytes_per_replica_s = self.event_bytes / (num_replicas * horizon)
        return result


def _run_policy(policy: str, trace: Trace, num_replicas: int, cost: CostModel,
                scoring: ScoringConfig, publish_period_s: float, record_ttl_s: float,
                seed: int) -> SimResult:
    return _Sim(policy, trace, num_replicas, cost, scoring, publish_period_s, record_ttl_s,
                seed).run()


def _decide(policy: str, request: TraceRequest, turn: int, cluster: _Cluster,
            router: CacheAwareRouter | None, trie: TextTriePolicy | None,
            assignment: list[int], rng: random.Random, now: float) -> Choice:
    if router is not None:
        choice = router.choose(request.keys, request.num_prompt_tokens, now)
        router.commit(choice.slot, request.keys, request.num_prompt_tokens, now)
        return choice
    if policy == "round-robin":
        return rank_round_robin(cluster.live_loads(), turn)
    if policy == "pow2":
        return rank_power_of_two(cluster.live_loads(), rng)
    if trie is not None:
        choice = trie.choose(request.text_keys, request.num_prompt_tokens, LAYOUT.block_size,
                             cluster.live_loads(), turn)
        trie.insert(choice.slot, request.text_keys)
        return choice
    if policy == "oracle":
        return rank_oracle(request.group, assignment, cluster.live_loads(), turn)
    raise ValueError(f"unknown policy {policy!r}; one of {', '.join(ALL_POLICIES)}")


def _index_bytes(cluster: _Cluster) -> int:
    """Python memory of an index holding every replica's final resident set."""
    snapshots = [r.log.snapshot() for r in cluster.replicas]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = ResidentIndex(max(len(s.keys) for s in snapshots) + 1)
        for i, snapshot in enumerate(snapshots):
            index.apply_snapshot(f"r{i}", snapshot)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def simulate(
    num_requests: int = 100_000,
    replicas: Sequence[int] = (16, 64, 256),
    tenants: Sequence[int] = (8,),
    seed: int = 0,
    *,
    policies: Sequence[str] = POLICIES,
    trace: TraceConfig | None = None,
    cost: CostModel | None = None,
    scoring: ScoringConfig | None = None,
    publish_period_s: float = 1.0,
    record_ttl_s: float = 5.0,
    progress: Callable[[SimResult], None] | None = None,
) -> list[SimResult]:
    """Every policy on the same seeded trace, for each (replicas, tenants) pair."""
    for policy in policies:
        if policy not in ALL_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {', '.join(ALL_POLICIES)}")
    trace_config = trace or TraceConfig()
    cost = cost or CostModel()
    scoring = scoring or ScoringConfig()
    results = []
    for num_tenants in tenants:
        for num_replicas in replicas:
            workload = make_trace(num_requests, num_replicas, num_tenants, seed, trace_config,
                                  LAYOUT)
            for policy in policies:
                result = _run_policy(policy, workload, num_replicas, cost, scoring,
                                     publish_period_s, record_ttl_s, seed)
                result.tenants = num_tenants
                results.append(result)
                if progress is not None:
                    progress(result)
    return results


def ingress_hash_us(num_tokens: int = 1100, repeats: int = 50) -> float:
    """Microseconds to compute one prompt's block keys at the ingress (engine hashing)."""
    tokens = list(range(num_tokens))
    t0 = time.perf_counter()
    for _ in range(repeats):
        request_keys(tokens, LAYOUT, "salt")
    return (time.perf_counter() - t0) / repeats * 1e6

