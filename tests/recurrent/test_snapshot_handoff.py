"""Prefill/decode disaggregation of a hybrid model (a tiny random Qwen3.5): the prefill
replica hands over the prompt's blocks and the recurrent-state snapshot at their end, so the
decode replica's prefix hit covers the handed-over run and its greedy tokens equal one
engine's; without the snapshot the hit would be 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.cluster_local import LocalTransport
from helpers.tiny_qwen3_5 import make_tiny_qwen3_5_folder

from kvstack import LLM, SamplingParams
from kvstack.cluster.pd.handoff import Leases, LocalCourier
from kvstack.cluster.pd.ingress import PDClusterEngine
from kvstack.cluster.pd.replicas import DecodeReplica, PrefillReplica
from kvstack.cluster.view import ClusterView

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_handoff_carries_the_state_snapshot(tmp_path: Path) -> None:
    folder = make_tiny_qwen3_5_folder(tmp_path)
    llm = {"model": str(folder), "kv_cache_memory": "8MiB", "block_size": 4, "num_threads": 1,
           "max_num_seqs": 4, "state_snapshot_every": 1000}
    courier = LocalCourier()
    leases = Leases(on_end=courier.drop)
    prefill = PrefillReplica("p0", llm, courier, leases)
    decode = DecodeReplica("d0", llm, courier)
    view, prefill_view = ClusterView("pow2"), ClusterView("cache-aware")
    loop = asyncio.new_event_loop()
    reference = LLM(**llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        engine = loop.run_until_complete(PDClusterEngine.connect(
            LocalTransport({"d0": decode}, view), view,
            prefill=LocalTransport({"p0": prefill}, prefill_view), prefill_view=prefill_view))

        async def generate(ids: list[int]) -> list[int]:
            outs = [out async for out in engine.generate(ids, params, "q1")]
            return list(outs[-1].outputs[0].token_ids)

        ids = [(7 * i + 3) % 250 for i in range(42)]  # 10 full blocks and 2 tokens
        got = loop.run_until_complete(generate(ids))
        want = reference.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        assert got == list(want)
        handoffs = engine.handoffs.as_dict()
        assert handoffs["blocks"] == 10 + 1 and handoffs["num_fallbacks"] == 0  # + the state
        stats = decode.engine.engine.stats()
        # the decode side computed the prompt's last 2 tokens and the first token only
        assert stats.prefix_cache_hit_tokens == 40
        assert stats.num_prompt_tokens - stats.prefix_cache_hit_tokens == 3
        loop.run_until_complete(asyncio.sleep(0.05))
        assert len(leases) == 0 and len(courier) == 0 and decode.tiers.num_inbox_blocks == 0
        prefill.engine.engine.check_integrity()
        decode.engine.engine.check_integrity()
        engine.shutdown()
    finally:
        loop.close()
        prefill.shutdown()
        decode.shutdown()
        reference.close()
