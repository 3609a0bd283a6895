"""The image's HEALTHCHECK: ``python -m mmcpu.healthcheck [ROLE]``; exit 0 = healthy, 1 = not (one line on stdout).

What each role's check means:

- **engine** (``audio``, ``vision``, any role of MMCPU_ENGINE_ROLES): vLLM's ``/health`` must answer 200. In vllm
  0.26.0 that only reads the engine client's ``errored`` flag (``AsyncLLM.check_health``), set once the EngineCore
  process has died: it catches a *dead* core but not a *hung* one (alive, never finishing a step). So, unless the
  engine's token counters on ``/metrics`` advanced since the previous check (it is busy and making progress,
  nothing to prove), the check also sends one bounded 1-token request (a 1-token completion; for Whisper a 0.5 s
  silent clip with ``max_completion_tokens=1``) straight to the engine and fails when it does not finish within
  ``MMCPU_HEALTH_PROBE_S``.
  The launcher runs the same test (:func:`mmcpu.health.progress_check`) from its watchdog and restarts a hung
  engine (mmcpu.supervisor.Watchdog); on Kubernetes this module is the engines' exec livenessProbe.
- **gateway**: the gateway's own ``/ping`` (liveness of the gateway process itself); the engines have their own
  checks, and the gateway's ``/health`` (readiness, per engine) is for load balancers.
- **all** (every engine and the gateway in one container): all of the above.

Without ROLE the role comes from ``/tmp/mmcpu-role`` (written by ``mmcpu-entrypoint``), else every port that
accepts a connection is checked as what it is by its number.
"""

from __future__ import annotations

import sys

from mmcpu import health
from mmcpu.config import get_settings


def probe_gateway(port: int, timeout: float) -> str:
    health.request(f"http://127.0.0.1:{port}/ping", timeout)
    return "ok"


def main() -> int:
    settings = get_settings()
    known = health.roles(settings)
    engines = {t.name: t for t in health.role_targets(settings)}
    ports = {health.GATEWAY: settings.gateway_port, **{name: t.port for name, t in engines.items()}}
    wanted = sys.argv[1] if len(sys.argv) > 1 else health.read_role(known)
    if wanted is not None and wanted not in known:
        print(f"unknown role {wanted!r} (expected one of {', '.join(known)})")
        return 1
    names = list(ports) if wanted in (None, health.ALL) else [wanted]
    results: dict[str, str] = {}
    for name in names:
        try:
            if name == health.GATEWAY:
                results[name] = probe_gateway(ports[name], settings.health_timeout_s)
            else:
                results[name] = health.probe_engine(
                    engines[name].kind,
                    ports[name],
                    settings.health_timeout_s,
                    settings.health_probe_s,
                    health.watchdog_fresh_s(settings),
                    health.engine_headers(settings),
                )
        except health.NotServed:
            # Auto-detection: a refused port is not this container's. A named role's port must answer.
            if wanted is not None:
                results[name] = "not listening"
        except health.Unhealthy as exc:
            results[name] = str(exc)
        except (ValueError, KeyError, IndexError) as exc:  # an answer that is not what vLLM sends
            results[name] = f"unexpected answer: {exc}"
    print(" ".join(f"{name}:{ports[name]}={why}" for name, why in results.items()) or "no port answers yet")
    return 0 if results and all(why.startswith("ok") for why in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
