"""The Ray Serve request router: a thin adapter from Ray's `RequestRouter` to `ClusterView`.

Ray creates one router per `DeploymentHandle` (in the handle owner's process, running in an
event loop of its own thread) and feeds it each replica's `routing_stats` on every change;
`choose_replicas` returns ranks of replicas, best first, and Ray sends the request to the
least-busy replica of the first rank with room (`max_ongoing_requests`).

The ingress creates the `ClusterView` and registers it (`register_view`) before its handle
makes a router, so the view it reads for /v1/cluster and feeds with snapshots is the one the
router decides with; a router in a process without a registered view makes its own.
Ray pickles this module by value (its classes travel to the handle owner's process), so it
keeps no state of its own: the registry lives in `view`, which is imported there as usual.
Calls carrying a `Control` go to their target replica (any replica when it is gone: the
replica then refuses); anything else is routed by load alone.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvstack.cluster.view import ClusterView, registered_view
from kvstack.cluster.wire import Control, ReplicaRequest


class KvstackRouter(RequestRouter):
    """`request_router_class` of the engine deployment (`kvstack.cluster.ray_router:...`)."""

    def initialize_state(self, policy: str = "cache-aware", **view_kwargs: Any) -> None:
        deployment = self._deployment_id
        view = registered_view(deployment.app_name, deployment.name)
        self.view = view if view is not None else ClusterView(policy, **view_kwargs)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.view.update({r.replica_id.unique_id: r.routing_stats for r in replicas},
                         time.time())

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.remove(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        arg = _first_arg(pending_request)
        if isinstance(arg, Control):
            target = by_name.get(arg.target or "")
            return [[target]] if target is not None else [candidate_replicas]
        if not isinstance(arg, ReplicaRequest):
            return [candidate_replicas]
        ranks = self.view.choose(arg, list(by_name), time.time())
        return [[by_name[n] for n in rank if n in by_name] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        arg = _first_arg(pending_request)
        if isinstance(arg, ReplicaRequest):
            self.view.routed(arg, replica_id.unique_id, time.time())


def _first_arg(pending_request: PendingRequest | None) -> object:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
