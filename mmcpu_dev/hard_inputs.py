"""Hard inputs: requests an OpenAI-compatible multimodal server must answer with a clear 4xx, never 500 or death.

Each :class:`Case` names the endpoint, how to build the request (the ``openai`` client where it can express it,
else :class:`mmcpu_dev.payloads.RawRequest`: exact bytes for httpx) and the expected status. The tests, the compose
smoke check (through the gateway) and anyone else run them the same way:

    from mmcpu_dev import hard_inputs
    for result in hard_inputs.run_all("http://127.0.0.1:8000/v1", api_key="..."):
        print(result.case.name, result.status, result.ok, result.detail)

``run_all`` also sends a good request per modality after the middle case and after the last one (cases named
``alive-audio`` / ``alive-vision``): a hard input must not take the engine down for the requests after it.

The catalogue covers decompression bombs (PNG, JPEG, WebP, GIF and APNG, declared or real, frames counted), media
URLs that reach inside (IP literals in every notation, IPv6 loopback and IPv4-mapped forms, names, other schemes:
one fixed answer, :data:`mmcpu.media.FETCH_FAILED`), oversize and deep JSON, huge multipart field counts, slow
bodies, long audio and parameter extremes. Redirects, DNS rebinding and private or metadata addresses need a network
of their own: mmcpu_dev/netlab.py. A case whose answer a part of the product not yet in this tree gives is marked
``pending`` (:data:`PENDING` says which part); :func:`run_all` leaves those out unless asked.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import httpx
import openai

from mmcpu.config import IMAGE_LIMIT, MAX_IMAGE_PIXELS, MAX_MEDIA_MB
from mmcpu.media import FETCH_FAILED
from mmcpu_dev import payloads
from mmcpu_dev.checks import CheckFailed, openai_error_body
from mmcpu_dev.payloads import RawRequest, image_chat_kwargs, test_image, transcription_kwargs

Modality = Literal["audio", "vision"]
LONG_TEXT = "word " * 5000  # far beyond any context here (Whisper decoder 448, tiny-llava 1024)
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
CHAT = "/v1/chat/completions"
# vLLM 0.26.0's limit on decoded audio (envs.VLLM_MAX_AUDIO_DECODE_DURATION_S, default 600 s): longer
# uploads are refused before decoding when the container states its length (FLAC/WAV headers).
MAX_AUDIO_S = 600
# The gateway's body limit (MMCPU_MAX_UPLOAD_MB's default) and the answers agreed for what crosses it.
MAX_UPLOAD_MB = 25
# Hosts the test engines list in MMCPU_MEDIA_DOMAINS (tests/conftest.py): every one is loopback in some spelling,
# so the cases below prove that even a LISTED host is refused when it is not a public address. Addresses outside
# loopback (private, link-local, metadata) are proven in a network of their own (mmcpu_dev/netlab.py), never here.
LISTED_LOOPBACK = [
    "localhost",
    "127.0.0.1",
    "2130706433",
    "0177.0.0.1",
    "0x7f.0.0.1",
    "0x7f000001",
    "127.1",
    "0.0.0.0",
    "0",
    "::1",
    "::",
    "::ffff:127.0.0.1",
    "::ffff:7f00:1",
]
# Parts of the product whose answers some cases expect and which this tree does not have yet.
# None today: the gateway's request bounds (JSON depth and size, body deadline, n / best_of / max_tokens) answer
# every case that once waited for them.
PENDING: dict[str, str] = {}


@dataclass(frozen=True)
class OpenAICall:
    """``client.<method>(**kwargs)`` with the unmodified openai client, e.g. method="chat.completions.create"."""

    method: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class SlowBody:
    """``request`` sent over a raw socket: the headers and half the body at once, then one byte a second for as long
    as the case's timeout, unless the server answers first (slow-loris)."""

    request: RawRequest


Request = OpenAICall | RawRequest | SlowBody


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str
    modality: Modality
    build: Callable[[str], Request] = field(repr=False)  # served model name -> request
    status: int = 400
    why: str = ""
    param: str | None = None  # when set, the error must name this parameter (OpenAI's error.param)
    message: str | None = None  # when set, the error message must start with it (a fixed text) or contain it
    pending: str | None = None  # a key of PENDING: the answer comes with that part of the product
    timeout_s: float = 120


class Result(NamedTuple):
    case: Case
    status: int | None  # None: no HTTP answer (timeout, connection refused: the engine hung or died)
    ok: bool
    detail: str


# --- request builders of the cases ----------------------------------------------------------------
def _stt(
    audio: bytes | Callable[[], bytes], fmt: str = "wav", *, endpoint: str = TRANSCRIPTIONS, **kwargs: Any
) -> Callable[[str], Request]:
    """``audio`` as bytes, or a builder called when the case is sent (audio that takes seconds to encode)."""
    method = "audio.translations.create" if endpoint == TRANSLATIONS else "audio.transcriptions.create"

    def build(model: str) -> Request:
        args = transcription_kwargs(
            audio() if callable(audio) else audio,
            model=model,
            filename=f"audio.{fmt}",
            content_type=payloads.audio_mime(fmt),
            **kwargs,
        )
        if endpoint == TRANSLATIONS:
            args.pop("language", None)  # translations take no language
        return OpenAICall(method, args)

    return build


def _chat(images: list, **kwargs: Any) -> Callable[[str], Request]:
    return lambda model: OpenAICall("chat.completions.create", image_chat_kwargs(images, model=model, **kwargs))


def _chat_with(**override: Any) -> Callable[[str], Request]:
    """A one-image chat with some fields replaced by values the typed client would not build."""

    def build(model: str) -> Request:
        return OpenAICall("chat.completions.create", {**image_chat_kwargs([test_image(1)], model=model), **override})

    return build


def _raw_chat(mutate: Callable[[dict[str, Any]], Any], **raw: Any) -> Callable[[str], Request]:
    def build(model: str) -> Request:
        body = image_chat_kwargs([test_image(1)], model=model)
        body = mutate(body) or body
        request = payloads.raw_json(CHAT, body)
        if raw:
            request = RawRequest(CHAT, raw.get("body", request.body), raw.get("headers", request.headers))
        return request

    return build


def _truncated(fmt: str, keep: int) -> bytes:
    """A 1 s tone in ``fmt``, cut after ``keep`` bytes: inside the container's header / first page or frame."""
    return payloads.audio_file(1.0, fmt)[:keep]


def _corrupt_frames(fmt: str) -> bytes:
    """The header intact, the coded frames after it overwritten with a fixed garbage pattern."""
    data = bytearray(payloads.audio_file(1.0, fmt))
    start = min(len(data) // 4, 200)
    data[start:] = bytes((i * 37 + 11) % 256 for i in range(len(data) - start))
    return bytes(data)


def _multipart(fields: Callable[[str], dict[str, str]], files: dict | None = None) -> Callable[[str], Request]:
    return lambda model: payloads.raw_multipart(TRANSCRIPTIONS, fields(model), files)


def _stt_form(endpoint: str, extra: dict[str, str], **kwargs: Any) -> Callable[[str], Request]:
    """A 1 s tone as raw multipart plus ``extra`` fields the typed client has no argument for (a stream on
    translations, vLLM's stream options)."""

    def build(model: str) -> Request:
        data, files = payloads.audio_form(transcription_kwargs(payloads.audio_file(1.0), model=model, **kwargs))
        return payloads.raw_multipart(endpoint, {**data, **extra}, files)

    return build


CASES: list[Case] = [
    # --- audio: /v1/audio/transcriptions (and translations) on the Whisper engine -------------------------
    Case(
        "audio-too-long",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(MAX_AUDIO_S + 1, "flac", tone_hz=None), "flac"),
        why=f"{MAX_AUDIO_S + 1} s of (tiny, FLAC-compressed) silence: over vLLM's {MAX_AUDIO_S} s decode limit",
    ),
    Case(
        "truncated-mp3",
        TRANSCRIPTIONS,
        "audio",
        _stt(_truncated("mp3", 120), "mp3"),
        why="an MP3 cut inside its first frame",
    ),
    Case(
        "truncated-ogg",
        TRANSCRIPTIONS,
        "audio",
        _stt(_truncated("ogg", 60), "ogg"),
        why="an Ogg Vorbis file cut inside its first page",
    ),
    Case(
        "truncated-flac",
        TRANSCRIPTIONS,
        "audio",
        _stt(_truncated("flac", 30), "flac"),
        why="a FLAC file cut inside STREAMINFO",
    ),
    Case(
        "corrupt-flac-frames",
        TRANSCRIPTIONS,
        "audio",
        _stt(_corrupt_frames("flac"), "flac"),
        why="a FLAC header followed by garbage instead of frames",
    ),
    Case(
        "corrupt-mp3-frames",
        TRANSCRIPTIONS,
        "audio",
        _stt(_corrupt_frames("mp3"), "mp3"),
        why="an MP3's first bytes followed by garbage",
    ),
    Case(
        "zero-length-audio",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(0.0, "wav")),
        why="a well-formed WAV with no samples",
    ),
    Case(
        "zero-length-flac",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(0.0, "flac"), "flac"),
        why="a well-formed FLAC with no samples",
    ),
    Case(
        "invalid-response-format",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(1.0), response_format="xml"),
        why="response_format outside json/text/srt/verbose_json/vtt",
    ),
    Case(
        "verbose-json-stream",
        TRANSCRIPTIONS,
        "audio",
        lambda model: OpenAICall(
            "audio.transcriptions.create",
            {
                **transcription_kwargs(payloads.audio_file(1.0), model=model, response_format="verbose_json"),
                "stream": True,
            },
        ),
        param="response_format",
        why="verbose_json cannot stream (vLLM) - must say so, not fail mid-stream",
    ),
    # A stream is OpenAI's transcript.text.* events, text only (mmcpu/stt): the other formats refuse it.
    *[
        Case(
            f"stream-{fmt.replace('_', '-')}",
            TRANSCRIPTIONS,
            "audio",
            _stt(payloads.audio_file(1.0), response_format=fmt, stream=True),
            param="response_format",
            why=f"stream with response_format={fmt}: no streamed form (events carry text only)",
        )
        for fmt in ("srt", "vtt", "diarized_json")
    ],
    # Word timestamps need verbose_json (OpenAI's rule).
    *[
        Case(
            f"word-timestamps-{fmt}",
            TRANSCRIPTIONS,
            "audio",
            _stt_form(TRANSCRIPTIONS, {"timestamp_granularities[]": "word"}, response_format=fmt),
            param="timestamp_granularities",
            why=f"timestamp_granularities=[word] with response_format={fmt}",
        )
        for fmt in ("json", "text")
    ],
    # Segment timestamps: known values only, and only with verbose_json.
    Case(
        "timestamp-granularity-unknown",
        TRANSCRIPTIONS,
        "audio",
        _stt_form(TRANSCRIPTIONS, {"timestamp_granularities[]": "sentence"}, response_format="verbose_json"),
        param="timestamp_granularities",
        why="timestamp_granularities holds a value other than segment/word",
    ),
    Case(
        "segment-timestamps-json",
        TRANSCRIPTIONS,
        "audio",
        _stt_form(TRANSCRIPTIONS, {"timestamp_granularities[]": "segment"}, response_format="json"),
        param="timestamp_granularities",
        why="timestamp_granularities=[segment] with response_format=json",
    ),
    Case(
        "translation-stream-srt",
        TRANSLATIONS,
        "audio",
        _stt_form(TRANSLATIONS, {"stream": "true"}, response_format="srt"),
        param="response_format",
        why="a translation stream with srt: refused like a transcription's",
    ),
    Case(
        "stream-options-without-stream",
        TRANSCRIPTIONS,
        "audio",
        _stt_form(TRANSCRIPTIONS, {"stream_include_usage": "true"}),
        param="stream_include_usage",
        why="vLLM's stream_include_usage without stream=true",
    ),
    Case(
        "stream-with-beam-search",
        TRANSCRIPTIONS,
        "audio",
        _stt_form(TRANSCRIPTIONS, {"stream": "true", "use_beam_search": "true"}),
        why="vLLM's use_beam_search cannot stream",
    ),
    Case(
        "beam-search-verbose-json",
        TRANSCRIPTIONS,
        "audio",
        _stt_form(TRANSCRIPTIONS, {"use_beam_search": "true"}, response_format="verbose_json"),
        param="use_beam_search",
        why="use_beam_search with a timestamped format (the package times greedy or sampled decodes only)",
    ),
    Case(
        "temperature-above-range-audio",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(1.0), temperature=5.0),
        why="temperature 5 (OpenAI: 0..1 for audio)",
    ),
    Case(
        "temperature-negative-audio",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(1.0), temperature=-1.0),
        why="temperature -1",
    ),
    Case(
        "unknown-language-code",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(1.0), language="xx"),
        why="language that is no ISO-639-1 code Whisper knows",
    ),
    Case(
        "wrong-content-type-audio",
        TRANSCRIPTIONS,
        "audio",
        lambda model: payloads.raw_json(TRANSCRIPTIONS, {"model": model, "file": "speech.wav"}),
        why="a JSON body where multipart/form-data is required",
    ),
    Case(
        "multipart-without-file",
        TRANSCRIPTIONS,
        "audio",
        _multipart(lambda model: {"model": model, "language": "en"}),
        why="multipart/form-data with the fields but no file part",
    ),
    Case(
        "file-field-not-a-file",
        TRANSCRIPTIONS,
        "audio",
        _multipart(lambda model: {"model": model, "file": "hello"}),
        status=422,
        why="'file' sent as a plain form field, not as a file (vLLM answers 422 on purpose)",
    ),
    Case(
        "prompt-over-decoder-context",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(1.0), language="en", prompt=LONG_TEXT),
        why="a `prompt` far longer than Whisper's 448-token decoder",
    ),
    Case(
        "stream-truncated-flac",
        TRANSCRIPTIONS,
        "audio",
        _stt(_truncated("flac", 30), "flac", stream=True),
        why="streaming asked for, the audio unreadable: a 4xx before any event, not an error event in a 200",
    ),
    Case(
        "chat-with-audio-model",
        CHAT,
        "audio",
        lambda model: OpenAICall(
            "chat.completions.create",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        ),
        status=404,
        why="a chat completion for the Whisper model: its engine has no chat route",
    ),
    Case(
        "get-on-transcriptions",
        TRANSCRIPTIONS,
        "audio",
        lambda model: RawRequest(TRANSCRIPTIONS, b"", method="GET"),
        status=405,
        why="GET on a POST-only route",
    ),
    # chunking_strategy (mmcpu/stt, mmcpu/vad.py): "auto" or OpenAI's server_vad object, refused before any decoding.
    *[
        Case(
            f"chunking-strategy-{name}",
            TRANSCRIPTIONS,
            "audio",
            _stt_form(TRANSCRIPTIONS, fields),
            param="chunking_strategy",
            why=why,
        )
        for name, fields, why in [
            ("unknown-string", {"chunking_strategy": "fixed"}, "chunking_strategy 'fixed' (only 'auto' or an object)"),
            ("wrong-type", {"chunking_strategy": "[1, 2]"}, "chunking_strategy a JSON list"),
            ("unknown-object-type", {"chunking_strategy[type]": "client_vad"}, "an object of type client_vad"),
            (
                "threshold-out-of-range",
                {"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "1.5"},
                "server_vad threshold 1.5 (OpenAI: 0..1)",
            ),
            (
                "negative-silence",
                {"chunking_strategy": '{"type": "server_vad", "silence_duration_ms": -5}'},
                "server_vad silence_duration_ms -5",
            ),
            (
                "padding-not-integer",
                {"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "ten"},
                "server_vad prefix_padding_ms 'ten'",
            ),
            (
                "padding-beyond-bound",
                {"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "20000"},
                "server_vad prefix_padding_ms 20000 (0..10000)",
            ),
        ]
    ],
    Case(
        "translation-truncated-flac",
        TRANSLATIONS,
        "audio",
        _stt(_truncated("flac", 30), "flac", endpoint=TRANSLATIONS),
        why="the translations route shares the decoder: same 4xx",
    ),
    # --- vision: /v1/chat/completions with image_url parts on the LLaVA engine --------------------------------
    Case(
        "transcription-with-vision-model",
        TRANSCRIPTIONS,
        "vision",
        _stt(payloads.audio_file(1.0)),
        status=404,
        why="a transcription for the LLaVA model: its engine has no audio route",
    ),
    Case(
        "decompression-bomb-png",
        CHAT,
        "vision",
        _chat([payloads.png_declaring(30000, 30000)]),
        why="74-byte PNG declaring 30000x30000 (900 Mpx)",
    ),
    Case(
        "huge-dimensions-jpeg",
        CHAT,
        "vision",
        _chat([payloads.jpeg_declaring(65000, 65000)]),
        why="a tiny JPEG whose frame header claims 65000x65000",
    ),
    Case(
        "huge-dimensions-truncated-png",
        CHAT,
        "vision",
        _chat([payloads.png_declaring(12000, 12000)]),
        message="The image is 12000x12000 = 144000000 pixels",
        why="144 Mpx declared (under PIL's bomb limit), one row of data",
    ),
    Case(
        "too-many-images",
        CHAT,
        "vision",
        _chat([test_image(i) for i in range(IMAGE_LIMIT + 1)]),
        param="image",
        why=f"{IMAGE_LIMIT + 1} images, MMCPU_MAX_IMAGES (the engine's --limit-mm-per-prompt) is {IMAGE_LIMIT}",
    ),
    Case(
        "malformed-image-url",
        CHAT,
        "vision",
        _chat(["this is not a url"]),
        message=FETCH_FAILED,
        why="image_url that is no URL",
    ),
    Case(
        "unsupported-url-scheme",
        CHAT,
        "vision",
        _chat(["ftp://127.0.0.1/image.png"]),
        message=FETCH_FAILED,
        why="ftp:// image URL",
    ),
    Case(
        "file-url",
        CHAT,
        "vision",
        _chat(["file:///etc/passwd"]),
        message=FETCH_FAILED,
        why="file:// is refused like any unfetchable URL, never read",
    ),
    Case(
        "unreachable-image-url",
        CHAT,
        "vision",
        _chat(["http://127.0.0.1:9/none.png"]),
        message=FETCH_FAILED,
        why="a closed port on the server itself: the same answer as an open one",
    ),
    Case(
        "data-url-not-base64",
        CHAT,
        "vision",
        _chat(["data:image/png;charset=utf-8,not-base64-at-all"]),
        why="a data: URL in another encoding than base64 (unpatched: 501)",
    ),
    Case(
        "data-url-without-comma", CHAT, "vision", _chat(["data:image/png;base64"]), why="a data: URL with no data part"
    ),
    Case(
        "data-url-wrong-mime",
        CHAT,
        "vision",
        _chat([payloads.image_data_url(b"just text", mime="text/plain")]),
        why="data: URL of text/plain",
    ),
    Case(
        "model-not-a-string",
        CHAT,
        "vision",
        _raw_chat(lambda body: {**body, "model": 123}),
        why='"model": 123 (the typed client cannot send it)',
    ),
    Case(
        "wrong-content-type-chat",
        CHAT,
        "vision",
        _raw_chat(lambda body: None, headers={"Content-Type": "text/plain"}),
        why="a JSON chat body labelled text/plain",
    ),
    Case(
        "invalid-json",
        CHAT,
        "vision",
        lambda model: RawRequest(
            CHAT, b'{"model": "' + model.encode() + b'", "messages": [', {"Content-Type": "application/json"}
        ),
        why="a JSON document cut in the middle",
    ),
    Case("empty-messages", CHAT, "vision", _chat_with(messages=[]), why="messages: []"),
    Case(
        "temperature-above-range-chat",
        CHAT,
        "vision",
        _chat([test_image(1)], temperature=5.0),
        why="temperature 5 (OpenAI: 0..2)",
    ),
    Case("temperature-negative-chat", CHAT, "vision", _chat([test_image(1)], temperature=-1.0), why="temperature -1"),
    Case("n-zero", CHAT, "vision", _chat([test_image(1)], n=0), why="n = 0"),
    Case("n-negative", CHAT, "vision", _chat([test_image(1)], n=-3), why="n = -3"),
    Case("max-tokens-negative", CHAT, "vision", _chat([test_image(1)], max_tokens=-5), why="max_tokens = -5"),
    Case("n-too-large", CHAT, "vision", _chat([test_image(1)], n=100_000), why="n = 100000"),
    Case(
        "prompt-over-context",
        CHAT,
        "vision",
        _chat([test_image(1)], prompt=LONG_TEXT),
        why="text far beyond the model's context, beside an image",
    ),
    Case(
        "stream-decompression-bomb",
        CHAT,
        "vision",
        _chat([payloads.png_declaring(30000, 30000)], stream=True),
        why="the bomb again, streaming: a 4xx before any event",
    ),
    # MRV2's sampler has fixed per-request tables; overflowing one killed the engine (patches/0014).
    Case(
        "bad-words-too-long",
        CHAT,
        "vision",
        _chat_with(extra_body={"bad_words": ["x" * 3000]}),
        why="one bad word of thousands of tokens (MRV2 holds 1024 per request)",
    ),
    Case(
        "bad-words-too-many",
        CHAT,
        "vision",
        _chat_with(extra_body={"bad_words": [f"w{i}" for i in range(200)]}),
        why="200 bad words (MRV2 holds 128)",
    ),
    Case(
        "allowed-token-ids-too-many",
        CHAT,
        "vision",
        _chat_with(extra_body={"allowed_token_ids": [5] * 1025}),
        why="1025 allowed_token_ids (MRV2 holds 1024)",
    ),
    Case(
        "stop-token-ids-too-many",
        CHAT,
        "vision",
        _chat_with(extra_body={"min_tokens": 1, "stop_token_ids": list(range(1, 200))}),
        why="199 stop_token_ids with min_tokens (MRV2 holds 128)",
    ),
    Case(
        "max-tokens-over-context",
        CHAT,
        "vision",
        _chat([test_image(1)], max_tokens=10**7),
        why="max_tokens far beyond the model's context",
    ),
    Case(
        "image-url-not-an-object",
        CHAT,
        "vision",
        _chat_with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": 42}]}]),
        why="image_url part whose image_url is a number",
    ),
]

CASES += [
    # --- decompression bombs: declared or real, frames counted (MMCPU_MAX_IMAGE_PIXELS, before decoding) -------
    *[
        Case(f"bomb-{name}", CHAT, "vision", _chat([data]), param="image_url", message="The image is", why=why)
        for name, data, why in [
            (
                "png-real-13000",
                payloads.png_bomb(13000),
                "a REAL 13000x13000 1-bit PNG (~20 KB; ~480 MiB as RGB): refused from its header",
            ),
            ("jpeg-real-8000", payloads.jpeg_bomb(8000), "a REAL 8000x8000 JPEG (~750 KB, 64 Mpx)"),
            ("webp-16000", payloads.webp_declaring(16000, 16000), "a lossless WebP declaring 16000x16000"),
            (
                "webp-animated-40-frames",
                payloads.webp_declaring(1000, 1000, 40),
                "an animated WebP: 40 frames of 1000x1000 (each frame alone would pass)",
            ),
            (
                "gif-65535-screen",
                payloads.gif_declaring(65535, 65535, 1),
                "a GIF whose logical screen is 65535x65535 (PIL decodes onto a canvas that size)",
            ),
            ("gif-40-frames", payloads.gif_declaring(2000, 2000, 40), "a GIF of 40 frames on a 2000x2000 screen"),
            (
                "apng-million-frames",
                payloads.apng_declaring(100, 100, 1_000_000),
                "an APNG whose acTL claims a million 100x100 frames",
            ),
            ("apng-13000", payloads.apng_declaring(13000, 13000, 2), "an APNG declaring 13000x13000, two frames"),
            (
                "png-one-over-limit",
                payloads.png_bomb(MAX_IMAGE_PIXELS // 3000 + 1, 3000),
                f"a real 1-bit PNG one column over {MAX_IMAGE_PIXELS} pixels: the limit is exact",
            ),
        ]
    ],
    Case(
        "bomb-four-png-13000",
        CHAT,
        "vision",
        _chat([payloads.png_bomb(13000)] * 4),
        param="image_url",
        message="The image is",
        why="four real 13000x13000 1-bit PNGs, ~80 KB in all: once a dead vision engine",
    ),
    Case(
        "bomb-png-stream",
        CHAT,
        "vision",
        _chat([payloads.png_bomb(13000)], stream=True),
        param="image_url",
        why="a real bomb, streaming: a 400 before any event",
    ),
    Case(
        "bomb-after-a-good-image",
        CHAT,
        "vision",
        _chat([test_image(7), payloads.png_bomb(13000)]),
        param="image_url",
        why="a good image first, then the bomb: the request fails whole",
    ),
    *[
        Case(
            f"image-format-{fmt.lower()}",
            CHAT,
            "vision",
            _chat([payloads.image_bytes(fmt)]),
            param="image_url",
            message="The image could not be decoded",
            why=f"a {fmt} file: only PNG, JPEG, WEBP and GIF are decoded",
        )
        for fmt in ("BMP", "TIFF", "ICO", "TGA", "PPM")
    ],
    Case(
        "data-url-over-media-limit",
        CHAT,
        "vision",
        _chat([f"data:image/png;base64,{'A' * (int(MAX_MEDIA_MB * 2**20) * 4 // 3 + 4096)}"]),
        param="image_url",
        message="The media item is",
        why=f"a data: URL payload over MMCPU_MAX_MEDIA_MB ({MAX_MEDIA_MB:g} MiB), "
        "refused from its length before base64 is decoded",
    ),
    Case(
        "data-url-empty-payload",
        CHAT,
        "vision",
        _chat(["data:image/png;base64,"]),
        param="image_url",
        why="a data: URL with nothing after the comma",
    ),
    Case(
        "data-url-invalid-base64",
        CHAT,
        "vision",
        _chat(["data:image/png;base64,!!!!not*base64!!!!"]),
        param="image_url",
        why="characters outside base64's alphabet",
    ),
    Case(
        "far-too-many-images",
        CHAT,
        "vision",
        _chat([test_image(1)] * 500),
        param="image",
        why="500 images: refused by count before any is decoded",
    ),
    Case(
        "video-url-on-image-model",
        CHAT,
        "vision",
        _chat_with(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": "http://127.0.0.1:8002/v.mp4"}},
                        {"type": "text", "text": "?"},
                    ],
                }
            ]
        ),
        why="a video part for a model without video input",
    ),
    Case(
        "audio-url-on-image-model",
        CHAT,
        "vision",
        _chat_with(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:8001/a.wav"}},
                        {"type": "text", "text": "?"},
                    ],
                }
            ]
        ),
        why="an audio part for a model without audio input",
    ),
    Case(
        "image-embeds-not-enabled",
        CHAT,
        "vision",
        _chat_with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_embeds", "image_embeds": "AAAA"}, {"type": "text", "text": "?"}],
                }
            ]
        ),
        why="precomputed embeddings (a pickled tensor) without --enable-mm-embeds",
    ),
    # --- media URLs that reach inside: ONE answer, whether the port is open, closed, listed or not --------------
    Case("image-url-empty", CHAT, "vision", _chat([""]), why="an empty image URL (vLLM refuses it before loading)"),
    *[
        Case(f"ssrf-{name}", CHAT, "vision", _chat([url]), param="image_url", message=FETCH_FAILED, why=why)
        for name, url, why in [
            ("loopback-open-port", "http://127.0.0.1:8002/v1/models", "the vision engine's own API (open in compose)"),
            ("loopback-closed-port", "http://127.0.0.1:9/x.png", "a closed port: the same answer as an open one"),
            ("loopback-ssh", "http://127.0.0.1:22/", "another service's port"),
            ("decimal", "http://2130706433:8002/v1/models", "127.0.0.1 as one decimal number"),
            ("octal", "http://0177.0.0.1:8002/v1/models", "127.0.0.1 with an octal first byte"),
            ("hex-dotted", "http://0x7f.0.0.1:8002/v1/models", "127.0.0.1 with a hex first byte"),
            ("hex-whole", "http://0x7f000001:8002/v1/models", "127.0.0.1 as one hex number"),
            ("short-form", "http://127.1:8002/v1/models", "127.0.0.1 in inet_aton's short form"),
            ("zero-address", "http://0.0.0.0:8002/v1/models", "0.0.0.0, which Linux connects to loopback"),
            ("zero-short", "http://0:8002/v1/models", "0, short for 0.0.0.0"),
            ("ipv6-loopback", "http://[::1]:8002/v1/models", "IPv6 loopback"),
            ("ipv6-unspecified", "http://[::]:8002/v1/models", "IPv6 ::, loopback when connected to"),
            ("ipv4-mapped", "http://[::ffff:127.0.0.1]:8002/v1/models", "IPv4-mapped IPv6 of loopback"),
            ("ipv4-mapped-hex", "http://[::ffff:7f00:1]:8002/v1/models", "the same in hex groups"),
            ("localhost", "http://localhost:8002/v1/models", "a name that resolves to loopback"),
            ("localhost-dot", "http://localhost.:8002/v1/models", "the same name, fully qualified"),
            ("localhost-upper", "HTTP://LOCALHOST:8002/v1/models", "upper-case scheme and host"),
            ("userinfo-trick", "http://localhost@images.example.invalid/x.png", "the host is after the @"),
            ("unlisted-host", "https://images.example.invalid/x.png", "a host MMCPU_MEDIA_DOMAINS does not list"),
            ("scheme-relative", "//127.0.0.1:8002/v1/models", "no scheme"),
            ("gopher", "gopher://127.0.0.1:6379/_INFO", "gopher:// to a Redis port"),
            ("dict", "dict://127.0.0.1:11211/stats", "dict:// to a memcached port"),
            ("file-localhost", "file://localhost/etc/passwd", "file:// with a host"),
            ("file-proc", "file:///proc/self/environ", "file:// of the process's environment"),
            ("javascript", "javascript:alert(1)", "javascript:"),
        ]
    ],
    # --- bodies the gateway bounds (agreed answers; the audio route for multipart, chat for JSON) ---------------
    Case(
        "json-body-over-upload-limit",
        CHAT,
        "vision",
        lambda model: RawRequest(
            CHAT,
            b'{"model": "' + model.encode() + b'", "x": "' + b"a" * ((MAX_UPLOAD_MB << 20) + 1) + b'"}',
            {"Content-Type": "application/json"},
        ),
        status=413,
        why=f"a JSON body one byte over MMCPU_MAX_UPLOAD_MB ({MAX_UPLOAD_MB} MiB): 413 request_too_large",
    ),
    Case(
        "chunked-body-over-upload-limit",
        CHAT,
        "vision",
        lambda model: RawRequest(
            CHAT,
            b" " * ((MAX_UPLOAD_MB << 20) + 1024),
            {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        ),
        status=413,
        why="the same size with no Content-Length (chunked): counted while it streams",
    ),
    Case(
        "multipart-over-upload-limit",
        TRANSCRIPTIONS,
        "audio",
        lambda model: payloads.raw_multipart(
            TRANSCRIPTIONS, {"model": model}, {"file": ("big.wav", b"\0" * ((MAX_UPLOAD_MB << 20) + 1), "audio/wav")}
        ),
        status=413,
        why="an upload one byte over the limit",
    ),
    Case(
        "json-nested-100000",
        CHAT,
        "vision",
        lambda model: RawRequest(
            CHAT,
            b'{"model": "' + model.encode() + b'", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            {"Content-Type": "application/json"},
        ),
        why="nesting 100,000 deep (was a RecursionError and a 500)",
    ),
    Case(
        "json-nested-2000-objects",
        CHAT,
        "vision",
        lambda model: RawRequest(
            CHAT,
            b'{"model": "' + model.encode() + b'", "x": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000 + b"}",
            {"Content-Type": "application/json"},
        ),
        why="objects nested 2,000 deep",
    ),
    Case(
        "json-million-elements",
        CHAT,
        "vision",
        _raw_chat(lambda body: {**body, "x": [0] * 1_000_000}),
        why="a good chat plus a 3 MB array of a million numbers in an unknown field (was parsed in full and served)",
    ),
    Case(
        "json-many-keys",
        CHAT,
        "vision",
        _raw_chat(lambda body: {**body, **{f"k{i}": 0 for i in range(200_000)}}),
        why="a good chat plus 200,000 unknown keys in the top object",
    ),
    Case(
        "json-not-an-object",
        CHAT,
        "vision",
        lambda model: RawRequest(CHAT, b"[1, 2, 3]", {"Content-Type": "application/json"}),
        why="a JSON array where an object is required",
    ),
    Case(
        "json-empty-body",
        CHAT,
        "vision",
        lambda model: RawRequest(CHAT, b"", {"Content-Type": "application/json"}),
        why="no body at all",
    ),
    Case(
        "json-invalid-utf8",
        CHAT,
        "vision",
        lambda model: RawRequest(
            CHAT, b'{"model": "' + model.encode() + b'", "messages": "\xff\xfe"}', {"Content-Type": "application/json"}
        ),
        why="bytes that are not UTF-8 inside a string",
    ),
    Case(
        "multipart-100000-fields",
        TRANSCRIPTIONS,
        "audio",
        _multipart(
            lambda model: {"model": model, **{f"f{i}": "x" for i in range(100_000)}},
            {"file": ("a.wav", payloads.audio_file(1.0), "audio/wav")},
        ),
        why="100,000 form fields beside the file",
    ),
    Case(
        "multipart-10000-files",
        TRANSCRIPTIONS,
        "audio",
        lambda model: payloads.raw_multipart(
            TRANSCRIPTIONS, {"model": model}, {f"file{i}": ("a.wav", b"RIFF", "audio/wav") for i in range(10_000)}
        ),
        why="10,000 file parts",
    ),
    Case(
        "multipart-no-boundary",
        TRANSCRIPTIONS,
        "audio",
        lambda model: RawRequest(TRANSCRIPTIONS, b"--x\r\n\r\n", {"Content-Type": "multipart/form-data"}),
        why="multipart/form-data without a boundary",
    ),
    Case(
        "slow-json-body",
        CHAT,
        "vision",
        lambda model: SlowBody(payloads.raw_json(CHAT, image_chat_kwargs([test_image(1)], model=model))),
        status=408,
        timeout_s=45,
        why="a chat body that trickles a byte a second (slow-loris) past the body deadline",
    ),
    Case(
        "slow-multipart-body",
        TRANSCRIPTIONS,
        "audio",
        lambda model: SlowBody(
            payloads.raw_multipart(
                TRANSCRIPTIONS, {"model": model}, {"file": ("a.wav", payloads.audio_file(1.0), "audio/wav")}
            )
        ),
        status=408,
        timeout_s=45,
        why="an upload that trickles past the body deadline",
    ),
    # --- parameter extremes: bounded by settings and the model length, named in error.param ----------------------
    Case(
        "n-1024-one-token",
        CHAT,
        "vision",
        _chat_with(n=1024, max_tokens=1, temperature=1.0),
        param="n",
        why="n=1024 with max_tokens=1, sampled (n=16384 was served: 72 s of one engine)",
    ),
    Case(
        "n-16384-greedy",
        CHAT,
        "vision",
        _chat_with(n=16384, max_tokens=1),
        why="n=16384 with temperature 0: vLLM refuses n > 1 for greedy sampling",
    ),
    Case(
        "best-of-huge",
        CHAT,
        "vision",
        _chat_with(extra_body={"best_of": 10_000, "n": 1}),
        param="best_of",
        why="vLLM's best_of=10000",
    ),
    Case(
        "max-tokens-over-model-length",
        CHAT,
        "vision",
        _chat([test_image(1)], max_tokens=10**9),
        param="max_tokens",
        why="max_tokens 10^9: over the model length, named",
    ),
    Case(
        "max-completion-tokens-over-model-length",
        CHAT,
        "vision",
        _chat_with(max_tokens=None, max_completion_tokens=10**9),
        param="max_completion_tokens",
        why="max_completion_tokens 10^9",
    ),
    Case("max-tokens-zero", CHAT, "vision", _chat([test_image(1)], max_tokens=0), why="max_tokens = 0"),
    Case("top-p-above-one", CHAT, "vision", _chat_with(top_p=2.0), why="top_p 2"),
    Case("top-p-zero", CHAT, "vision", _chat_with(top_p=0.0), why="top_p 0 (vLLM: in (0, 1])"),
    Case("top-k-negative", CHAT, "vision", _chat_with(extra_body={"top_k": -5}), why="vLLM's top_k -5 (-1 or >= 1)"),
    Case("presence-penalty-out-of-range", CHAT, "vision", _chat_with(presence_penalty=10.0), why="OpenAI: -2..2"),
    Case("frequency-penalty-out-of-range", CHAT, "vision", _chat_with(frequency_penalty=-10.0), why="OpenAI: -2..2"),
    Case(
        "repetition-penalty-zero",
        CHAT,
        "vision",
        _chat_with(extra_body={"repetition_penalty": 0.0}),
        why="vLLM's repetition_penalty 0 (> 0)",
    ),
    Case(
        "top-logprobs-over-limit",
        CHAT,
        "vision",
        _chat_with(logprobs=True, top_logprobs=10_000),
        why="top_logprobs 10000",
    ),
    Case(
        "logit-bias-out-of-range",
        CHAT,
        "vision",
        _chat_with(logit_bias={"5": 1e9}),
        status=200,
        why="a bias of 10^9 (OpenAI: -100..100): vLLM applies it; a bounded answer, the engine unharmed",
    ),
    Case(
        "logit-bias-unknown-token",
        CHAT,
        "vision",
        _chat_with(logit_bias={"999999999": 1}),
        why="a token id beyond the vocabulary",
    ),
    Case(
        "seed-over-64-bits",
        CHAT,
        "vision",
        lambda model: payloads.raw_json(CHAT, {**image_chat_kwargs([test_image(1)], model=model), "seed": 2**70}),
        why="a seed of 2^70",
    ),
    Case("stop-too-many", CHAT, "vision", _chat_with(stop=[f"s{i}" for i in range(10_000)]), why="10,000 stop strings"),
    Case(
        "messages-unknown-role",
        CHAT,
        "vision",
        _chat_with(messages=[{"role": "robot", "content": "hi"}]),
        status=200,
        why="a role that is not system/user/assistant/tool/developer: vLLM hands it to the chat "
        "template; a bounded answer",
    ),
    Case(
        "content-part-unknown-type",
        CHAT,
        "vision",
        _chat_with(messages=[{"role": "user", "content": [{"type": "hologram", "hologram": {}}]}]),
        why="a content part of an unknown type",
    ),
    Case(
        "model-path-traversal",
        CHAT,
        "vision",
        lambda model: OpenAICall(
            "chat.completions.create", {**image_chat_kwargs([test_image(1)], model="../../../../etc/passwd")}
        ),
        status=404,
        why="a model name that is a path: no such model, nothing read",
    ),
    Case(
        "model-huge-name",
        CHAT,
        "vision",
        lambda model: OpenAICall(
            "chat.completions.create", {**image_chat_kwargs([test_image(1)], model="m" * 100_000)}
        ),
        status=404,
        why="a 100,000-character model",
    ),
    Case(
        "response-format-bad-schema",
        CHAT,
        "vision",
        _chat_with(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
        ),
        why="a JSON schema that is not one",
    ),
    # --- audio of long duration: refused before it is decoded (today vLLM's VLLM_MAX_AUDIO_DECODE_DURATION_S, 600 s,
    # from the container's header; the speech API's own MMCPU_MAX_AUDIO_S answers the same 400) --------------------
    Case(
        "audio-wav-1hz-16000s",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.wav_declaring(1, 16_000)),
        why="16,000 samples at 1 Hz: 32 KB that resample to 256 M samples (1 GiB of float32) at 16 kHz",
    ),
    Case(
        "audio-wav-8hz-hours",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.wav_declaring(8, 3600)),
        why="8 Hz for an hour: 57 KB",
    ),
    Case(
        "audio-wav-data-claims-4gb",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.wav_declaring(16000, 1.0, claimed_bytes=0xFFFFFFF0)),
        status=200,
        why="a WAV whose data chunk claims 4 GiB (37 hours at 16 kHz) with 1 s present: the decoder reads what is "
        "there, a bounded answer",
    ),
    Case(
        "audio-flac-2h-silence",
        TRANSCRIPTIONS,
        "audio",
        _stt(lambda: payloads.long_silence(7200, "flac"), "flac"),
        why="two hours of FLAC silence (~ 300 KB)",
    ),
    Case(
        "audio-ogg-20min-silence",
        TRANSCRIPTIONS,
        "audio",
        _stt(lambda: payloads.long_silence(1200, "ogg"), "ogg"),
        why="20 minutes of Ogg Vorbis silence (the length is read from the last page)",
    ),
    Case(
        "translation-flac-2h-silence",
        TRANSLATIONS,
        "audio",
        _stt(lambda: payloads.long_silence(7200, "flac"), "flac", endpoint=TRANSLATIONS),
        why="the same two hours on the translations route",
    ),
]

# Good requests: the engine must still serve after the hard ones.
ALIVE: dict[Modality, Case] = {
    "audio": Case(
        "alive-audio",
        TRANSCRIPTIONS,
        "audio",
        _stt(payloads.audio_file(1.0), language="en"),
        status=200,
        why="a 1 s tone, greedy: any text, HTTP 200",
    ),
    "vision": Case(
        "alive-vision", CHAT, "vision", _chat([test_image(1), test_image(2)]), status=200, why="two images, greedy"
    ),
}


def by_name(name: str) -> Case:
    return next(c for c in [*CASES, *ALIVE.values()] if c.name == name)


# --- sending ----------------------------------------------------------------------------------------------
def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def send(request: Request, base_url: str, api_key: str = "unused", timeout_s: float = 120) -> tuple[int | None, Any]:
    """Send one request; return (HTTP status, JSON body or text). (None, reason) when no HTTP answer came."""
    try:
        if isinstance(request, SlowBody):
            return _send_slow(request.request, base_url, api_key, timeout_s)
        if isinstance(request, RawRequest):
            url = _v1(base_url) + request.path.removeprefix("/v1")
            headers = {"Authorization": f"Bearer {api_key}", **request.headers}
            content: Any = request.body
            if headers.get("Transfer-Encoding") == "chunked":  # no Content-Length: httpx sends an iterator chunked
                del headers["Transfer-Encoding"]
                content = (request.body[i : i + 2**20] for i in range(0, len(request.body), 2**20))
            response = httpx.request(request.method, url, content=content, headers=headers, timeout=timeout_s)
            return response.status_code, _body(response)
        client = openai.OpenAI(base_url=_v1(base_url), api_key=api_key, max_retries=0, timeout=timeout_s)
        target: Any = client
        for attr in request.method.split("."):
            target = getattr(target, attr)
        try:
            result = target(**request.kwargs)
        except openai.APIStatusError as exc:
            return exc.status_code, _body(exc.response)
        if isinstance(result, openai.Stream):
            try:
                return 200, [event.model_dump() for event in result]
            except openai.APIError as exc:  # an error event inside a 200 stream: too late for a status
                return 200, f"error event in the stream: {exc}"
        return 200, result if isinstance(result, str) else result.model_dump()
    except (openai.APIConnectionError, httpx.HTTPError) as exc:  # APITimeoutError is an APIConnectionError
        return None, f"{type(exc).__name__}: {exc}"


def _send_slow(request: RawRequest, base_url: str, api_key: str, timeout_s: float) -> tuple[int | None, Any]:
    url = httpx.URL(_v1(base_url) + request.path.removeprefix("/v1"))
    headers = {
        "Host": url.netloc.decode(),
        "Authorization": f"Bearer {api_key}",
        **request.headers,
        "Content-Length": str(len(request.body)),
        "Connection": "close",
    }
    head = (
        f"{request.method} {url.raw_path.decode()} HTTP/1.1\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "\r\n"
    )
    deadline = time.monotonic() + timeout_s
    half = len(request.body) // 2
    with socket.create_connection((url.host, url.port or 80), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + request.body[:half])
        sent = half
        answer = b""
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
                continue
            if answer:
                break
            if sent < len(request.body):
                try:
                    sock.sendall(request.body[sent : sent + 1])
                    sent += 1
                except OSError:
                    break
    if not answer:
        return None, f"no answer within {timeout_s:.0f} s while the body trickled"
    status_line, _, rest = answer.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        return None, f"not HTTP: {answer[:120]!r}"
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def judge(case: Case, status: int | None, body: Any) -> tuple[bool, str]:
    """A case passes with its expected status and, for errors, OpenAI's error schema (all four fields)."""
    if status != case.status:
        return False, f"expected HTTP {case.status}, got {status}: {str(body)[:300]}"
    if status >= 400:
        try:
            error = openai_error_body(body, strict=True)
        except CheckFailed as exc:
            return False, str(exc)
        if case.param is not None and error["param"] != case.param:
            return False, f"expected error.param {case.param!r}, got {error['param']!r}: {error['message'][:200]}"
        if case.message is not None and not error["message"].startswith(case.message):
            return False, f"expected a message starting {case.message[:60]!r}, got {error['message'][:200]!r}"
        return True, error["message"][:200]
    return True, str(body)[:120]


def run_case(case: Case, base_url: str, api_key: str = "unused", *, model: str, timeout_s: float = 120) -> Result:
    status, body = send(case.build(model), base_url, api_key, min(timeout_s, case.timeout_s))
    ok, detail = judge(case, status, body)
    return Result(case, status, ok, detail)


def default_models() -> dict[Modality, str]:
    """The served model names of the compose engines (mmcpu.config audio_model / vision_model)."""
    from mmcpu.config import get_settings
    from mmcpu.launch import served_name

    settings = get_settings()
    return {"audio": served_name(settings.audio_model), "vision": served_name(settings.vision_model)}


def run_all(
    base_url: str,
    api_key: str = "unused",
    *,
    models: dict[Modality, str] | None = None,
    modalities: Iterable[Modality] = ("audio", "vision"),
    timeout_s: float = 120,
    include_pending: bool = False,
) -> list[Result]:
    """Every case of the given modalities (not the pending ones unless asked), with ``alive-*`` good requests after
    the middle case and the last."""
    models = {**default_models(), **(models or {})}
    chosen = set(modalities)
    cases = [c for c in CASES if c.modality in chosen and (include_pending or not c.pending)]
    alive = [ALIVE[m] for m in ("audio", "vision") if m in chosen]
    plan = cases[: len(cases) // 2] + alive + cases[len(cases) // 2 :] + alive
    return [run_case(c, base_url, api_key, model=models[c.modality], timeout_s=timeout_s) for c in plan]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--audio-model")
    parser.add_argument("--vision-model")
    parser.add_argument("--only", choices=["audio", "vision"], action="append")
    parser.add_argument("--include-pending", action="store_true", help="also the cases marked pending (PENDING)")
    args = parser.parse_args(argv)
    models = {k: v for k, v in {"audio": args.audio_model, "vision": args.vision_model}.items() if v}
    results = run_all(
        args.base_url,
        args.api_key,
        models=models,
        modalities=args.only or ("audio", "vision"),
        include_pending=args.include_pending,
    )
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.case.name} [{r.case.endpoint}] -> {r.status}: {r.detail}", flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
