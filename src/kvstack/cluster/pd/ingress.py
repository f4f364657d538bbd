"""`PDClusterEngine`: the ingress of a disaggregated cluster, over a prefill and a decode pool.

A request that can be handed over (`handoff_safe`) runs in two legs:
1. the prefill pool (routed by the cache-aware scorer: cached prefix vs load) computes the
   prompt and the first token, which streams to the client at once, then yields a `Handoff`;
   a prefill replica dying before any output is retried once on another one;
2. the decode pool (routed by load) gets prompt + first token with the handoff; its `Receipt`
   is counted and relayed to the prefill replica as the lease's acknowledgement; its outputs
   are merged behind the first token (ids, text, finish) and stream on. A decode replica
   dying ends the stream with `ReplicaLostError` (the API's error event): a token was sent.
A prefill replica dying after the first token leaves no handoff: the decode side recomputes
the prompt (counted). Any other request (several samples, penalties, stop strings, ...) is
served whole by the decode pool, as a colocated cluster serves it.

With `max_local_prefill` N > 0, a prompt of at most N tokens is prefilled where it decodes
(NVIDIA Dynamo's conditional disaggregation): a short prompt costs a decode replica's step
little, while on the prefill pool it would queue behind long documents' prefills and its
handoff would cost more than computing it (counted as `local_prefills`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvstack.blend.params import BlendSpec
from kvstack.cluster.client import ClusterEngine, Transport
from kvstack.cluster.pd.handoff import Handoff, HandoffCounters, Receipt, handoff_safe
from kvstack.cluster.router import request_keys
from kvstack.cluster.stats import sum_stats
from kvstack.cluster.view import ClusterView
from kvstack.cluster.wire import Control, ReplicaGoneError, ReplicaLostError, ReplicaRequest
from kvstack.engine.stats import EngineStats
from kvstack.errors import KvstackError
from kvstack.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvstack.sampling_params import SamplingParams

logger = logging.getLogger("kvstack.cluster")


@dataclass
class _Leg:
    """The first leg's result as the second needs it."""

    first: RequestOutput | None = None
    handoff: Handoff | None = None
    prefill_lost: bool = False
    receipt: Receipt | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))


class PDClusterEngine(ClusterEngine):
    def __init__(self, transport: Transport, view: ClusterView, info: Any, *,
                 prefill: Transport, prefill_view: ClusterView, max_local_prefill: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(transport, view, info, **kwargs)
        self.prefill = prefill
        self.max_local_prefill = max_local_prefill
        self.prefill_view = prefill_view
        prefill_view.set_layout(info.layout)
        self.handoffs = HandoffCounters()
        self._prefill_stats: dict[str, EngineStats] = {}
        self._acks: set[asyncio.Task[Any]] = set()

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams,
                       request_id: str, cache_salt: str | None = None,
                       draft_token_ids: Sequence[int] | None = None,
                       blend: BlendSpec | None = None, snapshot_at: Sequence[int] = ()
                       ) -> AsyncIterator[RequestOutput]:
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        whole = blend is not None or not handoff_safe(sampling_params, draft_token_ids)
        local = not whole and len(ids) <= self.max_local_prefill
        if whole or local:
            if whole:
                self.handoffs.whole += 1
            else:
                self.handoffs.local += 1
            async for out in super().generate(ids, sampling_params, request_id, cache_salt,
                                              draft_token_ids, blend, snapshot_at):
                yield out
            return
        request = ReplicaRequest(request_id, ids, sampling_params, cache_salt,
                                 tuple(request_keys(ids, self.layout, cache_salt)),
                                 snapshot_at=tuple(snapshot_at))
        leg = _Leg()
        async for out in self._prefill_leg(request, leg):
            yield out
        if leg.first is None or leg.first.finished:
            return
        async for out in self._decode_leg(request, leg):
            yield out

    async def _prefill_leg(self, request: ReplicaRequest,
                           leg: _Leg) -> AsyncIterator[RequestOutput]:
        for attempt in (0, 1):
            replica: str | None = None
            try:
                async for item in self.prefill.stream(request):
                    if isinstance(item, str):
                        replica = item
                    elif isinstance(item, Handoff):
                        leg.handoff = item
                    elif leg.first is None:
                        leg.first = item
                        self.prefill_view.outcome(request.request_id, replica or "",
                                                  item.num_cached_tokens)
                        yield self._output(leg, item, request.prompt_token_ids)
                return
            except ReplicaGoneError as err:
                if leg.first is not None:  # a token went out: decode recomputes the prompt
                    leg.prefill_lost = True
                    self.handoffs.fallback("prefill_lost")
                    return
                if attempt:
                    self.num_lost_streams += 1
                    raise ReplicaLostError("prefill replicas died while serving this "
                                           "request; retry it") from err
                self.num_retries += 1
                lost = replica or err.replica
                logger.warning("prefill replica %s died before answering %s; retrying",
                               lost, request.request_id)
                request = replace(request, exclude=(lost,) if lost else ())

    async def _decode_leg(self, request: ReplicaRequest,
                          leg: _Leg) -> AsyncIterator[RequestOutput]:
        assert leg.first is not None
        first_ids = leg.first.outputs[0].token_ids
        ids = request.prompt_token_ids + first_ids
        sp = request.sampling_params
        rest = replace(sp, max_tokens=None if sp.max_tokens is None else sp.max_tokens - 1)
        decode = ReplicaRequest(request.request_id, ids, rest, request.cache_salt,
                                tuple(request_keys(ids, self.layout, request.cache_salt)),
                                handoff=leg.handoff)
        acked = False
        replica: str | None = None
        try:
            async for item in self.transport.stream(decode):
                if isinstance(item, str):
                    replica = item
                elif isinstance(item, Receipt) and leg.handoff is not None:
                    self.handoffs.add(leg.handoff, item)
                    leg.receipt = item
                    acked = True
                    self._release(leg.handoff)
                elif isinstance(item, RequestOutput):
                    if replica is not None:  # the first output: the decode side's hit
                        self.view.outcome(request.request_id, replica, item.num_cached_tokens)
                        self._check_hit(leg, item)
                        replica = None
                    yield self._output(leg, self._merged(leg.first, item),
                                       request.prompt_token_ids)
        except ReplicaGoneError as err:
            self.num_lost_streams += 1
            raise ReplicaLostError("the decode replica died while serving this request; "
                                   "retry it") from err
        finally:
            if leg.handoff is not None and not acked:
                self._release(leg.handoff)

    def _check_hit(self, leg: _Leg, out: RequestOutput) -> None:
        """A handoff the decode side could not use in full was recomputed: a fallback."""
        if leg.handoff is None:
            if not leg.prefill_lost:  # (counted when the prefill replica was lost)
                self.handoffs.fallback("no_handoff")
            return
        faulty = leg.receipt is None or leg.receipt.fault is not None  # counted with it
        if not faulty and out.num_cached_tokens < leg.handoff.num_tokens:
            self.handoffs.fallback("recomputed")

    @staticmethod
    def _merged(first: RequestOutput, out: RequestOutput) -> RequestOutput:
        """The decode leg's cumulative output behind the prefill leg's first token."""
        a, b = first.outputs[0], out.outputs[0]
        merged = CompletionOutput(0, a.text + b.text, a.token_ids + b.token_ids,
                                  finish_reason=b.finish_reason, stop_reason=b.stop_reason)
        # The client's cached tokens are the prefill replica's prefix hit, as one engine's.
        return replace(out, outputs=[merged], num_cached_tokens=first.num_cached_tokens)

    @staticmethod
    def _output(leg: _Leg, out: RequestOutput, ids: list[int]) -> RequestOutput:
        """`out` with the prompt and timings as the ingress saw them (replicas' clocks
        differ): first token, each new token's gap, the finish."""
        m = leg.metrics
        now = time.perf_counter()
        if m.first_token_time is None:
            m.first_token_time = now
        elif m.last_token_time is not None:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        if out.finished:
            m.finished_time = now
        return replace(out, prompt_token_ids=ids, metrics=replace(
            m, inter_token_latencies=list(m.inter_token_latencies)))

    def _release(self, handoff: Handoff) -> None:
        """End the prefill replica's lease (best effort: its timeout frees it otherwise)."""
        task = asyncio.ensure_future(self._call_prefill("release", Control(
            handoff.replica, (handoff.lease,))))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _call_prefill(self, method: str, control: Control) -> Any:
        with contextlib.suppress(ReplicaGoneError, KvstackError, TimeoutError):
            return await asyncio.wait_for(self.prefill.call(method, control),
                                          self.call_timeout_s)
        return None

    async def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None,
                         ttl_s: float) -> tuple[int, int]:
        """Pins go to the prefill replica holding the prefix: where a later hit saves work."""
        keys = request_keys(list(token_ids), self.layout, cache_salt)
        target = self.prefill_view.holder(keys)
        if target is None:
            return 0, 0
        pinned = await self._call_prefill("pin_prefix", Control(target, (list(token_ids),
                                                                         cache_salt, ttl_s)))
        return pinned if pinned is not None else (0, 0)

    # --- upkeep over both pools ------------------------------------------------------------

    async def heal(self) -> None:
        await super().heal()
        for name in self.prefill_view.needs_snapshot():
            snapshot = await self._call_prefill("snapshot", Control(name))
            if snapshot is not None:
                self.prefill_view.apply_snapshot(name, snapshot)
                self.num_snapshot_fetches += 1

    async def refresh_stats(self) -> None:
        await super().refresh_stats()
        names = self.prefill_view.replicas
        results = await asyncio.gather(*(self._call_prefill("stats", Control(n))
                                         for n in names))
        self._prefill_stats = {n: r for n, r in zip(names, results, strict=True)
                               if isinstance(r, EngineStats)}

    def replica_stats(self) -> dict[str, EngineStats]:
        return {**super().replica_stats(), **self._prefill_stats}

    def stats(self) -> EngineStats:
        return sum_stats(list(self.replica_stats().values()))

    def describe_cluster(self) -> dict[str, Any]:
        body = super().describe_cluster()
        prefill = self.prefill_view.summary()
        body["roles"] = {"prefill": [r["name"] for r in prefill["replicas"]],
                         "decode": [r["name"] for r in body["replicas"]]}
        body["prefill"] = prefill
        body["handoffs"] = self.handoffs.as_dict()
        return body
