"""One dispatch point: every Triton launch under ``TRITON_INTERPRET=1`` goes through here.

With the interpreter on, ``@triton.jit`` returns a ``triton.runtime.interpreter.InterpretedFunction`` and
``kernel[grid](*args, **kw)`` calls ``InterpretedFunction.run(*args, grid=grid, warmup=False, **kw)``.
:func:`install` wraps that one method. A launch whose kernel has a registered native implementation whose
guard matches (the kernel's argument names and the SHA-256 of its source) runs the torch code instead; any
other launch runs in the interpreter, as before (with its gaps filled: :mod:`mmcpu.kernels.interpreter`), and
is counted. No vLLM launcher is edited. :mod:`mmcpu.plugin` installs it in vLLM's CPU worker.

Native implementations are plain functions ``impl(grid, <the kernel's arguments by name>)`` registered with
:func:`native`; the guard's argument names are read from that signature, so an implementation cannot silently
drift from the kernel it replaces.

Why not vLLM 0.32's own override registry (``vllm/triton_utils/dispatcher.py``: ``register_kernels``,
``KernelOverride``): its ``__getitem__(grid)`` returns the implementation's launcher and drops the grid, and many
of these kernels' results depend on it (the padding programs of the block-table and slot-mapping kernels, the
vocab blocks of gumbel sampling, the chunks of the KV zeroer), which the arguments do not carry. It also rebinds
every module attribute holding the kernel to a wrapper (so the source-hash guard and the check's scan would no
longer see vLLM's kernel), and the CPU platform registers its overrides only when ``HAS_TRITON`` is false, while
MRV2 on CPU needs it true (patches/0004). A launch through ``@triton.heuristics`` / ``@triton.autotune`` wrappers
still ends in the one method wrapped here, with the wrapper's arguments filled in.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmcpu.kernels import interpreter as gaps

# A child of vLLM's logger, so these lines land in the engine log with vLLM's format and level.
logger = logging.getLogger("vllm.mmcpu.kernels")

# Modules that register native kernels (mirroring the vLLM files they replace). Imported by install().
NATIVE_MODULES = (
    "mmcpu.kernels.block_table",
    "mmcpu.kernels.buffer_utils",
    "mmcpu.kernels.input_batch",
    "mmcpu.kernels.structured_outputs",
    "mmcpu.kernels.utils",
    "mmcpu.kernels.cp_utils",
    "mmcpu.kernels.metrics.logits",
    "mmcpu.kernels.mm.rope",
    "mmcpu.kernels.model_states.mamba_hybrid",
    "mmcpu.kernels.model_states.prompt_embeds",
    "mmcpu.kernels.sample.gumbel",
    "mmcpu.kernels.sample.min_p",
    "mmcpu.kernels.sample.penalties",
    "mmcpu.kernels.sample.logit_bias",
    "mmcpu.kernels.sample.bad_words",
    "mmcpu.kernels.sample.logprob",
    "mmcpu.kernels.sample.prompt_logprob",
    "mmcpu.kernels.sample.output",
    "mmcpu.kernels.sample.trace_replay",
    "mmcpu.kernels.sample.thinking_budget",
    "mmcpu.kernels.sample.batch_shard",
    "mmcpu.kernels.topk_topp",
)

# Launch options Triton accepts beside the kernel's own arguments; never part of a kernel's signature.
LAUNCH_OPTIONS = frozenset(
    {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid"}
)


@dataclass(frozen=True)
class NativeKernel:
    module: str  # vLLM module defining the kernel, e.g. "vllm.v1.worker.gpu.block_table"
    name: str  # the kernel function's name
    source_sha256: str  # SHA-256 of the kernel's dedented source (inspect.getsource) it was written against
    arg_names: tuple[str, ...]  # read from impl's signature, after its leading ``grid``
    impl: Callable[..., Any]

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.name)


REGISTRY: dict[tuple[str, str], NativeKernel] = {}


def native(module: str, name: str, *, sha256: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``impl`` as the native version of vLLM kernel ``module.name`` (source hash ``sha256``)."""

    def register(impl: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(impl).parameters)
        if not params or params[0] != "grid":
            raise TypeError(f"{impl.__qualname__}: a native kernel's first parameter must be 'grid'")
        entry = NativeKernel(module, name, sha256, tuple(params[1:]), impl)
        if entry.key in REGISTRY:
            raise ValueError(f"native kernel {module}.{name} registered twice")
        REGISTRY[entry.key] = entry
        return impl

    return register


def _reached(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    """What a kernel's body is: ``("fn", f)`` for the kernel and, by name, every ``@triton.jit`` helper it reaches
    (transitively); ``("constexpr", (name, value))`` for every ``tl.constexpr`` global it reads."""
    seen: set[str] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        yield "fn", f
        for name in sorted(set(f.__code__.co_names) - seen):
            value = f.__globals__.get(name)
            inner = getattr(value, "fn", None)
            if callable(inner) and hasattr(value, "arg_names"):  # a jit function (interpreted or compiled)
                seen.add(name)
                todo.append(inner)
            elif value is not None and type(value).__name__ == "constexpr":
                seen.add(name)
                yield "constexpr", (name, value.value)


def kernel_source_sha256(fn: Callable[..., Any]) -> str:
    """The guard's hash of a kernel: its source (decorator line included, indentation removed) and, by name,
    the source of every ``@triton.jit`` helper and the value of every ``tl.constexpr`` global it reaches
    (a kernel's body is its helpers too: gumbel sampling lives in ``gumbel_block_argmax``)."""
    digest = hashlib.sha256()
    for kind, item in _reached(fn):
        if kind == "fn":
            digest.update(textwrap.dedent(inspect.getsource(item)).encode())
        else:
            digest.update(f"{item[0]}={item[1]!r}".encode())
    return digest.hexdigest()


def kernel_source_files(fn: Callable[..., Any]) -> set[str]:
    """The source files the guard's hash of ``fn`` reads (the kernel's and its helpers' modules)."""
    return {inspect.getsourcefile(item) or "" for kind, item in _reached(fn) if kind == "fn"} - {""}


def load_native_modules() -> dict[tuple[str, str], NativeKernel]:
    for mod in NATIVE_MODULES:
        importlib.import_module(mod)
    return REGISTRY


# ------------------------------------------------------------------------------------------------------
# Guard and launch


@dataclass
class Stats:
    native: Counter = field(default_factory=Counter)  # kernel name -> launches run natively
    interpreter: Counter = field(default_factory=Counter)  # kernel name -> launches left to the interpreter

    def summary(self) -> str:
        n_nat, n_int = sum(self.native.values()), sum(self.interpreter.values())
        text = f"kernel launches: {n_nat} native, {n_int} interpreted"
        if n_int:
            text += " (" + ", ".join(f"{k} x{v}" for k, v in self.interpreter.most_common()) + ")"
        return text

    def snapshot(self) -> dict[str, Any]:
        # dict(Counter) is one C-level copy under the GIL: safe against the launch path's increments.
        return {
            "pid": os.getpid(),
            "time": time.time(),
            "mode": _mode,
            "native": dict(self.native),
            "interpreted": dict(self.interpreter),
        }


def write_snapshot(path: Path) -> None:
    """Write STATS to ``path`` as JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(STATS.snapshot()))
    os.replace(tmp, path)


def read_snapshot(path: Path) -> dict[str, Any] | None:
    """The last snapshot an engine wrote to ``path``, or None if there is none yet."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class StatsWriter(threading.Thread):
    """Rewrites the launch counts to a file every ``interval`` seconds while the engine lives.

    Why a file and a heartbeat rather than a line at shutdown: vLLM's shutdown order (API server, EngineCore,
    worker, all signalled at once) decides whether a worker's shutdown hook still logs, and on some machines it
    does not. A snapshot whose ``time`` is later than a moment proves every launch before that moment was
    counted in it, whatever happens at shutdown."""

    def __init__(self, path: Path, interval: float = 1.0) -> None:
        super().__init__(name="mmcpu-kernel-stats", daemon=True)
        self.path, self.interval = path, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            try:
                write_snapshot(self.path)
            except OSError as exc:  # e.g. a read-only or full /tmp: say so once, keep serving
                logger.warning("MRV2 kernel launch counts not written to %s: %s", self.path, exc)
                return
            if self.stopped.wait(self.interval):
                return


STATS = Stats()
_decisions: dict[Any, NativeKernel | None] = {}  # kernel fn object -> its native impl, or None = interpreter
_original_run: Callable[..., Any] | None = None
_mode: str | None = None
_writer: StatsWriter | None = None


def guard(fn: Callable[..., Any], arg_names: list[str]) -> tuple[NativeKernel | None, str]:
    """Which native implementation may replace kernel ``fn``, and why (or why not)."""
    entry = REGISTRY.get((fn.__module__, fn.__name__))
    if entry is None:
        return None, "no native implementation"
    if tuple(arg_names) != entry.arg_names:
        return None, f"argument names changed: kernel {tuple(arg_names)} vs native {entry.arg_names}"
    try:
        sha = kernel_source_sha256(fn)
    except (OSError, TypeError) as exc:
        return None, f"kernel source unreadable ({exc})"
    if sha != entry.source_sha256:
        return None, f"kernel source changed (sha256 {sha[:12]}, native written for {entry.source_sha256[:12]})"
    return entry, "guard matches"


def _decide(kernel: Any) -> NativeKernel | None:
    fn = kernel.fn
    if fn in _decisions:
        return _decisions[fn]
    entry, why = guard(fn, kernel.arg_names) if _mode == "native" else (None, "MMCPU_KERNELS=interpreter")
    if entry is None and _mode == "native":
        # Said at once, at the first launch: a kernel we know whose code moved under us (never run stale native
        # code), or one with no native version. Either is slow (the start-up check, mmcpu.kernels.check, refuses
        # an engine whose reachable kernels are not all native; this catches what it cannot see).
        logger.warning("Triton kernel %s.%s runs in the interpreter: %s", fn.__module__, fn.__name__, why)
    _decisions[fn] = entry
    return entry


def run_native(entry: NativeKernel, arg_names: list[str], grid: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Call ``entry.impl`` with a launch's arguments (positional + keyword, launch options dropped)."""
    call = dict(zip(arg_names, args, strict=False))
    for key, value in kwargs.items():
        if key not in LAUNCH_OPTIONS:
            call[key] = value
    if callable(grid):
        grid = grid(call)
    return entry.impl(grid, **call)


def _run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    if warmup:
        return None
    entry = _decide(self)
    if entry is not None:
        STATS.native[entry.name] += 1
        return run_native(entry, self.arg_names, grid, args, kwargs)
    STATS.interpreter[self.fn.__name__] += 1
    assert _original_run is not None  # installed before InterpretedFunction.run can be this
    return _original_run(self, *args, grid=grid, warmup=warmup, **kwargs)


def interpret(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``kernel`` in Triton's interpreter, bypassing native dispatch (the tests' reference)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = _original_run or InterpretedFunction.run
    return run(kernel, *args, grid=grid, warmup=False, **kwargs)


def install(mode: str = "native", stats_path: Path | None = None) -> bool:
    """Route Triton interpreter launches through the native registry. Idempotent; True if installed.
    With ``stats_path``, the launch counts are also kept in that file (:class:`StatsWriter`)."""
    global _original_run, _mode, _writer
    if mode not in ("native", "interpreter"):
        raise ValueError(f"MMCPU_KERNELS must be 'native' or 'interpreter', not {mode!r}")
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as exc:  # no triton: nothing launches Triton kernels either
        logger.warning("native kernels not installed: triton unavailable (%s)", exc)
        return False
    if mode == "native":
        load_native_modules()
    if _mode != mode:
        _decisions.clear()
    _mode = mode
    if _original_run is None:
        # Whatever runs in the interpreter (all in that mode, a stale kernel in native) can sample. Once per
        # installation: each apply is undone by one restore (uninstall's).
        gaps.apply()
        _original_run = InterpretedFunction.run
        InterpretedFunction.run = _run
    from mmcpu import cpu

    logger.info(
        "MRV2 Triton kernels: MMCPU_KERNELS=%s (%d native implementations); CPU: %s; vLLM ops: %s",
        mode,
        len(REGISTRY),
        cpu.current().line(),
        ", ".join(cpu.loaded_vllm_c()) or "not loaded yet",
    )
    if stats_path is not None and _writer is None:
        _writer = StatsWriter(Path(stats_path))
        _writer.start()
        logger.info("MRV2 kernel launch counts: %s (rewritten every %.0f s)", stats_path, _writer.interval)
    return True


def uninstall() -> None:
    global _original_run, _mode, _writer
    if _original_run is not None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = _original_run
        gaps.restore()
    if _writer is not None:
        _writer.stopped.set()
        _writer.join(5)
    _original_run, _mode, _writer = None, None, None
    _decisions.clear()
