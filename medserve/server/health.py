"""Liveness, readiness (every model's state) and Prometheus metrics: the probes an orchestrator polls."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from medserve.server.services import services

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    store = services(request).store
    ready = store.ready.is_set()
    models = {e.name: e.state for e in store.entries()}
    return JSONResponse({"ready": ready, "models": models}, 200 if ready else 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(services(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
