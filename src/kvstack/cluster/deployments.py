"""The Ray Serve application: N engine replicas behind one ingress running the HTTP server.

- `EngineDeployment`: one `EngineReplica` per Serve replica (`num_cpus` = its torch threads,
  `max_ongoing_requests` = the engine's `max_num_seqs`, so Ray queues the rest at the router
  instead of the engine). Serve polls `record_routing_stats` every `routing_period_s` and
  `check_health` every `health_check_period_s`; both answer during a long prefill because
  the engine steps in a thread of its own.
- `Ingress` (`num_cpus=0`): builds the router's view, the `ClusterEngine` over a handle to
  the engine deployment, and the FastAPI app of `kvstack serve` on top of it (every endpoint,
  auth, tenants, prompt caching, semantic cache, usage shapes), plus GET /v1/cluster.
`build_app(spec)` binds both; `kvstack serve --replicas N` and the benchmark run it.

With `num_prefill_replicas` P > 0 (`--prefill-replicas P`), the engine deployment is N - P
`DecodeDeployment`s (routed by load) and a second one, `prefill`, holds P
`PrefillDeployment`s (routed by the chosen policy); the ingress runs a `PDClusterEngine`
over both and KV blocks travel between them by Ray object ref (`cluster/pd/`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from kvstack.cluster.client import ClusterEngine
from kvstack.cluster.http import add_cluster_routes
from kvstack.cluster.pd.ingress import PDClusterEngine
from kvstack.cluster.pd.metrics import add_handoff_metrics
from kvstack.cluster.pd.ray_courier import RayCourier
from kvstack.cluster.pd.replicas import DecodeReplica, PrefillReplica
from kvstack.cluster.ray_transport import HandleTransport
from kvstack.cluster.replica import EngineReplica
from kvstack.cluster.view import POLICIES, ClusterView, register_view
from kvstack.cluster.wire import Control, ReplicaRequest
from kvstack.errors import InvalidRequestError
from kvstack.server.app import create_app
from kvstack.server.auth import KeyRing
from kvstack.server.state import ServerConfig

ENGINE = "engine"
PREFILL = "prefill"
DECODE_POLICY = "pow2"  # a decode replica gets the whole prefix handed over: load decides
INGRESS = "ingress"
OUR_ROUTER = "kvstack.cluster.ray_router:KvstackRouter"
# Ray's own text-trie router (the peer we compare with). Its public path imports vLLM; this one
# needs only Ray. It reads the prompt's text, so the ingress sends it along for this router.
RAY_PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware."
                     "prefix_aware_router:PrefixCacheAffinityRouter")
ROUTERS = (*POLICIES, "ray-prefix")


@dataclass(frozen=True)
class ClusterSpec:
    """Everything `build_app` needs; picklable (Ray ships it to the replicas)."""

    num_replicas: int
    llm_kwargs: dict[str, Any]  # `LLM(...)` keyword arguments of every replica
    replica_threads: int = 1
    max_num_seqs: int = 64
    router: str = "cache-aware"
    api_keys: tuple[str, ...] = ()
    server_config: ServerConfig = field(default_factory=ServerConfig)
    app_name: str = "kvstack"
    routing_period_s: float = 0.1
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    oracle_pins: dict[int, int] = field(default_factory=dict)  # router "oracle" (bench)
    num_prefill_replicas: int = 0  # of num_replicas, these only prefill (`cluster/pd/`)
    max_local_prefill: int = 0  # with prefill replicas: prompts this short prefill at decode

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise InvalidRequestError(f"unknown router {self.router!r}; use one of "
                                      f"{', '.join(ROUTERS)}")
        if self.num_replicas < 1 or self.replica_threads < 1:
            raise InvalidRequestError("--replicas and --replica-threads must be >= 1")
        if not 0 <= self.num_prefill_replicas < self.num_replicas:
            raise InvalidRequestError("--prefill-replicas must leave at least one of "
                                      "--replicas to decode")
        if self.max_local_prefill < 0:
            raise InvalidRequestError("--max-local-prefill must be >= 0")
        if self.max_local_prefill and not self.num_prefill_replicas:
            raise InvalidRequestError("--max-local-prefill needs --prefill-replicas P")
        if self.num_prefill_replicas and self.router not in POLICIES:
            raise InvalidRequestError(f"--prefill-replicas needs one of kvstack's routers "
                                      f"({', '.join(POLICIES)})")


class EngineDeployment:
    def __init__(self, llm_kwargs: dict[str, Any], max_waiting: int | None) -> None:
        name = serve.get_replica_context().replica_id.unique_id
        self.replica = EngineReplica(name, llm_kwargs, max_waiting)

    async def generate(self, request: ReplicaRequest) -> Any:
        async for item in self.replica.generate(request):
            yield item

    async def pin_prefix(self, control: Control) -> tuple[int, int]:
        return await self.replica.pin_prefix(control)

    async def describe(self, control: Control) -> Any:
        return self.replica.describe(control)

    async def snapshot(self, control: Control) -> Any:
        return self.replica.snapshot(control)

    async def stats(self, control: Control) -> Any:
        return await self.replica.stats(control)

    async def record_routing_stats(self) -> dict[str, Any]:
        return self.replica.routing_stats()

    async def check_health(self) -> None:
        self.replica.check_health()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.replica.shutdown()


class PrefillDeployment(EngineDeployment):
    def __init__(self, llm_kwargs: dict[str, Any], max_waiting: int | None) -> None:
        name = serve.get_replica_context().replica_id.unique_id
        self.replica = PrefillReplica(name, llm_kwargs, RayCourier(), max_waiting=max_waiting)

    async def release(self, control: Control) -> bool:
        replica = self.replica
        assert isinstance(replica, PrefillReplica)
        return await replica.release(control)


class DecodeDeployment(EngineDeployment):
    def __init__(self, llm_kwargs: dict[str, Any], max_waiting: int | None) -> None:
        name = serve.get_replica_context().replica_id.unique_id
        self.replica = DecodeReplica(name, llm_kwargs, RayCourier(), max_waiting=max_waiting)


@serve.ingress()
class Ingress:
    # Ray Serve awaits an async constructor; Python's typing knows no such thing.
    async def __init__(self, engine: DeploymentHandle, spec: ClusterSpec,  # type: ignore[misc]
                       prefill: DeploymentHandle | None = None) -> None:
        policy = spec.router if spec.router in POLICIES else "round-robin"
        view = ClusterView(DECODE_POLICY if prefill is not None else policy,
                           oracle_pins=spec.oracle_pins)
        register_view(spec.app_name, ENGINE, view)  # before the handle makes its router
        if prefill is None:
            self.engine = await ClusterEngine.connect(HandleTransport(engine), view,
                                                      send_text=spec.router == "ray-prefix")
        else:
            prefill_view = ClusterView(policy, oracle_pins=spec.oracle_pins)
            register_view(spec.app_name, PREFILL, prefill_view)
            self.engine = await PDClusterEngine.connect(
                HandleTransport(engine), view, prefill=HandleTransport(prefill),
                prefill_view=prefill_view, max_local_prefill=spec.max_local_prefill)
        app = create_app(self.engine, KeyRing(list(spec.api_keys)), spec.server_config)
        if isinstance(self.engine, PDClusterEngine):
            add_handoff_metrics(app, self.engine.handoffs)
        self.asgi_app = add_cluster_routes(app)

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi_app

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()


def _engine_deployment(cls: type, name: str, num_replicas: int, policy: str,
                       spec: ClusterSpec) -> Any:
    ours = policy in POLICIES
    # Ray's pydantic model takes these as documented; its stubs type every field as a dict.
    options: dict[str, Any] = {
        "request_router_class": OUR_ROUTER if ours else RAY_PREFIX_ROUTER,
        "request_router_kwargs": {"policy": policy} if ours else {},
        "request_routing_stats_period_s": spec.routing_period_s,
        "request_routing_stats_timeout_s": max(10 * spec.routing_period_s, 5.0),
    }
    return serve.deployment(
        cls, name=name, num_replicas=num_replicas,
        max_ongoing_requests=spec.max_num_seqs,
        max_queued_requests=spec.server_config.max_waiting or -1,
        ray_actor_options={"num_cpus": spec.replica_threads},
        health_check_period_s=spec.health_check_period_s,
        health_check_timeout_s=spec.health_check_timeout_s,
        graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(**options),
        # Stats and snapshot calls come every second: only errors are worth a log line.
        logging_config={"enable_access_log": False},
    )


def build_app(spec: ClusterSpec) -> Any:
    """The bound application: `serve.run(build_app(spec), name=spec.app_name)`."""
    ingress = serve.deployment(Ingress, name=INGRESS, num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1024)
    llm_kwargs = {**spec.llm_kwargs, "num_threads": spec.replica_threads,
                  "max_num_seqs": spec.max_num_seqs}
    waiting = spec.server_config.max_waiting
    num_prefill = spec.num_prefill_replicas
    # serve.deployment(cls, ...) returns a Deployment; its stubs only know the decorator form.
    if not num_prefill:
        engine = _engine_deployment(EngineDeployment, ENGINE, spec.num_replicas, spec.router,
                                    spec)
        return ingress.bind(engine.bind(llm_kwargs, waiting), spec)  # type: ignore[attr-defined]
    decode = _engine_deployment(DecodeDeployment, ENGINE, spec.num_replicas - num_prefill,
                                DECODE_POLICY, spec)
    prefill = _engine_deployment(PrefillDeployment, PREFILL, num_prefill, spec.router, spec)
    return ingress.bind(decode.bind(llm_kwargs, waiting), spec,  # type: ignore[attr-defined]
                        prefill.bind(llm_kwargs, waiting))
