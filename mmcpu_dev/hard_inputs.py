"""Hard inputs: requests an OpenAI-compatible multimodal server must answer with a clear 4xx, never 500 or death.

Each :class:`Case` names the endpoint, how to build the request (the ``openai`` client where it can express it,
else :class:`mmcpu_dev.payloads.RawRequest`: exact bytes for httpx) and the expected status. The tests, the compose
smoke check (through the gateway) and anyone else run them the same way:

    from mmcpu_dev import hard_inputs
    for result in hard_inputs.run_all("http://127.0.0.1:8000/v1", api_key="..."):
        print(result.case.name, result.status, result.ok, result.detail)

``run_all`` also sends a good request per modality after the middle case and after the last one (cases named
``alive-audio`` / ``alive-vision``): a hard input must not take the engine down for the requests after it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import httpx
import openai

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
# The vision engine's --limit-mm-per-prompt (mmcpu.config vision_args, tests/conftest.py llava_engine).
IMAGE_LIMIT = 4


@dataclass(frozen=True)
class OpenAICall:
    """``client.<method>(**kwargs)`` with the unmodified openai client, e.g. method="chat.completions.create"."""

    method: str
    kwargs: dict[str, Any]


Request = OpenAICall | RawRequest


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str
    modality: Modality
    build: Callable[[str], Request] = field(repr=False)  # served model name -> request
    status: int = 400
    why: str = ""
    param: str | None = None  # when set, the error must name this parameter (OpenAI's error.param)


class Result(NamedTuple):
    case: Case
    status: int | None  # None: no HTTP answer (timeout, connection refused: the engine hung or died)
    ok: bool
    detail: str


# --- request builders of the cases ----------------------------------------------------------------
def _stt(audio: bytes, fmt: str = "wav", *, endpoint: str = TRANSCRIPTIONS, **kwargs: Any) -> Callable[[str], Request]:
    method = "audio.translations.create" if endpoint == TRANSLATIONS else "audio.transcriptions.create"

    def build(model: str) -> Request:
        args = transcription_kwargs(
            audio, model=model, filename=f"audio.{fmt}", content_type=payloads.audio_mime(fmt), **kwargs
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
    Case("audio-too-long", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(MAX_AUDIO_S + 1, "flac", tone_hz=None), "flac"),
         why=f"{MAX_AUDIO_S + 1} s of (tiny, FLAC-compressed) silence: over vLLM's {MAX_AUDIO_S} s decode limit"),
    Case("truncated-mp3", TRANSCRIPTIONS, "audio", _stt(_truncated("mp3", 120), "mp3"),
         why="an MP3 cut inside its first frame"),
    Case("truncated-ogg", TRANSCRIPTIONS, "audio", _stt(_truncated("ogg", 60), "ogg"),
         why="an Ogg Vorbis file cut inside its first page"),
    Case("truncated-flac", TRANSCRIPTIONS, "audio", _stt(_truncated("flac", 30), "flac"),
         why="a FLAC file cut inside STREAMINFO"),
    Case("corrupt-flac-frames", TRANSCRIPTIONS, "audio", _stt(_corrupt_frames("flac"), "flac"),
         why="a FLAC header followed by garbage instead of frames"),
    Case("corrupt-mp3-frames", TRANSCRIPTIONS, "audio", _stt(_corrupt_frames("mp3"), "mp3"),
         why="an MP3's first bytes followed by garbage"),
    Case("zero-length-audio", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(0.0, "wav")),
         why="a well-formed WAV with no samples"),
    Case("zero-length-flac", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(0.0, "flac"), "flac"),
         why="a well-formed FLAC with no samples"),
    Case("invalid-response-format", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(1.0), response_format="xml"),
         why="response_format outside json/text/srt/verbose_json/vtt"),
    Case("verbose-json-stream", TRANSCRIPTIONS, "audio",
         lambda model: OpenAICall("audio.transcriptions.create", {
             **transcription_kwargs(payloads.audio_file(1.0), model=model, response_format="verbose_json"),
             "stream": True}),
         param="response_format", why="verbose_json cannot stream (vLLM) - must say so, not fail mid-stream"),
    # A stream is OpenAI's transcript.text.* events, text only (patches/0019): the other formats refuse it.
    *[Case(f"stream-{fmt.replace('_', '-')}", TRANSCRIPTIONS, "audio",
           _stt(payloads.audio_file(1.0), response_format=fmt, stream=True), param="response_format",
           why=f"stream with response_format={fmt}: no streamed form (events carry text only)")
      for fmt in ("srt", "vtt", "diarized_json")],
    # Word timestamps need verbose_json (OpenAI's rule; patches/0022).
    *[Case(f"word-timestamps-{fmt}", TRANSCRIPTIONS, "audio",
           _stt_form(TRANSCRIPTIONS, {"timestamp_granularities[]": "word"}, response_format=fmt),
           param="timestamp_granularities", why=f"timestamp_granularities=[word] with response_format={fmt}")
      for fmt in ("json", "text")],
    # Segment timestamps (patches/0020): known values only, and only with verbose_json.
    Case("timestamp-granularity-unknown", TRANSCRIPTIONS, "audio",
         _stt_form(TRANSCRIPTIONS, {"timestamp_granularities[]": "sentence"}, response_format="verbose_json"),
         param="timestamp_granularities", why="timestamp_granularities holds a value other than segment/word"),
    Case("segment-timestamps-json", TRANSCRIPTIONS, "audio",
         _stt_form(TRANSCRIPTIONS, {"timestamp_granularities[]": "segment"}, response_format="json"),
         param="timestamp_granularities", why="timestamp_granularities=[segment] with response_format=json"),
    Case("translation-stream-srt", TRANSLATIONS, "audio", _stt_form(TRANSLATIONS, {"stream": "true"}, response_format="srt"),
         param="response_format", why="a translation stream with srt: refused like a transcription's"),
    Case("stream-options-without-stream", TRANSCRIPTIONS, "audio",
         _stt_form(TRANSCRIPTIONS, {"stream_include_usage": "true"}), param="stream_include_usage",
         why="vLLM's stream_include_usage without stream=true"),
    Case("stream-with-beam-search", TRANSCRIPTIONS, "audio",
         _stt_form(TRANSCRIPTIONS, {"stream": "true", "use_beam_search": "true"}),
         why="vLLM's use_beam_search cannot stream"),
    Case("temperature-above-range-audio", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(1.0), temperature=5.0),
         why="temperature 5 (OpenAI: 0..1 for audio)"),
    Case("temperature-negative-audio", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(1.0), temperature=-1.0),
         why="temperature -1"),
    Case("unknown-language-code", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(1.0), language="xx"),
         why="language that is no ISO-639-1 code Whisper knows"),
    Case("wrong-content-type-audio", TRANSCRIPTIONS, "audio",
         lambda model: payloads.raw_json(TRANSCRIPTIONS, {"model": model, "file": "speech.wav"}),
         why="a JSON body where multipart/form-data is required"),
    Case("multipart-without-file", TRANSCRIPTIONS, "audio", _multipart(lambda model: {"model": model, "language": "en"}),
         why="multipart/form-data with the fields but no file part"),
    Case("file-field-not-a-file", TRANSCRIPTIONS, "audio", _multipart(lambda model: {"model": model, "file": "hello"}),
         status=422, why="'file' sent as a plain form field, not as a file (vLLM answers 422 on purpose)"),
    Case("prompt-over-decoder-context", TRANSCRIPTIONS, "audio",
         _stt(payloads.audio_file(1.0), language="en", prompt=LONG_TEXT),
         why="a `prompt` far longer than Whisper's 448-token decoder"),
    Case("stream-truncated-flac", TRANSCRIPTIONS, "audio", _stt(_truncated("flac", 30), "flac", stream=True),
         why="streaming asked for, the audio unreadable: a 4xx before any event, not an error event in a 200"),
    Case("chat-with-audio-model", CHAT, "audio",
         lambda model: OpenAICall("chat.completions.create", {
             "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}),
         status=404, why="a chat completion for the Whisper model: its engine has no chat route"),
    Case("get-on-transcriptions", TRANSCRIPTIONS, "audio", lambda model: RawRequest(TRANSCRIPTIONS, b"", method="GET"),
         status=405, why="GET on a POST-only route"),
    # chunking_strategy (patches/0023): "auto" or OpenAI's server_vad object, refused before any decoding.
    *[Case(f"chunking-strategy-{name}", TRANSCRIPTIONS, "audio", _stt_form(TRANSCRIPTIONS, fields),
           param="chunking_strategy", why=why)
      for name, fields, why in [
          ("unknown-string", {"chunking_strategy": "fixed"}, "chunking_strategy 'fixed' (only 'auto' or an object)"),
          ("wrong-type", {"chunking_strategy": "[1, 2]"}, "chunking_strategy a JSON list"),
          ("unknown-object-type", {"chunking_strategy[type]": "client_vad"}, "an object of type client_vad"),
          ("threshold-out-of-range", {"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "1.5"},
           "server_vad threshold 1.5 (OpenAI: 0..1)"),
          ("negative-silence", {"chunking_strategy": '{"type": "server_vad", "silence_duration_ms": -5}'},
           "server_vad silence_duration_ms -5"),
          ("padding-not-integer", {"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]":
                                   "ten"}, "server_vad prefix_padding_ms 'ten'"),
      ]],
    Case("translation-truncated-flac", TRANSLATIONS, "audio", _stt(_truncated("flac", 30), "flac", endpoint=TRANSLATIONS),
         why="the translations route shares the decoder: same 4xx"),
    # --- vision: /v1/chat/completions with image_url parts on the LLaVA engine --------------------------------
    Case("transcription-with-vision-model", TRANSCRIPTIONS, "vision", _stt(payloads.audio_file(1.0)), status=404,
         why="a transcription for the LLaVA model: its engine has no audio route"),
    Case("decompression-bomb-png", CHAT, "vision", _chat([payloads.png_declaring(30000, 30000)]),
         why="74-byte PNG declaring 30000x30000 (900 Mpx)"),
    Case("huge-dimensions-jpeg", CHAT, "vision", _chat([payloads.jpeg_declaring(65000, 65000)]),
         why="a tiny JPEG whose frame header claims 65000x65000"),
    Case("huge-dimensions-truncated-png", CHAT, "vision", _chat([payloads.png_declaring(12000, 12000)]),
         why="144 Mpx declared (under PIL's bomb limit), one row of data"),
    Case("too-many-images", CHAT, "vision", _chat([test_image(i) for i in range(IMAGE_LIMIT + 1)]),
         why=f"{IMAGE_LIMIT + 1} images, the engine's --limit-mm-per-prompt is {IMAGE_LIMIT}"),
    Case("malformed-image-url", CHAT, "vision", _chat(["this is not a url"]), why="image_url that is no URL"),
    Case("unsupported-url-scheme", CHAT, "vision", _chat(["ftp://127.0.0.1/image.png"]), why="ftp:// image URL"),
    Case("file-url", CHAT, "vision", _chat(["file:///etc/passwd"]),
         why="file:// must be refused (no --allowed-local-media-path), never read"),
    Case("unreachable-image-url", CHAT, "vision", _chat(["http://127.0.0.1:9/none.png"]), status=422,
         why="http URL nobody answers (port 9 on the server itself): 422, as vLLM answers a 404 from the host"),
    Case("data-url-not-base64", CHAT, "vision", _chat(["data:image/png;charset=utf-8,not-base64-at-all"]),
         why="a data: URL in another encoding than base64 (unpatched: 501)"),
    Case("data-url-without-comma", CHAT, "vision", _chat(["data:image/png;base64"]),
         why="a data: URL with no data part"),
    Case("data-url-wrong-mime", CHAT, "vision",
         _chat([payloads.image_data_url(b"just text", mime="text/plain")]),
         why="data: URL of text/plain"),
    Case("model-not-a-string", CHAT, "vision", _raw_chat(lambda body: {**body, "model": 123}),
         why='"model": 123 (the typed client cannot send it)'),
    Case("wrong-content-type-chat", CHAT, "vision",
         _raw_chat(lambda body: None, headers={"Content-Type": "text/plain"}),
         why="a JSON chat body labelled text/plain"),
    Case("invalid-json", CHAT, "vision", lambda model: RawRequest(CHAT, b'{"model": "' + model.encode() + b'", "messages": [',
                                                                 {"Content-Type": "application/json"}),
         why="a JSON document cut in the middle"),
    Case("empty-messages", CHAT, "vision", _chat_with(messages=[]), why="messages: []"),
    Case("temperature-above-range-chat", CHAT, "vision", _chat([test_image(1)], temperature=5.0),
         why="temperature 5 (OpenAI: 0..2)"),
    Case("temperature-negative-chat", CHAT, "vision", _chat([test_image(1)], temperature=-1.0), why="temperature -1"),
    Case("n-zero", CHAT, "vision", _chat([test_image(1)], n=0), why="n = 0"),
    Case("n-negative", CHAT, "vision", _chat([test_image(1)], n=-3), why="n = -3"),
    Case("max-tokens-negative", CHAT, "vision", _chat([test_image(1)], max_tokens=-5), why="max_tokens = -5"),
    Case("n-too-large", CHAT, "vision", _chat([test_image(1)], n=100_000), why="n = 100000"),
    Case("prompt-over-context", CHAT, "vision", _chat([test_image(1)], prompt=LONG_TEXT),
         why="text far beyond the model's context, beside an image"),
    Case("stream-decompression-bomb", CHAT, "vision", _chat([payloads.png_declaring(30000, 30000)], stream=True),
         why="the bomb again, streaming: a 4xx before any event"),
    # MRV2's sampler has fixed per-request tables; overflowing one killed the engine (patches/0014).
    Case("bad-words-too-long", CHAT, "vision", _chat_with(extra_body={"bad_words": ["x" * 3000]}),
         why="one bad word of thousands of tokens (MRV2 holds 1024 per request)"),
    Case("bad-words-too-many", CHAT, "vision", _chat_with(extra_body={"bad_words": [f"w{i}" for i in range(200)]}),
         why="200 bad words (MRV2 holds 128)"),
    Case("allowed-token-ids-too-many", CHAT, "vision", _chat_with(extra_body={"allowed_token_ids": [5] * 1025}),
         why="1025 allowed_token_ids (MRV2 holds 1024)"),
    Case("stop-token-ids-too-many", CHAT, "vision",
         _chat_with(extra_body={"min_tokens": 1, "stop_token_ids": list(range(1, 200))}),
         why="199 stop_token_ids with min_tokens (MRV2 holds 128)"),
    Case("max-tokens-over-context", CHAT, "vision", _chat([test_image(1)], max_tokens=10**7),
         why="max_tokens far beyond the model's context"),
    Case("image-url-not-an-object", CHAT, "vision",
         _chat_with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": 42}]}]),
         why="image_url part whose image_url is a number"),
]

# Good requests: the engine must still serve after the hard ones.
ALIVE: dict[Modality, Case] = {
    "audio": Case("alive-audio", TRANSCRIPTIONS, "audio", _stt(payloads.audio_file(1.0), language="en"), status=200,
                  why="a 1 s tone, greedy: any text, HTTP 200"),
    "vision": Case("alive-vision", CHAT, "vision", _chat([test_image(1), test_image(2)]), status=200,
                   why="two images, greedy"),
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
        if isinstance(request, RawRequest):
            url = _v1(base_url) + request.path.removeprefix("/v1")
            headers = {"Authorization": f"Bearer {api_key}", **request.headers}
            response = httpx.request(request.method, url, content=request.body, headers=headers, timeout=timeout_s)
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
        return True, error["message"][:200]
    return True, str(body)[:120]


def run_case(case: Case, base_url: str, api_key: str = "unused", *, model: str, timeout_s: float = 120) -> Result:
    status, body = send(case.build(model), base_url, api_key, timeout_s)
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
) -> list[Result]:
    """Every case of the given modalities, with ``alive-*`` good requests after the middle case and the last."""
    models = {**default_models(), **(models or {})}
    chosen = set(modalities)
    cases = [c for c in CASES if c.modality in chosen]
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
    args = parser.parse_args(argv)
    models = {k: v for k, v in {"audio": args.audio_model, "vision": args.vision_model}.items() if v}
    results = run_all(args.base_url, args.api_key, models=models, modalities=args.only or ("audio", "vision"))
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.case.name} [{r.case.endpoint}] -> {r.status}: {r.detail}", flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
