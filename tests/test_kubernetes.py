"""Kubernetes manifests: every overlay renders with the real kustomize, every object passes the
Kubernetes OpenAPI schemas (offline, strict), the policy holds, and each policy rule fails when the
setting it guards is removed from a rendered copy."""

from __future__ import annotations

import copy
import functools
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mmcpu import k8s, k8s_smoke
from mmcpu.config import REPO_ROOT

TARGETS = k8s.overlays()


@functools.cache
def _rendered(target: str) -> tuple:
    return tuple(k8s.render(target))


def rendered(target: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(target)))


def test_base_and_both_overlays_exist():
    assert {"base", "cpu-pool", "offline"} <= set(TARGETS)
    assert k8s.components("base") == set()
    assert k8s.components("cpu-pool") == {"cpu-pool"}
    assert k8s.components("offline") == {"offline"}


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


MUTATIONS = [
    Mutation("no runAsNonRoot", "run_as_non_root", lambda o: drop_security(o, "audio", "runAsNonRoot")),
    Mutation("runAsUser 0", "run_as_non_root", lambda o: ctr(o, "gateway")["securityContext"].update(runAsUser=0)),
    Mutation("writable root", "read_only_root_fs",
             lambda o: ctr(o, "audio")["securityContext"].pop("readOnlyRootFilesystem")),
    Mutation("gateway root rw", "read_only_root_fs",
             lambda o: ctr(o, "gateway")["securityContext"].update(readOnlyRootFilesystem=False)),
    Mutation("seed job root rw", "read_only_root_fs",
             lambda o: job_ctr(o)["securityContext"].pop("readOnlyRootFilesystem"), "offline"),
    Mutation("privilege escalation", "no_privilege_escalation",
             lambda o: ctr(o, "vision")["securityContext"].pop("allowPrivilegeEscalation")),
    Mutation("init privilege escalation", "no_privilege_escalation",
             lambda o: init_ctr(o, "audio")["securityContext"].update(allowPrivilegeEscalation=True), "offline"),
    Mutation("capabilities kept", "drop_all_capabilities",
             lambda o: ctr(o, "audio")["securityContext"]["capabilities"].update(drop=[])),
    Mutation("capability added", "drop_all_capabilities",
             lambda o: ctr(o, "gateway")["securityContext"]["capabilities"].update(add=["NET_ADMIN"])),
    Mutation("no seccomp", "seccomp_runtime_default", lambda o: drop_security(o, "vision", "seccompProfile")),
    Mutation("seccomp unconfined", "seccomp_runtime_default",
             lambda o: ctr(o, "audio")["securityContext"].update(seccompProfile={"type": "Unconfined"})),
    Mutation("token mounted", "no_service_account_token",
             lambda o: pod(o, "audio").pop("automountServiceAccountToken")),
    Mutation("service links", "service_links_disabled", lambda o: pod(o, "gateway").pop("enableServiceLinks")),
    Mutation("no /tmp volume", "writable_caches",
             lambda o: ctr(o, "audio")["volumeMounts"].remove(
                 next(m for m in ctr(o, "audio")["volumeMounts"] if m["mountPath"] == "/tmp"))),
    Mutation("cache volume read-only", "writable_caches",
             lambda o: next(m for m in ctr(o, "vision")["volumeMounts"] if m["mountPath"] == "/cache").update(
                 readOnly=True)),
    Mutation("no HOME", "writable_caches",
             lambda o: ctr(o, "gateway")["env"].remove(env_item(o, "gateway", "HOME"))),
    Mutation("triton cache on root fs", "writable_caches",
             lambda o: set_env(o, "audio", "TRITON_CACHE_DIR", "/opt/t")),
    Mutation("memory request < limit", "guaranteed_qos",
             lambda o: ctr(o, "audio")["resources"]["requests"].update(memory="4Gi")),
    Mutation("fractional cpu", "guaranteed_qos", lambda o: set_resources(o, "vision", cpu="1500m")),
    Mutation("no limits", "guaranteed_qos", lambda o: ctr(o, "gateway")["resources"].pop("limits")),
    Mutation("init container burstable", "guaranteed_qos",
             lambda o: init_ctr(o, "vision")["resources"]["requests"].update(cpu="100m"), "offline"),
    Mutation("no startup probe", "probes", lambda o: ctr(o, "audio").pop("startupProbe")),
    Mutation("no readiness probe", "probes", lambda o: ctr(o, "vision").pop("readinessProbe")),
    Mutation("no liveness probe", "probes", lambda o: ctr(o, "gateway").pop("livenessProbe")),
    Mutation("startup too short", "probes", lambda o: ctr(o, "audio")["startupProbe"].update(failureThreshold=10)),
    Mutation("probe wrong port", "probes",
             lambda o: ctr(o, "vision")["readinessProbe"]["httpGet"].update(port=9999)),
    Mutation("no HPA", "hpa", lambda o: remove(o, "HorizontalPodAutoscaler", "mmcpu-audio")),
    Mutation("HPA min 1", "hpa",
             lambda o: k8s.find(o, "HorizontalPodAutoscaler", "mmcpu-vision")["spec"].update(minReplicas=1)),
    Mutation("replicas beside HPA", "hpa", lambda o: dep(o, "audio")["spec"].update(replicas=2)),
    Mutation("HPA fast scale-down", "hpa",
             lambda o: k8s.find(o, "HorizontalPodAutoscaler", "mmcpu-audio")["spec"]["behavior"]["scaleDown"].update(
                 stabilizationWindowSeconds=30)),
    Mutation("no PDB", "pdb", lambda o: remove(o, "PodDisruptionBudget", "mmcpu-vision")),
    Mutation("PDB blocks drains", "pdb", lambda o: pdb_min_available(o, "audio", 2)),
    Mutation("no topology spread", "topology_spread", lambda o: pod(o, "audio").pop("topologySpreadConstraints")),
    Mutation("loose spread", "topology_spread",
             lambda o: pod(o, "gateway")["topologySpreadConstraints"][0].update(maxSkew=3)),
    Mutation("short grace", "graceful_termination",
             lambda o: pod(o, "audio").update(terminationGracePeriodSeconds=30)),
    Mutation("no vLLM drain", "graceful_termination", lambda o: set_env(o, "vision", "MMCPU_EXTRA_ARGS", "")),
    Mutation("tiny vLLM drain", "graceful_termination",
             lambda o: set_env(o, "audio", "MMCPU_EXTRA_ARGS", "--shutdown-timeout=5")),
    Mutation("gateway leaves first", "graceful_termination",
             lambda o: pod(o, "gateway").update(terminationGracePeriodSeconds=60)),
    Mutation("more threads than cores", "engine_threads_and_kv_cache",
             lambda o: set_env(o, "audio", "OMP_NUM_THREADS", "4")),
    Mutation("cpu raised, threads not", "engine_threads_and_kv_cache", lambda o: set_resources(o, "vision", cpu="4")),
    Mutation("KV cache too big", "engine_threads_and_kv_cache",
             lambda o: set_env(o, "audio", "MMCPU_KVCACHE_GIB", "8")),
    Mutation("memory cut, KV kept", "engine_threads_and_kv_cache", lambda o: set_resources(o, "vision", memory="4Gi")),
    Mutation("KV cache not a number", "engine_threads_and_kv_cache",
             lambda o: set_env(o, "audio", "MMCPU_KVCACHE_GIB", "lots")),
    Mutation("fixed core ids", "engine_threads_and_kv_cache",
             lambda o: set_env(o, "vision", "MMCPU_OMP_THREADS_BIND", "0-1")),
    Mutation("bind unset: launcher's auto off the pool", "engine_threads_and_kv_cache",
             lambda o: ctr(o, "audio")["env"].remove(env_item(o, "audio", "MMCPU_OMP_THREADS_BIND")),
             unless="cpu-pool"),
    Mutation("reserved cores unset", "engine_threads_and_kv_cache",
             lambda o: ctr(o, "vision")["env"].remove(env_item(o, "vision", "VLLM_CPU_NUM_OF_RESERVED_CPU"))),
    Mutation("service selects nothing", "services_reach_pods",
             lambda o: k8s.find(o, "Service", "mmcpu-audio")["spec"]["selector"].update(
                 {"app.kubernetes.io/component": "audi0"})),
    Mutation("gateway URL to nowhere", "services_reach_pods",
             lambda o: config_map(o).update(MMCPU_VISION_URL="http://mmcpu-vision:8001")),
    Mutation("namespace not restricted", "namespace_restricted",
             lambda o: k8s.by_kind(o, "Namespace")[0]["metadata"]["labels"].pop("pod-security.kubernetes.io/enforce")),
    Mutation("no nodeSelector", "engines_on_cpu_pool", lambda o: pod(o, "audio").pop("nodeSelector"), "cpu-pool"),
    Mutation("no toleration", "engines_on_cpu_pool", lambda o: pod(o, "vision").pop("tolerations"), "cpu-pool"),
    Mutation("no node affinity", "engines_on_cpu_pool", lambda o: pod(o, "audio").pop("affinity"), "cpu-pool"),
    Mutation("threads unbound on pool", "engines_on_cpu_pool",
             lambda o: set_env(o, "vision", "MMCPU_OMP_THREADS_BIND", "nobind"), "cpu-pool"),
    Mutation("hub allowed", "models_from_pvc_offline", lambda o: config_map(o).pop("HF_HUB_OFFLINE"), "offline"),
    Mutation("models writable", "models_from_pvc_offline",
             lambda o: next(m for m in ctr(o, "audio")["volumeMounts"] if m["mountPath"] == "/models").pop(
                 "readOnly"), "offline"),
    Mutation("model by hub id", "models_from_pvc_offline",
             lambda o: config_map(o).update(MMCPU_VISION_MODEL="llava-hf/llava-1.5-7b-hf"), "offline"),
    Mutation("claim missing", "models_from_pvc_offline",
             lambda o: remove(o, "PersistentVolumeClaim", "mmcpu-model-cache"), "offline"),
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


def test_engine_environment_is_what_the_launcher_builds(monkeypatch):
    monkeypatch.setenv("MMCPU_KVCACHE_GIB", "9")  # this process's settings must not leak into the check
    objects = rendered("cpu-pool")
    [(argv, env)] = k8s.engine_processes(objects, ctr(objects, "audio"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # the overlay's MMCPU_OMP_THREADS_BIND
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    assert argv[argv.index("--model") + 1] == "/models/whisper-tiny.en"  # from the generated ConfigMap
    assert k8s.shutdown_timeout(argv) == 120


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
    assert k8s.main(["check", "offline"]) == 0
    assert "offline: ok:" in capsys.readouterr().out
    assert k8s.main(["render", "no-such-overlay"]) == 2
    assert "no kustomization.yaml" in capsys.readouterr().err


def test_render_script_prints_applicable_yaml():
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "k8s-render"), "cpu-pool"], capture_output=True, text=True, check=True
    )
    assert proc.stdout == k8s.render_text("cpu-pool")
    assert "mmcpu.io/pool: cpu-inference" in proc.stdout


def test_docker_emulation_gives_the_container_its_pod_spec():
    args = k8s_smoke.docker_run_args(rendered("base"), "mmcpu-audio")
    joined = " ".join(args)
    for expected in (
        "--user 10001:10001", "--group-add 10001", "--read-only", "--security-opt no-new-privileges",
        "--cap-drop ALL", "--cpus 2", f"--memory {6 * 2**30} --memory-swap {6 * 2**30}",
        f"--shm-size {2**30}", "--network-alias mmcpu-audio", "--publish 127.0.0.1::8001",
        f"type=tmpfs,destination=/tmp,tmpfs-mode=1777,tmpfs-size={2 * 2**30}",
        "type=tmpfs,destination=/model-cache,tmpfs-mode=1777",
        "--env MMCPU_OMP_THREADS_BIND=nobind", "--env MMCPU_AUDIO_MODEL=/models/whisper-tiny.en",
    ):
        assert expected in joined
    assert args[-2:] == ["mmcpu:latest", "audio"]
    gateway = k8s_smoke.docker_run_args(rendered("base"), "mmcpu-gateway", image="x:1")
    assert not any(a.startswith("MMCPU_API_KEY") for a in gateway)  # a Secret: absent here
    assert gateway[-2:] == ["x:1", "gateway"]
    with pytest.raises(k8s_smoke.SmokeError, match="init containers"):
        k8s_smoke.docker_run_args(rendered("offline"), "mmcpu-audio")
