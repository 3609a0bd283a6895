"""What the e2e tests drive: the docker client, a compose stack of this project, timed probes through its gateway,
the smoke client's container, and the figures file. Requests are built by mmcpu_dev.payloads and sent with the
unmodified ``openai`` client; every wait is bounded; every process started here is stopped here."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import openai
import psutil

from mmcpu.launch import served_name
from mmcpu.proc import stop_group, tree, tree_rss
from mmcpu_dev.checks import CheckFailed, openai_error_body
from mmcpu_dev.payloads import audio_file, image_chat_kwargs, test_image, transcription_kwargs
from mmcpu_dev.servers import free_port
from mmcpu_dev.shell import human

REPO_ROOT = Path(__file__).resolve().parents[2]
LOGS = REPO_ROOT / ".cache" / "logs" / "e2e"
SERVICES = ("audio", "vision", "gateway")
OTHER = {"audio": "vision", "vision": "audio"}
log = logging.getLogger("e2e")


def say(message: str) -> None:
    log.info(message)


@dataclass(frozen=True)
class Config:
    """The run's knobs, from the environment (tests/e2e/__init__.py lists them)."""

    docker: str
    image: str
    image_unpatched: str
    image_smoke: str
    ca_bundle: Path
    timeout_s: float
    restart_s: float
    faults: bool
    load_n: int
    long_s: float
    api_key: str
    engine_api_key: str
    audio_model: str
    vision_model: str
    stop_grace_s: int

    @classmethod
    def from_env(cls) -> Config:
        env = os.environ
        docker = env.get("DOCKER") or "/usr/bin/docker"
        if not os.access(docker, os.X_OK):
            docker = shutil.which("docker") or docker
        grace = env.get("MMCPU_STOP_GRACE", "150s").removesuffix("s")
        return cls(
            docker=docker,
            image=env.get("IMAGE") or "mmcpu:latest",
            image_unpatched=env.get("IMAGE_UNPATCHED") or "mmcpu:unpatched",
            image_smoke=env.get("IMAGE_SMOKE") or "mmcpu:smoke",
            ca_bundle=Path(env.get("CA_BUNDLE") or "/etc/ssl/certs/ca-certificates.crt"),
            timeout_s=float(env.get("E2E_TIMEOUT_S", 2400)),
            # An engine coming back after a fault is a full start again: 46-137 s measured, first starts up to
            # 579 s on a loaded 2-core host (docs/docker.md), and slower CPUs exist among the CI machines.
            restart_s=float(env.get("E2E_RESTART_S", 1200)),
            faults=env.get("E2E_FAULTS", "1") == "1",
            load_n=int(env.get("E2E_LOAD_N", 100)),
            # 300 s of speech: a 60 s clip is transcribed in ~3 s with native kernels, over before the stop lands.
            long_s=float(env.get("E2E_LONG_S", 720)),
            # The stacks run as deployed: the gateway requires a client key and the engines their internal key
            # (made up per run unless given), each service getting only its own (compose.yaml).
            api_key=env.get("MMCPU_API_KEY") or secrets.token_urlsafe(24),
            engine_api_key=env.get("MMCPU_ENGINE_API_KEY") or secrets.token_urlsafe(24),
            audio_model=served_name(env.get("MMCPU_AUDIO_MODEL") or "/models/whisper-tiny.en"),
            vision_model=served_name(env.get("MMCPU_VISION_MODEL") or "/models/tiny-llava"),
            stop_grace_s=int(grace) if grace.isdigit() else 150,
        )


# --- processes -------------------------------------------------------------------------------------------
def run(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    check: bool = True,
    merge: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run a command to its end within ``timeout`` s; output to ``log_path`` when given, else captured (``merge``:
    stderr into stdout, e.g. for ``docker logs``). ``check``: a non-zero exit raises with the output's tail."""
    if log_path is None:
        result = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
            text=True,
            timeout=timeout,
            env=env,
            cwd=REPO_ROOT,
        )
        output = result.stdout + (result.stderr or "")
    else:
        with log_path.open("w") as out:
            result = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env, cwd=REPO_ROOT
            )
        output = log_path.read_text(errors="replace")
    if check and result.returncode != 0:
        tail = "\n".join(output.splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}:\n{tail}")
    return result


class Background:
    """A command in the background (its own process group), its output in a log file; stopped on exit."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        with log_path.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        """Its exit code; stops it and raises when it runs longer than ``timeout`` s."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        stop_group(self.proc, timeout_s=30)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(what: str, ready, limit_s: float, every_s: float = 1.0):
    """Poll ``ready()`` until it returns something truthy (returned); raise after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {limit_s:.0f} s")
        time.sleep(every_s)


# --- docker ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Docker:
    binary: str

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        # DOCKER_BUILDKIT: `docker build --secret` (the leaking control image) needs BuildKit.
        return run([self.binary, *args], timeout=timeout, check=check, env=dict(os.environ, DOCKER_BUILDKIT="1"))

    def inspect(self, ref: str) -> dict | None:
        result = self("inspect", ref, check=False)
        return json.loads(result.stdout)[0] if result.returncode == 0 else None

    def compose_command(self) -> list[str]:
        """``docker compose`` (v2) when the client has it, else docker-compose 1.29 (Debian's)."""
        if self("compose", "version", check=False).returncode == 0:
            return [self.binary, "compose"]
        if tool := shutil.which("docker-compose"):
            return [tool]
        raise RuntimeError("neither 'docker compose' nor docker-compose is installed")


def docker_time(stamp: str) -> float | None:
    """Docker's RFC 3339 nanosecond stamps (``2026-12-01T12:00:00.123456789Z``) as epoch seconds; None if unset."""
    if not stamp or stamp.startswith("0001-"):
        return None
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")


def cgroup_file(container_id: str, name: str) -> Path | None:
    """A file of the container's memory cgroup (v1 memory controller or v2), None if not found."""
    for base in (
        f"/sys/fs/cgroup/memory/docker/{container_id}",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope",
        f"/sys/fs/cgroup/docker/{container_id}",
    ):
        path = Path(base) / name
        if path.is_file():
            return path
    return None


def cgroup_anon_bytes(container_id: str) -> int:
    """Anonymous memory of the container (no double counting of shared pages, unlike summed RSS); 0 if unknown."""
    path = cgroup_file(container_id, "memory.stat")
    for line in path.read_text().splitlines() if path else []:
        key, _, value = line.partition(" ")
        if key in ("total_rss", "anon"):
            return int(value)
    return 0


def cgroup_peak_bytes(container_id: str) -> int:
    """The kernel's peak of the container's memory since its last start (what mem_limit is compared with)."""
    path = cgroup_file(container_id, "memory.max_usage_in_bytes") or cgroup_file(container_id, "memory.peak")
    return int(path.read_text()) if path else 0


class Figures:
    """The run's figures, one ``name value`` line each in figures.txt (``make e2e`` prints the file at the end)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, name: str, value: str) -> None:
        with self.path.open("a") as out:
            out.write(f"{name:<54} {value}\n")
        say(f"figure: {name} = {value}")


# --- requests through the gateway -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    status: int  # HTTP status; 0 when no HTTP answer came (refused, timed out)
    seconds: float
    code: str | None = None  # the OpenAI error's code, e.g. engine_unavailable
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.status or 'no answer'} {self.code or ''} after {self.seconds:.1f}s".replace("  ", " ")


class Probe:
    """One small request per modality, timed, as a client of the stack sees it during a fault: a 1 s silent clip
    for the audio route, a two-image chat of 4 tokens for the vision one."""

    def __init__(self, base_url: str, cfg: Config) -> None:
        # max_retries=0: a failing request must show up as the failure it is.
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=cfg.api_key, max_retries=0)
        self.kwargs = {
            "audio": transcription_kwargs(
                audio_file(1.0, tone_hz=None), model=cfg.audio_model, language="en", filename="probe.wav"
            ),
            "vision": image_chat_kwargs([test_image(3, 32), test_image(5, 32)], model=cfg.vision_model, max_tokens=4),
        }

    def __call__(self, modality: str, timeout_s: float) -> Answer:
        client = self.client.with_options(timeout=timeout_s)
        create = client.audio.transcriptions.create if modality == "audio" else client.chat.completions.create
        t0 = time.monotonic()
        try:
            create(**self.kwargs[modality])
            return Answer(200, time.monotonic() - t0)
        except openai.APIStatusError as exc:
            seconds = time.monotonic() - t0
            try:
                error = openai_error_body(exc.response.json())
            except (CheckFailed, ValueError):
                error = {}
            return Answer(exc.status_code, seconds, error.get("code"), exc.response.text[:200])
        except openai.APIConnectionError as exc:  # includes timeouts
            return Answer(0, time.monotonic() - t0, None, f"{type(exc).__name__}: {exc}")

    def until_ok(self, modality: str, since: float, limit_s: float) -> tuple[float, list[Answer]]:
        """Probe every 3 s until the route answers 200, by itself; bounded by ``limit_s`` after ``since`` (a
        monotonic time). Returns the seconds since ``since`` and the failed answers on the way."""
        failed = []
        while True:
            answer = self(modality, 60)
            if answer.status == 200:
                return time.monotonic() - since, failed
            failed.append(answer)
            if time.monotonic() - since > limit_s:
                raise TimeoutError(f"{modality} did not answer 200 within {limit_s:.0f} s (last: {answer})")
            time.sleep(3)


# --- the compose stack ---------------------------------------------------------------------------------
@dataclass
class Sample:
    t: float  # seconds since the stack began
    service: str
    health: str
    rss: int
    anon: int
    peak: int  # the cgroup's max usage since the container's last start


class Stack:
    """compose.yaml + compose.test.yaml as the project ``PROJECT-e2e-NAME`` (PROJECT: MMCPU_PROJECT, default mmcpu),
    the gateway on a free loopback port.

    As a context manager it starts from nothing (``down -v`` of a leftover run), samples health and memory of the
    services every 5 s, and on exit - whatever happened - saves the services' logs, records the figures and
    removes every container, network and volume of the project."""

    def __init__(
        self,
        name: str,
        image: str,
        cfg: Config,
        docker: Docker,
        compose: list[str],
        figures: Figures,
        env: dict[str, str | None],
    ) -> None:
        self.name, self.image, self.cfg, self.docker, self.figures = name, image, cfg, docker, figures
        self.project = f"{os.environ.get('MMCPU_PROJECT') or 'mmcpu'}-e2e-{name}"
        self.port = free_port()
        self.gateway = f"http://127.0.0.1:{self.port}"
        self.base = [*compose, "-p", self.project, "-f", "compose.yaml", "-f", "compose.test.yaml"]
        self.env = dict(
            os.environ,
            MMCPU_IMAGE=image,
            MMCPU_SMOKE_IMAGE=cfg.image_smoke,
            MMCPU_PUBLISH=f"127.0.0.1:{self.port}",
            MMCPU_API_KEY=cfg.api_key,
            MMCPU_ENGINE_API_KEY=cfg.engine_api_key,
        )
        for key, value in env.items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.samples: list[Sample] = []
        self.logs: dict[str, str] = {}  # the services' logs, saved on exit
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._sample_forever, name=f"monitor-{name}", daemon=True)
        self.t0 = time.monotonic()

    # -- compose and docker --
    def compose(
        self, *args: str, timeout: float = 300, log_path: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return run([*self.base, *args], timeout=timeout, env=self.env, log_path=log_path, check=check)

    def compose_background(self, *args: str, log_path: Path) -> Background:
        return Background([*self.base, *args], log_path, self.env)

    def smoke_args(self, *args: str) -> list[str]:
        """A one-off container of the smoke service in the stack's network: mmcpu_dev.smoke against the gateway."""
        return ["run", "--rm", "--no-deps", "-T", "smoke", "--base-url", "http://gateway:8000/v1", *args]

    def smoke(self, log_path: Path, *args: str, timeout: float | None = None) -> int:
        return self.compose(
            *self.smoke_args(*args), timeout=timeout or self.cfg.timeout_s, log_path=log_path, check=False
        ).returncode

    def smoke_background(self, log_path: Path, *args: str) -> Background:
        return self.compose_background(*self.smoke_args(*args), log_path=log_path)

    def containers(self, service: str | None = None, running: bool = False) -> list[str]:
        """Container ids of the project (of one service), by compose's labels (the same in v1 and v2)."""
        args = ["ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            args += ["--filter", f"label=com.docker.compose.service={service}"]
        if not running:
            args.append("-a")
        return self.docker(*args, check=False).stdout.split()

    def container(self, service: str) -> str | None:
        ids = self.containers(service)
        return ids[0] if ids else None

    def state(self, service: str) -> dict:
        """``docker inspect``'s State of the service's container ({} while there is none)."""
        cid = self.container(service)
        info = self.docker.inspect(cid) if cid else None
        return dict(info["State"], RestartCount=info["RestartCount"]) if info else {}

    def health(self, service: str) -> str:
        state = self.state(service)
        return (state.get("Health") or {}).get("Status") or state.get("Status") or "none"

    def restart_count(self, service: str) -> int:
        return self.state(service).get("RestartCount", 0)

    def container_log(self, service: str) -> str:
        """``docker logs`` of the service's container: every start of it since it was created."""
        cid = self.container(service)
        return run([self.docker.binary, "logs", cid], timeout=120, check=False, merge=True).stdout if cid else ""

    def service_log(self, service: str) -> str:
        return run(
            [*self.base, "logs", "--no-color", service], timeout=120, env=self.env, check=False, merge=True
        ).stdout

    def exec_python(self, service: str, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``python -S -c CODE ARGS`` in the service's container (-S: no site-packages, a fast start)."""
        cid = self.container(service)
        assert cid, f"{service}: no container"
        return self.docker("exec", cid, "python", "-S", "-c", code, *args, check=False, timeout=timeout)

    def run_python(self, service: str, code: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """``python -S -c CODE ARGS`` in a one-off container of a compose service, on that service's networks."""
        return self.compose(
            "run",
            "--rm",
            "--no-deps",
            "-T",
            "--entrypoint",
            "python",
            service,
            "-S",
            "-c",
            code,
            *args,
            timeout=timeout,
            check=False,
        )

    def ip(self, service: str, network: str) -> str:
        """The service container's address on a network of the project (compose names it PROJECT_NETWORK)."""
        info = self.docker.inspect(self.container(service) or "")
        nets = (info or {}).get("NetworkSettings", {}).get("Networks", {})
        return next(v["IPAddress"] for k, v in nets.items() if k.replace("-", "_").endswith(f"_{network}"))

    def engine_core(self, service: str) -> psutil.Process:
        """vLLM's EngineCore process of an engine's container (a host process: the engine shares our kernel)."""
        pid = self.state(service).get("Pid") or None
        for proc in tree(pid):
            try:
                if "EngineCore" in " ".join(proc.cmdline()):
                    return proc
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"{service}: no EngineCore process below pid {pid}")

    def running_requests(self, service: str) -> float:
        """vLLM's num_requests_running gauge, read inside the container (the engine's port is not published)."""
        port = {"audio": 8001, "vision": 8002}[service]
        url = f"http://127.0.0.1:{port}/metrics"
        code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
        cid = self.container(service)
        # python -S: the container's interpreter without site-packages starts fast enough to poll.
        result = self.docker("exec", cid, "python", "-S", "-c", code, check=False, timeout=60) if cid else None
        lines = result.stdout.splitlines() if result and result.returncode == 0 else []
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running"))

    # -- readiness --
    def gateway_status(self) -> str | None:
        """The gateway's readiness (its /health ``status``): ok, degraded (serving, an engine still down),
        unavailable; None while it does not answer."""
        try:
            # With the key: /health tells a keyless caller only up or down.
            return (
                httpx.get(f"{self.gateway}/health", timeout=2, headers={"Authorization": f"Bearer {self.cfg.api_key}"})
                .json()
                .get("status")
            )
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def serving(self) -> bool:
        return self.gateway_status() in ("ok", "degraded")

    def pings(self) -> bool:
        try:
            return httpx.get(f"{self.gateway}/ping", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, service: str, limit_s: float) -> float:
        t0 = time.monotonic()
        wait_for(f"{self.name}: {service} healthy", lambda: self.health(service) == "healthy", limit_s, every_s=2)
        return time.monotonic() - t0

    def wait_all_healthy(self, limit_s: float) -> None:
        for service in SERVICES:
            self.wait_healthy(service, limit_s)

    def elapsed(self) -> float:
        """Seconds since the stack began (its ``down`` of leftovers done)."""
        return time.monotonic() - self.t0

    def probe(self) -> Probe:
        return Probe(self.gateway, self.cfg)

    # -- lifecycle --
    def __enter__(self) -> Stack:
        self.compose("down", "-v", "--remove-orphans", check=False)
        self.t0 = time.monotonic()
        self._monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        services_log = LOGS / f"stack-{self.name}-services.log"
        try:
            # The peak as the kernel has it now; for a container that has ended already, as last sampled.
            peaks = {svc: cgroup_peak_bytes(cid) for svc in SERVICES if (cid := self.container(svc))}
            self._stop.set()
            self._monitor.join(60)
            last = {sample.service: sample.peak for sample in self.samples if sample.peak}
            peaks = {svc: peaks.get(svc) or last.get(svc, 0) for svc in SERVICES}
            services_log.write_text(self.compose("logs", "--no-color", timeout=300, check=False).stdout)
            for service in SERVICES:
                self.logs[service] = self.service_log(service)
        finally:  # nothing of the project outlives the run, whatever failed above
            self._stop.set()
            self.compose("down", "-v", "--remove-orphans", timeout=600, check=False)
            # One-off smoke containers whose client was stopped midway: compose does not list every kind of them.
            if leftovers := self.containers():
                self.docker("rm", "-f", "-v", *leftovers, check=False)
        for service in SERVICES:
            mine = [s for s in self.samples if s.service == service]
            healthy = next((s.t for s in mine if s.health == "healthy"), None)
            self.figures.add(
                f"{self.name}: {service} healthy after (first start)",
                f"{healthy:.0f}s" if healthy is not None else "never",
            )
            self.figures.add(
                f"{self.name}: {service} peak RSS (sum over processes, ps)",
                human(max((s.rss for s in mine), default=0)),
            )
            self.figures.add(
                f"{self.name}: {service} peak anonymous memory (cgroup)", human(max((s.anon for s in mine), default=0))
            )
            self.figures.add(
                f"{self.name}: {service} peak memory (cgroup max usage since its last start)",
                human(peaks.get(service, 0)),
            )
        self.figures.add(f"{self.name}: stack wall time (up to down)", f"{time.monotonic() - self.t0:.0f}s")
        say(f"stack {self.name}: service logs in {services_log}")

    def _sample_forever(self) -> None:
        with (LOGS / f"monitor-{self.name}.txt").open("w") as out:
            while not self._stop.is_set():
                for service in SERVICES:
                    try:
                        cid = self.container(service)
                        info = self.docker.inspect(cid) if cid else None
                        if not info:
                            continue
                        state = info["State"]
                        health = (state.get("Health") or {}).get("Status") or state.get("Status", "?")
                        sample = Sample(
                            round(time.monotonic() - self.t0, 1),
                            service,
                            health,
                            tree_rss(state.get("Pid") or None),
                            cgroup_anon_bytes(cid),
                            cgroup_peak_bytes(cid),
                        )
                    except Exception as exc:
                        say(f"monitor {self.name}: {service}: {type(exc).__name__}: {exc}")
                        continue
                    self.samples.append(sample)
                    out.write(f"{sample.t} {service} {health} {sample.rss} {sample.anon}\n")
                    out.flush()
                self._stop.wait(5)


# Printed by PROCESSES in a container: one JSON list of [pid, ppid, state, name] of every process in it.
PROCESSES = """
import json, os
out = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    out.append([int(pid), int(rest[1]), rest[0], name])
print(json.dumps(out))
"""


def zombies(processes_json: str) -> set[tuple[int, str]]:
    """(pid, name) of the zombie processes in PROCESSES' output."""
    return {(pid, name) for pid, _ppid, state, name in json.loads(processes_json) if state == "Z"}


@contextmanager
def stopped(proc: psutil.Process) -> Iterator[None]:
    """SIGSTOP a process (a hung EngineCore: alive, never finishing a step); SIGCONT on the way out if it still
    exists (a test that failed before the watchdog killed it must not leave a stopped engine behind)."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            if proc.is_running():  # psutil checks the process's start time too: a reused pid is not touched
                proc.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass


@dataclass
class Tally:
    """Answers of a route that must keep answering: 200s, and the others as they came."""

    ok: int = 0
    bad: list[Answer] = field(default_factory=list)

    def add(self, answer: Answer) -> None:
        if answer.status == 200:
            self.ok += 1
        else:
            self.bad.append(answer)
