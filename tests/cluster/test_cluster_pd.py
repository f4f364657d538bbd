"""Prefill/decode disaggregation in process: one prefill and one decode replica called
directly (`helpers.cluster_local`), the HTTP app of `kvstack serve` on a `PDClusterEngine`,
blocks handed over through a `LocalCourier`. A tiny random-weight Llama with the embedded
model's tokenizer keeps it fast; the real-Ray version is test_cluster_pd_ray.py.

Checks: greedy answers equal one engine's through both APIs, streaming, with the prompt's
blocks restored on the decode side (a prefix hit there) and counted in /v1/cluster and
/metrics; several samples served whole; int8 KV; corrupted and late handoffs recomputed
(counted, still exact); the decode replica dying mid-stream (an error event in each API's
shape); leases released on acknowledgement or timeout; both pools' integrity after each case.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from helpers.cluster_local import LocalTransport
from helpers.live_server import free_port
from helpers.tiny_gemma3 import make_tiny_gemma3_folder
from helpers.tiny_models import make_tiny_chat_folder

from kvstack import LLM, SamplingParams
from kvstack.cluster.http import add_cluster_routes
from kvstack.cluster.pd.handoff import Leases, LocalCourier
from kvstack.cluster.pd.ingress import PDClusterEngine
from kvstack.cluster.pd.metrics import add_handoff_metrics
from kvstack.cluster.pd.replicas import DecodeReplica, PrefillReplica
from kvstack.cluster.view import ClusterView
from kvstack.engine.chat import chat_token_ids
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.kv.groups import KVLayout
from kvstack.outputs import RequestOutput
from kvstack.server.app import create_app
from kvstack.server.state import ServerConfig
from kvstack.weights import Checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-alice"
MODEL = "tiny"
AUTH = {"authorization": f"Bearer {KEY}"}


class PDCluster:
    def __init__(self, folder: Path, decode_llm: dict[str, Any] | None = None,
                 **llm: Any) -> None:
        self.llm_kwargs = {"model": str(folder), "kv_cache_memory": "8MiB", "block_size": 16,
                           "num_threads": 1, "max_num_seqs": 8, **llm}
        self.courier = LocalCourier()
        self.leases = Leases(on_end=self.courier.drop)
        self.prefill = {"p0": PrefillReplica("p0", self.llm_kwargs, self.courier, self.leases)}
        self.decode = {"d0": DecodeReplica("d0", {**self.llm_kwargs, **(decode_llm or {})},
                                           self.courier, fetch_timeout_s=1.0)}
        self.view = ClusterView("pow2")
        self.prefill_view = ClusterView("cache-aware")
        self.transport = LocalTransport(dict(self.decode), self.view)
        self.prefill_transport = LocalTransport(dict(self.prefill), self.prefill_view)
        self.loop = asyncio.new_event_loop()
        self.engine: PDClusterEngine = self.run(PDClusterEngine.connect(
            self.transport, self.view, prefill=self.prefill_transport,
            prefill_view=self.prefill_view, stats_period_s=0.2))
        app = create_app(self.engine, [KEY], ServerConfig(model_name=MODEL))
        add_handoff_metrics(app, self.engine.handoffs)
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(add_cluster_routes(app), host="127.0.0.1",
                                                    port=port, log_level="warning"))
        self.serving = self.loop.create_task(self.server.serve())
        self.run(self._started())
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self.reference = LLM(**{k: v for k, v in self.llm_kwargs.items() if k != "max_num_seqs"})

    async def _started(self) -> None:
        while not self.server.started:
            await asyncio.sleep(0.05)

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.run(self.http.post(path, json=body, headers=AUTH))

    def stream(self, path: str, body: dict[str, Any]) -> list[str]:
        async def lines() -> list[str]:
            async with self.http.stream("POST", path, json={**body, "stream": True},
                                        headers=AUTH) as r:
                assert r.status_code == 200
                return [line async for line in r.aiter_lines()]

        return self.run(asyncio.wait_for(lines(), 120))

    def handoffs(self) -> dict[str, Any]:
        r = self.run(self.http.get("/v1/cluster", headers=AUTH))
        assert r.status_code == 200, r.text
        return r.json()["handoffs"]

    def want(self, prompt: str | list[int], max_tokens: int, **sp: Any) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **sp)
        given = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        return self.reference.generate(given, params)[0].outputs[0].text

    def settle_and_check(self) -> None:
        """No lease, courier object or inbox block outlives a request; both pools whole."""
        self.run(asyncio.sleep(0.05))  # the acknowledgement is a task of its own
        assert len(self.leases) == 0 and len(self.courier) == 0
        for replica in [*self.prefill.values(), *self.decode.values()]:
            replica.engine.engine.check_integrity()
        assert all(r.tiers.num_inbox_blocks == 0 for r in self.decode.values())

    def close(self) -> None:
        self.run(self.http.aclose())
        self.server.should_exit = True
        self.run(self.serving)
        upkeep = list(self.engine._tasks)
        self.engine.shutdown()
        self.run(asyncio.gather(*upkeep, return_exceptions=True))
        self.loop.close()
        for replica in [*self.prefill.values(), *self.decode.values()]:
            replica.shutdown()
        self.reference.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, embedded_checkpoint: Checkpoint) -> Path:
    return make_tiny_chat_folder(tmp_path_factory.mktemp("pd"),
                                 load_tokenizer(embedded_checkpoint))


@pytest.fixture(scope="module")
def cluster(folder: Path) -> Iterator[PDCluster]:
    made = PDCluster(folder)
    yield made
    made.close()


def document(tag: str, words: int = 60) -> str:
    return " ".join(f"{tag}{i % 7} alpha{i % 11} beta{i % 5}" for i in range(words))


def _text_of_stream(lines: list[str], api: str) -> str:
    events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    if api == "openai":
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return "".join(e["delta"]["text"] for e in events
                   if e.get("type") == "content_block_delta")


def test_greedy_completions_equal_one_engines_with_the_prompt_handed_over(
    cluster: PDCluster,
) -> None:
    prompt = document("eq") + " first"
    before = cluster.handoffs()
    body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                            "temperature": 0, "max_tokens": 12}).json()
    assert body["choices"][0]["text"] == cluster.want(prompt, 12)
    assert body["usage"]["completion_tokens"] == 12
    after = cluster.handoffs()
    assert after["count"] == before["count"] + 1 and after["bytes"] > before["bytes"]
    assert after["num_fallbacks"] == 0
    num_prompt = body["usage"]["prompt_tokens"]
    decode = cluster.decode["d0"].engine.engine.stats()
    # The decode replica computed only the last partial block and the first token.
    assert decode.num_prompt_tokens - decode.prefix_cache_hit_tokens <= 16 + 1
    assert after["blocks"] - before["blocks"] == num_prompt // 16
    cluster.settle_and_check()


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_streams_through_both_apis_equal_one_engines(cluster: PDCluster, api: str) -> None:
    user = document("st") + " stream " + api
    if api == "openai":
        lines = cluster.stream("/v1/completions", {"model": MODEL, "prompt": user,
                                                   "temperature": 0, "max_tokens": 10})
        want = cluster.want(user, 10)
    else:
        messages = [{"role": "user", "content": user}]
        lines = cluster.stream("/v1/messages", {"model": MODEL, "messages": messages,
                                                "temperature": 0, "max_tokens": 10})
        ids = chat_token_ids(cluster.reference.get_tokenizer(), messages)
        want = cluster.want(ids, 10)
    assert _text_of_stream(lines, api) == want
    assert cluster.handoffs()["num_fallbacks"] == 0
    cluster.settle_and_check()


def test_chat_completions_equal_one_engines(cluster: PDCluster) -> None:
    messages = [{"role": "system", "content": document("sys", 30)},
                {"role": "user", "content": "Say something."}]
    body = cluster.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                 "temperature": 0, "max_tokens": 9}).json()
    ids = chat_token_ids(cluster.reference.get_tokenizer(), messages)
    assert body["choices"][0]["message"]["content"] == cluster.want(ids, 9)
    cluster.settle_and_check()


def test_several_samples_are_served_whole_by_a_decode_replica(cluster: PDCluster) -> None:
    prompt = document("n2") + " samples"
    before = cluster.handoffs()
    body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt, "n": 2,
                                            "temperature": 0, "max_tokens": 8}).json()
    want = cluster.reference.generate(prompt, SamplingParams(n=2, temperature=0,
                                                             max_tokens=8))[0]
    assert [c["text"] for c in body["choices"]] == [o.text for o in want.outputs]
    after = cluster.handoffs()
    assert after["whole_requests"] == before["whole_requests"] + 1
    assert after["count"] == before["count"]
    cluster.settle_and_check()


def test_short_prompts_prefill_on_the_decode_replica_with_max_local_prefill(
    cluster: PDCluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = list(cluster.reference.get_tokenizer().encode(document("loc")))
    limit = 40
    monkeypatch.setattr(cluster.engine, "max_local_prefill", limit)

    def complete(prompt: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                "temperature": 0, "max_tokens": 10}).json()
        assert body["choices"][0]["text"] == cluster.want(prompt, 10)
        return body, cluster.handoffs()

    prefilled = cluster.prefill["p0"].engine.engine.stats().num_prompt_tokens
    before = cluster.handoffs()
    _, local = complete(ids[:limit])  # at the limit: prefilled where it decodes
    assert local["local_prefills"] == before["local_prefills"] + 1
    assert local["count"] == before["count"]
    assert cluster.prefill["p0"].engine.engine.stats().num_prompt_tokens == prefilled
    _, remote = complete(ids[:limit + 1])  # one token over: through the prefill replica
    assert remote["count"] == local["count"] + 1
    assert remote["local_prefills"] == local["local_prefills"]
    text = cluster.run(cluster.http.get("/metrics", headers=AUTH)).text
    assert f"kvstack_handoff_local_prefills_total {float(remote['local_prefills'])}" in text
    cluster.settle_and_check()


def test_a_corrupted_handoff_is_recomputed_and_counted(cluster: PDCluster,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_put = cluster.courier.put

    def corrupt(blocks: list[bytes]) -> int:
        flipped = [bytearray(b) for b in blocks]
        flipped[0][-1] ^= 0xFF  # the first block's last payload byte: its crc no longer holds
        return real_put([bytes(b) for b in flipped])

    monkeypatch.setattr(cluster.courier, "put", corrupt)
    prompt = document("bad") + " corrupt"
    before = cluster.handoffs()
    body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                            "temperature": 0, "max_tokens": 8}).json()
    assert body["choices"][0]["text"] == cluster.want(prompt, 8)
    after = cluster.handoffs()
    assert after["fallbacks"].get("corrupt", 0) == before["fallbacks"].get("corrupt", 0) + 1
    faults = cluster.decode["d0"].tiers.stats.faults
    assert faults.get("checksum", 0) >= 1
    cluster.settle_and_check()


def test_a_late_handoff_is_recomputed_and_counted(cluster: PDCluster) -> None:
    cluster.courier.delay_s = 5.0  # the decode replica waits 1 s
    try:
        prompt = document("late") + " late"
        before = cluster.handoffs()
        body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                "temperature": 0, "max_tokens": 8}).json()
    finally:
        cluster.courier.delay_s = 0.0
    assert body["choices"][0]["text"] == cluster.want(prompt, 8)
    after = cluster.handoffs()
    assert after["fallbacks"].get("late", 0) == before["fallbacks"].get("late", 0) + 1
    cluster.settle_and_check()


def test_handoff_counters_are_in_metrics(cluster: PDCluster) -> None:
    cluster.post("/v1/completions", {"model": MODEL, "prompt": document("met") + " m",
                                     "temperature": 0, "max_tokens": 4})
    text = cluster.run(cluster.http.get("/metrics", headers=AUTH)).text
    count = cluster.handoffs()["count"]
    assert f"kvstack_handoffs_total {float(count)}" in text
    assert "kvstack_handoff_bytes_total" in text and 'kind="late"' in text
    body = cluster.run(cluster.http.get("/v1/cluster", headers=AUTH)).json()
    assert body["roles"] == {"prefill": ["p0"], "decode": ["d0"]}


def test_an_unacknowledged_lease_is_freed_by_its_timeout() -> None:
    courier = LocalCourier()
    leases = Leases(ttl_s=5.0, on_end=courier.drop)
    lease = leases.hold("p0", courier.put([b"x"]), now=100.0)
    assert leases.expire(now=104.9) == 0 and len(courier) == 1
    assert leases.expire(now=105.0) == 1 and len(courier) == 0 and len(leases) == 0
    assert not leases.release(lease)  # a late acknowledgement finds nothing, frees nothing
    assert leases.num_expired == 1 and leases.num_released == 0


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_the_decode_replica_dying_mid_stream_ends_it_with_an_error_event(
    cluster: PDCluster, api: str,
) -> None:
    common = {"model": MODEL, "stream": True, "max_tokens": 1500, "ignore_eos": True,
              "temperature": 0}
    if api == "openai":
        body: dict[str, Any] = {**common, "prompt": "Tell a long story."}
        path = "/v1/completions"
    else:
        body = {**common, "messages": [{"role": "user", "content": "Tell a long story."}]}
        path = "/v1/messages"

    async def until_killed() -> list[str]:
        lines: list[str] = []
        async with cluster.http.stream("POST", path, json=body, headers=AUTH) as r:
            assert r.status_code == 200
            killed = False
            async for line in r.aiter_lines():
                lines.append(line)
                if not killed and line.startswith("data:") and len(lines) > 8:
                    cluster.transport.kill("d0")
                    killed = True
        return lines

    lost = cluster.engine.num_lost_streams
    lines = cluster.run(asyncio.wait_for(until_killed(), 60))
    if api == "openai":
        events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
        assert "error" in events[-1] and lines[-2:] == ["data: [DONE]", ""]
    else:
        assert "event: error" in lines
        error = json.loads(lines[lines.index("event: error") + 1][5:])
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert cluster.engine.num_lost_streams == lost + 1
    # Serve's part: a fresh decode replica under the same name.
    cluster.decode["d0"].shutdown()
    cluster.decode["d0"] = DecodeReplica("d0", cluster.llm_kwargs, cluster.courier,
                                         fetch_timeout_s=1.0)
    cluster.transport.replicas["d0"] = cluster.decode["d0"]
    cluster.transport.live.add("d0")
    cluster.transport._dead.pop("d0", None)
    cluster.settle_and_check()
    prompt = document("after") + " revived"
    text = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                            "temperature": 0, "max_tokens": 6}).json()
    assert text["choices"][0]["text"] == cluster.want(prompt, 6)


def test_int8_kv_handoff_equals_one_engine(folder: Path) -> None:
    made = PDCluster(folder, kv_cache_dtype="int8")
    try:
        prompt = document("i8") + " int8"
        body = made.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                             "temperature": 0, "max_tokens": 10}).json()
        assert body["choices"][0]["text"] == made.want(prompt, 10)
        handoffs = made.handoffs()
        assert handoffs["count"] == 1 and handoffs["num_fallbacks"] == 0
        made.settle_and_check()
    finally:
        made.close()


def test_a_prefill_replica_dying_after_the_first_token_is_recomputed_on_decode(
    cluster: PDCluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    replica = cluster.prefill["p0"]
    real = replica.generate

    async def dies_after_first_token(request: Any) -> Any:
        async for item in real(request):
            yield item
            if isinstance(item, RequestOutput):
                cluster.prefill_transport.kill("p0")
                await asyncio.sleep(60)  # gone: the transport raises into the stream

    monkeypatch.setattr(replica, "generate", dies_after_first_token)
    prompt = document("plost") + " prefill lost"
    before = cluster.handoffs()
    try:
        body = cluster.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                "temperature": 0, "max_tokens": 8}).json()
    finally:
        cluster.prefill_transport.live.add("p0")
        cluster.prefill_transport._dead.pop("p0", None)
    assert body["choices"][0]["text"] == cluster.want(prompt, 8)
    after = cluster.handoffs()
    assert after["fallbacks"].get("prefill_lost", 0) == before["fallbacks"].get(
        "prefill_lost", 0) + 1
    assert after["count"] == before["count"]  # nothing was handed over
    cluster.settle_and_check()


def test_gemma3_hands_over_each_window_groups_last_window_only(tmp_path: Path) -> None:
    folder = make_tiny_gemma3_folder(tmp_path)  # window 8: 2 blocks of 16 reach it
    llm = {"model": str(folder), "kv_cache_memory": "4MiB", "block_size": 16, "num_threads": 1}
    courier = LocalCourier()
    leases = Leases(on_end=courier.drop)
    prefill = PrefillReplica("p0", llm, courier, leases)
    decode = DecodeReplica("d0", llm, courier)
    view, prefill_view = ClusterView("pow2"), ClusterView("cache-aware")
    loop = asyncio.new_event_loop()
    reference = LLM(**llm)
    try:
        engine = loop.run_until_complete(PDClusterEngine.connect(
            LocalTransport({"d0": decode}, view), view,
            prefill=LocalTransport({"p0": prefill}, prefill_view), prefill_view=prefill_view))

        async def generate(ids: list[int]) -> list[int]:
            outs = [out async for out in engine.generate(ids, SamplingParams(
                temperature=0, max_tokens=10, ignore_eos=True), "g1")]
            return outs[-1].outputs[0].token_ids

        ids = [(7 * i + 3) % 250 for i in range(100)]  # 6 full blocks
        got = loop.run_until_complete(generate(ids))
        want = reference.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
        assert got == want
        handoffs = engine.handoffs.as_dict()
        groups = KVLayout.of(prefill.engine.info.config.layer_windows(), "float32").groups
        num_window = sum(g.window is not None for g in groups[1:])
        num_full = len(groups) - num_window
        assert handoffs["blocks"] == 6 * num_full + 2 * num_window, (handoffs, groups)
        assert handoffs["num_fallbacks"] == 0
        stats = decode.engine.engine.stats()
        assert stats.num_prompt_tokens - stats.prefix_cache_hit_tokens <= 16 + 1
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


def test_handoffs_hold_under_preemption_on_the_decode_side(folder: Path) -> None:
    # A decode pool of ~32 blocks: three requests of ~14 blocks each cannot run together.
    made = PDCluster(folder, decode_llm={"kv_cache_memory": "256KiB"})
    try:
        tokenizer = made.reference.get_tokenizer()
        prompts = [tokenizer.encode(document(f"pre{i}", 20) + f" preempt {i}") for i in range(3)]
        params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

        async def one(i: int) -> list[int]:
            outs = [o async for o in made.engine.generate(prompts[i], params, f"pre{i}")]
            return outs[-1].outputs[0].token_ids

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(one(i) for i in range(3))))

        got = made.run(together())
        want = [made.reference.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
                .token_ids for ids in prompts]
        assert got == want
        assert made.decode["d0"].engine.engine.stats().num_preemptions > 0
        assert made.engine.handoffs.count == 3
        made.settle_and_check()
    finally:
        made.close()


def test_cache_control_pins_reach_the_prefill_replica_holding_the_prefix(
    cluster: PDCluster,
) -> None:
    ids = cluster.reference.get_tokenizer().encode(document("pin") + " pinned")

    async def serve_then_pin() -> tuple[int, int]:
        async for _ in cluster.engine.generate(ids, SamplingParams(temperature=0, max_tokens=4),
                                               "pin1"):
            pass
        cluster.prefill_transport.poll()  # the prefill replica's report of the new blocks
        return await cluster.engine.pin_prefix(ids, None, 30.0)

    new, _ = cluster.run(serve_then_pin())
    assert new == len(ids) // 16 * 16
    assert cluster.prefill["p0"].engine.engine.stats().num_blocks_pinned == len(ids) // 16
    cluster.settle_and_check()
