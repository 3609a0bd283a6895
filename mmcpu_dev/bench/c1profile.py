"""python -m mmcpu_dev.bench c1profile: one transcription at c=1 taken apart, ours against OpenVINO GenAI.

Ours is the audio role's default engine as ``mmcpu-entrypoint audio`` starts it (checkpoint, dtype, quantisation
and vLLM arguments from the launcher: ``plan.role_engine``), MRV2 with the native kernels. Requests go one at a
time (c=1) through the OpenAI API; per part:

- client wall time of the request (p50);
- vLLM's own request metrics (Prometheus histograms on ``/metrics``, deltas over the measured requests): end to end
  in the engine (``e2e_request_latency``: from the request's arrival at the engine client to its last output),
  queue, prefill (the encoder pass + the first decoder step), decode, inter-token latency (one decode step),
  generated tokens;
- what is left of the wall time outside the engine: the API server (HTTP, audio decoding, feature extraction,
  prompt building, detokenisation, the ZMQ hop to the EngineCore and back);
- audio decoding (vLLM's ``load_audio``) and feature extraction (the checkpoint's ``WhisperFeatureExtractor``)
  timed alone in this process on the same clips;
- with ``--pyspy``: py-spy on the API server and on the EngineCore during the measured requests, inclusive shares
  of the main phases (``profiles``).

OpenVINO GenAI's ``WhisperPipeline`` (the peer venv and IR that ``make bench-peers`` builds, same tiny.en weights,
``INFERENCE_NUM_THREADS`` = the CPUs) on the same samples, its own ``perf_metrics``: features extraction, encoder
inference, decoder inference per token (TPOT), detokenisation, generate duration. The load average and other
processes' CPU are recorded beside the figures; the JSON goes to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

from mmcpu.config import REPO_ROOT, get_settings

METRICS = (
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_generation_tokens",
)

OV_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import openvino_genai as g
from peer import read_wav
pipe = g.WhisperPipeline(sys.argv[1], "CPU", INFERENCE_NUM_THREADS=int(sys.argv[4]))
spec = json.loads(sys.argv[2])
out = []
for path in spec["clips"]:
    samples = read_wav(path)
    for r in range(spec["reps"] + 1):
        t0 = time.perf_counter()
        res = pipe.generate(samples)
        wall = time.perf_counter() - t0
        if r == 0:
            continue  # warm-up per clip
        pm = res.perf_metrics
        raw = pm.whisper_raw_metrics
        out.append({"wall_ms": 1e3 * wall, "generate_ms": pm.get_generate_duration().mean,
                    "features_ms": pm.get_features_extraction_duration().mean,
                    "encoder_ms": pm.get_encode_inference_duration().mean,
                    "decoder_ms": sum(raw.decode_inference_durations) / 1e3,  # us per call, summed
                    "decode_step_ms": pm.get_decode_inference_duration().mean,
                    "ttft_ms": pm.get_ttft().mean, "tpot_ms": pm.get_tpot().mean,
                    "detok_ms": pm.get_detokenization_duration().mean,
                    "tokens": pm.get_num_generated_tokens(), "text": str(res)})
print(json.dumps(out))
"""


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    got: dict[str, float] = {}
    for name in METRICS:
        for part in ("sum", "count"):
            m = re.search(rf"^vllm:{name}_{part}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
            got[f"{name}_{part}"] = float(m.group(1)) if m else float("nan")
    return got


def mean_of(before: dict, after: dict, name: str) -> float:
    n = after[f"{name}_count"] - before[f"{name}_count"]
    return (after[f"{name}_sum"] - before[f"{name}_sum"]) / n if n else float("nan")


def other_cores(pids: set[int], seconds: float, since: dict) -> float:
    import psutil

    total = sum(psutil.cpu_times()[:3]) - since["all"]
    ours = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            ours += t.user + t.system - since.get(pid, 0.0)
        except psutil.NoSuchProcess:
            pass
    return (total - ours - (sum(os.times()[:2]) - since["self"])) / seconds


def cpu_marks(pids: set[int]) -> dict:
    import psutil

    marks = {"all": sum(psutil.cpu_times()[:3]), "self": sum(os.times()[:2])}
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        marks[pid] = t.user + t.system
    return marks


def front_end_parts(clips: list, model: Path, reps: int) -> dict[str, float]:
    """Audio decoding and feature extraction as vLLM's speech-to-text path runs them, timed alone (ms, median)."""
    import io

    from transformers import WhisperFeatureExtractor
    from vllm.multimodal.media.audio import load_audio

    fe = WhisperFeatureExtractor.from_pretrained(str(model))
    dec, feat = [], []
    for clip in clips:
        data = Path(clip.path).read_bytes()
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            y, sr = load_audio(io.BytesIO(data), sr=fe.sampling_rate)
            t1 = time.perf_counter()
            fe(y, sampling_rate=sr, return_tensors="pt")
            t2 = time.perf_counter()
            dec.append(t1 - t0), feat.append(t2 - t1)
    return {"audio_decode_ms": 1e3 * statistics.median(dec), "features_ms": 1e3 * statistics.median(feat)}


def pids_of(eng) -> tuple[int | None, int | None]:
    import psutil

    api = core = None
    for p in [psutil.Process(eng.proc.pid), *psutil.Process(eng.proc.pid).children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "vllm.entrypoints.openai.api_server" in cmd and api is None:
            api = p.pid
        if "EngineCore" in (p.name() + cmd):
            core = p.pid
    return api, core


def ours(clips: list, reps: int, out: Path, pyspy: Path | None, runner: str = "v2") -> dict:
    from mmcpu_dev.bench import plan as plans
    from mmcpu_dev.bench.runners import Http, Profiler
    from mmcpu_dev.servers import Engine

    settings = get_settings()
    model, args, _ = plans.role_engine("audio", settings)
    eng = Engine(model, out / f"c1profile-ours-{runner}.log", runner=runner, vllm_args=list(args))
    try:
        eng.start()
        http = Http(eng.base_url, audio_model=eng.name)
        for clip in clips:
            http.transcribe(clip)  # warm-up
        api, core = pids_of(eng)
        before, marks, t0 = scrape(eng.base_url), cpu_marks({p for p in (api, core) if p}), time.monotonic()
        load0 = os.getloadavg()[0]
        walls, texts, profs = [], [], []
        if pyspy:
            profs = [
                Profiler(pyspy, pid, out / f"c1profile-{name}.txt", rate=200)
                for name, pid in (("api", api), ("core", core))
                if pid
            ]
            for p in profs:
                p.__enter__()
        try:
            for clip in clips:
                for _ in range(reps):
                    s = time.perf_counter()
                    texts.append(http.transcribe(clip))
                    walls.append(time.perf_counter() - s)
        finally:
            for p in profs:
                p.__exit__(None, None, None)
        elapsed = time.monotonic() - t0
        after = scrape(eng.base_url)
        res = {
            "model": str(model),
            "runner": runner,
            "args": list(args),
            "load": [load0, os.getloadavg()[0]],
            "other_cores": round(other_cores({p for p in (api, core) if p}, elapsed, marks), 2),
            "wall_ms": [1e3 * w for w in walls],
            "texts": texts,
        }
        for name in METRICS:
            res[name] = mean_of(before, after, name)
        res["front_end"] = front_end_parts(clips, model, reps)
        return res
    finally:
        eng.stop()


def openvino(clips: list, reps: int, ir: Path, threads: int) -> dict:
    py = REPO_ROOT / ".cache" / "peers" / "openvino" / "bin" / "python"
    load0 = os.getloadavg()[0]
    spec = json.dumps({"clips": [str(c.path) for c in clips], "reps": reps})
    text = subprocess.run(
        [str(py), "-P", "-c", OV_SCRIPT, str(ir), spec, str(REPO_ROOT / "mmcpu_dev" / "bench"), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = json.loads(text.strip().splitlines()[-1])
    return {"ir": str(ir), "load": [load0, os.getloadavg()[0]], "rows": rows}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(o: dict, v: dict) -> list[str]:
    rows = v["rows"]
    ov = {k: med([r[k] for r in rows]) for k in rows[0] if k != "text"}
    fe = o["front_end"]
    e2e, wall = 1e3 * o["e2e_request_latency_seconds"], statistics.mean(o["wall_ms"])
    itl, tok = 1e3 * o["inter_token_latency_seconds"], o["request_generation_tokens"]
    prefill = 1e3 * o["request_prefill_time_seconds"]
    lines = [
        "| part | ours ms | OpenVINO GenAI ms |",
        "|---|---|---|",
        f"| one request, wall (p50) | {med(o['wall_ms']):.1f} | {ov['wall_ms']:.1f} "
        f"(generate {ov['generate_ms']:.1f}) |",
        f"| one request, wall (mean) | {wall:.1f} | {statistics.mean(r['wall_ms'] for r in rows):.1f} |",
        f"| outside the engine: API server, HTTP, ZMQ hop (mean wall - mean engine e2e) | {wall - e2e:.1f} | - |",
        f"| . audio decoding (alone) | {fe['audio_decode_ms']:.1f} | - (given samples) |",
        f"| . feature extraction (alone) | {fe['features_ms']:.1f} | {ov['features_ms']:.1f} |",
        f"| engine, end to end (vLLM e2e latency) | {e2e:.1f} | - |",
        f"| . queue | {1e3 * o['request_queue_time_seconds']:.1f} | - |",
        f"| . prefill: encoder + first decoder step | {prefill:.1f} | {ov['encoder_ms']:.1f} encoder + "
        f"{ov['tpot_ms']:.1f} step |",
        f"| . encoder (prefill - one step) | {prefill - itl:.1f} | {ov['encoder_ms']:.1f} |",
        f"| . decode, all steps | {1e3 * o['request_decode_time_seconds']:.1f} | {ov['decoder_ms']:.1f} "
        f"(all decoder inference) |",
        f"| . one decode step (vLLM inter-token latency / OpenVINO TPOT) | {itl:.2f} | {ov['tpot_ms']:.2f} "
        f"(decoder inference alone {ov['decode_step_ms']:.2f}) |",
        f"| generated tokens per request (mean) | {tok:.1f} | {ov['tokens']:.1f} |",
        f"| detokenisation | (in the API server) | {ov['detok_ms']:.2f} |",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    from mmcpu import cpu
    from mmcpu_dev.bench import inputs
    from mmcpu_dev.bench import plan as plans

    ap = argparse.ArgumentParser(prog="python -m mmcpu_dev.bench c1profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=6, help="clips of the fixed workload (default 6)")
    ap.add_argument("--reps", type=int, default=3, help="requests per clip after one warm-up")
    ap.add_argument("--ir", type=Path, default=REPO_ROOT / ".cache/peers/weights/whisper-tiny.en-ov-fp32")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "c1profile")
    ap.add_argument("--pyspy", action="store_true", help="py-spy on the API server and the EngineCore")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-ours", action="store_true")
    ap.add_argument("--runner", choices=("v2", "v1"), default="v2", help="ours on MRV2 (default) or on V1")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = get_settings()
    clips = inputs.clips(plans.workload()[: args.clips], settings.cache_dir / "bench" / "clips")
    print("CPU:", cpu.current().line(), flush=True)
    res: dict = {"cpu": cpu.current().line(), "clips": [c.seconds for c in clips]}
    res["openvino"] = openvino(clips, args.reps, args.ir, os.cpu_count() or 2)
    print("openvino done, load", res["openvino"]["load"], flush=True)
    if not args.no_ours:
        pyspy = REPO_ROOT / ".cache" / "bench-venv" / "bin" / "py-spy" if args.pyspy else None
        res["ours"] = ours(clips, args.reps, args.out, pyspy, args.runner)
        print("\n".join(table(res["ours"], res["openvino"])))
        print(
            f"load ours {res['ours']['load']}, other cores {res['ours']['other_cores']}; "
            f"openvino {res['openvino']['load']}"
        )
    (args.json or args.out / "c1profile.json").write_text(json.dumps(res, indent=1))
    return 0
