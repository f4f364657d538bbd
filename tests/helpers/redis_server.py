"""A throwaway `redis-server` (Debian's) on a free loopback port in a temp dir, never 6379.

No persistence (a restart loses everything, like a crash); `maxmemory` optional. The
`redis_server` fixture skips the test where redis-server is not installed (`.ci/run` and
`make redis-server` install it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.live_server import free_port


class RedisServer:
    def __init__(self, directory: Path, maxmemory: str | None = None) -> None:
        self.directory = directory
        self.maxmemory = maxmemory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or start again, on the same port) and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                str(self.directory), "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--logfile", str(self.directory / "redis.log")]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; log:\n{self.log()[-2000:]}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""


def start_redis(directory: Path, maxmemory: str | None = None) -> RedisServer:
    """Start a server, or skip the test where redis-server is missing (fail in CI)."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            raise RuntimeError("redis-server is not installed; .ci/run should have done it")
        pytest.skip("redis-server is not installed; run `make redis-server`")
    return RedisServer(directory, maxmemory).start()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.stop()
