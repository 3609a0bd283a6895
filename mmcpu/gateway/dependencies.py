"""FastAPI dependencies shared by the routers: the app's Upstreams, the optional API key, the size limit."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from mmcpu.config import Settings
from mmcpu.gateway.errors import BodyTooLarge, OpenAIError
from mmcpu.gateway.upstream import Upstreams


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


def get_upstreams(request: Request) -> Upstreams:
    return request.app.state.upstreams


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
UpstreamsDep = Annotated[Upstreams, Depends(get_upstreams)]


def limit_bytes(settings: Settings) -> int:
    return int(settings.max_upload_mb * 1024 * 1024)


async def verify_api_key(request: Request, settings: SettingsDep) -> None:
    expected = settings.api_key.get_secret_value() if settings.api_key is not None else ""
    if not expected:  # unset or empty (compose's `MMCPU_API_KEY=${MMCPU_API_KEY:-}`): no key required
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.encode()):
        raise OpenAIError(
            401,
            "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def check_content_length(request: Request, settings: SettingsDep) -> None:
    """Reject an announced oversize body before any engine is contacted."""
    declared = request.headers.get("content-length")
    if declared is None:
        return
    if not declared.isdigit():
        raise OpenAIError(400, f"Invalid Content-Length header: {declared!r}")
    if int(declared) > limit_bytes(settings):
        raise BodyTooLarge(limit_bytes(settings))


# Order matters: a client without the key learns nothing else (401 before 413).
API_DEPENDENCIES = [Depends(verify_api_key), Depends(check_content_length)]
