"""The systems as the benchmark drives them, and what it records around each round: a vLLM engine or the gateway
over HTTP (the one request builder, mmcpu_dev.payloads), faster-whisper in the bench venv (``peer.py`` over
stdin/stdout), the load during a round, peak memory per process tree, and py-spy on vLLM's worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import openai
import psutil

from mmcpu.proc import stop_group, tree_rss
from mmcpu_dev.bench.inputs import Clip
from mmcpu_dev.bench.stats import Round, Sample
from mmcpu_dev.payloads import image_chat_kwargs, transcription_kwargs
from mmcpu_dev.servers import Engine, free_port, wait_until_ok

PEER = Path(__file__).with_name("peer.py")  # run by path by the bench venv's python (-P: this folder off sys.path)
FOREIGN_CORES_LIMIT = 0.25  # a round during which other processes used more cores than this is flagged
T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_round(calls: list[Callable[[], str]], concurrency: int, meta: list[tuple[float, str, str | None]]) -> Round:
    """Send all calls with at most ``concurrency`` in flight; meta[i] = (audio seconds, kind, reference)."""

    def timed(i: int) -> Sample:
        audio_s, kind, ref = meta[i]
        t0 = time.perf_counter()
        try:
            text = calls[i]()
            return Sample(time.perf_counter() - t0, audio_s, text, None, kind, ref)
        except Exception as exc:
            return Sample(time.perf_counter() - t0, audio_s, None, f"{type(exc).__name__}: {str(exc)[:200]}", kind, ref)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(timed, range(len(calls))))
    return Round(concurrency, time.perf_counter() - t0, samples)


class Http:
    """A vLLM engine or the gateway, through the unmodified openai client."""

    def __init__(self, base_url: str, audio_model: str | None = None, vision_model: str | None = None) -> None:
        # max_retries=0: a failing request is counted as the failure it is, not retried into a success.
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=1800)
        self.url, self.audio_model, self.vision_model = base_url, audio_model, vision_model

    def transcribe(self, clip: Clip) -> str:
        kwargs = transcription_kwargs(clip.path, model=self.audio_model, language="en")
        return self.client.audio.transcriptions.create(**kwargs).text

    def chat(self, images: list, **sampling: object) -> str:
        kwargs = {**image_chat_kwargs(images, model=self.vision_model), **sampling}
        return self.client.chat.completions.create(**kwargs).choices[0].message.content or ""

    def audio_round(self, clips: list[Clip], concurrency: int) -> Round:
        return run_round(
            [lambda c=c: self.transcribe(c) for c in clips], concurrency, [(c.seconds, "audio", c.text) for c in clips]
        )

    def vision_round(self, image_sets: list[list], concurrency: int) -> Round:
        return run_round(
            [lambda imgs=imgs: self.chat(imgs) for imgs in image_sets],
            concurrency,
            [(0.0, "vision", None)] * len(image_sets),
        )


class Peer:
    """One peer process (peer.py in that peer's venv: faster-whisper, OpenVINO GenAI or whisper.cpp) over
    stdin/stdout; ``env`` adds settings it reads at start (e.g. CT2_FORCE_CPU_ISA)."""

    def __init__(
        self, python: Path, argv: list[str], what: str, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        t0 = time.monotonic()
        self.what, self.log = what, log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(python), "-P", str(PEER), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        hello = self._read()
        if not hello.get("ready"):
            raise RuntimeError(f"{what} did not start: {hello} (log {log_path})")
        self.ready_s, self.versions = time.monotonic() - t0, hello["versions"]
        self.warm: set[tuple] = set()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = [ln for ln in Path(self.log.name).read_text(errors="replace").splitlines() if ln.strip()][-3:]
            rc = self.proc.wait()
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            raise RuntimeError(f"{self.what} died ({how}): {' | '.join(tail)[-600:] or 'nothing on stderr'}")
        return json.loads(line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc.poll() is None else None

    def audio_round(self, clips: list[Clip], concurrency: int, threads: int, workers: int, batch: int = 0) -> Round:
        """All clips, ``concurrency`` calls in flight, on a model with ``threads`` x ``workers``; ``batch`` > 0:
        each file through BatchedInferencePipeline with that batch size instead."""
        key = (threads, workers, batch)
        self.proc.stdin.write(
            json.dumps(
                {
                    "op": "run",
                    "files": [str(c.path) for c in clips],
                    "concurrency": concurrency,
                    "cpu_threads": threads,
                    "num_workers": workers,
                    "batch": batch,
                    "warmup": key not in self.warm,
                }
            )
            + "\n"
        )
        self.proc.stdin.flush()
        self.warm.add(key)  # the first call on a freshly loaded model is slow: the peer sends one untimed first
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.what}: {reply['error']}")
        samples = [
            Sample(r["latency_s"], c.seconds, r["text"], r["error"], "audio", c.text)
            for c, r in zip(clips, reply["results"], strict=True)
        ]
        return Round(concurrency, reply["wall_s"], samples)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def FasterWhisper(
    python: Path, model: Path, compute_type: str, log_path: Path, env: dict[str, str] | None = None
) -> Peer:
    return Peer(
        python,
        ["fw", "--model", str(model), "--compute-type", compute_type],
        f"faster-whisper {compute_type}",
        log_path,
        env,
    )


class Gateway:
    """The project's gateway (uvicorn) as its own process on loopback, as the container role runs it."""

    def __init__(self, engines: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        env = dict(
            os.environ,
            MMCPU_HOST="127.0.0.1",
            MMCPU_GATEWAY_PORT=str(self.port),
            MMCPU_API_KEY="",
            MMCPU_ENGINES=",".join(f"{name}={url}" for name, url in engines.items()),
        )
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mmcpu.gateway.app import main; sys.exit(main())"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until_ok(f"{self.url}/ping", self.proc, 60, "gateway", log_path)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc.poll() is None else None

    def stop(self) -> None:
        stop_group(self.proc, timeout_s=15)
        self.log.close()


# --- records around the rounds -------------------------------------------------------------------------------------
def worker_pid(engine: Engine) -> int | None:
    """vLLM's model-runner process (VLLM::Worker; EngineCore when the runner lives there)."""
    if not engine.proc or engine.proc.poll() is not None:
        return None
    found: dict[str, int] = {}
    for proc in psutil.Process(engine.proc.pid).children(recursive=True):
        try:
            name = " ".join(proc.cmdline()[:1]) or proc.name()
        except psutil.NoSuchProcess:
            continue
        for tag in ("VLLM::Worker", "VLLM::EngineCore"):
            if tag in name:
                found.setdefault(tag, proc.pid)
    return found.get("VLLM::Worker") or found.get("VLLM::EngineCore")


def worker_cpus(engine: Engine) -> dict[str, int]:
    """CPU affinity of the model runner's threads, e.g. {"0-1": 47}: where vLLM's OpenMP binding put them."""
    pid = worker_pid(engine)
    found: dict[str, int] = {}
    for status in Path(f"/proc/{pid}/task").glob("*/status") if pid else []:
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
        except (OSError, StopIteration):
            continue
        cpus = line.split(":", 1)[1].strip()
        found[cpus] = found.get(cpus, 0) + 1
    return found


class RssSampler(threading.Thread):
    """Peak tree RSS per named process, sampled twice a second while the benchmark runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: dict[str, Callable[[], int | None]] = {}
        self.peak: dict[str, int] = {}
        self.stop_event = threading.Event()

    def watch(self, name: str, pid: Callable[[], int | None]) -> None:
        self.pids[name] = pid

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            for name, pid in list(self.pids.items()):
                self.peak[name] = max(self.peak.get(name, 0), tree_rss(pid()))


class CpuWatch:
    """What else ran while a round was measured: the 1-min load average at its start, and the cores used by
    processes outside this benchmark's own process tree (system busy time minus ours, over the round)."""

    def __init__(self) -> None:
        self.t0, self.load = time.monotonic(), os.getloadavg()[0]
        self.sys0, self.ours0 = self._busy(), self._ours()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _ours() -> float:
        return tree_cpu_s([os.getpid()])

    def stop(self) -> dict:
        wall = max(time.monotonic() - self.t0, 1e-6)
        foreign = max(0.0, (self._busy() - self.sys0) - (self._ours() - self.ours0)) / wall
        return {
            "loadavg_1m": round(self.load, 2),
            "foreign_cores": round(foreign, 2),
            "flagged": foreign > FOREIGN_CORES_LIMIT,
        }


def tree_cpu_s(pids: list[int | None]) -> float:
    """User + system CPU seconds used so far by these processes and everything under them (all threads)."""
    seen: set[int] = set()
    total = 0.0
    for pid in pids:
        if not pid:
            continue
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            try:
                c = proc.cpu_times()
                total += c.user + c.system
            except psutil.NoSuchProcess:
                pass
    return total


class CpuUse:
    """The cores the measured system's own processes kept busy over a round: their CPU time / the round's wall."""

    def __init__(self, pids: Callable[[], list[int | None]] | None) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.cpu0 = tree_cpu_s(pids()) if pids else 0.0

    def stop(self) -> dict:
        if not self.pids:
            return {}
        wall = max(time.monotonic() - self.t0, 1e-6)
        cpu = max(0.0, tree_cpu_s(self.pids()) - self.cpu0)
        return {"cpu_s": round(cpu, 2), "cores": round(cpu / wall, 2)}


USE_MIN = 0.75  # a layout that kept fewer than this share of the cores it can keep busy did not use its cores


def layout_cores(threads: int, workers: int, concurrency: int, cpus: int) -> int:
    """The cores a peer's layout can keep busy: min(workers, concurrency) replicas of ``threads`` threads each,
    at most the CPUs there are."""
    return min(min(workers, concurrency) * threads, cpus)


def layout_use(cores: float | None, threads: int, workers: int, concurrency: int, cpus: int) -> dict:
    """The layout's record beside a round's cpu/wall: the cores it can keep busy, and ``underused`` when it used
    fewer than USE_MIN of them (only where that is at least 2: one core's use is bounded by the round's own gaps)."""
    can = layout_cores(threads, workers, concurrency, cpus)
    return {
        "layout": f"{threads}x{workers}",
        "layout_cores": can,
        "underused": cores is not None and can >= 2 and cores < USE_MIN * can,
    }


# A search round is 8 requests: its tail, where fewer requests are left than replicas, leaves cores idle whatever the
# layout (Intel Xeon, 2 CPUs: one 2-thread OpenVINO replica kept 1.64-1.73 cores in search rounds and 1.81-1.87 in
# the 32-request measured ones; two and four 1-thread replicas 1.37-1.49 in search rounds, 1.67-1.92 measured). Below
# this share its replicas ran as if on one core (pinned: ~1.0 of 2), which a tail cannot explain.
SEARCH_USE_MIN = 0.625


def replicas_idle(workers: int, concurrency: int, use: dict, flagged: bool, search: bool = False) -> bool:
    """A layout of several replicas at work together that left cores idle on an undisturbed round: the replicas
    did not run in parallel (e.g. pinned onto one core), so the peer's search may have missed its best layout.
    A measured round must keep USE_MIN of its cores busy; a search round SEARCH_USE_MIN."""
    if min(workers, concurrency) < 2 or flagged or not use.get("underused"):
        return False
    return not search or use.get("cores", 0.0) < SEARCH_USE_MIN * use["layout_cores"]


RETAKES = 3  # a disturbed round is taken again this many times at most (a shared machine)
RETAKE_PAUSE_S = 15


def undisturbed(take: Callable[[], T], what: str) -> tuple[T, dict]:
    """``take()`` (one round) with its load record (CpuWatch). A round during which other processes used more
    than FOREIGN_CORES_LIMIT cores is taken again, after a pause, up to RETAKES times; the last one counts,
    flagged if it still was disturbed."""
    retakes = 0
    while True:
        watch = CpuWatch()
        result = take()
        load = watch.stop()
        if not load["flagged"] or retakes == RETAKES:
            return result, load
        log(f"{what}: other processes used {load['foreign_cores']} cores; taking it again")
        retakes += 1
        time.sleep(RETAKE_PAUSE_S)


class Profiler:
    """py-spy record on one process for the duration of a ``with`` block (non-blocking: the target is not paused)."""

    def __init__(self, py_spy: Path, pid: int | None, out: Path, rate: int = 25) -> None:
        self.cmd = [
            str(py_spy),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--nonblocking",
            "--format",
            "raw",
            "--output",
            str(out),
        ]
        self.pid, self.out, self.proc, self.error = pid, out, None, None

    def __enter__(self) -> Profiler:
        if not self.pid:
            self.error = "no vLLM worker process found"
        elif not Path(self.cmd[0]).is_file():
            self.error = f"{self.cmd[0]} missing (make bench-venv)"
        else:
            self.out.unlink(missing_ok=True)
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.proc:
            return
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.out.is_file():
            self.error = f"py-spy wrote nothing (exit {self.proc.returncode}): {err.strip()[-300:]}"

    def raw(self) -> str:
        return "" if self.error else self.out.read_text()
