"""`kvstack serve --replicas N`: the server as a Ray Serve application (`kvstack.cluster`).

Without --ray-address a private local Ray instance is started and, on SIGTERM or Ctrl-C,
stopped (Serve drains and stops the replicas first). With --ray-address the application is
deployed on that cluster and deleted again on exit; the cluster itself keeps running.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from kvstack.cli.args import llm_kwargs
from kvstack.server.state import ServerConfig


def run_cluster(args: argparse.Namespace, keys: list[str], config: ServerConfig) -> int:
    try:
        from kvstack.cluster.deployments import ClusterSpec, build_app
        from kvstack.cluster.launch import (
            OBJECT_STORE_BYTES,
            PD_OBJECT_STORE_BYTES,
            RayInstance,
            deploy,
            start_http,
            undeploy,
        )
    except ImportError as err:
        from kvstack.errors import InvalidRequestError

        raise InvalidRequestError(f"--replicas needs Ray Serve ({err.name} is missing); run "
                                  "`pip install 'kvstack[cluster]'`") from err
    threads = args.replica_threads or 1
    spec = ClusterSpec(
        num_replicas=args.replicas,
        llm_kwargs=llm_kwargs(args, max_pinned_fraction=args.max_pinned_fraction),
        replica_threads=threads, max_num_seqs=args.max_num_seqs,
        router=args.router or "cache-aware", api_keys=tuple(keys), server_config=config,
        num_prefill_replicas=args.prefill_replicas or 0,
        max_local_prefill=args.max_local_prefill or 0,
    )
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    stop = threading.Event()
    store = PD_OBJECT_STORE_BYTES if spec.num_prefill_replicas else OBJECT_STORE_BYTES
    with RayInstance(args.ray_address, num_cpus=args.replicas * threads,
                     object_store_bytes=store):
        # ray.init installs its own SIGTERM handler in the driver: ours goes on top.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: _stop(stop, signum, frame))
        start_http(args.host, args.port)
        try:
            deploy(build_app(spec), spec.app_name, url)
            roles = (f", {spec.num_prefill_replicas} of them prefill only"
                     if spec.num_prefill_replicas else "")
            print(f"kvstack: {args.replicas} replicas{roles} ({spec.router} router) serving "
                  f"at {url}", file=sys.stderr, flush=True)
            while not stop.wait(1.0):
                pass
        finally:
            if args.ray_address:
                undeploy(spec.app_name)
    return 0


def _stop(stop: threading.Event, signum: int, frame: FrameType | None) -> None:
    stop.set()
