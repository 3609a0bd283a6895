"""/v1/models: the engines' lists merged; an engine that is down is left out."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from mmcpu.gateway.dependencies import UpstreamsDep
from mmcpu.gateway.errors import OpenAIError

router = APIRouter(tags=["models"])


async def _merged(upstreams: UpstreamsDep) -> list[dict[str, Any]]:
    await upstreams.refresh()
    if len(upstreams.down()) == len(upstreams.engines):
        raise OpenAIError(
            503, f"No engine is available: {upstreams.down_summary()}", type="server_error", code="engine_unavailable"
        )
    return upstreams.models()


@router.get("/v1/models")
async def list_models(upstreams: UpstreamsDep) -> dict[str, Any]:
    return {"object": "list", "data": await _merged(upstreams)}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, upstreams: UpstreamsDep) -> dict[str, Any]:
    for entry in await _merged(upstreams):
        if entry.get("id") == model:
            return entry
    raise OpenAIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
