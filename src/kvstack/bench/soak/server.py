"""The soak's server: one `kvstack serve` with a disk tier and a Responses database, both in a
folder that outlives the process, so a restart (`restart`) finds the same tier files and
stored responses. `ready` is clear while it is down: the traffic waits on it instead of
counting refused connections as failures."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from kvstack.bench.common import BenchOptions
from kvstack.bench.http_load import _same_kvstack_env, free_port, stop_process, wait_healthy


class SoakServer:
    def __init__(self, options: BenchOptions, folder: Path, pin_ttl_s: int,
                 cache_ttl_scale: float) -> None:
        self.options = options
        self.folder = folder
        self.pin_ttl_s = pin_ttl_s
        self.cache_ttl_scale = cache_ttl_scale
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = asyncio.Event()
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0

    def command(self) -> list[str]:
        o = self.options
        return [sys.executable, "-m", "kvstack", "serve", "--model", o.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--threads", str(o.threads),
                "--max-num-seqs", "8", "--log-level", "warning",
                "--kv-disk-dir", str(self.folder / "tier"),
                "--responses-db", str(self.folder / "responses.sqlite"),
                "--responses-pin-ttl", str(self.pin_ttl_s),
                "--cache-ttl-scale", str(self.cache_ttl_scale)]

    def start(self) -> None:
        log = (self.folder / f"server-{self.lives}.log").open("wb")
        with log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=_same_kvstack_env())
        if not wait_healthy(self.url, self.proc):
            text = (self.folder / f"server-{self.lives}.log").read_text(errors="replace")
            stop_process(self.proc)
            raise RuntimeError(f"kvstack serve did not come up; log:\n{text[-4000:]}")
        self.lives += 1
        self.ready.set()

    async def restart(self) -> float:
        """SIGTERM (in-flight requests drain), then start again on the same folder and port;
        returns the seconds it was down."""
        loop = asyncio.get_running_loop()
        self.ready.clear()
        start = loop.time()
        await loop.run_in_executor(None, self.stop)
        await loop.run_in_executor(None, self.start)
        return loop.time() - start

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid
