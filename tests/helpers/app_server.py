"""A FastAPI app served by uvicorn on a free loopback port, in a thread of this process: a
real HTTP server (streams are not buffered, any client can reach it) over an engine that
shares this process's loaded checkpoints."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from helpers.live_server import free_port


class AppServer:
    def __init__(self, app: FastAPI, timeout: float = 60) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="app-server",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the app server did not start")
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
