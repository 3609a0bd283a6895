"""The image's HEALTHCHECK: ``python -m mmcpu.healthcheck``; exit 0 = healthy, 1 = not (one line on stdout).

One image runs four roles (``mmcpu-entrypoint audio|vision|gateway|all``), so the check cannot hard-code a
port: it probes ``/health`` on the gateway, audio and vision ports of the settings. A port that refuses the
connection is not served by this container and is skipped; healthy = at least one port served and every
served port answers 200. In role ``all`` the gateway's own /health is 200 only when both engines answer.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

from mmcpu.config import get_settings


def probe(port: int, timeout: float) -> str | None:
    """``None`` if nothing listens on the port, else ``"ok"`` or the reason it is not healthy."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as resp:
            return "ok" if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return None
        return str(exc.reason)
    except OSError as exc:  # timeouts, resets
        return str(exc) or type(exc).__name__


def main() -> int:
    settings = get_settings()
    ports = {"gateway": settings.port, "audio": settings.audio_port, "vision": settings.vision_port}
    results = {name: probe(port, settings.health_timeout_s) for name, port in ports.items()}
    served = {name: why for name, why in results.items() if why is not None}
    print(" ".join(f"{name}:{ports[name]}={why}" for name, why in served.items()) or "no port answers yet")
    return 0 if served and all(why == "ok" for why in served.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
