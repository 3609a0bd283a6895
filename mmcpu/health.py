"""Engine health, one module for its three users: the launcher's watchdog (:mod:`mmcpu.supervisor`), the exec
health check (``python -m mmcpu.healthcheck``: the image's HEALTHCHECK, the Kubernetes liveness probe) and the
gateway's stall detector (:class:`StallDetector`, driven by :mod:`mmcpu.gateway.upstream`).

Progress means the same to all three: vLLM's token counters on ``/metrics`` moved, else a bounded 1-token
request finished (:func:`progress_check`). vLLM's ``/health`` answers while a hung EngineCore never finishes a
step, so it only tells a dead core.

The state they share across processes, all here: the container's role (:data:`ROLE_FILE`, written by
``mmcpu-entrypoint``), the exec check's token count between runs (:func:`health_file`), the watchdog's last pass
(:func:`watchdog_file`) and the EngineCore's kernel-stats heartbeat (:func:`kernel_stats_path`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mmcpu.config import Settings, get_settings

STATE_DIR = Path("/tmp")
ROLE_FILE = STATE_DIR / "mmcpu-role"
# Container roles besides the engine roles (Settings.roles): the gateway alone, or every engine and the gateway.
GATEWAY, ALL = "gateway", "all"
# How an engine is probed: a 0.5 s silent transcription (Whisper) or a 1-token text completion (everything else).
KINDS = ("audio", "vision")


def roles(settings: Settings) -> tuple[str, ...]:
    """The container roles ``mmcpu-entrypoint`` and the health check accept: each engine role, gateway, all."""
    return (*settings.roles, GATEWAY, ALL)


def model_kind(model: str) -> str:
    """How an engine serving ``model`` is probed: ``audio`` for an encoder-decoder speech model (Whisper), else
    ``vision`` (a text completion, which every chat / vision-language model answers)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "audio" if "whisper" in model.lower() else "vision"
    speech = "whisper" in str(config.get("model_type", "")).lower() or any(
        "Whisper" in a for a in config.get("architectures") or []
    )
    return "audio" if speech else "vision"


@dataclass(frozen=True)
class Target:
    """An engine as the health checks see it: its child / role name, its port and how it is probed."""

    name: str
    port: int
    kind: str


def role_targets(settings: Settings) -> list[Target]:
    """Every engine role of the settings as a :class:`Target` (the kind from its model, as the launcher's)."""
    return [Target(name, r.port, r.kind or model_kind(r.model)) for name, r in settings.roles.items()]


# --- state files ------------------------------------------------------------------------------------------------
def write_role(role: str, path: Path | None = None) -> None:
    """Tells the health check which ports must answer (it runs in the same container, without arguments)."""
    try:
        (path or ROLE_FILE).write_text(role)
    except OSError:
        pass


def read_role(known: tuple[str, ...]) -> str | None:
    try:
        found = ROLE_FILE.read_text().strip()
    except OSError:
        return None
    return found if found in known else None


def kernel_stats_path(settings: Settings, port: int) -> Path:
    """Where the engine on ``port`` keeps its MRV2 kernel launch counts (``MMCPU_KERNEL_STATS``, else per port)."""
    return settings.kernel_stats or Path(tempfile.gettempdir()) / f"mmcpu-kernels-{port}.json"


def health_file(port: int) -> Path:
    """The exec check's token count between its runs (each run is a new process)."""
    return STATE_DIR / f"mmcpu-health-{port}.json"


def watchdog_file(port: int) -> Path:
    return STATE_DIR / f"mmcpu-watchdog-{port}.json"


def _age(path: Path) -> float | None:
    try:
        return max(0.0, time.time() - float(json.loads(path.read_text())["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_watchdog_pass(port: int) -> None:
    """The launcher's watchdog proved progress on ``port`` just now (wall clock)."""
    try:
        watchdog_file(port).write_text(json.dumps({"time": time.time()}))
    except OSError:
        pass


def watchdog_pass_age(port: int) -> float | None:
    return _age(watchdog_file(port))


def heartbeat_age(path: Path) -> float | None:
    return _age(path)


def heartbeat_note(port: int) -> str:
    """A hint for the failure line: the age of the EngineCore's kernel-stats heartbeat (mmcpu.kernels.dispatch
    StatsWriter, rewritten every second while the process runs; it stops when the core is stopped, not when
    Python deadlocks, so it only explains, never decides)."""
    age = heartbeat_age(kernel_stats_path(get_settings(), port))
    return "" if age is None else f"; EngineCore heartbeat {age:.0f}s old"


# --- the progress check -----------------------------------------------------------------------------------------
class Unhealthy(Exception):
    pass


class NotServed(Exception):
    """Nothing listens on the port (yet)."""


def request(url: str, timeout: float, data: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        raise Unhealthy(f"{url.split('/', 3)[-1]}: HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            raise NotServed() from None
        raise Unhealthy(f"{url.split('/', 3)[-1]}: {exc.reason}") from None
    except OSError as exc:  # timeouts, resets
        raise Unhealthy(f"{url.split('/', 3)[-1]}: {exc or type(exc).__name__}") from None


def engine_headers(settings: Settings) -> dict[str, str]:
    """What every internal caller of an engine's /v1 paths sends: MMCPU_ENGINE_API_KEY as a bearer token (vLLM
    answers 401 without it once the engine runs with the key); nothing when no key is set."""
    key = settings.engine_api_key.get_secret_value() if settings.engine_api_key is not None else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def token_count(metrics: str) -> float:
    """Prompt + generation tokens the engine has processed so far (vLLM's Prometheus counters, every label set),
    read with prometheus_client's parser: a timestamp after the value or an OpenMetrics ``_created`` sample is
    not taken for the count."""
    # By sample name: the family is named without _total when a TYPE line says counter, with it when none does.
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name in TOKEN_COUNTERS
    )


def silent_wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return buf.getvalue()


def multipart(fields: dict[str, str], file: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="probe.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + file
        + b"\r\n"
    )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def progress_check(
    kind: str,
    port: int,
    timeout: float,
    probe_s: float,
    before: float | None,
    headers: dict[str, str] | None = None,
) -> tuple[str, float]:
    """One check of an engine probed as ``kind``: (verdict, token count now). Raises Unhealthy (or NotServed)
    when it fails.

    /health first (a dead EngineCore), then progress: token counters that moved since ``before`` prove the core
    is stepping (a busy engine needs nothing more); else one 1-token request must finish within ``probe_s``
    (a hung core never finishes it, however well its API server still answers /health and /metrics). ``headers``
    go with the /v1 requests: the engine's internal key (:func:`engine_headers`)."""
    auth = headers or {}
    base = f"http://127.0.0.1:{port}"
    request(f"{base}/health", timeout)  # 503 once the EngineCore is dead
    tokens = token_count(request(f"{base}/metrics", timeout).decode())
    if before is not None and tokens > before:
        return "ok (progress)", tokens
    if probe_s == 0:
        return "ok (/health only)", tokens
    model = json.loads(request(f"{base}/v1/models", timeout, headers=auth))["data"][0]["id"]
    t0 = time.monotonic()
    try:
        if kind == "audio":
            body, ctype = multipart(
                {
                    "model": model,
                    "language": "en",
                    "max_completion_tokens": "1",
                    "temperature": "0",
                    "response_format": "json",
                },
                silent_wav(),
            )
            request(f"{base}/v1/audio/transcriptions", probe_s, body, {**auth, "Content-Type": ctype})
        else:
            body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1, "temperature": 0}).encode()
            request(f"{base}/v1/completions", probe_s, body, {**auth, "Content-Type": "application/json"})
    except Unhealthy as exc:
        raise Unhealthy(f"no progress: {exc} (1-token probe, bound {probe_s:g}s){heartbeat_note(port)}") from None
    elapsed = time.monotonic() - t0
    tokens = token_count(request(f"{base}/metrics", timeout).decode())
    return f"ok (1-token probe {elapsed:.2f}s)", tokens


def probe_engine(
    kind: str, port: int, timeout: float, probe_s: float, fresh_s: float = 0, headers: dict[str, str] | None = None
) -> str:
    """:func:`progress_check` with the token count kept between runs in :func:`health_file`. A progress check
    the launcher's watchdog passed within ``fresh_s`` stands in for the 1-token request."""
    if fresh_s and (age := watchdog_pass_age(port)) is not None and age <= fresh_s:
        request(f"http://127.0.0.1:{port}/health", timeout)
        return f"ok (launcher watchdog passed {age:.0f}s ago)"
    state = health_file(port)
    try:
        before = json.loads(state.read_text())["tokens"]
    except (OSError, ValueError, KeyError):
        before = None
    verdict, tokens = progress_check(kind, port, timeout, probe_s, before, headers)
    state.write_text(json.dumps({"tokens": tokens}))
    return verdict


def watchdog_fresh_s(settings: Settings) -> float:
    """How old a watchdog pass may be for the exec check to trust it: the watchdog passes every interval (+ its
    probe's bound), so two of those; 0 without a watchdog."""
    if not settings.watchdog_interval_s:
        return 0
    return 2 * settings.watchdog_interval_s + settings.health_probe_s


# --- the gateway's stall detector -------------------------------------------------------------------------------
class StallDetector:
    """One engine's stalls as the gateway sees them. A hung EngineCore still answers /health and /metrics from
    its API server, so a hang is told by requests: requests wait for its answer's headers and nothing progressed
    (no response headers or bytes, token counters unchanged, since the first of them started waiting) for
    ``stall_s``. The request path reports here (:meth:`waiting`, :meth:`progressed`); the gateway's background
    check reads the counters when :meth:`counters_due` and marks the engine down when :meth:`stalled`, then calls
    :meth:`hang`: requests waiting on :attr:`hung` give up at once. It stays hung until its counters move
    (:meth:`recovered`) or the engine goes away (:meth:`forget`: its launcher's watchdog killed it and the restart
    policy brings a new process)."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s, self.clock = stall_s, clock
        self.inflight = 0  # requests waiting for the response's headers (a hung engine never sends them)
        self.progress_at = 0.0
        self.tokens: float | None = None  # the counters' last value
        self.tokens_at = float("-inf")
        self.hung_tokens: float | None = None  # while hung: the value it hung at
        self.hung = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return bool(self.stall_s)

    @property
    def is_hung(self) -> bool:
        return self.hung_tokens is not None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A request waits for the engine's response headers for as long as the block runs."""
        if self.inflight == 0:
            self.progress_at = self.clock()  # waiting starts now, not at the last request's end
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def progressed(self) -> None:
        """A response's headers or bytes arrived."""
        self.progress_at = self.clock()

    def counters_due(self) -> bool:
        """Read the token counters? At most 5 times per stall window, and only once requests have been quiet."""
        now, every = self.clock(), self.stall_s / 5
        return self.enabled and self.inflight > 0 and now - self.progress_at >= every and now - self.tokens_at >= every

    def counters(self, tokens: float | None) -> None:
        """The counters just read (None: not readable); moved ones are progress."""
        self.tokens_at = self.clock()
        if tokens is not None and tokens != self.tokens:
            self.tokens, self.progress_at = tokens, self.tokens_at

    def stalled(self) -> float | None:
        """Seconds without progress while requests wait, once that reaches ``stall_s``; else None."""
        quiet = self.clock() - self.progress_at
        return quiet if self.enabled and self.inflight and quiet >= self.stall_s else None

    def hang(self) -> None:
        self.hung_tokens = self.tokens if self.tokens is not None else -1.0
        self.hung.set()

    def recovered(self, tokens: float | None) -> bool:
        """While hung: its counters moved (``tokens`` just read), so its core steps again."""
        return tokens is not None and tokens != self.hung_tokens

    def forget(self) -> None:
        """Not hung any more (gone, or its counters moved): the next up mark is believed."""
        self.hung_tokens = None

    def clear(self) -> None:
        """Marked up: requests may wait on it again."""
        self.hung_tokens = None
        if self.hung.is_set():
            self.hung = asyncio.Event()
