"""The image's HEALTHCHECK: ``python -m mmcpu.healthcheck [ROLE]``; exit 0 = healthy, 1 = not (one line on stdout).

What each role's check means:

- **engine** (``audio``, ``vision``): vLLM's ``/health`` must answer 200. In vllm 0.26.0 that only reads the
  engine client's ``errored`` flag (``AsyncLLM.check_health``), set once the EngineCore process has died: it
  catches a *dead* core but not a *hung* one (alive, never finishing a step). So, unless the engine's token
  counters on ``/metrics`` advanced since the previous check (it is busy and making progress, nothing to prove),
  the check also sends one bounded 1-token request (a 1-token completion; for Whisper a 0.5 s silent clip with
  ``max_completion_tokens=1``) straight to the engine and fails when it does not finish within
  ``MMCPU_HEALTH_PROBE_S``.
  The launcher runs the same test (:func:`progress_check`) from its watchdog and restarts a hung engine
  (mmcpu.launch.Watchdog); on Kubernetes this module is the engines' exec livenessProbe.
- **gateway**: the gateway's own ``/ping`` (liveness of the gateway process itself); the engines have their own
  checks, and the gateway's ``/health`` (readiness, per engine) is for load balancers.
- **all** (the three in one container): all of the above.

Without ROLE the role comes from ``/tmp/mmcpu-role`` (written by ``mmcpu-entrypoint``), else every port that
accepts a connection is checked as what it is by its number.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import wave
from pathlib import Path

from mmcpu.config import get_settings

ROLE_FILE = Path("/tmp/mmcpu-role")
STATE_DIR = Path("/tmp")
ROLES = ("audio", "vision", "gateway", "all")


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


def token_count(metrics: str) -> float:
    """Prompt + generation tokens the engine has processed so far (vLLM's Prometheus counters)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total")):
            total += float(line.rsplit(" ", 1)[1])
    return total


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
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="probe.wav"\r\n'
                 "Content-Type: audio/wav\r\n\r\n".encode() + file + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def progress_check(name: str, port: int, timeout: float, probe_s: float, before: float | None) -> tuple[str, float]:
    """One check of an engine: (verdict, token count now). Raises Unhealthy (or NotServed) when it fails.

    /health first (a dead EngineCore), then progress: token counters that moved since ``before`` prove the core
    is stepping (a busy engine needs nothing more); else one 1-token request must finish within ``probe_s``
    (a hung core never finishes it, however well its API server still answers /health and /metrics)."""
    base = f"http://127.0.0.1:{port}"
    request(f"{base}/health", timeout)  # 503 once the EngineCore is dead
    tokens = token_count(request(f"{base}/metrics", timeout).decode())
    if before is not None and tokens > before:
        return "ok (progress)", tokens
    if probe_s == 0:
        return "ok (/health only)", tokens
    model = json.loads(request(f"{base}/v1/models", timeout))["data"][0]["id"]
    t0 = time.monotonic()
    try:
        if name == "audio":
            body, ctype = multipart({"model": model, "language": "en", "max_completion_tokens": "1",
                                     "temperature": "0", "response_format": "json"}, silent_wav())
            request(f"{base}/v1/audio/transcriptions", probe_s, body, {"Content-Type": ctype})
        else:
            body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1, "temperature": 0}).encode()
            request(f"{base}/v1/completions", probe_s, body, {"Content-Type": "application/json"})
    except Unhealthy as exc:
        raise Unhealthy(f"no progress: {exc} (1-token probe, bound {probe_s:g}s){heartbeat_note(port)}") from None
    elapsed = time.monotonic() - t0
    tokens = token_count(request(f"{base}/metrics", timeout).decode())
    return f"ok (1-token probe {elapsed:.2f}s)", tokens


def heartbeat_note(port: int) -> str:
    """A hint for the failure line: the age of the EngineCore's kernel-stats heartbeat (mmcpu.kernels.dispatch
    StatsWriter, rewritten every second while the process runs; it stops when the core is stopped, not when
    Python deadlocks, so it only explains, never decides)."""
    age = heartbeat_age(get_settings().kernel_stats or Path(tempfile.gettempdir()) / f"mmcpu-kernels-{port}.json")
    return "" if age is None else f"; EngineCore heartbeat {age:.0f}s old"


def heartbeat_age(path: Path) -> float | None:
    try:
        return max(0.0, time.time() - float(json.loads(path.read_text())["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def watchdog_file(port: int) -> Path:
    return STATE_DIR / f"mmcpu-watchdog-{port}.json"


def record_watchdog_pass(port: int) -> None:
    """The launcher's watchdog proved progress on ``port`` just now (wall clock)."""
    try:
        watchdog_file(port).write_text(json.dumps({"time": time.time()}))
    except OSError:
        pass


def watchdog_pass_age(port: int) -> float | None:
    try:
        return max(0.0, time.time() - float(json.loads(watchdog_file(port).read_text())["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def probe_engine(name: str, port: int, timeout: float, probe_s: float, fresh_s: float = 0) -> str:
    """:func:`progress_check` with the token count kept between runs in a file (each run is a new process).
    A progress check the launcher's watchdog passed within ``fresh_s`` stands in for the 1-token request."""
    if fresh_s and (age := watchdog_pass_age(port)) is not None and age <= fresh_s:
        request(f"http://127.0.0.1:{port}/health", timeout)
        return f"ok (launcher watchdog passed {age:.0f}s ago)"
    state = STATE_DIR / f"mmcpu-health-{port}.json"
    try:
        before = json.loads(state.read_text())["tokens"]
    except (OSError, ValueError, KeyError):
        before = None
    verdict, tokens = progress_check(name, port, timeout, probe_s, before)
    state.write_text(json.dumps({"tokens": tokens}))
    return verdict


def probe_gateway(port: int, timeout: float) -> str:
    request(f"http://127.0.0.1:{port}/ping", timeout)
    return "ok"


def role() -> str | None:
    if len(sys.argv) > 1:
        return sys.argv[1]
    try:
        found = ROLE_FILE.read_text().strip()
    except OSError:
        return None
    return found if found in ROLES else None


def main() -> int:
    settings = get_settings()
    ports = {"gateway": settings.gateway_port, "audio": settings.audio_port, "vision": settings.vision_port}
    wanted = role()
    if wanted is not None and wanted not in ROLES:
        print(f"unknown role {wanted!r} (expected one of {', '.join(ROLES)})")
        return 1
    names = list(ports) if wanted in (None, "all") else [wanted]
    results: dict[str, str] = {}
    for name in names:
        try:
            if name == "gateway":
                results[name] = probe_gateway(ports[name], settings.health_timeout_s)
            else:
                # The watchdog passes every interval (+ its probe's bound): older than two of those, check here.
                fresh_s = 2 * settings.watchdog_interval_s + settings.health_probe_s if settings.watchdog_interval_s else 0
                results[name] = probe_engine(name, ports[name], settings.health_timeout_s, settings.health_probe_s,
                                             fresh_s)
        except NotServed:
            # Auto-detection: a refused port is not this container's. A named role's port must answer.
            if wanted is not None:
                results[name] = "not listening"
        except Unhealthy as exc:
            results[name] = str(exc)
        except (ValueError, KeyError, IndexError) as exc:  # an answer that is not what vLLM sends
            results[name] = f"unexpected answer: {exc}"
    print(" ".join(f"{name}:{ports[name]}={why}" for name, why in results.items()) or "no port answers yet")
    return 0 if results and all(why.startswith("ok") for why in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
