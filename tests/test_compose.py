"""compose.yaml / compose.test.yaml as docker-compose 1.29 renders them: what a host gets by default and with
its env overrides (limits, published address, drain), checked on `docker-compose config`'s output, not on the
YAML literals."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from mmcpu import supervisor
from mmcpu.config import REPO_ROOT, Settings

SERVICES = {"audio", "vision", "gateway"}
# Fixed inside the containers (ports, in-container URLs and paths), so compose must not pass them through.
CONTAINER_FIXED = {"host", "gateway_port", "audio_port", "vision_port", "engines", "cache_dir",
                   "models_dir"}
# Measured peaks (docs/docker.md: cgroup max usage over a make e2e run with the fault tests, a 5 min clip and the
# mixed load; uniproc executor, 0.25 GiB KV cache): the default limits must leave room above them, else the kernel
# OOM-kills an engine under load.
MEASURED_PEAK_GIB = {"audio": 2.3, "vision": 1.6, "gateway": 0.1}
UNITS = {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def render(*files: str, **env: str) -> dict:
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed (apt-get install docker-compose)"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MMCPU_")}
    args = [tool]
    for name in files or ("compose.yaml",):
        args += ["-f", name]
    result = subprocess.run([*args, "config"], cwd=REPO_ROOT, capture_output=True, text=True, env={**clean, **env})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def size_bytes(value: str | int) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([bkmg]?)b?", str(value).lower())
    assert match, f"not a size: {value!r}"
    return int(float(match[1]) * UNITS[match[2] or "b"])


def duration_s(value: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|m|s|ms)", value):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    assert total > 0, f"not a duration: {value!r}"
    return total


@pytest.fixture(scope="module")
def default() -> dict:
    return render()["services"]


def test_docker_compose_1_29_accepts_both_files():
    assert set(render("compose.yaml", "compose.test.yaml")["services"]) == SERVICES | {"smoke"}


def test_every_setting_reaches_every_service(default):
    wanted = {f"MMCPU_{name.upper()}" for name in Settings.model_fields} - {
        f"MMCPU_{name.upper()}" for name in CONTAINER_FIXED
    }
    assert set(default) == SERVICES
    for name, service in default.items():
        env = set(service["environment"])
        assert wanted <= env, f"{name} lacks {sorted(wanted - env)}"
    rendered = render(MMCPU_DRAIN_S="30", MMCPU_HEALTH_PROBE_S="0")["services"]
    assert rendered["audio"]["environment"]["MMCPU_DRAIN_S"] == "30"
    assert rendered["gateway"]["environment"]["MMCPU_HEALTH_PROBE_S"] == "0"


def test_gateway_published_on_loopback_by_default_and_movable(default):
    assert [p["host_ip"] if isinstance(p, dict) else str(p).split(":")[0] for p in default["gateway"]["ports"]] == \
        ["127.0.0.1"], default["gateway"]["ports"]
    for name in ("audio", "vision"):
        assert not default[name].get("ports"), f"{name} must stay internal"
    everywhere = render(MMCPU_PUBLISH="8000")["services"]["gateway"]["ports"]
    assert "127.0.0.1" not in str(everywhere) and "8000" in str(everywhere)


def test_gateway_reaches_the_engines_by_service_name(default):
    engines = Settings(engines=default["gateway"]["environment"]["MMCPU_ENGINES"]).engines
    assert engines == {"audio": "http://audio:8001", "vision": "http://vision:8002"}
    # It starts with the engines but waits for neither's health: it serves the one that is up (503 for the other).
    conditions = {s: d["condition"] for s, d in default["gateway"]["depends_on"].items()}
    assert set(conditions) == {"audio", "vision"} and "service_healthy" not in conditions.values()


def test_default_limits_parse_and_leave_room_above_the_measured_peaks(default):
    for name, peak_gib in MEASURED_PEAK_GIB.items():
        service = default[name]
        limit = size_bytes(service["mem_limit"])
        assert limit >= 1.2 * peak_gib * 2**30, f"{name}: {service['mem_limit']} is too close to {peak_gib} GiB"
        assert size_bytes(service["memswap_limit"]) == limit, f"{name}: swap would hide the limit"
        assert 0 < float(service["cpus"]) <= 2, f"{name}: cpus above 2 fail on the 2-core hosts this targets"


def test_limits_follow_their_env_overrides():
    services = render(MMCPU_AUDIO_MEM_LIMIT="7g", MMCPU_VISION_MEM_LIMIT="3500m", MMCPU_GATEWAY_MEM_LIMIT="256m",
                      MMCPU_AUDIO_CPUS="1.5")["services"]
    assert size_bytes(services["audio"]["mem_limit"]) == 7 * 2**30
    assert size_bytes(services["vision"]["mem_limit"]) == 3500 * 2**20
    assert size_bytes(services["gateway"]["memswap_limit"]) == 256 * 2**20
    assert float(services["audio"]["cpus"]) == 1.5


def test_every_service_restarts_by_itself_under_an_init(default):
    for name, service in default.items():
        assert service["restart"] in {"unless-stopped", "always", "on-failure"}, name
        assert service["init"] is True, name
    assert render(MMCPU_RESTART="no")["services"]["audio"]["restart"] == "no"
    assert render("compose.yaml", "compose.test.yaml")["services"]["smoke"]["restart"] == "no"


def test_stop_grace_covers_the_drain_and_the_launchers_own_grace(default):
    drain = Settings().drain_s
    for name, service in default.items():
        grace = duration_s(service["stop_grace_period"])
        # The launcher kills a child still running at drain + STARTUP_GRACE_S; Docker must not SIGKILL first.
        assert grace > drain + supervisor.STARTUP_GRACE_S, f"{name}: {grace} s"


def test_each_service_checks_its_own_role_with_sane_timings(default):
    for name, service in default.items():
        check = service["healthcheck"]
        assert check["test"][-2:] == ["mmcpu.healthcheck", name]
        timeout = duration_s(check["timeout"])
        if name != "gateway":
            # /health, /metrics, /v1/models, the 1-token probe and /metrics again must fit in the check's timeout.
            assert timeout > Settings().health_probe_s + 4 * Settings().health_timeout_s
            # Measured engine starts (docs/docker.md): 48-80 s idle; a margin of >= 4x, but a hung load must show
            # in minutes, not the 20 of old.
            assert 4 * 80 <= duration_s(check["start_period"]) <= 600


def test_logs_are_rotated(default):
    for name, service in default.items():
        logging = service["logging"]
        assert logging["driver"] == "json-file", name
        assert size_bytes(logging["options"]["max-size"]) <= 100 * 2**20
        assert int(logging["options"]["max-file"]) >= 2
