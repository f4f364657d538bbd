"""Starting (or joining) Ray and running the application on it.

Without an address, `RayInstance` starts a private local Ray: its own short temp dir (removed
afterwards; Ray's socket paths must stay short), loopback addresses, no dashboard, explicit
free ports where Ray takes them, a 100 MiB object store (nothing large travels through it;
with prefill replicas 2 GiB: it carries the KV handoffs), and as many logical CPUs as the
replicas ask for. Ray's token authentication stays on (Ray's default for a local instance):
its processes listen on every interface even when the node address is loopback, and the token
is what keeps others out. With an address ("auto", or
host:port of `ray start --head`) it joins that cluster and leaves it running afterwards.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from kvstack.errors import KvstackError

OBJECT_STORE_BYTES = 100 * 2**20
# With prefill replicas the object store carries every handoff in flight (46 KB per token of
# the embedded model's float32 KV: 184 MB for a 4,000-token prompt); 100 MiB would spill them.
PD_OBJECT_STORE_BYTES = 2 * 2**30
READY_TIMEOUT_S = 600.0  # replicas load the model in parallel; a loaded machine is slow
# Serve's controller kills an HTTP proxy that misses 3 readiness checks of 5 s each, and
# serve.start then fails: on a busy machine (both cores computing) a proxy can take longer
# to come up. A private instance gives it a minute per check (env read by Ray's processes).
SERVE_PROXY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                   "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


class ClusterStartError(KvstackError):
    """Ray or the application did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayInstance:
    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 log_to_driver: bool = True,
                 object_store_bytes: int = OBJECT_STORE_BYTES) -> None:
        self.address = address
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.log_to_driver = log_to_driver
        self.temp_dir: Path | None = None

    def __enter__(self) -> RayInstance:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = {"namespace": "kvstack", "log_to_driver": self.log_to_driver,
                                  "configure_logging": False}
        if self.address:
            ray.init(address=self.address, **kwargs)
            return self
        for name, value in SERVE_PROXY_ENV.items():
            os.environ.setdefault(name, value)
        # Short and private: Ray puts unix sockets under it (a 107-byte path limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kr", dir=tempfile.gettempdir()))
        try:
            ray.init(num_cpus=self.num_cpus, include_dashboard=False,
                     object_store_memory=self.object_store_bytes, _node_ip_address="127.0.0.1",
                     _temp_dir=str(self.temp_dir), _metrics_export_port=free_port(), **kwargs)
        except Exception as err:
            self._remove_temp_dir()
            raise ClusterStartError(f"could not start a local Ray instance: {err}") from err
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        import ray
        from ray import serve

        try:
            if self.address is None:
                serve.shutdown()
        finally:
            ray.shutdown()
            self._remove_temp_dir()

    def _remove_temp_dir(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def start_http(host: str, port: int) -> None:
    """Serve's HTTP proxy on host:port (cluster-wide; set once per Serve instance)."""
    from ray import serve

    try:
        serve.start(http_options={"host": host, "port": port})
    except Exception as err:  # Ray raises its own types (ActorDiedError, GetTimeoutError, ...)
        raise ClusterStartError(f"Serve's HTTP proxy on {host}:{port} did not start: "
                                f"{type(err).__name__}: {str(err).splitlines()[0]}") from err


def deploy(app: Any, name: str, url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Run the application and wait until its /health answers through the proxy."""
    from ray import serve

    serve.run(app, name=name, route_prefix="/", blocking=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ClusterStartError(f"the cluster did not answer {url}/health within {timeout_s:.0f} s")


def undeploy(name: str) -> None:
    """Delete the application and wait until its replicas are gone."""
    from ray import serve

    serve.delete(name, _blocking=True)


class LocalRedis:
    """A throwaway `redis-server` (Debian's binary) on a free loopback port, in a temp dir,
    without persistence: the shared KV tier of a benchmark run."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterStartError("redis-server is not installed; run `make redis-server` "
                                    "(apt-get install redis-server)")
        self._dir = Path(tempfile.mkdtemp(prefix="kvstack-redis-"))
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self._dir),
             "--save", "", "--appendonly", "no", "--logfile", str(self._dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.client().ping()
                return self
            except Exception:  # not up yet
                time.sleep(0.1)
        self.__exit__(None, None, None)
        raise ClusterStartError("redis-server did not answer within 10 s")

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def flush(self) -> None:
        self.client().flushall()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
