"""vLLM's media connector with mmcpu's URL policy and size limits: ``VLLM_MEDIA_CONNECTOR=mmcpu``.

vLLM renders a chat in its API server process and loads each ``image_url`` / ``audio_url`` / ``video_url`` part
through the connector that ``MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, ...)`` builds
(``vllm/renderers/chat_utils.py``). The general plugin (mmcpu/plugin.py), which vLLM loads in that process too,
registers :class:`PolicyMediaConnector` there under :data:`NAME`; the launcher sets ``VLLM_MEDIA_CONNECTOR`` for
every engine. vLLM's own connector and its download code stay untouched: this one replaces only
``load_from_url`` / ``load_from_url_async``, which every ``fetch_*`` method goes through.

- ``data:`` URLs: their encoded size is checked before base64 is decoded, an image's header before it is decoded.
- http(s) URLs: :class:`mmcpu.media.policy.Policy` (listed host, public address, re-checked on every redirect),
  one attempt within the fetch timeout for the whole chain, no proxy from the environment, no transfer encoding
  that could inflate the body, at most MMCPU_MAX_MEDIA_MB read. Every failure (refused, unreachable, timed out,
  an error status such as a 5xx, an undecodable body) answers 400 with :data:`FETCH_FAILED`, one fixed text: the
  client learns nothing about what is or is not listening where. Only a size limit is named.
- ``file:`` URLs are refused like an unfetchable URL (``--allowed-local-media-path`` has no effect here).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
import pybase64
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.media.audio import AudioMediaIO
from vllm.multimodal.media.base import MediaIO
from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector, global_thread_pool
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from yarl import URL

from mmcpu.config import get_settings
from mmcpu.media import FETCH_FAILED, limits
from mmcpu.media.policy import Policy, PublicResolver, Refused

NAME = "mmcpu"
BAD_BASE64 = "The data: URL's payload is not valid base64."
MAX_REDIRECTS = 3
DEFAULT_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default, for a caller that passes none
REDIRECTS = frozenset({301, 302, 303, 307, 308})
CHUNK = 64 * 1024

logger = logging.getLogger("vllm.mmcpu.media")
_M = TypeVar("_M")


def param_of(media_io: MediaIO[Any]) -> str:
    """The request field a media item came from, for error.param."""
    if isinstance(media_io, VideoMediaIO):
        return "video_url"
    if isinstance(media_io, AudioMediaIO):
        return "audio_url"
    return "image_url"


class PolicyMediaConnector(MediaConnector):
    """See the module docstring. Built per rendered request, like vLLM's own."""

    def __init__(
        self,
        media_io_kwargs: dict[str, dict[str, Any]] | None = None,
        *args: Any,
        allowed_local_media_path: str = "",
        allowed_media_domains: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(media_io_kwargs, *args, allowed_media_domains=allowed_media_domains, **kwargs)
        settings = get_settings()
        # The launcher passes MMCPU_MEDIA_DOMAINS as --allowed-media-domains; the setting is read too, for an
        # engine started some other way with this connector.
        self.policy = Policy([*(allowed_media_domains or []), *settings.media_domains])
        self.max_bytes = int(settings.max_media_mb * 2**20)
        self.max_pixels = settings.max_image_pixels
        if allowed_local_media_path:
            logger.warning("--allowed-local-media-path is ignored: the mmcpu media connector refuses file: URLs")

    # --- decoding, with the limits first -------------------------------------------------------------
    def _decode(self, data: bytes, media_io: MediaIO[_M]) -> _M:
        limits.check_bytes(len(data), self.max_bytes, param=param_of(media_io))
        if isinstance(media_io, ImageMediaIO):
            limits.check_image(data, self.max_pixels)
        return media_io.load_bytes(data)

    def _load_data(self, url: str, media_io: MediaIO[_M]) -> _M:
        # RFC 2397: data:[<mediatype>][;<param>=<value>]*[;base64],<data>
        spec, sep, payload = url[5:].partition(",")
        media_type, _, encoding = spec.rpartition(";")
        param = param_of(media_io)
        if not sep or encoding.lower() != "base64":
            raise VLLMValidationError("A data: URL must be base64-encoded: data:<type>;base64,<data>.", parameter=param)
        limits.check_bytes(len(payload) * 3 // 4, self.max_bytes, param=param)  # before decoding anything
        if not isinstance(media_io, ImageMediaIO):
            # Audio and video keep their own base64 handling (video/jpeg is a list of frames).
            return media_io.load_base64(media_type.partition(";")[0], payload)
        try:
            data = pybase64.b64decode(payload, validate=True)
        except ValueError:  # binascii.Error is a ValueError
            raise VLLMValidationError(BAD_BASE64, parameter=param) from None
        return self._decode(data, media_io)

    # --- fetching --------------------------------------------------------------------------------------
    async def _fetch(self, url: str, param: str, timeout_s: float) -> bytes:
        target = self.policy.check_url(url)
        # A new session per fetch: no pooled connection to a host checked for another request, no DNS cache.
        connector = aiohttp.TCPConnector(resolver=PublicResolver(), use_dns_cache=False, force_close=True)
        headers = {"User-Agent": "mmcpu-media", "Accept-Encoding": "identity"}
        async with (
            asyncio.timeout(timeout_s),
            aiohttp.ClientSession(
                connector=connector, trust_env=False, auto_decompress=False, headers=headers
            ) as session,
        ):
            for _hop in range(MAX_REDIRECTS + 1):
                async with session.get(target, allow_redirects=False) as response:
                    if response.status in REDIRECTS:
                        location = response.headers.get("Location")
                        if not location:
                            raise Refused("redirect without Location")
                        target = self.policy.check_url(target.join(URL(location)))
                        continue
                    if response.status != 200:
                        raise Refused(f"HTTP {response.status}")
                    if response.headers.get("Content-Encoding", "identity").lower() != "identity":
                        raise Refused(f"Content-Encoding {response.headers['Content-Encoding']}")
                    if response.content_length is not None:
                        limits.check_bytes(response.content_length, self.max_bytes, param=param)
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.content.iter_chunked(CHUNK):
                        size += len(chunk)
                        limits.check_bytes(size, self.max_bytes, param=param, at_least=True)
                        chunks.append(chunk)
                    return b"".join(chunks)
            raise Refused(f"more than {MAX_REDIRECTS} redirects")

    async def _load_remote(self, url: str, media_io: MediaIO[_M], timeout_s: float | None) -> _M:
        param = param_of(media_io)
        try:
            if url[:5].lower() != "http:" and url[:6].lower() != "https:":
                raise Refused("not an http(s) URL")
            data = await self._fetch(url, param, timeout_s or DEFAULT_TIMEOUT_S)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(global_thread_pool, self._decode, data, media_io)
        except limits.OverLimit:
            raise
        except Exception as exc:
            # The reason goes to the engine's log for the operator, never to the client.
            logger.info("media URL refused or failed: %s: %s", type(exc).__name__, exc)
            raise VLLMValidationError(FETCH_FAILED, parameter=param) from None

    # --- vLLM's MediaConnector interface -----------------------------------------------------------------
    async def load_from_url_async(self, url: str, media_io: MediaIO[_M], *, fetch_timeout: int | None = None) -> _M:
        if url[:5].lower() == "data:":
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(global_thread_pool, self._load_data, url, media_io)
        return await self._load_remote(url, media_io, fetch_timeout)

    def load_from_url(self, url: str, media_io: MediaIO[_M], *, fetch_timeout: int | None = None) -> _M:
        if url[:5].lower() == "data:":
            return self._load_data(url, media_io)
        # The synchronous path (vLLM's offline LLM.chat): the same fetch, in an event loop of its own.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._load_remote(url, media_io, fetch_timeout)).result()


MEDIA_CONNECTOR_REGISTRY.register(NAME)(PolicyMediaConnector)
