"""The HTTP side of `bench serve`: the server under test and the clients that load it.

`server` yields the base URL of a `kvstack serve` started as a subprocess on a free loopback
port (or of the one given with `--url`). `LoadTest` streams `/v1/chat/completions` (greedy,
`ignore_eos`, a fixed `max_tokens`, usage in the last chunk) from closed-loop clients and
returns each request's timings; the case turns them into rates and percentiles.

TTFT is the time from sending a request to its first content chunk; TPOT is (last content
chunk - first content chunk) / (completion tokens - 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvstack.bench.common import BenchOptions
from kvstack.errors import KvstackError

if TYPE_CHECKING:
    from tqdm import tqdm

START_TIMEOUT_S = 300.0  # model load included
READ_TIMEOUT_S = 300.0  # longest silence on one stream
STOP_TIMEOUT_S = 30.0  # SIGTERM drains in-flight requests; then SIGKILL

# (variant, request number) -> the request's chat messages
Messages = Callable[[str, int], list[dict[str, str]]]
Sample = dict[str, Any]  # one request: ttft_s, tpot_s, completion/prompt/cached tokens


class ServerUnavailableError(KvstackError):
    """The server given with --url does not answer."""


# -- the server ------------------------------------------------------------------------------


@contextlib.contextmanager
def server(options: BenchOptions, kv_bytes: int, max_num_seqs: int) -> Iterator[str]:
    """The server's base URL: --url as given, or a `kvstack serve` started (and always
    stopped) here."""
    with server_process(options, kv_bytes, max_num_seqs) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(options: BenchOptions, kv_bytes: int, max_num_seqs: int
                   ) -> Iterator[tuple[str, subprocess.Popen[bytes] | None]]:
    """`server`, with the process it started (None with --url), e.g. to read its CPU time."""
    if options.url:
        url = options.url.rstrip("/")
        if not _healthy(url):
            raise ServerUnavailableError(f"no kvstack server answers at {url}/health; start one "
                                         "with `kvstack serve` or leave out --url")
        yield url, None
        return
    with tempfile.TemporaryDirectory(prefix="kvstack-bench-serve-") as tmp:
        log_path = Path(tmp) / "server.log"
        for _ in range(3):  # the free port may be taken before the server binds it
            port = free_port()
            with log_path.open("wb") as log:
                proc = subprocess.Popen(_serve_command(options, port, kv_bytes, max_num_seqs),
                                        stdout=log, stderr=subprocess.STDOUT,
                                        env=_same_kvstack_env())
            try:
                url = f"http://127.0.0.1:{port}"
                if wait_healthy(url, proc):
                    yield url, proc
                    return
                text = log_path.read_text(errors="replace")
                if "address already in use" not in text.lower():
                    raise RuntimeError(f"kvstack serve did not come up; log:\n{text[-4000:]}")
            finally:
                stop_process(proc)
        raise RuntimeError("no free port found for kvstack serve")


def _serve_command(options: BenchOptions, port: int, kv_bytes: int,
                   max_num_seqs: int) -> list[str]:
    """The `kvstack serve` command line for the run's model, threads and KV budget."""
    return [sys.executable, "-m", "kvstack", "serve", "--model", options.model,
            "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(options.threads), "--kv-cache-memory", str(kv_bytes),
            "--max-num-seqs", str(max_num_seqs), "--log-level", "warning",
            *_format_flags(options)]


def _format_flags(options: BenchOptions) -> list[str]:
    """`kvstack serve` flags for the run's weight format (none: the server's default)."""
    flags = ["--dtype", options.dtype] if options.dtype else []
    return flags + (["--quantization", options.quantization] if options.quantization else [])


def _same_kvstack_env() -> dict[str, str]:
    """The environment with this kvstack first on the path, so the server runs this code."""

    src = str(Path(__file__).resolve().parents[2])  # <src>/kvstack/bench/http_load.py
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str, route: str = "/health") -> bool:
    try:
        return httpx.get(f"{url}{route}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen[bytes], route: str = "/health") -> bool:
    """Whether `url` answers 200 on `route` before START_TIMEOUT_S or the process's exit."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if _healthy(url, route):
            return True
        time.sleep(0.25)
    return False


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (in-flight requests drain), then SIGKILL after STOP_TIMEOUT_S."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the load --------------------------------------------------------------------------------



async def sse_chunks(client: httpx.AsyncClient, path: str, body: dict[str, Any]
                     ) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of one streamed OpenAI response, as they arrive; a refusal or an error
    event mid-stream is a RuntimeError naming it."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"the server answered {response.status_code}: "
                               f"{response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"the server failed mid-stream: {chunk['error']}")
            yield chunk

class LoadTest:
    """Closed-loop clients on one connection pool; requests are numbered across the run."""

    def __init__(self, url: str, messages: Messages, max_tokens: int, salt: str,
                 bar: tqdm) -> None:
        self.url = url
        self.messages = messages
        self.max_tokens = max_tokens
        self.salt = salt
        self.bar = bar
        self.model = ""
        self.next_number = 0

    async def run(self, levels: Sequence[int], variants: Sequence[str],
                  num_requests: Callable[[int], int]) -> list[dict[str, Any]]:
        """Per level: {"concurrency": c, variant: (its requests' samples, elapsed seconds)}."""
        limits = httpx.Limits(max_connections=max(levels) + 2)
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            models = (await client.get("/v1/models")).raise_for_status().json()
            self.model = models["data"][0]["id"]
            for variant in variants:  # warms the server; caches the shared system prompt
                await self._one(client, variant)
                self.bar.update(1)
            rows = []
            for c in levels:
                row: dict[str, Any] = {"concurrency": c}
                for variant in variants:
                    row[variant] = await self._level(client, variant, c, num_requests(c))
                rows.append(row)
        return rows

    async def _level(self, client: httpx.AsyncClient, variant: str, concurrency: int,
                     num: int) -> tuple[list[Sample], float]:
        samples: list[Sample] = []
        left = iter(range(num))

        async def client_loop() -> None:
            for _ in left:  # shared: each client takes the next request when its last is done
                samples.append(await self._one(client, variant))
                self.bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return samples, time.perf_counter() - start

    async def _one(self, client: httpx.AsyncClient, variant: str) -> Sample:
        body = {"model": self.model, "messages": self.messages(variant, self.next_number),
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, "max_tokens": self.max_tokens, "ignore_eos": True,
                "cache_salt": self.salt, "semantic_cache": False}
        self.next_number += 1
        first = last = None
        usage: dict[str, Any] | None = None
        start = time.perf_counter()
        async for chunk in sse_chunks(client, "/v1/chat/completions", body):
            if any(choice["delta"].get("content") for choice in chunk["choices"]):
                last = time.perf_counter()
                first = first or last
            usage = chunk.get("usage") or usage
        if usage is None or first is None or last is None:
            raise RuntimeError("a stream ended without content or usage")
        num_tokens = usage["completion_tokens"]
        return {
            "ttft_s": first - start,
            "tpot_s": (last - first) / (num_tokens - 1) if num_tokens > 1 else None,
            "completion_tokens": num_tokens,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        }
