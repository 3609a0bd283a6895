"""The ``vllm.endpoint_plugins`` entry point ``mmcpu_stt``: POST /v1/audio/transcriptions and /translations.

vLLM attaches a plugin's router after its own and drops its own route of the same path and method; this plugin
keeps that route's endpoint (and, from ``init_state``, vLLM's serving objects) to hand it every request the package
does not cover. With ``MMCPU_STT_ROUTES=vllm`` it attaches nothing, so vLLM's routes stay exactly as they are."""

# No `from __future__ import annotations`: FastAPI must read the routes' Form() annotations, made in router().
import json
import logging
from argparse import Namespace
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from mmcpu.stt import PLUGIN_NAME, ROUTE_HEADER, formats
from mmcpu.stt.serving import TASKS, SpeechServing

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handlers: in the engine's log
PATHS = {task: f"/v1/audio/{task}" for task in TASKS}
PLAIN_TEXT = ("text", "srt", "vtt")  # OpenAI's formats that vLLM's own serving does not generate


def _enabled() -> bool:
    from mmcpu.config import get_settings

    return get_settings().stt_routes == "plugin"


class SttPlugin:
    name = PLUGIN_NAME
    required_tasks = ("transcription",)  # speech models only; vision engines never load it

    def __init__(self) -> None:
        self.core_endpoints: dict[str, Any] = {}  # vLLM's own route handlers, by task ("transcriptions", ...)
        self.serving: dict[str, SpeechServing] = {}
        self.attached = False

    def attach_router(self, app: FastAPI) -> None:
        if not _enabled():
            logger.info("mmcpu_stt: MMCPU_STT_ROUTES=vllm, vLLM's speech routes stay in place")
            return
        for route in app.routes:
            for task, path in PATHS.items():
                if isinstance(route, APIRoute) and route.path == path and "POST" in route.methods:
                    self.core_endpoints[task] = route.endpoint
        app.include_router(self.router())
        paths = set(PATHS.values())

        @app.middleware("http")
        async def route_header(request: Request, call_next: Any) -> Response:
            # Requests refused while vLLM's request model parses the form never reach the route: name it too.
            response: Response = await call_next(request)
            if request.url.path in paths and ROUTE_HEADER not in response.headers:
                response.headers[ROUTE_HEADER] = "plugin"
            return response

        self.attached = True

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if not self.attached:
            return
        if engine_client is None:
            raise RuntimeError("mmcpu_stt needs an engine (it was loaded on vLLM's render-only server)")
        cores = {
            "transcriptions": getattr(state, "openai_serving_transcription", None),
            "translations": getattr(state, "openai_serving_translation", None),
        }
        for task, core in cores.items():
            if core is not None:
                self.serving[task] = SpeechServing(engine_client, core, TASKS[task])
        logger.info("mmcpu_stt serves %s (MMCPU_STT_ROUTES=plugin)", ", ".join(PATHS[t] for t in self.serving))

    # --- routes -----------------------------------------------------------------------------------------------------
    def router(self) -> APIRouter:
        from pydantic import Field
        from vllm.entrypoints.serve.utils.api_utils import load_aware_call, with_cancellation
        from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest
        from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest

        class Transcription(TranscriptionRequest):
            # Any value parses, so that an unknown one is the package's 400 naming timestamp_granularities (vLLM's
            # Literal would be a validation error naming "body.0").
            timestamp_granularities: list[str] = Field(alias="timestamp_granularities[]", default=[])

        router = APIRouter()

        @with_cancellation
        @load_aware_call
        async def own(raw_request: Request, request: Any, task: str) -> Response:
            return await self.answer(self.serving[task], request)

        async def serve(raw_request: Request, request: Any, task: str) -> Response:
            serving = self.serving.get(task)
            reason = "engine" if serving is None else serving.delegation(request)
            route = "plugin" if reason is None else f"vllm; reason={reason}"
            try:
                if reason is None:
                    response = await own(raw_request=raw_request, request=request, task=task)
                else:
                    logger.debug("mmcpu_stt hands %s to vLLM's serving: %s", PATHS[task], reason)
                    response = await self.delegate(raw_request, request, task)
            except Exception as exc:
                # The app's own handler (vLLM's: OpenAI's error schema) answers, with the route header too.
                handler = _handler(raw_request.app, exc)
                if handler is None:
                    raise
                response = await handler(raw_request, exc)
            response.headers[ROUTE_HEADER] = route
            return response

        @router.post(PATHS["transcriptions"])
        async def transcriptions(raw_request: Request, request: Annotated[Transcription, Form()]) -> Response:
            return await serve(raw_request, request, "transcriptions")

        @router.post(PATHS["translations"])
        async def translations(raw_request: Request, request: Annotated[TranslationRequest, Form()]) -> Response:
            return await serve(raw_request, request, "translations")

        return router

    async def delegate(self, raw_request: Request, request: Any, task: str) -> Response:
        """vLLM's serving answers. It generates json / verbose_json only: text, srt and vtt are asked of it as json /
        verbose_json and rendered here, as the package renders its own."""
        fmt = request.response_format
        if fmt not in PLAIN_TEXT or request.stream:
            response: Response = await self.core_endpoints[task](raw_request=raw_request, request=request)
            return response
        request.response_format = "json" if fmt == "text" else "verbose_json"
        response = await self.core_endpoints[task](raw_request=raw_request, request=request)
        if response.status_code != 200:
            return response
        doc = json.loads(bytes(response.body))
        if fmt == "text":
            return PlainTextResponse(str(doc.get("text", "")).strip() + "\n")
        segments = [
            formats.Segment(float(s["start"]), float(s["end"]), str(s["text"]), [], 0.0, 0)
            for s in doc.get("segments") or []
        ]
        return PlainTextResponse(formats.subtitles(segments, fmt))

    @staticmethod
    async def answer(serving: SpeechServing, request: Any) -> Response:
        from vllm.entrypoints.speech_to_text.base.utils import read_upload_with_limit

        data = await read_upload_with_limit(request.file)
        if request.stream:
            return StreamingResponse(await serving.stream(request, data), media_type="text/event-stream")
        result = await serving.answer(request, data)
        if isinstance(result, str):
            return PlainTextResponse(result)
        return JSONResponse(result)


def _handler(app: Any, exc: Exception) -> Any:
    """The app's exception handler for ``exc`` (the nearest class in its MRO), or None."""
    handlers = getattr(app, "exception_handlers", {})
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


def factory() -> SttPlugin:
    """The entry point (pyproject.toml ``[project.entry-points."vllm.endpoint_plugins"]``)."""
    return SttPlugin()
