"""Chat completions: routed by the body's ``model`` to the engine that serves it; the body is sent unchanged."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from starlette.responses import StreamingResponse

from mmcpu.gateway.dependencies import UpstreamsDep
from mmcpu.gateway.errors import OpenAIError

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, upstreams: UpstreamsDep) -> StreamingResponse:
    raw = await request.body()  # the size limit applies while this reads (GatewayMiddleware)
    try:
        payload = json.loads(raw)
    except ValueError as exc:
        raise OpenAIError(400, f"The request body is not valid JSON: {exc}") from exc
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str) or not model:
        # Two engines sit behind this URL, so there is no default model to fall back on.
        raise OpenAIError(400, "'model' is required: a model id from /v1/models.", param="model")
    engine = await upstreams.engine_for_model(model)
    # The body parsed as JSON, so say so even if the client did not (vLLM's FastAPI insists on it).
    return await upstreams.forward(engine, request, raw, default_content_type="application/json")
