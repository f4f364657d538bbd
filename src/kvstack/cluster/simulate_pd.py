"""Prefill/decode disaggregation on simulated clusters: which prefill:decode ratio, what link.

A discrete-event model at the granularity of engine steps, of N replicas two ways, on one
seeded open-loop trace:
- colocated: each replica batches continuously; a step carries one token of every running
  decode plus at most `chunk_tokens` of prefill (chunked prefill, prompts FIFO), so a long
  prompt's chunks slow every decode sharing those steps. Requests go to the least-loaded one.
- disaggregated: P prefill-only replicas (least-loaded pick, FIFO inside) compute the prompt
  and the first token (the TTFT), then hand the KV to the least-loaded of the D = N - P
  decode-only replicas: prompt_tokens * kv_bytes_per_token through the prefill replica's NIC
  and the decode replica's NIC, each serialising its transfers (a queue: where handoffs pile
  up once the network is the bottleneck), plus a fixed latency per handoff.
A step costs fixed_s + (decode rows + prefill tokens) / prefill_tokens_per_s, with fixed_s =
1/decode - 1/prefill (as `CostModel`): one sequence alone decodes at decode_tokens_per_s. A
replica holds at most `max_num_seqs` sequences; the rest wait. Not modelled: KV memory (no
preemption), the prefix cache, a decode replica's admission work, network contention beyond
the two NICs, stragglers. This is a model for ranking ratios and reading off where the handoff
starts to cost; it does not predict a deployment's latencies.

The searches over it (the best ratio, the link bound) are in `simulate_pd_search`; run both
with `kvstack bench cluster --simulate --pd` (bench/cluster_pd_sim.py).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvstack.cluster.simulate import CostModel

# bench cluster --pd's two classes: (prompt tokens low, high), output tokens
CHAT = ((40, 120), 128)
DOC = ((2000, 4000), 16)
MIXES = {"chat-heavy": 0.1, "rag-heavy": 0.5}  # fraction of requests that are documents
RUNNING_REQUEST_TOKENS = 32.0  # a running sequence weighs this in the router's load (scoring)
_STEP, _LANDED = 0, 1


@dataclass(frozen=True)
class PDConfig:
    max_num_seqs: int = 64  # per replica (the engine's default)
    kv_bytes_per_token: float = 46_080.0  # the embedded model, float32 KV
    network_gbit_s: float | None = 10.0  # per NIC; None: infinitely fast
    handoff_latency_s: float = 0.003  # per handoff, besides the bytes
    load: float = 0.7  # offered requests / the colocated cluster's capacity
    requests_per_replica: int = 40


@dataclass(frozen=True)
class Trace:
    mix: str
    rate_per_s: float
    arrival: np.ndarray
    doc: np.ndarray  # bool per request
    prompt: np.ndarray
    output: np.ndarray


@dataclass(frozen=True)
class ClassFigures:
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float


@dataclass(frozen=True)
class PDRun:
    mix: str
    replicas: int
    prefill_replicas: int  # 0: colocated
    network_gbit_s: float | None
    requests: int
    rate_per_s: float
    chat: ClassFigures
    doc: ClassFigures
    throughput_tokens_per_s: float
    doc_ready_p50_s: float  # a document's TTFT + its handoff: when its second token can start
    doc_ready_p99_s: float
    handoff_s_mean: float  # first token -> KV on the decode replica (queue + transfer)
    handoff_wait_s_mean: float  # of which queued behind other transfers
    handoff_queue_max: int  # most handoffs bound for one decode replica at once
    sim_seconds: float


def step_fixed_s(cost: CostModel) -> float:
    return max(1.0 / cost.decode_tokens_per_s - 1.0 / cost.prefill_tokens_per_s, 0.0)


def mean_tokens(doc_fraction: float) -> tuple[float, float]:
    """Mean prompt and output tokens of a request of the mix."""
    prompt = (1 - doc_fraction) * sum(CHAT[0]) / 2 + doc_fraction * sum(DOC[0]) / 2
    return prompt, (1 - doc_fraction) * CHAT[1] + doc_fraction * DOC[1]


def colocated_capacity(cost: CostModel, doc_fraction: float, max_num_seqs: int) -> float:
    """Requests/s one colocated replica sustains on the mix at best: every token at prefill
    speed, plus each output step's fixed time shared by a full batch."""
    prompt, output = mean_tokens(doc_fraction)
    return 1.0 / ((prompt + output) / cost.prefill_tokens_per_s
                  + output * step_fixed_s(cost) / max_num_seqs)


def make_trace(num_requests: int, rate_per_s: float, mix: str, seed: int = 0) -> Trace:
    """Poisson arrivals; each request a chat turn or a document, unique prompts."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests))
    doc = rng.random(num_requests) < MIXES[mix]
    chat_prompt = rng.integers(CHAT[0][0], CHAT[0][1] + 1, num_requests)
    doc_prompt = rng.integers(DOC[0][0], DOC[0][1] + 1, num_requests)
    return Trace(mix, rate_per_s, arrival, doc, np.where(doc, doc_prompt, chat_prompt),
                 np.where(doc, DOC[1], CHAT[1]))


def cluster_trace(cost: CostModel, config: PDConfig, replicas: int, mix: str,
                  num_requests: int | None = None, seed: int = 0) -> Trace:
    """The trace that loads `replicas` colocated replicas at `config.load` of capacity."""
    rate = config.load * replicas * colocated_capacity(cost, MIXES[mix], config.max_num_seqs)
    return make_trace(num_requests or config.requests_per_replica * replicas, rate, mix, seed)


@dataclass
class _Replica:
    role: str  # colocated, prefill or decode
    waiting: deque[int] = field(default_factory=deque)  # not yet holding a sequence slot
    prefills: deque[list[int]] = field(default_factory=deque)  # [request, tokens left], FIFO
    decodes: list[tuple[int, int]] = field(default_factory=list)  # heap: (last step, request)
    active: int = 0  # sequences held (prefilling or decoding)
    steps: int = 0
    busy: bool = False
    finishing: list[int] = field(default_factory=list)  # prompts the running step completes
    inbound: int = 0  # handoffs bound here, not landed yet


class _Sim:
    """One configuration over one trace: replicas, the event heap, per-request times."""

    def __init__(self, trace: Trace, cost: CostModel, config: PDConfig, replicas: int,
                 prefill_replicas: int) -> None:
        if not 0 <= prefill_replicas < replicas:
            raise ValueError(f"prefill replicas must be in 0..{replicas - 1}")
        self.trace, self.cost, self.config = trace, cost, config
        self.p = prefill_replicas
        roles = ["colocated"] * replicas if self.p == 0 else (
            ["prefill"] * self.p + ["decode"] * (replicas - self.p))
        self.replicas = [_Replica(role) for role in roles]
        self.fixed = step_fixed_s(cost)
        self.load = np.zeros(replicas)  # the router's view: queued prefill + running weight
        self.link_free = [0.0] * replicas  # when each NIC is done with its queued transfers
        gbit = config.network_gbit_s
        self.bytes_per_s = math.inf if gbit is None else gbit * 1e9 / 8
        self.prompt, self.output = trace.prompt.tolist(), trace.output.tolist()
        n = len(self.prompt)
        self.first, self.finish = np.full(n, np.nan), np.full(n, np.nan)
        self.ready, self.wire, self.landed = (np.full(n, np.nan) for _ in range(3))
        self.target = [0] * n  # the decode replica a request was handed to
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.queue_max = 0

    def run(self) -> PDRun:
        started = time.process_time()
        arrivals, events, i = self.trace.arrival.tolist(), self.events, 0
        while i < len(arrivals) or events:
            if i < len(arrivals) and (not events or arrivals[i] <= events[0][0]):
                self._arrive(i, arrivals[i])
                i += 1
                continue
            when, _, kind, what = heapq.heappop(events)
            if kind == _STEP:
                self._step_end(what, when)
            else:
                self._land(what, when)
        return _figures(self, time.process_time() - started)

    def _push(self, when: float, kind: int, what: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, what))

    def _arrive(self, req: int, now: float) -> None:
        front = self.p or len(self.replicas)  # prefill replicas, or every colocated one
        slot = int(np.argmin(self.load[:front]))
        self.load[slot] += self.prompt[req] + RUNNING_REQUEST_TOKENS
        self.replicas[slot].waiting.append(req)
        if not self.replicas[slot].busy:
            self._start(slot, now)

    def _start(self, slot: int, now: float) -> None:
        """The replica's next step, from `now`: admit what fits, then one token of every decode
        and up to a chunk of prefill (prompts in turn); nothing to do leaves it idle."""
        rep = self.replicas[slot]
        while rep.waiting and rep.active < self.config.max_num_seqs:
            req = rep.waiting.popleft()
            rep.active += 1
            if rep.role == "decode":  # the first token came with the handoff
                heapq.heappush(rep.decodes, (rep.steps + self.output[req] - 1, req))
            else:
                rep.prefills.append([req, self.prompt[req]])
        tokens, chunk = 0, self.cost.chunk_tokens
        while rep.prefills and tokens < chunk:
            head = rep.prefills[0]
            take = min(head[1], chunk - tokens)
            tokens += take
            head[1] -= take
            if head[1]:
                break
            rep.finishing.append(rep.prefills.popleft()[0])
        rows = len(rep.decodes)
        rep.busy = rows + tokens > 0
        if rep.busy:
            self.load[slot] -= tokens
            self._push(now + self.fixed + (rows + tokens) / self.cost.prefill_tokens_per_s,
                       _STEP, slot)

    def _step_end(self, slot: int, now: float) -> None:
        rep = self.replicas[slot]
        rep.steps += 1
        while rep.decodes and rep.decodes[0][0] <= rep.steps:
            self._done(slot, heapq.heappop(rep.decodes)[1], now)
        for req in rep.finishing:
            self.first[req] = now
            if self.output[req] == 1:
                self._done(slot, req, now)
            elif rep.role == "prefill":
                rep.active -= 1
                self.load[slot] -= RUNNING_REQUEST_TOKENS
                self._hand_off(slot, req, now)
            else:  # it decodes here from the next step on
                heapq.heappush(rep.decodes, (rep.steps + self.output[req] - 1, req))
        rep.finishing.clear()
        self._start(slot, now)

    def _done(self, slot: int, req: int, now: float) -> None:
        self.finish[req] = now
        self.replicas[slot].active -= 1
        self.load[slot] -= 1.0 if self.replicas[slot].role == "decode" else RUNNING_REQUEST_TOKENS

    def _hand_off(self, source: int, req: int, now: float) -> None:
        """To the decode replica with the fewest sequences (held, waiting, inbound), through
        the prefill replica's NIC and the decode replica's, each a FIFO queue."""
        target = self.p + int(np.argmin(self.load[self.p:]))
        self.load[target] += 1.0
        rep = self.replicas[target]
        rep.inbound += 1
        self.queue_max = max(self.queue_max, rep.inbound)
        # Each NIC sends its transfers in turn, at full rate, independently of the other (as
        # packets pipeline through both): the handoff is done when the later one is.
        wire = self.prompt[req] * self.config.kv_bytes_per_token / self.bytes_per_s
        out_done = max(now, self.link_free[source]) + wire
        in_done = max(now, self.link_free[target]) + wire
        self.link_free[source], self.link_free[target] = out_done, in_done
        self.ready[req], self.wire[req], self.target[req] = now, wire, target
        self._push(max(out_done, in_done) + self.config.handoff_latency_s, _LANDED, req)

    def _land(self, req: int, now: float) -> None:
        target = self.target[req]
        self.landed[req] = now
        rep = self.replicas[target]
        rep.inbound -= 1
        rep.waiting.append(req)
        if not rep.busy:
            self._start(target, now)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _class(sim: _Sim, mask: np.ndarray) -> ClassFigures:
    arrival, output = sim.trace.arrival[mask], sim.trace.output[mask]
    ttft = sim.first[mask] - arrival
    many = output > 1
    tpot = (sim.finish[mask][many] - sim.first[mask][many]) / (output[many] - 1)
    return ClassFigures(int(mask.sum()), _pct(ttft, 50), _pct(ttft, 99), _pct(tpot, 50),
                        _pct(tpot, 99))


def _figures(sim: _Sim, sim_seconds: float) -> PDRun:
    trace = sim.trace
    span = float(np.nanmax(sim.finish) - trace.arrival[0])
    handed = ~np.isnan(sim.landed)
    ready = (np.where(handed, sim.landed, sim.first) - trace.arrival)[trace.doc]
    handoff = (sim.landed - sim.ready)[handed]
    wait = handoff - sim.wire[handed] - sim.config.handoff_latency_s
    return PDRun(
        trace.mix, len(sim.replicas), sim.p, sim.config.network_gbit_s, len(trace.arrival),
        trace.rate_per_s, _class(sim, ~trace.doc), _class(sim, trace.doc),
        throughput_tokens_per_s=float(trace.output.sum()) / max(span, 1e-9),
        doc_ready_p50_s=_pct(ready, 50), doc_ready_p99_s=_pct(ready, 99),
        handoff_s_mean=float(handoff.mean()) if handed.any() else 0.0,
        handoff_wait_s_mean=max(float(wait.mean()), 0.0) if handed.any() else 0.0,
        handoff_queue_max=sim.queue_max, sim_seconds=sim_seconds)


def simulate_pd(trace: Trace, cost: CostModel, config: PDConfig, replicas: int,
                prefill_replicas: int) -> PDRun:
    """Play `trace` on `replicas` replicas, `prefill_replicas` of them prefill-only (0:
    colocated)."""
    return _Sim(trace, cost, config, replicas, prefill_replicas).run()
