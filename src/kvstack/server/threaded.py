"""An app served by uvicorn in a background thread on a loopback port: for tests that need
the engine in their own process, and for `kvstack ui screenshot`."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from kvstack.server.app import stop_streams


class ServerThread:
    """`with ServerThread(app) as url:` serves `app` until the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning",
                 start_timeout_s: float = 60.0) -> None:
        self.app = app
        self.host = host
        self.start_timeout_s = start_timeout_s
        self._sock = socket.socket()
        self._sock.bind((host, 0))  # bound here, so the port is known and never raced for
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="kvstack-server", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.05)
        return self.url

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> None:
        stop_streams(self.app)
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
