"""A real 2-replica cluster on Ray Serve, in this process: the embedded model, one thread per
replica, Redis on a free port, Ray on its own temp dir and ports (never `ray start`/`ray stop`).

One cluster for the module (starting Ray and loading two models takes minutes on a loaded
2-core machine). Checks what only the real thing shows: Ray's router sees the replicas' stats
and sends follow-ups to the replica holding their document; greedy answers equal one engine's;
tenants; a replica killed with streams in flight (each ends with an error event in its API's
shape, a request that had no output yet is retried on the survivor and gets its prefix back
from Redis, Serve brings a replacement up); Redis down; a fresh router rebuilding its view.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from helpers.redis_server import RedisServer, start_redis
from ray import serve

from kvstack import LLM, SamplingParams
from kvstack.cluster.client import ClusterEngine
from kvstack.cluster.deployments import ENGINE, ClusterSpec, build_app
from kvstack.cluster.launch import RayInstance, deploy, free_port, start_http
from kvstack.cluster.ray_transport import HandleTransport
from kvstack.cluster.router import request_keys
from kvstack.cluster.view import ClusterView, register_view
from kvstack.engine.chat import chat_token_ids
from kvstack.server.auth import Tenant

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray on pydantic 2

MODEL = "smollm2-135m"
KEYS = ("sk-alice", "sk-bob")
APP = "kvstack-test"


class RayCluster:
    def __init__(self, tmp: Path) -> None:
        self._reference: LLM | None = None
        self.redis: RedisServer = start_redis(tmp)
        self.ray = RayInstance(num_cpus=2, log_to_driver=False).__enter__()
        try:
            port = free_port()
            start_http("127.0.0.1", port)
            self.url = f"http://127.0.0.1:{port}"
            spec = ClusterSpec(2, {"model": MODEL, "kv_cache_memory": "64MiB",
                                   "kv_redis_url": self.redis.url}, replica_threads=1,
                               max_num_seqs=4, api_keys=KEYS, app_name=APP,
                               health_check_period_s=1.0)
            deploy(build_app(spec), APP, self.url)
        except BaseException:
            self.close()
            raise
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def reference(self) -> LLM:
        """One engine on its own, as the replicas run it (1 thread), for the greedy check."""
        if self._reference is None:
            self._reference = LLM(MODEL, kv_cache_memory="64MiB", num_threads=1)
        return self._reference

    def cluster(self) -> dict[str, Any]:
        r = self.http.get("/v1/cluster", headers=auth(KEYS[0]))
        assert r.status_code == 200, r.text
        return r.json()

    def chat(self, system: str, user: str, key: str = KEYS[0], **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}], **extra}
        r = self.http.post("/v1/chat/completions", json=body, headers=auth(key))
        assert r.status_code == 200, r.text
        return r.json()

    def routed(self) -> dict[str, int]:
        return {r["name"]: r["routed"] for r in self.cluster()["replicas"]}

    def close(self) -> None:
        if self._reference is not None:
            self._reference.close()
        self.ray.__exit__(None, None, None)
        self.redis.stop()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def document(tag: str, words: int = 90) -> str:
    return " ".join(f"{tag} item {i} is filed under shelf {i % 9}." for i in range(words // 8))


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    patch.setenv("RAY_DEDUP_LOGS", "0")
    made = RayCluster(tmp_path_factory.mktemp("ray"))
    yield made
    made.close()
    patch.undo()


def test_follow_ups_go_to_the_replica_holding_their_document(rc: RayCluster) -> None:
    doc = document("affinity")
    first = rc.chat(doc, "Which shelf holds item 3?")
    before = rc.routed()
    hits = [cached(rc.chat(doc, q)) for q in ("Item 5?", "Item 7?", "Item 2?")]
    after = rc.routed()
    grew = {n: after[n] - before.get(n, 0) for n in after}
    assert sorted(grew.values()) == [0, 3], grew  # all three on one replica
    prefix = first["usage"]["prompt_tokens"] - 20
    assert all(h >= prefix for h in hits), (hits, prefix)
    prediction = rc.cluster()["router"]["prediction"]
    assert prediction["exact_fraction"] >= 0.75, prediction
    assert rc.cluster()["router"]["decision_us"]["p99"] < 50_000


def test_greedy_answers_equal_one_engines(rc: RayCluster) -> None:
    for system, user in ((document("greedy"), "Summarise the shelves."),
                         ("You are terse.", "Name three colours.")):
        got = rc.chat(system, user, max_tokens=16)["choices"][0]["message"]["content"]
        want = rc.reference().chat([{"role": "system", "content": system},
                                    {"role": "user", "content": user}],
                                   SamplingParams(temperature=0, max_tokens=16))
        assert got == want[0].outputs[0].text


def test_tenants_never_share_blocks(rc: RayCluster) -> None:
    doc = document("tenants")
    rc.chat(doc, "First?", key=KEYS[0])
    assert cached(rc.chat(doc, "Second?", key=KEYS[0])) > 0
    assert cached(rc.chat(doc, "Second?", key=KEYS[1])) == 0


def _replica_actor(name: str) -> Any:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if name in actor["name"] and ENGINE in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no actor for replica {name}")


def _queued_prefills(rc: RayCluster, name: str) -> tuple[int, int]:
    """(requests whose prefill `name` has still to compute, load reports received from it).
    The router's figure also counts requests it routed there since the last report, which may
    not have reached the replica yet."""
    replica = next(r for r in rc.cluster()["replicas"] if r["name"] == name)
    return int(replica.get("load", {}).get("queued_requests", 0)), int(replica["reports"])


def _stream(rc: RayCluster, path: str, body: dict[str, Any], out: list[str],
            first: threading.Event) -> None:
    with httpx.Client(base_url=rc.url, timeout=600) as client, \
            client.stream("POST", path, json=body, headers=auth(KEYS[0])) as r:
        for line in r.iter_lines():
            out.append(line)
            if line.startswith("data:"):
                first.set()


def test_a_killed_replica_ends_its_streams_retries_and_restores_from_redis(
        rc: RayCluster) -> None:
    doc = document("killed", 120)
    before = rc.routed()
    warm = rc.chat(doc, "Warm up.")
    home = next(n for n, count in rc.routed().items() if count > before.get(n, 0))
    long = {"model": MODEL, "temperature": 0, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": "Go on."}]
    streams = {"/v1/chat/completions": {**long, "messages": messages},
               "/v1/messages": {**long, "system": doc, "messages": messages[1:]}}
    lines: dict[str, list[str]] = {p: [] for p in streams}
    started = {p: threading.Event() for p in streams}
    threads = [threading.Thread(target=_stream, args=(rc, p, b, lines[p], started[p]))
               for p, b in streams.items()]
    for t in threads:
        t.start()
    for p in streams:
        assert started[p].wait(300), f"{p} never started"
    # A request with the same document and a long new tail: routed to `home`, killed there
    # before its first token, retried on the survivor, which restores the document from Redis.
    tail = document("tail", 700)
    result: dict[str, Any] = {}
    late = threading.Thread(target=lambda: result.update(rc.chat(doc, tail, max_tokens=8)))
    retries = rc.cluster()["ingress"]["retries"]
    late.start()
    # Kill `home` once the late request's prefill is queued there: routed there (the router
    # counts it at once), then still queued after three of home's own load reports, so it has
    # reached the replica (a request killed in flight is re-sent by Ray, not our ingress).
    deadline = time.monotonic() + 120
    seen_at = None
    while True:
        queued, reports = _queued_prefills(rc, home)
        if queued < 1:
            seen_at = None
        elif seen_at is None:
            seen_at = reports
        elif reports >= seen_at + 3:
            break
        assert time.monotonic() < deadline and late.is_alive(), "the late request never queued"
        time.sleep(0.05)
    ray.kill(_replica_actor(home), no_restart=True)
    killed_at = time.monotonic()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream hung after its replica died"
    assert time.monotonic() - killed_at < 60
    openai, anthropic = lines["/v1/chat/completions"], lines["/v1/messages"]
    events = [json.loads(x[5:]) for x in openai if x.startswith("data: {")]
    assert "error" in events[-1] and openai[-2] == "data: [DONE]", openai[-6:]
    assert "event: error" in anthropic, anthropic[-6:]
    late.join(600)
    assert result["choices"][0]["finish_reason"] == "length"
    assert cached(result) >= warm["usage"]["prompt_tokens"] - 32  # from Redis, not recomputed
    body = rc.cluster()
    assert body["ingress"]["retries"] >= retries + 1
    assert body["hit_tokens"]["redis"] > 0
    # Serve brings a replacement up.
    deadline = time.monotonic() + 300
    while len([r for r in rc.cluster()["replicas"] if r.get("reports")]) < 2:
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(2)


def test_requests_succeed_with_redis_down(rc: RayCluster) -> None:
    rc.redis.stop()
    try:
        got = rc.chat(document("down"), "Still there?")
        assert got["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        rc.redis.start()


def test_metrics_label_each_replica_and_pins_reach_the_holder(rc: RayCluster) -> None:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "system": [{"type": "text", "text": document("pinned"),
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi?"}]}
    r = rc.http.post("/v1/messages", json=body, headers=auth(KEYS[0]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_creation_input_tokens"] > 0
    metrics = rc.http.get("/metrics").text
    names = {r["name"] for r in rc.cluster()["replicas"] if "engine" in r}
    assert names and all(f'kvstack_kv_blocks_total{{replica="{n}"}}' in metrics
                         for n in names)


def test_a_fresh_router_rebuilds_its_view_within_seconds(rc: RayCluster) -> None:
    """What a restarted ingress goes through: a new handle, a new router, an empty view."""
    doc = document("fresh")
    rc.chat(doc, "Remember this.")
    view = ClusterView("cache-aware")
    register_view(APP, ENGINE, view)
    handle = serve.get_deployment_handle(ENGINE, app_name=APP)
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(ClusterEngine.connect(HandleTransport(handle), view))
    ids = chat_token_ids(engine.tokenizer, [{"role": "system", "content": doc},
                                            {"role": "user", "content": "x"}])
    keys = request_keys(ids, engine.layout, Tenant(KEYS[0]).cache_salt(None))
    started = time.monotonic()
    try:
        while view.holder(keys) is None:
            assert time.monotonic() - started < 30, view.summary()
            loop.run_until_complete(asyncio.sleep(0.25))
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0.1))
        loop.close()
