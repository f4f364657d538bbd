"""The soak's clients: each request kind a coroutine that sends one request (or one short
chain) and appends what happened to `Traffic.records`.

Kinds, drawn at random by each closed-loop worker:
- `agent`: the requests the agent CLIs really sent (the captures under tests/server/
  agent_requests in a checkout), replayed with the served model's name and a small output cap;
- `sdk_chat`: a streamed chat through the OpenAI SDK, three turns resending the history;
- `responses`: a chain of three Responses turns through the SDK, each continuing the last with
  `previous_response_id` (store on; one streamed turn); every acknowledged id is remembered,
  and after the restart each must still be found;
- `load`: a guidellm-style burst, four streamed completions of ~300-word prompts at once,
  `ignore_eos`, a fixed number of tokens;
- `hostile`: a malformed or out-of-range body, which must get a 4xx;
- `disconnect`: a stream the client closes after its first chunks.

A record: {"t": seconds since the start, "kind", "status" (HTTP status, 0 for a transport
error), "ttft_s", "itl_s" (gaps between content chunks), "error"}; status -1: the client itself
failed, e.g. on an answer it could not parse). A request the restart
interrupts is counted apart (`during_restart`), not as a failure.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

from kvstack.bench.common import topic_texts
from kvstack.bench.soak.server import SoakServer

AGENT_CAPTURES = ("claude-code", "codex")
OUTPUT_CAP = 16
LOAD_STREAMS = 4
KIND_WEIGHTS = {"agent": 1, "sdk_chat": 3, "responses": 3, "load": 2, "hostile": 2,
                "disconnect": 2}
HOSTILE: tuple[tuple[str, bytes], ...] = (
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"model": "m", "messages": "hello"}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "max_tokens": 8}'),
    ("/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}'),
    ("/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}'),
    ("/v1/completions", b'{"model": "m", "prompt": "hi", "max_tokens": 100000000}'),
    ("/v1/completions", b'{"model": "m", "prompt": [[-5, 99999999]]}'),
    ("/v1/responses", b'{"model": "m", "input": "hi", "previous_response_id": "resp_nope"}'),
    ("/v1/responses", b'{"model": "m", "input": 42}'),
    ("/v1/messages", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/messages", b'\xff\xfe\x00garbage'),
    ("/v1/chat/completions", b"[" * 5000 + b"]" * 5000),
)


def agent_captures() -> list[dict[str, Any]]:
    """The captured agent-CLI requests, when this kvstack runs from a checkout that has them
    (they are test fixtures, not package data); otherwise none."""
    folder = Path(__file__).resolve().parents[4] / "tests" / "server" / "agent_requests"
    requests: list[dict[str, Any]] = []
    for name in AGENT_CAPTURES:
        path = folder / f"{name}.json"
        if path.is_file():
            requests.extend(json.loads(path.read_text())["requests"])
    return requests


class Traffic:
    def __init__(self, server: SoakServer, model: str, seed: int = 0) -> None:
        self.server = server
        self.model = model
        self.random = random.Random(seed)
        self.start = time.monotonic()
        self.records: list[dict[str, Any]] = []
        self.acked: list[str] = []  # stored response ids whose creation was acknowledged
        self.agent = agent_captures()
        self.texts = topic_texts()
        self.http = httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(300.0,
                                                                                  connect=10.0))
        self.sdk = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="soak", max_retries=0,
                               timeout=300.0)
        self.number = 0

    async def close(self) -> None:
        await self.http.aclose()
        await self.sdk.close()

    def now(self) -> float:
        return time.monotonic() - self.start

    async def worker(self, stop: asyncio.Event) -> None:
        kinds: dict[str, Callable[[], Awaitable[None]]] = {
            "agent": self.agent_replay, "sdk_chat": self.sdk_chat,
            "responses": self.responses_chain, "load": self.load_burst,
            "hostile": self.hostile, "disconnect": self.disconnect}
        if not self.agent:
            kinds.pop("agent")
        names = list(kinds)
        weights = [KIND_WEIGHTS[n] for n in names]
        while not stop.is_set():
            await self.server.ready.wait()
            kind = self.random.choices(names, weights)[0]
            await self._guarded(kind, kinds[kind])

    async def _guarded(self, kind: str, one: Callable[[], Awaitable[None]]) -> None:
        """Run one request kind; a transport error is a record with status 0 (or a request
        the restart interrupted)."""
        t = self.now()
        try:
            await one()
        except (httpx.TransportError, APIConnectionError) as err:
            self.records.append({"t": t, "kind": kind, "status": 0, "error": repr(err)[:300],
                                 "during_restart": not self.server.ready.is_set()})
        except Exception as err:  # a client-side surprise is counted, not fatal
            self.records.append({"t": t, "kind": kind, "status": -1, "error": repr(err)[:300]})

    def _record(self, t: float, kind: str, status: int, **extra: Any) -> None:
        self.records.append({"t": t, "kind": kind, "status": status, **extra})

    def _question(self) -> str:
        self.number += 1
        return f"Question {self.number}: {self.random.choice(self.texts)[:300]} Summarise it."

    # -- the kinds ------------------------------------------------------------------------

    async def agent_replay(self) -> None:
        request = self.random.choice(self.agent)
        body = {**request["body"], "model": self.model}
        cap = "max_output_tokens" if request["path"].startswith("/v1/responses") \
            else "max_tokens"
        body[cap] = OUTPUT_CAP  # the point is the request's shape; a capture's cap is large
        headers = {k: v for k, v in request["headers"].items()
                   if k.lower() not in ("content-length", "host")}
        t = self.now()
        async with self.http.stream("POST", request["path"], json=body,
                                    headers=headers) as response:
            await response.aread()
        self._record(t, "agent", response.status_code)

    async def sdk_chat(self) -> None:
        messages: list[Any] = [{"role": "system", "content": "You answer briefly."}]
        for _ in range(3):
            messages.append({"role": "user", "content": self._question()})
            t = self.now()
            try:
                stream = await self.sdk.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=OUTPUT_CAP, temperature=0,
                    stream=True)
                text, stamps = "", []
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        stamps.append(time.monotonic())
                        text += chunk.choices[0].delta.content
            except APIStatusError as err:
                self._record(t, "sdk_chat", err.status_code, error=str(err)[:300])
                return
            self._record(t, "sdk_chat", 200, **_timings(t + self.start, stamps))
            messages.append({"role": "assistant", "content": text})

    async def responses_chain(self) -> None:
        previous: str | None = None
        for turn in range(3):
            t = self.now()
            try:
                if turn == 1:  # one streamed turn: acknowledged by its last event
                    response_id = None
                    stream = await self.sdk.responses.create(
                        model=self.model, input=self._question(), previous_response_id=previous,
                        max_output_tokens=OUTPUT_CAP, temperature=0, store=True, stream=True)
                    async for event in stream:
                        # incomplete: the output cap was reached (a random model never stops)
                        if event.type in ("response.completed", "response.incomplete"):
                            response_id = event.response.id
                    if response_id is None:
                        self._record(t, "responses", 200, error="the stream did not finish")
                        return
                else:
                    response = await self.sdk.responses.create(
                        model=self.model, input=self._question(), previous_response_id=previous,
                        max_output_tokens=OUTPUT_CAP, temperature=0, store=True)
                    response_id = response.id
            except APIStatusError as err:
                self._record(t, "responses", err.status_code, error=str(err)[:300])
                return
            self.acked.append(response_id)
            self._record(t, "responses", 200)
            previous = response_id

    async def load_burst(self) -> None:
        await asyncio.gather(*(self._completion() for _ in range(LOAD_STREAMS)))

    async def _completion(self) -> None:
        words = " ".join(self.random.choice(self.texts) for _ in range(2)).split()[:300]
        body = {"model": self.model, "prompt": f"{self.number} " + " ".join(words),
                "max_tokens": 2 * OUTPUT_CAP, "ignore_eos": True, "temperature": 0,
                "stream": True}
        self.number += 1
        t = self.now()
        stamps: list[float] = []
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self._record(t, "load", response.status_code, error=response.text[:300])
                return
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self._record(t, "load", 200, error=str(chunk["error"])[:300])
                        return
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        stamps.append(time.monotonic())
        self._record(t, "load", 200, **_timings(t + self.start, stamps))

    async def hostile(self) -> None:
        path, content = self.random.choice(HOSTILE)
        t = self.now()
        response = await self.http.post(path, content=content,
                                         headers={"content-type": "application/json"})
        self._record(t, "hostile", response.status_code,
                     error=None if 400 <= response.status_code < 500 else response.text[:300])

    async def disconnect(self) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": 64, "ignore_eos": True,
                "messages": [{"role": "user", "content": self._question()}]}
        t = self.now()
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            status = response.status_code
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
        self._record(t, "disconnect", status)

    async def lost_responses(self) -> list[str]:
        """The acknowledged stored responses the server no longer finds."""
        lost = []
        for response_id in self.acked:
            r = await self.http.get(f"/v1/responses/{response_id}")
            if r.status_code != 200:
                lost.append(response_id)
        return lost


def _timings(sent: float, stamps: list[float]) -> dict[str, Any]:
    """TTFT and the gaps between content chunks, from monotonic stamps."""
    if not stamps:
        return {}
    return {"ttft_s": stamps[0] - sent,
            "itl_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}
