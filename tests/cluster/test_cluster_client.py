"""The ingress over two engine replicas, in process: the HTTP app of `kvstack serve` on a
`ClusterEngine`, replicas called directly and routed by the same view the Ray router uses
(`helpers.cluster_local`). A tiny random-weight Llama with the embedded model's tokenizer keeps
it fast; the real-model, real-Ray version is test_cluster_ray.py.

Checks: affinity and its predicted hits, greedy answers equal to one engine's, tenants, a
replica dying before any output (retried) and mid-stream (an error event in each API's shape),
its prefixes restored from Redis on the survivor, Redis down, cache_control pins reaching the
replica that holds the prefix, /v1/cluster and /metrics, and a view that rebuilds itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from helpers.cluster_local import LocalTransport
from helpers.live_server import free_port
from helpers.redis_server import RedisServer, start_redis
from helpers.tiny_models import make_tiny_chat_folder

from kvstack import LLM, SamplingParams
from kvstack.cluster.client import ClusterEngine
from kvstack.cluster.http import add_cluster_routes
from kvstack.cluster.replica import EngineReplica
from kvstack.cluster.router import request_keys
from kvstack.cluster.view import ClusterView
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.semantic.cache import SemanticCache, SemanticCacheConfig
from kvstack.server.app import create_app
from kvstack.server.auth import Tenant
from kvstack.server.state import ServerConfig
from kvstack.weights import Checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEYS = ["sk-alice", "sk-bob"]
MODEL = "tiny"


class Cluster:
    def __init__(self, folder: Path, redis: RedisServer, tmp: Path) -> None:
        self.folder = folder
        self.redis = redis
        self.llm_kwargs = {"model": str(folder), "kv_cache_memory": "8MiB", "block_size": 16,
                           "kv_redis_url": redis.url, "num_threads": 1, "max_num_seqs": 8}
        self.replicas = {n: EngineReplica(n, self.llm_kwargs) for n in ("r0", "r1")}
        self.view = ClusterView("cache-aware")
        self.transport = LocalTransport(self.replicas, self.view)
        self.loop = asyncio.new_event_loop()
        self.engine = self.run(ClusterEngine.connect(self.transport, self.view,
                                                     stats_period_s=0.2))
        cache = SemanticCache(WordEmbedder(), SemanticCacheConfig(mode="verify",
                                                                  directory=tmp / "semantic"))
        self.semantic = cache
        app = create_app(self.engine, KEYS, ServerConfig(model_name=MODEL),
                         semantic_cache=cache)
        # A real server in this loop: httpx's ASGI transport would buffer whole streams.
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(add_cluster_routes(app), host="127.0.0.1",
                                                    port=port, log_level="warning"))
        self.serving = self.loop.create_task(self.server.serve())
        self.run(self._started())
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self.reference = LLM(str(folder), kv_cache_memory="8MiB", num_threads=1)

    async def _started(self) -> None:
        while not self.server.started:
            await asyncio.sleep(0.05)

    def run(self, work: Any) -> Any:
        return self.loop.run_until_complete(work)

    def post(self, path: str, body: dict[str, Any], key: str = KEYS[0]) -> httpx.Response:
        return self.run(self.http.post(path, json=body, headers=_auth(key)))

    def get(self, path: str, key: str = KEYS[0]) -> httpx.Response:
        return self.run(self.http.get(path, headers=_auth(key)))

    def complete(self, prompt: str, key: str = KEYS[0], max_tokens: int = 8,
                 **extra: Any) -> dict[str, Any]:
        r = self.post("/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0,
                                          "max_tokens": max_tokens, **extra}, key)
        assert r.status_code == 200, r.text
        return r.json()

    def replace(self, name: str) -> None:
        """Serve's part after a kill: a fresh replica under the same name. The killed one's
        process would be gone; here its engine (and tier writer thread) is closed."""
        self.replicas[name].shutdown()
        self.replicas[name] = EngineReplica(name, self.llm_kwargs)
        self.transport.live.add(name)
        self.transport._dead.pop(name, None)

    def settle(self) -> None:
        """Let the view's upkeep (snapshots, stats) run, and the tiers finish writing."""
        for replica in self.replicas.values():
            replica.engine.engine.flush_tiers(10)
        self.transport.poll()
        self.run(self.engine.heal())
        self.run(self.engine.refresh_stats())

    def close(self) -> None:
        self.run(self.http.aclose())
        self.server.should_exit = True
        self.run(self.serving)
        upkeep = list(self.engine._tasks)
        self.engine.shutdown()
        self.run(asyncio.gather(*upkeep, return_exceptions=True))
        self.loop.close()
        for replica in self.replicas.values():
            replica.shutdown()
        self.semantic.close()
        self.reference.close()


class WordEmbedder:
    """Bag of words hashed into 64 dimensions: equal texts get equal vectors."""

    name = "test-words"
    dim = 64

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, hash(word) % self.dim] += 1.0
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-6)
        return out


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def document(tag: str, words: int = 60) -> str:
    return " ".join(f"{tag}{i % 7} alpha{i % 11} beta{i % 5}" for i in range(words))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            embedded_checkpoint: Checkpoint) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    redis = start_redis(tmp)
    folder = make_tiny_chat_folder(tmp, load_tokenizer(embedded_checkpoint))
    made = Cluster(folder, redis, tmp)
    yield made
    made.close()
    redis.stop()


def test_follow_ups_go_to_the_replica_holding_the_document(cluster: Cluster) -> None:
    doc = document("aff")
    first = cluster.complete(doc + " Question one?")
    home = cluster.transport.routed[-1]
    cached = []
    for question in ("Question two?", "Question three?", "And four?"):
        cached.append(cluster.complete(doc + " " + question)["usage"]["prompt_tokens_details"]
                      ["cached_tokens"])
        assert cluster.transport.routed[-1] == home
    prefix = first["usage"]["prompt_tokens"] - 8
    assert all(c >= prefix - 16 for c in cached), (cached, prefix)
    prediction = cluster.get("/v1/cluster").json()["router"]["prediction"]
    assert prediction["requests"] >= 4 and prediction["exact_fraction"] >= 0.75
    for replica in cluster.replicas.values():
        replica.engine.engine.check_integrity()


def test_greedy_answers_equal_one_engines(cluster: Cluster) -> None:
    prompts = [document("eq") + " first", document("eq") + " second", "Short and unique."]
    for prompt in prompts:
        got = cluster.complete(prompt, max_tokens=12)["choices"][0]["text"]
        want = cluster.reference.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
        assert got == want[0].outputs[0].text


def test_tenants_never_share_or_steer_by_each_others_blocks(cluster: Cluster) -> None:
    doc = document("tenant")
    cluster.complete(doc + " a?", key=KEYS[0])
    again = cluster.complete(doc + " b?", key=KEYS[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    before = cluster.view.accuracy.predicted_tokens
    other = cluster.complete(doc + " b?", key=KEYS[1])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cluster.view.accuracy.predicted_tokens == before  # predicted nothing for bob


def test_a_replica_dying_before_any_output_is_retried_elsewhere(cluster: Cluster) -> None:
    doc = document("retry")
    cluster.complete(doc + " warm?")
    home = cluster.transport.routed[-1]
    original = cluster.replicas[home].generate

    async def dies_at_once(request: Any) -> Any:
        yield home
        cluster.transport.kill(home)
        await asyncio.sleep(3600)
        yield None

    cluster.replicas[home].generate = dies_at_once  # type: ignore[method-assign]
    retries = cluster.engine.num_retries
    got = cluster.complete(doc + " again?", max_tokens=10)
    want = cluster.reference.generate(doc + " again?", SamplingParams(temperature=0,
                                                                      max_tokens=10))
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert cluster.engine.num_retries == retries + 1
    assert cluster.transport.routed[-2:] == [home, _other(home)]
    cluster.replicas[home].generate = original  # type: ignore[method-assign]
    cluster.replace(home)


def _other(name: str) -> str:
    return {"r0": "r1", "r1": "r0"}[name]


async def _stream_until_killed(cluster: Cluster, path: str, body: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    async with cluster.http.stream("POST", path, json=body, headers=_auth(KEYS[0])) as r:
        assert r.status_code == 200
        killed = False
        async for line in r.aiter_lines():
            lines.append(line)
            if not killed and line.startswith("data:") and len(lines) > 6:
                cluster.transport.kill(cluster.transport.routed[-1])
                killed = True
    return lines


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_replica_dying_mid_stream_ends_it_with_an_error_event(cluster: Cluster,
                                                                api: str) -> None:
    common = {"model": MODEL, "stream": True, "max_tokens": 1500, "ignore_eos": True,
              "temperature": 0}
    if api == "openai":
        lines = cluster.run(asyncio.wait_for(_stream_until_killed(
            cluster, "/v1/completions", {**common, "prompt": "Tell a long story."}), 60))
        events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
        assert "error" in events[-1] and lines[-2:] == ["data: [DONE]", ""]
    else:
        lines = cluster.run(asyncio.wait_for(_stream_until_killed(
            cluster, "/v1/messages", {**common, "messages": [{"role": "user", "content":
                                                              "Tell a long story."}]}), 60))
        assert "event: error" in lines
        error = json.loads(lines[lines.index("event: error") + 1][5:])
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"  # 503
    assert cluster.engine.num_lost_streams >= 1
    cluster.replace(cluster.transport.routed[-1])


def test_a_dead_replicas_prefixes_come_back_from_redis(cluster: Cluster) -> None:
    doc = document("redis", 80)
    first = cluster.complete(doc + " one?")
    home = cluster.transport.routed[-1]
    cluster.settle()  # its blocks are written through to Redis
    cluster.transport.kill(home)
    got = cluster.complete(doc + " two?")
    assert cluster.transport.routed[-1] == _other(home)
    prefix = first["usage"]["prompt_tokens"] - 8
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= prefix - 16
    cluster.settle()
    survivor = cluster.get("/v1/cluster").json()["replicas"]
    assert [r["engine"]["hit_tokens"]["redis"] for r in survivor] >= [prefix - 16]
    cluster.replace(home)


def test_requests_succeed_with_redis_down(cluster: Cluster) -> None:
    cluster.redis.stop()
    try:
        got = cluster.complete(document("down") + " still?")
        assert got["choices"][0]["finish_reason"] == "length"
    finally:
        cluster.redis.start()


def test_cache_control_pins_reach_the_replica_holding_the_prefix(cluster: Cluster) -> None:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "system": [{"type": "text", "text": document("pin", 80),
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi?"}]}
    r = cluster.post("/v1/messages", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_creation_input_tokens"] > 0
    home = cluster.transport.routed[-1]
    cluster.settle()
    pinned = {n: s.num_blocks_pinned for n, s in cluster.engine.replica_stats().items()}
    assert pinned[home] > 0 and pinned[_other(home)] == 0


def test_cluster_json_and_metrics_name_each_replica(cluster: Cluster) -> None:
    cluster.complete(document("json") + " x?")
    cluster.settle()
    body = cluster.get("/v1/cluster").json()
    assert body["object"] == "cluster" and body["policy"] == "cache-aware"
    assert {r["name"] for r in body["replicas"]} == {"r0", "r1"}
    assert set(body["hit_tokens"]) == {"memory", "disk", "redis", "computed"}
    assert all("load" in r and "cached_blocks" in r for r in body["replicas"])
    metrics = cluster.run(cluster.http.get("/metrics")).text
    assert 'kvstack_kv_blocks_total{replica="r0"}' in metrics
    assert 'kvstack_prefix_cache_hits_total{replica="r1"}' in metrics
    assert cluster.get("/v1/cluster", key="wrong").status_code == 401


def test_a_view_that_missed_reports_rebuilds_from_snapshots(cluster: Cluster) -> None:
    doc = document("heal", 80)
    cluster.complete(doc + " one?")
    home = cluster.transport.routed[-1]
    cluster.transport.publish = False  # replicas publish, but their reports are lost
    for i in range(40):  # more batches on each replica than a report repeats
        cluster.complete(document(f"noise{i}", 40) + " ?")
        cluster.transport.poll()
    cluster.transport.publish = True
    fresh = ClusterView("cache-aware", cluster.view.layout)
    cluster.engine.view = cluster.transport.view = fresh  # a restarted ingress: empty view
    cluster.transport.poll()
    assert fresh.needs_snapshot()
    cluster.run(cluster.engine.heal())
    assert fresh.needs_snapshot() == []
    assert fresh.holder(_keys(cluster, doc + " two?")) == home
    cluster.complete(doc + " two?")
    assert cluster.transport.routed[-1] == home


def _keys(cluster: Cluster, prompt: str) -> list[int]:
    ids = cluster.engine.tokenizer.encode(prompt)
    return request_keys(ids, cluster.engine.layout, Tenant(KEYS[0]).cache_salt(None))


def test_semantic_cache_verify_mode_sends_its_draft_through_the_cluster(
        cluster: Cluster) -> None:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is a replica?"}]}
    first = cluster.post("/v1/chat/completions", body)
    hit = cluster.post("/v1/chat/completions", body)
    assert hit.headers["x-kvstack-semantic-cache"] == "hit"
    usage = hit.json()["usage"]["semantic_cache"]
    assert usage["draft_tokens"] > 0 and usage["accepted_tokens"] == usage["draft_tokens"]
    assert (hit.json()["choices"][0]["message"]["content"] ==
            first.json()["choices"][0]["message"]["content"])
