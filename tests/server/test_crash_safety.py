"""Crash safety of what the server acknowledged: `kill -9` of `kvstack serve` while it writes the
disk tier (--kv-disk-dir) and the Responses database (--responses-db), then a restart on the
same folder.

- Every stored response whose creation was acknowledged (a non-streamed 200, or a stream's
  final `response.completed` / `response.incomplete` event) is found after the restart, with
  the same output, and a conversation continues from it (`previous_response_id`).
- The tier files the killed server left (some of them half-written when it died) give the
  same greedy output as recomputation, with a prefix hit; once every tier file is truncated or
  corrupted, each is a miss and the answer is still the recomputed one.

The kill lands at a random moment: after a random number of acknowledgements while six
conversations are in flight (each turn's blocks queued for the tier as they complete). The
seed is printed; a failure names it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.live_server import LiveServer, start_server
from helpers.tiny_models import make_tiny_chat_folder

from kvstack.engine.tokenizer import load_tokenizer
from kvstack.kv.tiers.disk import block_files
from kvstack.weights import Checkpoint

CONVERSATIONS = 6
TURNS = 4
OUTPUT_CAP = 8
WORDS = ("cache", "block", "tier", "prefix", "token", "layer", "head", "value", "key", "page",
         "disk", "write", "rename", "sync", "commit", "crash", "restart", "answer", "model")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory, embedded_checkpoint: Checkpoint) -> Path:
    return make_tiny_chat_folder(tmp_path_factory.mktemp("crash"),
                                 load_tokenizer(embedded_checkpoint))


@pytest.fixture
def serve(tiny_chat: Path, tmp_path: Path) -> Iterator[Any]:
    """Starts servers on one tier folder and database; every one is gone at the end."""
    started: list[LiveServer] = []

    def start() -> LiveServer:
        server = start_server(
            ["--model", str(tiny_chat), "--threads", "1", "--max-num-seqs", "8",
             "--kv-cache-memory", "32MiB", "--kv-disk-dir", str(tmp_path / "tier"),
             "--responses-db", str(tmp_path / "responses.sqlite"), "--served-model-name", "m",
             "--log-level", "warning"],
            tmp_path / f"server-{len(started)}.log", env={"OMP_NUM_THREADS": "1"})
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def document(rng: random.Random) -> str:
    """~300 tokens of its own: a prompt of many full KV blocks."""
    return f"Document {uuid.uuid4().hex}: " + " ".join(rng.choice(WORDS) for _ in range(280))


def output_text(body: dict[str, Any]) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


async def create(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """The response object once acknowledged: a non-streamed 200's body, or a stream's final
    event's response."""
    if not body.get("stream"):
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())
    async with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] in ("response.completed", "response.incomplete"):
                    return dict(event["response"])
    raise AssertionError("the stream ended without its final event")


async def drive_until_killed(server: LiveServer, rng: random.Random, kill_after: int,
                             acked: dict[str, dict[str, Any]]) -> None:
    """Conversations of TURNS turns (every other one streamed) until `kill_after` turns are
    acknowledged; then SIGKILL at once, with the other conversations mid-request."""
    killed = asyncio.Event()

    async def conversation(client: httpx.AsyncClient) -> None:
        previous = None
        for turn in range(TURNS):
            doc = document(rng)
            body = {"model": "m", "input": doc, "max_output_tokens": OUTPUT_CAP,
                    "temperature": 0, "store": True, "stream": turn % 2 == 1,
                    "previous_response_id": previous}
            try:
                response = await create(client, body)
            except (httpx.TransportError, AssertionError):
                if not killed.is_set():
                    raise
                return  # cut off by the kill: never acknowledged
            acked[response["id"]] = {"input": doc, "output": output_text(response),
                                     "first": previous is None}
            previous = response["id"]
            if len(acked) >= kill_after and not killed.is_set():
                killed.set()
                os.kill(server.proc.pid, signal.SIGKILL)
        if not killed.is_set():  # every conversation ended first: kill as the last one ends
            killed.set()
            os.kill(server.proc.pid, signal.SIGKILL)

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        await asyncio.gather(*(conversation(client) for _ in range(CONVERSATIONS)))
    assert server.proc.wait(30) == -signal.SIGKILL


def check_acknowledged(server: LiveServer, acked: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        lost = [rid for rid in acked if client.get(f"/v1/responses/{rid}").status_code != 200]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged responses lost"
        for rid, seen in acked.items():
            assert output_text(client.get(f"/v1/responses/{rid}").json()) == seen["output"]
        last = next(reversed(acked))
        r = client.post("/v1/responses", json={"model": "m", "input": "and then?",
                                               "previous_response_id": last,
                                               "max_output_tokens": 2, "store": False})
        assert r.status_code == 200, r.text


def ask(client: httpx.Client, text: str, salt: str | None = None) -> tuple[str, int]:
    """(output, cached prompt tokens) of one unstored greedy request; a salt misses every
    cache (recomputation)."""
    body = {"model": "m", "input": text, "max_output_tokens": OUTPUT_CAP, "temperature": 0,
            "store": False, **({"cache_salt": salt} if salt else {})}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return output_text(out), out["usage"]["input_tokens_details"]["cached_tokens"]


def damage(tier: Path) -> int:
    """Every block file truncated (as a write cut short leaves it) or its payload flipped."""
    files = sorted(entry.path for entry in block_files(tier))
    for i, path in enumerate(files):
        data = bytearray(Path(path).read_bytes())
        if i % 2:
            data = data[: len(data) // 2]
        else:
            data[-1] ^= 0xFF
        Path(path).write_bytes(bytes(data))
    return len(files)


def test_kill_9_loses_no_acknowledged_response_and_tiers_never_answer_wrong(
        serve: Any, tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = random.Random(seed)
    acked: dict[str, dict[str, Any]] = {}
    kill_after = rng.randint(3, CONVERSATIONS * TURNS - 4)
    asyncio.run(drive_until_killed(serve(), rng, kill_after, acked))
    assert len(acked) >= kill_after, f"seed {seed}"

    server = serve()  # the same folder: the killed server's tier files and database
    check_acknowledged(server, acked)
    firsts = [seen["input"] for seen in acked.values() if seen["first"]][:3]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        restored = [ask(client, text) for text in firsts]
        recomputed = [ask(client, text, salt=f"recompute-{i}") for i, text in enumerate(firsts)]
    assert [text for text, _ in restored] == [text for text, _ in recomputed], f"seed {seed}"
    assert all(cached == 0 for _, cached in recomputed)
    assert sum(cached for _, cached in restored) > 0, "no prompt was restored from the tier"
    server.proc.kill()
    server.proc.wait()

    assert damage(tmp_path / "tier") > 0
    server = serve()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        after = [ask(client, text) for text in firsts]
    # Every tier file is bad: the first prompt misses altogether (the later ones share the
    # chat template's first blocks with it, now in memory) and every answer is recomputed.
    assert [text for text, _ in after] == [text for text, _ in recomputed], f"seed {seed}"
    assert after[0][1] == 0
    check_acknowledged(server, acked)
    assert server.terminate() == 0
