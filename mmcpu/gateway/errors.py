"""The OpenAI error schema: every error the gateway itself produces is ``{"error": {message, type, param, code}}``.

Errors coming from an engine are not rebuilt here: vLLM already answers in this schema, so they pass through.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("mmcpu.gateway")


class ClientGone(Exception):
    """The client disconnected while its request waited for the engine: nobody is left to answer."""


class OpenAIError(Exception):
    """Raise anywhere in the gateway to answer with an OpenAI-style error."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class BodyTooLarge(OpenAIError):
    def __init__(self, limit_bytes: int) -> None:
        super().__init__(
            413,
            f"Request body is larger than the gateway's limit of {limit_bytes} bytes (MMCPU_MAX_UPLOAD_MB).",
            code="request_too_large",
        )


class BodyTimeout(OpenAIError):
    def __init__(self, timeout_s: float) -> None:
        # Connection: close: the rest of the body is not waited for.
        super().__init__(
            408,
            f"The request body did not arrive within {timeout_s:g} s (MMCPU_BODY_TIMEOUT_S).",
            code="request_timeout",
            headers={"Connection": "close"},
        )


def engine_unavailable(engine: str, detail: str) -> OpenAIError:
    return OpenAIError(
        503, f"The {engine} engine is unavailable: {detail}", type="server_error", code="engine_unavailable"
    )


def install_error_handlers(app: FastAPI) -> None:
    """Map FastAPI's own errors (404 route, 405, validation) and crashes to the OpenAI schema too."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        # Nobody reads this (the client disconnected); 499 labels it in the metrics and the log line.
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return OpenAIError(400, first.get("msg", "invalid request"), param=param).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, f"Internal gateway error: {type(exc).__name__}", type="server_error").response()
