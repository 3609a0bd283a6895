"""Audio routes: the multipart upload goes to the audio engine byte for byte, streamed, never parsed here."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import StreamingResponse

from mmcpu.gateway.dependencies import UpstreamsDep

router = APIRouter(tags=["audio"])


@router.post("/v1/audio/transcriptions")
@router.post("/v1/audio/translations")
async def audio(request: Request, upstreams: UpstreamsDep) -> StreamingResponse:
    return await upstreams.forward(upstreams.engines["audio"], request, request.stream())
