"""The two roles of a disaggregated cluster's replicas, without Ray.

`PrefillReplica.generate` runs the request to its first token (`max_tokens=1`), yields that
output as not finished (unless the first token already ends it), then encodes the prompt's
full blocks from its capture and yields a `Handoff`: the courier's reference, held under a
lease until `release` (the ingress relays the decode side's receipt) or its timeout.

`DecodeReplica.generate` takes a request for prompt + first token carrying that `Handoff`:
it fetches the bytes (a late or lost handoff is a `Receipt` with a fault, and the prompt is
recomputed), checks them into its inbox (a corrupt block is dropped: a fault too), yields the
`Receipt`, then serves the request as any replica does: the prefix match restores them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from kvstack.cluster.pd.handoff import (
    FETCH_TIMEOUT_S,
    Courier,
    Handoff,
    HandoffMiss,
    Leases,
    Receipt,
)
from kvstack.cluster.pd.tiers import HandoffTiers
from kvstack.cluster.replica import EngineReplica
from kvstack.cluster.wire import Control, ReplicaRequest
from kvstack.kv.block_hash import BlockHash, request_block_hashes
from kvstack.kv.group_tables import group_hash
from kvstack.kv.groups import KVLayout
from kvstack.kv.tiers.codec import BlockFormat
from kvstack.outputs import RequestOutput


def _install_tiers(replica: EngineReplica, capture_bytes: int) -> HandoffTiers:
    engine = replica.engine.engine
    info = engine.info
    assert info.kv_shape is not None and engine.kv_storage is not None
    shape = info.kv_shape
    fmt = BlockFormat(info.fingerprint, info.kv_cache_dtype, shape.layers_per_block,
                      shape.num_kv_heads, shape.head_dim, shape.block_size)
    tiers = HandoffTiers(fmt, engine.kv_storage, engine.kv_tiers, capture_bytes)
    engine.set_block_tiers(tiers)
    return tiers


class PrefillReplica(EngineReplica):
    def __init__(self, name: str, llm_kwargs: dict[str, Any], courier: Courier,
                 leases: Leases | None = None, max_waiting: int | None = None) -> None:
        super().__init__(name, llm_kwargs, max_waiting)
        info = self.engine.info
        # A copy of the pool's published blocks: what a handoff can be encoded from.
        self.tiers = _install_tiers(self, capture_bytes=info.kv_cache_bytes)
        self.courier = courier
        self.leases = leases if leases is not None else Leases()
        self.kv_layout = KVLayout.of(info.config.layer_windows(), info.kv_cache_dtype)

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Any]:
        self.leases.expire()
        first = replace(request, sampling_params=replace(request.sampling_params, max_tokens=1))
        last: RequestOutput | None = None
        async for item in super().generate(first):
            if isinstance(item, str):
                yield item
            else:
                last = item
        if last is None:
            return
        out = last.outputs[0]
        if out.finish_reason != "length":  # the first token ended it (EOS, a stop token id)
            yield last
            return
        yield replace(last, finished=False, outputs=[replace(out, finish_reason=None)])
        hashes = self._run_hashes(request)
        blocks = self.tiers.export(hashes)
        num_tokens = len(blocks) * self.layout.block_size
        blocks += self.tiers.export(self._window_hashes(request, len(blocks)), leading=False)
        if blocks and num_tokens:  # a hybrid model's state at the run's end, if it kept one
            blocks += self.tiers.export_snapshot(hashes[num_tokens // self.layout.block_size - 1])
        ref = self.courier.put(blocks)
        lease = self.leases.hold(self.name, ref)
        yield Handoff(lease, self.name, ref, len(blocks), sum(len(b) for b in blocks),
                      num_tokens)

    def _run_hashes(self, request: ReplicaRequest) -> list[BlockHash]:
        """The prompt's full blocks as group 0 (every engine) names them."""
        return request_block_hashes(request.prompt_token_ids, self.layout.block_size,
                                    self.layout.fingerprint, request.cache_salt)

    def _window_hashes(self, request: ReplicaRequest, num_blocks: int) -> list[BlockHash]:
        """A hybrid model's other groups: what a hit of `num_blocks` blocks needs of each
        (a window group: its last window only)."""
        hashes = self._run_hashes(request)[:num_blocks]
        bs = self.layout.block_size
        wanted: list[BlockHash] = []
        for g, group in enumerate(self.kv_layout.groups[1:], start=1):
            reach = group.blocks_reachable(num_blocks * bs, bs)
            wanted += [group_hash(h, g) for h in hashes[num_blocks - reach:]]
        return wanted

    async def release(self, control: Control) -> bool:
        self._check_target(control)
        (lease,) = control.args
        return self.leases.release(lease)

    def routing_stats(self) -> dict[str, Any]:
        self.leases.expire()  # Serve polls this every period: the lease sweep rides on it
        return super().routing_stats()


class DecodeReplica(EngineReplica):
    def __init__(self, name: str, llm_kwargs: dict[str, Any], courier: Courier,
                 max_waiting: int | None = None,
                 fetch_timeout_s: float = FETCH_TIMEOUT_S) -> None:
        super().__init__(name, llm_kwargs, max_waiting)
        self.tiers = _install_tiers(self, capture_bytes=0)
        self.courier = courier
        self.fetch_timeout_s = fetch_timeout_s

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Any]:
        handoff = request.handoff
        rid = request.request_id
        try:
            async for item in super().generate(request):
                yield item
                if isinstance(item, str) and isinstance(handoff, Handoff):
                    # Before the engine sees the request: its prefix match needs the blocks.
                    yield await self._receive(rid, handoff)
                elif isinstance(item, RequestOutput):
                    self.tiers.release(rid)  # admitted: the blocks are in the pool now
        finally:
            self.tiers.release(rid)

    async def _receive(self, request_id: str, handoff: Handoff) -> Receipt:
        start = time.perf_counter()
        try:
            blocks = await self.courier.get(handoff.ref, self.fetch_timeout_s)
        except HandoffMiss as miss:
            return Receipt(handoff.lease, 0, 0, time.perf_counter() - start, miss.kind)
        # The codec's checks (crc over every byte) and the copy, off the event loop.
        accepted = await asyncio.to_thread(self.tiers.receive, request_id, blocks)
        fault = "corrupt" if accepted < len(blocks) else None
        return Receipt(handoff.lease, accepted, sum(len(b) for b in blocks),
                       time.perf_counter() - start, fault)
