"""Operations routes, open without the API key: /ping (liveness), /health (readiness; per engine with the key) and
/metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mmcpu.gateway.dependencies import SettingsDep, UpstreamsDep, verify_api_key
from mmcpu.gateway.errors import OpenAIError

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(request: Request, upstreams: UpstreamsDep, settings: SettingsDep) -> JSONResponse:
    # Ready while at least one engine is: the gateway serves the engines that are up and answers 503 for the others'
    # models, so one engine down must not take the whole base URL out of a load balancer.
    await upstreams.probe_all()
    down = list(upstreams.down())
    status = "ok" if not down else "degraded" if len(down) < len(upstreams.engines) else "unavailable"
    code = 503 if status == "unavailable" else 200
    try:
        await verify_api_key(request, settings)
    except OpenAIError:
        # Without the key: up or down only. Engine names, addresses, models and errors map the inside.
        return JSONResponse({"status": status}, status_code=code)
    engines = {
        e.name: {
            "url": e.url,
            "up": bool(e.up),
            "models": [m.get("id") for m in e.models],
            **({} if e.up else {"error": e.error}),
        }
        for e in upstreams.engines.values()
    }
    return JSONResponse({"status": status, "down": down, "engines": engines}, status_code=code)


@router.get("/ping")
async def ping() -> dict[str, str]:
    # Liveness of the gateway alone: restarting it would not bring a down engine back.
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request, upstreams: UpstreamsDep) -> Response:
    await upstreams.probe_all()  # fresh engine_up gauges at every scrape
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
