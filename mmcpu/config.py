"""The project's one settings module: every knob is an env var ``MMCPU_<FIELD>`` (table: docs/settings.md)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
# A source checkout (editable install) keeps its caches in .cache/; an installed package (the image) has no repo
# root, only site-packages, so there the defaults are the user's cache and the image's /models.
IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file()

# Images per chat request (MMCPU_MAX_IMAGES' default): the launcher gives every vision engine vLLM's
# --limit-mm-per-prompt from it (mmcpu.launch.engine_argv); the fixture tests send two different images per request
# and the hard-input catalogue one more than the limit.
IMAGE_LIMIT = 4
# Pixels per image and encoded MiB per media item (MMCPU_MAX_IMAGE_PIXELS / MMCPU_MAX_MEDIA_MB): measured so that a
# request at every default holds at most ~25 % of the 3 GiB vision engine (docs/security.md#memory-per-request).
MAX_IMAGE_PIXELS = 12_000_000  # a 12-megapixel photo (4000x3000)
MAX_MEDIA_MB = 10.0


def vision_limit_args(max_images: int) -> list[str]:
    """vLLM's per-request image limit as the launcher passes it."""
    return ["--limit-mm-per-prompt", json.dumps({"image": max_images}, separators=(",", ":"))]


VISION_LIMIT_ARGS = vision_limit_args(IMAGE_LIMIT)


class EngineRole(BaseModel):
    """One engine role of the container entrypoint: what it serves, on which port, with which extra vLLM args."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    port: int
    args: str = ""  # extra vLLM arguments, shell-split
    # How its health is probed (mmcpu.health.KINDS); None = from the model (Whisper: audio, else vision).
    kind: Literal["audio", "vision"] | None = None


# Container roles that are not engines (mmcpu.health.GATEWAY / ALL): no engine role may take their names.
NON_ENGINE_ROLES = ("gateway", "all")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MMCPU_", extra="ignore")

    # --- where things live ---------------------------------------------------------------------
    cache_dir: Path = Field(
        REPO_ROOT / ".cache" if IN_CHECKOUT else Path.home() / ".cache" / "mmcpu",
        description="venvs, fixture models, wheels, logs of the dev tooling",
        json_schema_extra={"doc_default": "checkout: `.cache`; installed: `~/.cache/mmcpu`"},
    )
    models_dir: Path = Field(
        REPO_ROOT / ".cache" / "models" if IN_CHECKOUT else Path("/models"),
        description="fixture/real model folders",
        json_schema_extra={"doc_default": "checkout: `.cache/models`; installed: `/models` (the image's)"},
    )

    # --- one vLLM engine (mmcpu-serve) ---------------------------------------------------------
    runner: Literal["v2", "v1"] = Field("v2", description="v2 = Model Runner V2 (MRV2); v1 = classic runner")
    kvcache_gib: float = Field(
        0.25,
        gt=0,
        description="KV cache in GiB (vLLM --kv-cache-memory-bytes). 0.25 holds 17 full-length "
        "Whisper-tiny requests (7.6k tokens) and costs 0.75 GiB less RSS than 1 (measured); raise it for real "
        "models (docs/sizing.md)",
    )
    executor: Literal["uni", "mp"] = Field(
        "uni",
        description="'uni' = vLLM's worker inside the EngineCore process (2 processes, no shared-memory "
        "queue per step); 'mp' = vLLM's CPU default, the worker in a third process",
    )
    omp_threads_bind: str = Field(
        "cpus",
        description="'cpus' = one OpenMP thread per CPU the engine is given (its cpuset and CPU quota; "
        "mmcpu.launch.placement), else VLLM_CPU_OMP_THREADS_BIND as it is: 'auto', '0-3', 'nobind'",
    )
    reserved_cpus: int | None = Field(
        None,
        ge=0,
        description="with 'cpus': cores kept for vLLM's front end; None = 0 below 8 CPUs, 1 from 8, 2 from 16",
    )
    triton_interpret: bool = Field(
        True, description="run MRV2's Triton kernels in Triton's interpreter (no triton-cpu on PyPI)"
    )
    kernels: Literal["native", "interpreter"] = Field(
        "native",
        description="MRV2's Triton kernels: 'native' = torch implementations (mmcpu.kernels); an engine whose "
        "reachable kernels lack a matching native version refuses to start. 'interpreter' = vLLM's own kernels in "
        "Triton's interpreter (a reference, 10-100x slower; float32/float16 models only)",
    )
    kernel_stats: Path | None = Field(
        None,
        description="file where an MRV2 engine keeps its kernel launch counts (JSON: native / interpreted "
        "per kernel, rewritten every second)",
        json_schema_extra={"doc_default": "`/tmp/mmcpu-kernels-PORT.json`"},
    )
    mm_cache_gib: float | None = Field(
        None,
        ge=0,
        description="vLLM's multimodal processor cache per process in GiB (--mm-processor-cache-gb; the "
        "API server and the EngineCore each hold one; 0 = off). vLLM's own 4 GiB each would overrun a 3-4 GiB "
        "container after a few hundred distinct real-sized images",
        json_schema_extra={"doc_default": "4 % of the memory limit (cgroup `memory.max`, else RAM), at most 4"},
    )
    max_model_len: int | None = Field(None, description="--max-model-len; None = the model's own")
    dtype: str | None = Field(
        None,
        description="vLLM --dtype of every engine, overriding the per-CPU default (mmcpu/cpu_defaults.json, "
        "measured per ISA class: `python -m mmcpu_dev.bench defaults`)",
        json_schema_extra={"doc_default": "per role and CPU: `mmcpu/cpu_defaults.json`"},
    )
    quantization: Literal["auto", "none", "int8"] = Field(
        "auto",
        description="Whisper engines: 'int8' = serve the int8 checkpoint beside the model (`<model>-int8`, "
        "made by mmcpu-quantize; none there: refuse to start), 'none' = the float one, 'auto' = the audio role "
        "follows the per-CPU default (mmcpu/cpu_defaults.json) and mmcpu-serve the checkpoint it is given",
    )
    int8_lm_head: bool = Field(
        True,
        description="with an int8 Whisper checkpoint, its output projection (tied to the token embedding, so the "
        "checkpoint keeps it float) runs int8 too, on the kernel the other int8 linears use: AMX with a bf16 model, or "
        "oneDNN on CPUs with VNNI (patches/0030): one decode step 10-12 % faster at c=1 on an AMD EPYC Zen 5 and an "
        "Intel Xeon with AMX, same WER (docs/bench/c1-profile.md). On AVX2 alone it stays float",
    )
    compile: bool = Field(
        False,
        description="torch.compile the model (inductor). Off = --enforce-eager: inductor's C++ build adds minutes "
        "to every cold start and gains little for small models",
    )
    extra_args: str = Field("", description="extra vLLM CLI arguments, shell-split")
    vad_default: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="served model names (comma-separated; '*' = every speech engine) whose transcriptions and "
        "translations without chunking_strategy get 'auto': Silero VAD, only speech encoded, long audio cut at "
        "pauses (docs/api.md#voice-activity-chunking). Unset = vLLM's fixed 30 s windows. Per role: set it in that "
        "role's service. The mmcpu.stt package reads it at start (MMCPU_STT_ROUTES=plugin)",
        json_schema_extra={"doc_default": "unset"},
    )

    stt_routes: Literal["plugin", "vllm"] = Field(
        "plugin",
        description="who answers POST /v1/audio/transcriptions and /translations on a speech engine. plugin = the "
        "mmcpu.stt package (a vllm.endpoint_plugins route; the launcher sets VLLM_PLUGINS=mmcpu,mmcpu_stt for speech "
        "engines and refuses to start one without it, or on a vLLM without MRV2's logits-processor interface, such as "
        "the proof line 0.26): it serves the speech API and hands LoRA / unknown model names "
        "and diarized_json to vLLM's serving (docs/api.md#the-speech-package). vllm = "
        "opt out: vLLM's own speech serving (no chunking_strategy, timestamps of vLLM's own, vLLM's stream chunks)",
    )
    stt_timestamps: Literal["align", "decode"] = Field(
        "align",
        description="how the mmcpu.stt package (MMCPU_STT_ROUTES=plugin) times verbose_json, srt and vtt. align = "
        "each window decoded exactly as json decodes it, then one teacher-forced cross-attention alignment of that "
        "text (segments built from json's own words, so every format keeps them; word timestamps from the same "
        "alignment). decode = one decode per window under Whisper's timestamp rules (the model places the "
        "timestamps; its words may differ from json's). Measured in docs/api.md#the-speech-package",
    )
    # Whisper's guards (mmcpu/stt/guards.py; docs/api.md#whispers-guards), openai-whisper's thresholds. Off by
    # default: on tiny.en they raised the WER of noisy speech (docs/api.md).
    stt_temperature_fallback: Annotated[list[float], NoDecode] = Field(
        default_factory=list,
        description="temperatures (comma-separated, ascending; openai-whisper: 0.2,0.4,0.6,0.8,1.0) a window of a "
        "non-streamed transcription is decoded at again, in turn, while its text compresses above "
        "MMCPU_STT_COMPRESSION_RATIO_THRESHOLD or its mean token logprob is below MMCPU_STT_LOGPROB_THRESHOLD. "
        "Unset = no fallback (streams never fall back: their text is already sent)",
        json_schema_extra={"doc_default": "unset"},
    )
    stt_compression_ratio_threshold: float = Field(
        2.4, gt=0, description="the fallback's gzip compression-ratio threshold (a looping text compresses well)"
    )
    stt_logprob_threshold: float = Field(
        -1.0, le=0, description="the fallback's and the no-speech rule's mean token logprob threshold"
    )
    stt_no_speech_threshold: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="a window whose <|nospeech|> probability is above this while its mean token logprob is below "
        "MMCPU_STT_LOGPROB_THRESHOLD is silence: no text (openai-whisper: 0.6). Needs the alignment method "
        "(MMCPU_STT_TIMESTAMPS=align, a model with alignment heads): it costs one encoder pass per such window. "
        "Unset = off",
        json_schema_extra={"doc_default": "unset"},
    )

    # --- roles of the container entrypoint --------------------------------------------------------
    audio_model: str = Field("/models/whisper-tiny.en", description="model served by the audio engine")
    audio_port: int = Field(8001, description="port of the audio engine")
    vision_model: str = Field("/models/tiny-llava", description="model served by the vision engine")
    vision_port: int = Field(8002, description="port of the vision engine")
    audio_args: str = Field("", description="extra vLLM arguments of the audio engine, shell-split")
    vision_args: str = Field("", description="extra vLLM arguments of the vision engine, shell-split")
    engine_roles: dict[str, EngineRole] = Field(
        default_factory=dict,
        description='engine roles beyond audio and vision, JSON: \'{"NAME": {"model": "/models/m", "port": '
        '8003, "args": "..."}}\'. Each is a role of its own (`mmcpu-entrypoint NAME`, checked by `python -m '
        "mmcpu.healthcheck NAME`) and runs under `all` too; the gateway routes to it when MMCPU_ENGINES lists it",
        json_schema_extra={"doc_default": "none: audio and vision"},
    )
    health_probe_s: float = Field(
        15,
        ge=0,
        description="timeout of the healthcheck's 1-token request to an engine (a hung EngineCore fails "
        "it); 0 = no such request, /health only",
    )
    watchdog_interval_s: float = Field(
        10,
        ge=0,
        description="the launcher checks each engine it runs for progress this often (the healthcheck's "
        "test: token counters, else a 1-token request bounded by MMCPU_HEALTH_PROBE_S); 0 = no watchdog",
    )
    watchdog_failures: int = Field(
        2,
        ge=1,
        description="consecutive failed progress checks after which the launcher kills a hung engine and "
        "exits 1 (the restart policy / kubelet then restarts it)",
    )

    # --- media: what one request may make an engine fetch and decode (mmcpu/media; docs/security.md) ---------
    max_image_pixels: int = Field(
        MAX_IMAGE_PIXELS,
        gt=0,
        description="pixels per image, width x height x frames (GIF, WebP, APNG), read from "
        "the image's header before it is decoded; larger: 400 naming this setting. At the defaults a request holds "
        "at most ~25 % of a 3 GiB vision engine (docs/security.md#memory-per-request)",
    )
    max_images: int = Field(
        IMAGE_LIMIT,
        ge=1,
        description="images per chat request: vLLM's --limit-mm-per-prompt of every vision engine "
        "(the launcher passes it unless the engine's args set their own); more: 400 before any image is loaded",
    )
    max_media_mb: float = Field(
        MAX_MEDIA_MB,
        gt=0,
        description="encoded MiB per media item, a data: URL's payload (checked before base64 is "
        "decoded) or a download (Content-Length, then while reading); larger: 400 naming this setting",
    )
    media_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="hosts (comma-separated, exact names) whose http(s) media URLs engines may fetch, passed to "
        "vLLM as --allowed-media-domains. Empty: data: URLs only. Even a listed host is fetched only from public "
        "addresses (never loopback, private, link-local, cluster or metadata ones), redirects included; every "
        "failed fetch answers one fixed 400 (docs/security.md)",
        json_schema_extra={"doc_default": "empty: `data:` URLs only"},
    )

    # --- gateway -------------------------------------------------------------------------------
    host: str = Field("0.0.0.0", description="address the gateway and the engines listen on")
    gateway_port: int = Field(8000, description="gateway port (the one OpenAI base URL)")
    engines: Annotated[dict[str, str], NoDecode] = Field(
        "audio=http://127.0.0.1:8001,vision=http://127.0.0.1:8002",
        validate_default=True,
        description="the gateway's engines, 'name=url,...' (compose: 'audio=http://audio:8001,vision=http://"
        "vision:8002'); requests are routed by the models each one's /v1/models lists. The name labels metrics, "
        "logs and /health; the order decides a model id listed by two engines",
    )
    api_key: SecretStr | None = Field(
        None,
        description="if set and not empty, every /v1/* request needs 'Authorization: Bearer KEY' (else "
        "401); /ping and /metrics stay open, /health says only ok / degraded / unavailable without the key",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="let the gateway listen beyond loopback (MMCPU_HOST not 127.0.0.1 / ::1 / localhost) "
        "without MMCPU_API_KEY; false: it refuses to start so. Compose sets it (the container must bind 0.0.0.0 and "
        "the stack publishes on 127.0.0.1 only); Kubernetes never does",
    )
    engine_api_key: SecretStr | None = Field(
        None,
        description="the engines' internal key: if set and not empty, each engine (vLLM's VLLM_API_KEY, handed "
        "over in its environment, never on its command line) answers 401 to every /v1/* request without "
        "'Authorization: Bearer KEY'; the gateway, the health check and the launcher's watchdog send it. "
        "/health and /metrics of an engine stay open",
    )
    max_upload_mb: float = Field(
        25,
        gt=0,
        description="largest request body in MiB (audio uploads, image "
        "chats); larger: 413, checked from Content-Length and while a chunked body streams",
    )
    request_timeout_s: float = Field(
        600,
        gt=0,
        description="timeout of a request towards an engine (between "
        "bytes, so a long SSE stream is fine); exceeded: 504",
    )
    health_timeout_s: float = Field(
        5, gt=0, description="timeout of the gateway's engine probes (/health, /v1/models) once connected"
    )
    models_ttl_s: float = Field(
        30,
        ge=0,
        description="how long the gateway trusts an engine's model list (a model in no list is looked "
        "up again at once)",
    )
    connect_timeout_s: float = Field(
        1,
        gt=0,
        description="timeout of connecting to an engine: the longest a request waits before a 503 for an "
        "engine that stopped answering",
    )
    stall_s: float = Field(
        30,
        ge=0,
        description="the gateway marks an engine down (503 engine_unavailable, in-flight requests "
        "included) when requests wait on it this long and its token counters do not move; 0 = never",
    )
    engine_concurrency: int = Field(
        8,
        ge=1,
        description="requests the gateway has in flight to one engine at once (its connection pool's "
        "size; match vLLM's --max-num-seqs of the engine, or what its replicas run together). The next ones queue",
    )
    engine_queue: int = Field(
        32,
        ge=0,
        description="requests that may wait for one engine beyond MMCPU_ENGINE_CONCURRENCY; one more is "
        "answered 429 (code `engine_overloaded`, `Retry-After`) at once",
    )
    queue_timeout_s: float = Field(
        30,
        gt=0,
        description="longest a queued request waits for a place at its engine; then 503 (code "
        "`engine_busy`, `Retry-After`)",
    )
    retry_after_s: int = Field(2, ge=1, description="`Retry-After` of the gateway's 429 and 503 answers, seconds")
    body_timeout_s: float = Field(
        30,
        gt=0,
        description="the whole request body must arrive within this time of the request's start (at "
        "25 MiB: 0.85 MiB/s); later: 408 and the connection closed, so slow uploads cannot hold engine places",
    )
    max_json_depth: int = Field(
        64,
        ge=2,
        description="deepest nesting of arrays and objects in a JSON body; deeper: 400, found by a scan "
        "of the bytes before they are parsed",
    )
    max_json_items: int = Field(
        100_000,
        ge=100,
        description="most values (array elements and object members) in a JSON body; more: 400 "
        "before parsing. Each image or text is one value, however long",
    )
    max_n: int = Field(
        16,
        ge=1,
        description="largest `n` (and vLLM's `best_of`) of a chat request: choices computed per request; "
        "larger: 400 naming the parameter",
    )
    max_output_tokens: int | None = Field(
        None,
        ge=1,
        description="largest `max_tokens` / `max_completion_tokens`; larger: 400 naming the parameter. "
        "Always bounded by the model length (max_model_len of the engine's /v1/models)",
        json_schema_extra={"doc_default": "the model length only"},
    )
    drain_s: float = Field(
        120,
        ge=0,
        description="on SIGTERM, in-flight requests may still run this long (engines: vLLM "
        "--shutdown-timeout; gateway: uvicorn's graceful shutdown); below the platform's kill deadline: compose "
        "stop_grace_period and Kubernetes terminationGracePeriodSeconds 150 s",
    )

    # --- realtime transcription (the gateway's /v1/realtime WebSocket; docs/realtime.md) -------------
    realtime_max_sessions: int = Field(
        64,
        ge=0,
        description="realtime sessions the gateway holds at once, with or without a model yet; one "
        "more is told so (`error` event, code `session_limit_reached`) and closed; 0 = /v1/realtime off",
    )
    realtime_sessions_per_engine: int = Field(
        32,
        ge=1,
        description="realtime sessions bound to one engine (by their transcription model) at once; one "
        "more gets an `error` event (code `session_limit_reached`) and keeps its previous model, if any",
    )
    realtime_buffer_s: float = Field(
        30,
        gt=1,
        le=30,
        description="longest turn in seconds of audio (Whisper's window): an open turn that "
        "reaches it is committed there, with or without a pause",
    )
    realtime_interim_s: float = Field(
        1.0,
        ge=0,
        description="how often the open turn is decoded again for `delta` events while it is spoken, "
        "in seconds (one decode per session in flight at most); 0 = no interim decodes, the whole text comes at "
        "commit",
    )
    realtime_final_after_ms: int = Field(
        200,
        ge=0,
        le=2000,
        description="with server_vad, a turn's final decode starts once its speech has been followed by "
        "this much silence, and the turn's audio ends there; speech resuming before `silence_duration_ms` "
        "cancels that decode and the turn goes on; at the commit its answer is the turn's (so `completed` comes "
        "as soon as the pause is long enough, not a whole decode later). 0, or not less than "
        "`silence_duration_ms`: the decode starts at the commit, over the whole pause",
    )
    realtime_interims_per_engine: int = Field(
        4,
        ge=1,
        description="interim decodes in flight on one engine across all its sessions: more sessions "
        "than this take turns (each one's deltas come less often), so interim work never crowds out the turns' "
        "final decodes",
    )
    realtime_idle_s: float = Field(
        60,
        gt=0,
        description="a session that sends no event for this long while none of its turns waits for the "
        "engine is closed (`error` event, code `idle_timeout`); an interim decode in flight is cancelled",
    )
    realtime_send_timeout_s: float = Field(
        10,
        gt=0,
        description="a client that does not read its server events for this long is disconnected and "
        "its engine requests cancelled",
    )
    realtime_max_event_mb: float = Field(
        15,
        gt=0,
        le=16,
        description="largest client event in MiB (OpenAI's limit for input_audio_buffer.append); "
        "larger: an `error` event, the session stays open. Above 16 MiB the WebSocket layer closes the connection "
        "(code 1009)",
    )
    # --- end of realtime transcription -------------------------------------------------------------

    @field_validator("engine_roles")
    @classmethod
    def _check_engine_roles(cls, value: dict[str, EngineRole]) -> dict[str, EngineRole]:
        for name in value:
            if name in ("audio", "vision"):
                raise ValueError(f"{name!r} is set by MMCPU_{name.upper()}_MODEL / _PORT / _ARGS, not here")
            if name in NON_ENGINE_ROLES or not name.replace("-", "").isalnum() or not name.islower():
                raise ValueError(
                    f"engine role {name!r}: expected a lower-case name other than {' / '.join(NON_ENGINE_ROLES)}"
                )
        return value

    @property
    def roles(self) -> dict[str, EngineRole]:
        """Every engine role, in order: audio and vision (MMCPU_AUDIO_* / MMCPU_VISION_*), then MMCPU_ENGINE_ROLES."""
        return {
            "audio": EngineRole(model=self.audio_model, port=self.audio_port, args=self.audio_args),
            "vision": EngineRole(model=self.vision_model, port=self.vision_port, args=self.vision_args),
            **self.engine_roles,
        }

    @field_validator("stt_temperature_fallback", mode="before")
    @classmethod
    def _parse_temperatures(cls, value: object) -> object:
        if isinstance(value, str):
            return [float(part) for part in value.split(",") if part.strip()]
        return value

    @field_validator("stt_temperature_fallback")
    @classmethod
    def _check_temperatures(cls, value: list[float]) -> list[float]:
        if value != sorted(value) or any(not 0 < t <= 2 for t in value):
            raise ValueError(f"temperatures must ascend within (0, 2], not {value}")
        return value

    @field_validator("vad_default", "media_domains", mode="before")
    @classmethod
    def _parse_name_list(cls, value: object) -> object:
        # 'whisper-tiny.en,whisper-base' / 'img.example.com,cdn.example.org' in compose and Kubernetes, like
        # MMCPU_ENGINES (not JSON).
        if isinstance(value, str):
            return [name for name in (part.strip() for part in value.split(",")) if name]
        return value

    @field_validator("engines", mode="before")
    @classmethod
    def _parse_engines(cls, value: object) -> object:
        # 'name=url,...' keeps MMCPU_ENGINES one readable line in compose and Kubernetes (not JSON).
        if not isinstance(value, str):
            return value
        engines: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, url = (x.strip() for x in item.partition("="))
            if not sep or not name or not url.startswith(("http://", "https://")):
                raise ValueError(f"expected 'name=http://host:port', got {item!r}")
            if name in engines:
                raise ValueError(f"engine {name!r} is listed twice")
            engines[name] = url.rstrip("/")
        if not engines:
            raise ValueError("no engine given")
        return engines


@lru_cache
def get_settings() -> Settings:
    return Settings()
