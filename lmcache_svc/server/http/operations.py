"""REST routes for operators: stats and Prometheus metrics (admin routes when
authentication is on), liveness and readiness (always open)."""

from __future__ import annotations

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from lmcache_svc.server.http.edge import error_response
from lmcache_svc.server.http.models import ErrorResponse, StatsResponse, StatusResponse
from lmcache_svc.server.http.routing import RouteTable, State
from lmcache_svc.server.stats import stats_fields

ROUTES = RouteTable()


@ROUTES.route("GET", "/v1/stats", summary="Tier usage, leases and namespaces", tags=["operations"])
def stats(state: State) -> StatsResponse:
    return StatsResponse.model_validate(stats_fields(state.cache))


@ROUTES.route(
    "GET",
    "/metrics",
    summary="Prometheus metrics",
    tags=["operations"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(state: State) -> Response:
    return Response(state.cache.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@ROUTES.route("GET", "/healthz", summary="Liveness: 200 while the process serves", tags=["health"])
async def healthz() -> StatusResponse:
    return StatusResponse(status="ok")


@ROUTES.route(
    "GET",
    "/readyz",
    summary="Readiness: 200 when ready to serve traffic, else 503",
    tags=["health"],
    responses={200: {"model": StatusResponse}, 503: {"model": ErrorResponse}},
)
async def readyz(request: Request, state: State) -> Response:
    if not state.ready():
        return error_response(request.scope, 503, "not_ready", "the server is not ready yet")
    return JSONResponse({"status": "ready"})
