"""GET /v1/cluster: the replicas, their load and cached blocks, hit rates by source (local
memory, disk, Redis, computed), and the router's decisions and prediction accuracy.

The route is added to the ingress's app (`kvstack serve --replicas`); a single-engine server
has no such route. It needs an API key like the other /v1 routes; its figures are per replica
and per cluster, never per tenant.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request

from kvstack.cluster.client import ClusterEngine
from kvstack.server.auth import AuthTenant
from kvstack.server.errors import ApiError
from kvstack.server.state import server_state

router = APIRouter()


@router.get("/v1/cluster")
async def cluster(request: Request, _: AuthTenant) -> dict[str, Any]:
    engine = server_state(request).engine
    if not isinstance(engine, ClusterEngine):
        raise ApiError(404, "this server runs one engine; /v1/cluster answers on "
                            "`kvstack serve --replicas N`", code="not_a_cluster")
    return engine.describe_cluster()


def add_cluster_routes(app: FastAPI) -> FastAPI:
    app.include_router(router)
    return app
