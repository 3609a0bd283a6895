"""Run the rendered Kubernetes pods under docker, as the kubelet would run them, and smoke-test them.

No cluster can run on the project's machines (no registry for kind's node image, no kubelet or
apiserver packages), so this is the closest proof that the hardened pod specs work with the real
image: each Deployment's container gets its user/group, read-only root, dropped capabilities,
no-new-privileges, CPU/memory limits, emptyDir and claim volumes (as tmpfs), /dev/shm size,
environment (ConfigMaps resolved; the required Secrets made up for the run) and args from the render; containers are
reachable under their
Service names, so the gateway's engine URLs work unchanged. Then: startup probes within their
window, readiness/liveness, the process's real credentials, MRV2 in the engine log, requests
through the gateway (the checks of mmcpu_dev.smoke), memory in use against the limit, and a stop
within the grace period.

    python -m mmcpu_dev.k8s_smoke [--overlay base] [--image mmcpu:latest] [--roles audio,vision,gateway]

Differences from a cluster, on purpose: no preStop hook (docker has none), volumes are tmpfs (their
pages count against the container's memory, unlike a disk emptyDir), no static CPU manager, and the
NetworkPolicies are not enforced (one docker network: mmcpu_dev.k8s evaluates them instead).
"""

from __future__ import annotations

import argparse
import json
import secrets as _secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai

from mmcpu.launch import served_name
from mmcpu_dev import k8s
from mmcpu_dev.smoke import Smoke

PREFIX = "mmcpu-k8s-smoke"
NETWORK = f"{PREFIX}-net"


class SmokeError(RuntimeError):
    pass


def secrets_token() -> str:
    return _secrets.token_urlsafe(24)


Secrets = dict[str, dict[str, str]]  # Secret name -> key -> value: what `kubectl create secret` would hold


def docker_run_args(
    objects: list[k8s.Obj], deployment: str, *, image: str | None = None, secrets: Secrets | None = None
) -> list[str]:
    """`docker run` arguments giving the Deployment's (single) container what its pod spec asks for. Secret
    references take their value from ``secrets``; a required one that is missing fails as the kubelet would
    (the container is not created)."""
    obj = k8s.find(objects, "Deployment", deployment)
    if obj is None:
        raise SmokeError(f"no Deployment {deployment} in the render")
    pod = obj["spec"]["template"]["spec"]
    if pod.get("initContainers"):
        raise SmokeError(f"{deployment}: init containers are not emulated (use the base or cpu-pool overlay)")
    [c] = pod["containers"]
    sec = c.get("securityContext") or {}
    uid, gid = k8s.effective(pod, c, "runAsUser"), k8s.effective(pod, c, "runAsGroup")
    if k8s.effective(pod, c, "runAsNonRoot") and uid in (None, 0):
        raise SmokeError(f"{deployment}: runAsNonRoot needs a non-zero runAsUser to be checked here")
    args = ["run", "-d", "--name", f"{PREFIX}-{deployment}", "--network", NETWORK]
    for svc in k8s.by_kind(objects, "Service"):
        if k8s.labels_match(svc["spec"].get("selector"), k8s.pod_labels(obj)):
            # Reached by the Service's name on the container's own port: they must be the same number.
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                number = next((p["containerPort"] for p in c.get("ports") or [] if p.get("name") == target), target)
                if number != port["port"]:
                    raise SmokeError(f"{k8s.kn(svc)}: port {port['port']} -> {target} cannot be emulated")
            args += ["--network-alias", svc["metadata"]["name"]]
    if uid is not None:
        args += ["--user", f"{uid}:{gid if gid is not None else uid}"]
    if (fs_group := (pod.get("securityContext") or {}).get("fsGroup")) is not None:
        args += ["--group-add", str(fs_group)]
    if sec.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sec.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = sec.get("capabilities") or {}
    args += [a for cap in caps.get("drop") or [] for a in ("--cap-drop", cap)]
    args += [a for cap in caps.get("add") or [] for a in ("--cap-add", cap)]
    if (k8s.effective(pod, c, "seccompProfile") or {}).get("type") == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]  # RuntimeDefault = docker's default profile
    limits = (c.get("resources") or {}).get("limits") or {}
    if "cpu" in limits:
        args += ["--cpus", f"{k8s.cpu_cores(limits['cpu']):g}"]
    if "memory" in limits:
        memory = str(int(k8s.mem_bytes(limits["memory"])))
        args += ["--memory", memory, "--memory-swap", memory]  # no swap, as on a kubelet node
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for mount in c.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        size = (volume.get("emptyDir") or {}).get("sizeLimit")
        if mount["mountPath"] == "/dev/shm":
            args += ["--shm-size", str(int(k8s.mem_bytes(size or "64Mi")))]
            continue
        if "emptyDir" not in volume and "persistentVolumeClaim" not in volume:
            raise SmokeError(f"{deployment}: volume {mount['name']} is neither emptyDir nor a claim")
        # A fresh emptyDir or claim: empty and writable for the pod's user (emptyDir is mode 0777).
        spec = f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777"
        if size:
            spec += f",tmpfs-size={int(k8s.mem_bytes(size))}"
        args += ["--mount", spec + (",readonly" if mount.get("readOnly") else "")]
    for name, value in k8s.container_env(objects, c).items():
        if value is not None:  # field refs do not exist here; Secrets below
            args += ["--env", f"{name}={value}"]
    for item in c.get("env") or []:
        if ref := (item.get("valueFrom") or {}).get("secretKeyRef"):
            value = (secrets or {}).get(ref["name"], {}).get(ref["key"])
            if value is not None:
                args += ["--env", f"{item['name']}={value}"]
            elif not ref.get("optional"):
                raise SmokeError(
                    f"{deployment}: Secret {ref['name']} (key {ref['key']}) is required by "
                    f"{item['name']}: the kubelet would not start the container"
                )
    args += [a for port in c.get("ports") or [] for a in ("--publish", f"127.0.0.1::{port['containerPort']}")]
    command = c.get("command") or []
    if command:
        args += ["--entrypoint", command[0]]
    args.append(image or c["image"])
    return args + command[1:] + list(c.get("args") or [])


# ------------------------------------------------------------------------------------------------


def docker(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SmokeError(f"docker {' '.join(args[:3])}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def say(text: str) -> None:
    print(f"[k8s-smoke {time.strftime('%H:%M:%S')}] {text}", flush=True)


def cleanup(deployments: list[str]) -> None:
    for name in deployments:
        docker("rm", "-f", f"{PREFIX}-{name}", check=False)
    docker("network", "rm", NETWORK, check=False)


def http_status(url: str, timeout: float) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def container_logs(container: str, lines: int = 30) -> str:
    proc = subprocess.run(["docker", "logs", "--tail", str(lines), container], capture_output=True, text=True)
    return proc.stdout + proc.stderr


def probe_url(container: str, c: k8s.Obj, probe: k8s.Obj) -> str:
    get = probe["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in c["ports"] if p.get("name") == port)
    host_port = docker("port", container, str(port)).splitlines()[0].rsplit(":", 1)[1]
    return f"http://127.0.0.1:{host_port}{get.get('path', '/')}"


def wait_startup(container: str, c: k8s.Obj) -> float:
    """Poll the startup probe as the kubelet does; seconds until it succeeded (fails past its window)."""
    probe = c["startupProbe"]
    url, window = probe_url(container, c, probe), k8s.probe_window(probe)
    t0 = time.monotonic()
    while time.monotonic() - t0 < window:
        state = json.loads(docker("inspect", "--format", "{{json .State}}", container))
        if not state["Running"]:
            logs = container_logs(container)
            raise SmokeError(f"{container} exited with {state['ExitCode']} while starting:\n{logs}")
        status = http_status(url, probe.get("timeoutSeconds", 1))
        if status is not None and 200 <= status < 400:
            return time.monotonic() - t0
        time.sleep(probe.get("periodSeconds", 10))
    logs = container_logs(container)
    raise SmokeError(f"{container}: startup probe {url} failed for its whole window of {window} s:\n{logs}")


def probe_passes(url: str, probe: k8s.Obj) -> int | None:
    """One probe as the kubelet judges it: up to failureThreshold attempts, periodSeconds apart, each within
    timeoutSeconds; the status of the first success, else of the last attempt. (One attempt alone would fail on a
    single slow answer, e.g. while the other engine still loads on the same cores, where the kubelet would not.)"""
    status = None
    for attempt in range(max(1, probe.get("failureThreshold", 3))):
        if attempt:
            time.sleep(probe.get("periodSeconds", 10))
        status = http_status(url, probe.get("timeoutSeconds", 1))
        if status is not None and 200 <= status < 400:
            return status
    return status


def exec_probe_passes(container: str, probe: k8s.Obj) -> tuple[bool, str]:
    """An exec probe as the kubelet judges it: its command in the container, exit 0 within timeoutSeconds, up to
    failureThreshold attempts periodSeconds apart; (passed, its output)."""
    out = ""
    for attempt in range(max(1, probe.get("failureThreshold", 3))):
        if attempt:
            time.sleep(probe.get("periodSeconds", 10))
        try:
            proc = subprocess.run(
                ["docker", "exec", container, *probe["exec"]["command"]],
                capture_output=True,
                text=True,
                timeout=probe.get("timeoutSeconds", 1),
            )
        except subprocess.TimeoutExpired:
            out = f"no exit within {probe.get('timeoutSeconds', 1)} s"
            continue
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0:
            return True, out
    return False, out


def check_credentials(container: str, pod: k8s.Obj, c: k8s.Obj) -> str:
    """The running process's uid, capabilities, no_new_privs, seccomp and root filesystem; tini as PID 1."""
    lines = docker("exec", container, "cat", "/proc/1/status").splitlines()
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    if status.get("Name", "").strip() != "tini":
        raise SmokeError(f"{container}: PID 1 is {status.get('Name', '?').strip()!r}, not tini")
    uid = status["Uid"].split()[0]
    expect_uid = str(k8s.effective(pod, c, "runAsUser"))
    problems = [f"uid {uid} != {expect_uid}"] if uid != expect_uid else []
    if int(status["CapEff"], 16) or int(status["CapPrm"], 16):
        problems.append(f"capabilities left: CapEff {status['CapEff']}, CapPrm {status['CapPrm']}")
    if status.get("NoNewPrivs", "").strip() != "1":
        problems.append("no_new_privs is off")
    if status.get("Seccomp", "").strip() != "2":
        problems.append(f"seccomp mode {status.get('Seccomp')} (2 = filter)")
    root = subprocess.run(["docker", "exec", container, "touch", "/etc/mmcpu-write-test"], capture_output=True)
    if root.returncode == 0:
        problems.append("the root filesystem is writable")
    if problems:
        raise SmokeError(f"{container}: " + "; ".join(problems))
    return f"tini as PID 1, uid {uid}, no capabilities, no_new_privs, seccomp filter, read-only root"


def memory_mib(container: str) -> float:
    usage = docker("stats", "--no-stream", "--format", "{{.MemUsage}}", container).split("/")[0].strip()
    return k8s.mem_bytes(usage.replace("iB", "i").replace("B", "")) / 2**20


def run(overlay: str, image: str | None, roles: list[str]) -> bool:
    objects = k8s.render(overlay)
    deployments = [f"mmcpu-{role}" for role in roles]
    if shutil.which("docker") is None:
        raise SmokeError("docker is not installed")
    image_ref = (
        image or k8s.find(objects, "Deployment", deployments[0])["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    if subprocess.run(["docker", "image", "inspect", image_ref], capture_output=True).returncode != 0:
        raise SmokeError(f"image {image_ref} is missing: build it first (make image)")
    cleanup(deployments)
    docker("network", "create", NETWORK)
    # The Secrets an operator creates before applying (README "Secrets"): fresh keys for this run.
    secrets = {spec["secret"]: {spec["key"]: secrets_token()} for spec in k8s.SECRET_ENV.values() if spec["required"]}
    try:
        for name in deployments:  # engines first: the gateway resolves their Service names
            docker(*docker_run_args(objects, name, image=image, secrets=secrets))
            say(f"started {name} as the pod spec says ({image_ref})")
        for name in deployments:
            container = f"{PREFIX}-{name}"
            obj = k8s.find(objects, "Deployment", name)
            pod = obj["spec"]["template"]["spec"]
            [c] = pod["containers"]
            took = wait_startup(container, c)
            say(f"{name}: startup probe passed after {took:.0f} s (window {k8s.probe_window(c['startupProbe'])} s)")
            for kind in ("readinessProbe", "livenessProbe"):
                if "exec" in c[kind]:  # run in the container, as the kubelet does
                    ok, out = exec_probe_passes(container, c[kind])
                    if not ok:
                        raise SmokeError(
                            f"{name}: {kind} {c[kind]['exec']['command']} failed "
                            f"{c[kind].get('failureThreshold', 3)} times in a row (last: {out})"
                        )
                    say(f"{name}: {kind} exec: {out}")
                    continue
                url = probe_url(container, c, c[kind])
                status = probe_passes(url, c[kind])
                if status is None or not 200 <= status < 400:
                    raise SmokeError(
                        f"{name}: {kind} {url} failed {c[kind].get('failureThreshold', 3)} times in a row "
                        f"(last answer: {status})"
                    )
            say(f"{name}: readiness and liveness probes pass")
            say(f"{name}: {check_credentials(container, pod, c)}")
            if k8s.is_engine(c) and k8s.container_settings(k8s.container_env(objects, c)).runner == "v2":
                if "Using V2 Model Runner" not in container_logs(container, lines=100000):
                    raise SmokeError(f"{name}: MMCPU_RUNNER=v2 but the log never says 'Using V2 Model Runner'")
                say(f"{name}: the engine runs Model Runner V2")
        ok = True
        if "gateway" in roles:
            ok = smoke_through_gateway(objects, roles, secrets["mmcpu-api-key"]["api-key"])
        for name in deployments:
            obj = k8s.find(objects, "Deployment", name)
            limit = k8s.mem_bytes(obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])
            say(f"{name}: memory in use {memory_mib(f'{PREFIX}-{name}'):.0f} MiB of the {limit / 2**20:.0f} MiB limit")
        for name in deployments:
            grace = k8s.find(objects, "Deployment", name)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            t0 = time.monotonic()
            docker("stop", "--time", str(grace), f"{PREFIX}-{name}")
            code = docker("inspect", "--format", "{{.State.ExitCode}}", f"{PREFIX}-{name}")
            took = time.monotonic() - t0
            say(f"{name}: stopped {took:.1f} s after SIGTERM (grace {grace} s), exit code {code}")
            if took >= grace:
                ok = False
                say(f"FAIL {name}: needed the whole grace period and was killed")
        return ok
    finally:
        cleanup(deployments)


def smoke_through_gateway(objects: list[k8s.Obj], roles: list[str], api_key: str) -> bool:
    gateway = k8s.find(objects, "Deployment", "mmcpu-gateway")["spec"]["template"]["spec"]["containers"][0]
    host_port = docker("port", f"{PREFIX}-mmcpu-gateway", str(gateway["ports"][0]["containerPort"]))
    base_url = f"http://127.0.0.1:{host_port.splitlines()[0].rsplit(':', 1)[1]}/v1"
    env = k8s.container_env(objects, gateway)
    audio_model, vision_model = served_name(env["MMCPU_AUDIO_MODEL"]), served_name(env["MMCPU_VISION_MODEL"])
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    with tempfile.TemporaryDirectory(prefix=f"{PREFIX}-") as tmp:
        smoke = Smoke(client, audio_model, vision_model, Path(tmp))
        if {"audio", "vision"} <= set(roles):
            return smoke.run()
        # One engine: its own checks, and the gateway keeps serving it while the other modality is absent.
        if "audio" in roles:
            smoke.check("transcription-json-wer", smoke.transcription_json)
            smoke.check("transcription-text", smoke.transcription_text)
        if "vision" in roles:
            smoke.check("vision-two-images", smoke.vision_two_images)
        health = http_status(base_url.removesuffix("/v1") + "/health", 10)
        smoke.check("gateway-health-503-with-an-engine-absent", lambda: _expect(health, 503))
    return all(smoke.results)


def _expect(actual: Any, wanted: Any) -> str:
    if actual != wanted:
        raise SmokeError(f"got {actual}, expected {wanted}")
    return f"{actual}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcpu_dev.k8s_smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--overlay", default="base", help="kustomization to render (default: %(default)s)")
    # The render names a fixed tag (mmcpu:0.1.0, for a registry); `make image` builds mmcpu:latest locally.
    parser.add_argument(
        "--image", default="mmcpu:latest", help="image to run (default: %(default)s, what make image builds)"
    )
    parser.add_argument("--roles", default="audio,vision,gateway", help="Deployments to run (default: %(default)s)")
    args = parser.parse_args(argv)
    roles = [r for r in args.roles.split(",") if r]
    if unknown := set(roles) - {"audio", "vision", "gateway"}:
        print(f"error: unknown roles {sorted(unknown)}", file=sys.stderr)
        return 2
    try:
        ok = run(args.overlay, args.image, sorted(roles, key=["audio", "vision", "gateway"].index))
    except (SmokeError, k8s.RenderError) as exc:
        say(f"FAILED: {exc}")
        return 1
    say("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
