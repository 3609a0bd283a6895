"""Operations routes, open without the API key: /health (all engines up?), /ping (this process answers) and
/metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mmcpu.gateway.dependencies import UpstreamsDep

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(upstreams: UpstreamsDep) -> JSONResponse:
    reasons = await upstreams.probe_all()
    engines = {
        name: {"url": upstreams.engines[name].url, "up": why is None, **({"error": why} if why else {})}
        for name, why in reasons.items()
    }
    down = [name for name, why in reasons.items() if why is not None]
    body = {"status": "ok" if not down else "unavailable", "down": down, "engines": engines}
    return JSONResponse(body, status_code=200 if not down else 503)


@router.get("/ping")
async def ping() -> dict[str, str]:
    # Liveness of the gateway alone: restarting it would not bring a down engine back.
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request, upstreams: UpstreamsDep) -> Response:
    await upstreams.probe_all()  # fresh engine_up gauges at every scrape
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
