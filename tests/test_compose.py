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
ENGINES = {"audio", "vision"}
# Fixed inside the containers (ports, in-container URLs and paths), so compose must not pass them through.
CONTAINER_FIXED = {"host", "gateway_port", "audio_port", "vision_port", "engines", "cache_dir", "models_dir"}
# Each secret goes to the services that use it and to no other (the smoke client is a client of the gateway).
SECRETS = {
    "MMCPU_API_KEY": {"gateway", "smoke"},
    "MMCPU_ENGINE_API_KEY": ENGINES | {"gateway"},
    "HF_TOKEN": ENGINES,
}
# Settings that concern one side only, passed only there.
ONLY = {"MMCPU_ALLOW_UNAUTHENTICATED": {"gateway"}}
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
    wanted = (
        {f"MMCPU_{name.upper()}" for name in Settings.model_fields}
        - {f"MMCPU_{name.upper()}" for name in CONTAINER_FIXED}
        - set(SECRETS)
        - set(ONLY)
    )
    assert set(default) == SERVICES
    for name, service in default.items():
        env = set(service["environment"])
        assert wanted <= env, f"{name} lacks {sorted(wanted - env)}"
    rendered = render(MMCPU_DRAIN_S="30", MMCPU_HEALTH_PROBE_S="0")["services"]
    assert rendered["audio"]["environment"]["MMCPU_DRAIN_S"] == "30"
    assert rendered["gateway"]["environment"]["MMCPU_HEALTH_PROBE_S"] == "0"


def test_gateway_published_on_loopback_by_default_and_movable(default):
    assert [p["host_ip"] if isinstance(p, dict) else str(p).split(":")[0] for p in default["gateway"]["ports"]] == [
        "127.0.0.1"
    ], default["gateway"]["ports"]
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
    services = render(
        MMCPU_AUDIO_MEM_LIMIT="7g",
        MMCPU_VISION_MEM_LIMIT="3500m",
        MMCPU_GATEWAY_MEM_LIMIT="256m",
        MMCPU_AUDIO_CPUS="1.5",
    )["services"]
    assert size_bytes(services["audio"]["mem_limit"]) == 7 * 2**30
    assert size_bytes(services["vision"]["mem_limit"]) == 3500 * 2**20
    assert size_bytes(services["gateway"]["memswap_limit"]) == 256 * 2**20
    assert float(services["audio"]["cpus"]) == 1.5


def test_every_service_restarts_by_itself(default):
    for name, service in default.items():
        assert service["restart"] in {"unless-stopped", "always", "on-failure"}, name
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


# --- secrets: each service gets only its own ----------------------------------------------------------------


def secret_env(**values: str) -> dict[str, str]:
    return {name: values.get(name, f"secret-{name.lower()}-{i}") for i, name in enumerate(SECRETS)}


def leaks(services: dict, values: dict[str, str]) -> list[str]:
    """Where a secret's value appears in a service that must not have it, under any name or inside any setting
    (e.g. spliced into MMCPU_EXTRA_ARGS), or where a service lacks a secret it needs."""
    problems = []
    for name, service in services.items():
        env = {k: "" if v is None else str(v) for k, v in (service.get("environment") or {}).items()}
        for secret, value in values.items():
            holders = sorted(k for k, v in env.items() if value in v)
            if name in SECRETS[secret]:
                if secret not in env or env[secret] != value:
                    problems.append(f"{name}: lacks {secret}")
            elif holders:
                problems.append(f"{name}: carries {secret}'s value in {holders}")
    return problems


def test_each_service_gets_only_its_own_secrets():
    values = secret_env()
    services = render("compose.yaml", "compose.test.yaml", **values)["services"]
    assert leaks(services, values) == []
    # The check finds a secret under another name, and a missing one.
    services["vision"]["environment"]["MMCPU_EXTRA_ARGS"] = f"--api-key {values['MMCPU_API_KEY']}"
    del services["audio"]["environment"]["MMCPU_ENGINE_API_KEY"]
    assert leaks(services, values) == [
        "audio: lacks MMCPU_ENGINE_API_KEY",
        "vision: carries MMCPU_API_KEY's value in ['MMCPU_EXTRA_ARGS']",
    ]


def test_side_only_settings_stay_on_their_side(default):
    for setting, owners in ONLY.items():
        assert {name for name, s in default.items() if setting in s["environment"]} == owners, setting


def test_unauthenticated_only_while_published_on_loopback(default):
    """The gateway may serve without MMCPU_API_KEY only because the stack publishes it on 127.0.0.1; a user who
    sets the key or turns the allowance off gets the fail-closed gateway."""
    gateway = default["gateway"]
    assert str(gateway["environment"]["MMCPU_ALLOW_UNAUTHENTICATED"]).lower() == "true"
    assert all((p["host_ip"] if isinstance(p, dict) else str(p).split(":")[0]) == "127.0.0.1" for p in gateway["ports"])
    closed = render(MMCPU_ALLOW_UNAUTHENTICATED="false")["services"]["gateway"]["environment"]
    assert closed["MMCPU_ALLOW_UNAUTHENTICATED"] == "false"


# --- hardening and networks ------------------------------------------------------------------------------------


def hardening_problems(services: dict) -> list[str]:
    """What every service of the stacks must have: a read-only root with /tmp as a sized tmpfs and named volumes as
    the only other writable places, no capabilities, no-new-privileges, nothing of the host's (namespaces, devices,
    bind mounts), and no second init in front of the image's tini."""
    problems = []
    for name, s in services.items():
        if s.get("read_only") is not True:
            problems.append(f"{name}: root filesystem not read-only")
        tmp = [str(t).partition(":")[2].split(",") for t in s.get("tmpfs") or [] if str(t).split(":")[0] == "/tmp"]
        if not tmp or not any(o.startswith("size=") for o in tmp[0]) or not {"noexec", "nosuid"} <= set(tmp[0]):
            problems.append(f"{name}: no sized noexec,nosuid tmpfs on /tmp")
        if "ALL" not in (s.get("cap_drop") or []) or s.get("cap_add"):
            problems.append(f"{name}: capabilities not all dropped ({s.get('cap_drop')}, add {s.get('cap_add')})")
        if not any(
            str(o).replace("=", ":") in ("no-new-privileges", "no-new-privileges:true")
            for o in s.get("security_opt") or []
        ):
            problems.append(f"{name}: no no-new-privileges")
        if s.get("privileged") or s.get("devices") or s.get("user") in ("0", "root", 0):
            problems.append(f"{name}: privileged, devices or root user")
        for key in ("network_mode", "pid", "ipc", "userns_mode"):
            if str(s.get(key, "")).startswith("host"):
                problems.append(f"{name}: {key} host")
        for volume in s.get("volumes") or []:
            kind = (
                volume.get("type")
                if isinstance(volume, dict)
                else ("bind" if str(volume).startswith("/") else "volume")
            )
            if kind != "volume":
                problems.append(f"{name}: {kind} mount {volume}")
        if s.get("init") is not False:
            problems.append(f"{name}: init is {s.get('init')!r}: Docker would put its own init before the image's tini")
    return problems


def test_every_service_is_hardened():
    services = render("compose.yaml", "compose.test.yaml")["services"]
    assert set(services) == SERVICES | {"smoke"}
    assert hardening_problems(services) == []
    # Each rule fails when its setting goes.
    for key, value, expected in [
        ("read_only", False, "not read-only"),
        ("cap_drop", [], "capabilities"),
        ("security_opt", [], "no-new"),
        ("tmpfs", ["/tmp"], "tmpfs on /tmp"),
        ("tmpfs", ["/tmp:size=1g"], "tmpfs on /tmp"),
        ("init", True, "init is True"),
        ("pid", "host", "pid host"),
        ("volumes", ["/:/host"], "bind mount"),
    ]:
        broken = {"audio": dict(services["audio"], **{key: value})}
        assert any(expected in p for p in hardening_problems(broken)), (key, hardening_problems(broken))


def networks_of(service: dict) -> set[str]:
    nets = service.get("networks") or {"default": None}
    return set(nets) if isinstance(nets, dict) else set(nets)


def test_engines_are_reachable_only_from_the_gateway():
    stack = render("compose.yaml", "compose.test.yaml")
    services = stack["services"]
    for name in ENGINES:
        assert networks_of(services[name]) == {"engines"}, name
        assert not services[name].get("ports") and not services[name].get("network_mode")
    members = {name for name, s in services.items() if "engines" in networks_of(s)}
    assert members == ENGINES | {"gateway"}, f"on the engines' network: {members}"
    assert networks_of(services["gateway"]) == {"default", "engines"}
    # No route out from the engines' network unless asked for (online models, allowed media domains).
    assert stack["networks"]["engines"]["internal"] is True
    assert render(MMCPU_ENGINES_INTERNAL="false")["networks"]["engines"]["internal"] is False
