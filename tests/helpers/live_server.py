"""`kvstack serve` in a subprocess on a free loopback port, ready once /health answers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import kvstack

_SRC = str(Path(kvstack.__file__).resolve().parent.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL if it will not go)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 timeout: float = 300) -> LiveServer:
    """Start the server with extra CLI `args`; retries if the chosen port got taken."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_SRC, full_env.get("PYTHONPATH", "")) if p
    )
    for _ in range(3):
        port = free_port()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvstack", "serve", "--host", "127.0.0.1",
                 "--port", str(port), *args],
                stdout=log, stderr=subprocess.STDOUT, env=full_env,
            )
        server = LiveServer(proc, port, log_path)
        if _wait_healthy(server, timeout):
            return server
        if "address already in use" not in server.log().lower():
            server.terminate(timeout=10)
            raise RuntimeError(f"server did not come up; log:\n{server.log()[-4000:]}")
    raise RuntimeError("no free port found for the server")


def _wait_healthy(server: LiveServer, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False
