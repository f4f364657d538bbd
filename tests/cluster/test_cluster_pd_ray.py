"""A real disaggregated cluster on Ray Serve, in this process: 1 prefill + 1 decode replica of
a tiny random-weight Llama (the embedded model's tokenizer), one thread each, no Redis (the
handoff is the only way KV moves), Ray on its own temp dir and ports.

One cluster for the module. Checks what only the real thing shows: the blocks travel by Ray
object ref from the prefill replica to the decode replica, which restores them as a prefix
hit; greedy answers equal one engine's through both APIs, streaming; the counters in
/v1/cluster and /metrics; no KV block held on either side once requests end; the decode
replica killed mid-stream ends the stream with an error event in the API's shape.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from helpers.tiny_models import make_tiny_chat_folder

from kvstack import LLM, SamplingParams
from kvstack.cluster.deployments import ENGINE, ClusterSpec, build_app
from kvstack.cluster.launch import RayInstance, deploy, free_port, start_http
from kvstack.engine.chat import chat_token_ids
from kvstack.engine.tokenizer import load_tokenizer
from kvstack.server.state import ServerConfig
from kvstack.weights import Checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray on pydantic 2

KEY = "sk-alice"
AUTH = {"authorization": f"Bearer {KEY}"}
APP = "kvstack-pd-test"
MODEL = "tiny"
LOCAL = 8  # --max-local-prefill: prompts this short never leave the decode replica


class PDRay:
    def __init__(self, folder: Path) -> None:
        self.llm_kwargs = {"model": str(folder), "kv_cache_memory": "8MiB", "block_size": 16}
        self.ray = RayInstance(num_cpus=2, log_to_driver=False).__enter__()
        try:
            port = free_port()
            start_http("127.0.0.1", port)
            self.url = f"http://127.0.0.1:{port}"
            spec = ClusterSpec(2, self.llm_kwargs, replica_threads=1, max_num_seqs=4,
                               api_keys=(KEY,), app_name=APP, health_check_period_s=1.0,
                               num_prefill_replicas=1, max_local_prefill=LOCAL,
                               server_config=ServerConfig(model_name=MODEL))
            deploy(build_app(spec), APP, self.url)
        except BaseException:
            self.ray.__exit__(None, None, None)
            raise
        self.http = httpx.Client(base_url=self.url, timeout=600)
        self.reference = LLM(**self.llm_kwargs, num_threads=1)

    def cluster(self) -> dict[str, Any]:
        r = self.http.get("/v1/cluster", headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()

    def want(self, prompt: str | list[int], max_tokens: int) -> str:
        given = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return self.reference.generate(given, params)[0].outputs[0].text

    def blocks_in_use(self) -> dict[str, int]:
        """KV blocks each replica's requests (or pins) hold, once its stats are fresh."""
        time.sleep(1.5)  # the ingress polls replica stats every second
        body = self.cluster()
        entries = body["replicas"] + body["prefill"]["replicas"]
        return {e["name"]: e["engine"]["kv_blocks_used"] for e in entries if "engine" in e}

    def close(self) -> None:
        self.reference.close()
        self.ray.__exit__(None, None, None)


def document(tag: str, words: int = 60) -> str:
    return " ".join(f"{tag}{i % 7} alpha{i % 11} beta{i % 5}" for i in range(words))


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, embedded_checkpoint: Checkpoint
       ) -> Iterator[PDRay]:
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    patch.setenv("RAY_DEDUP_LOGS", "0")
    folder = make_tiny_chat_folder(tmp_path_factory.mktemp("pdray"),
                                   load_tokenizer(embedded_checkpoint))
    made = PDRay(folder)
    yield made
    made.close()
    patch.undo()


def test_handoffs_by_object_ref_give_one_engines_greedy_answers(pd: PDRay) -> None:
    prompt = document("ray") + " first"
    r = pd.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                              "temperature": 0, "max_tokens": 12},
                     headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == pd.want(prompt, 12)
    user = document("raymsg") + " stream"
    messages = [{"role": "user", "content": user}]
    lines: list[str] = []
    with pd.http.stream("POST", "/v1/messages", headers=AUTH,
                        json={"model": MODEL, "messages": messages, "stream": True,
                              "temperature": 0, "max_tokens": 10}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    text = "".join(e["delta"]["text"] for e in events if e.get("type") == "content_block_delta")
    assert text == pd.want(chat_token_ids(pd.reference.get_tokenizer(), messages), 10)
    handoffs = pd.cluster()["handoffs"]
    assert handoffs["count"] == 2 and handoffs["num_fallbacks"] == 0, handoffs
    assert handoffs["bytes"] > 0 and handoffs["blocks"] >= 2 * (body["usage"]["prompt_tokens"]
                                                                // 16) - 2
    metrics = pd.http.get("/metrics", headers=AUTH).text
    assert "kvstack_handoffs_total 2.0" in metrics
    short = pd.reference.get_tokenizer().encode(document("s"))[:LOCAL]
    r = pd.http.post("/v1/completions", json={"model": MODEL, "prompt": short,
                                              "temperature": 0, "max_tokens": 8}, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == pd.want(short, 8)
    handoffs = pd.cluster()["handoffs"]
    assert handoffs["local_prefills"] == 1 and handoffs["count"] == 2, handoffs
    assert all(n == 0 for n in pd.blocks_in_use().values())


def _decode_actor() -> Any:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if APP in actor["name"] and f"#{ENGINE}#" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError("no decode replica actor")


def test_the_decode_replica_dying_mid_stream_ends_it_with_an_error_event(pd: PDRay) -> None:
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=pd.url, timeout=600) as client, client.stream(
                "POST", "/v1/completions", headers=AUTH,
                json={"model": MODEL, "prompt": document("die", 8) + " Tell a long story.",
                      "stream": True,
                      "max_tokens": 1500, "ignore_eos": True, "temperature": 0}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if sum(x.startswith("data:") for x in lines) > 4:
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(300)
    ray.kill(_decode_actor(), no_restart=True)
    reader.join(120)
    assert not reader.is_alive()
    events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    assert "error" in events[-1] and lines[-2:] == ["data: [DONE]", ""]
    assert pd.cluster()["ingress"]["lost_streams"] >= 1
