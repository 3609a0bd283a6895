"""Benchmark arithmetic and reporting: statistics of timed requests, ours/peer ratios, py-spy profile
summaries and the Markdown report. Pure functions over plain data, so they are unit-tested without servers;
``scripts/bench.py`` does the measuring.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# --- statistics ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def throughput(audio_s: float, wall_s: float) -> float | None:
    """Seconds of audio transcribed per second of wall time (real-time factor inverse); None if no time passed."""
    if wall_s <= 0:
        return None
    return audio_s / wall_s


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer, or None when either is missing or the peer is 0 (a ratio that cannot be formed)."""
    if ours is None or peer is None or peer == 0 or math.isnan(ours) or math.isnan(peer):
        return None
    return ours / peer


@dataclass
class Sample:
    """One timed request: latency, the audio seconds it carried (0 for vision), the text or the error."""

    latency_s: float
    audio_s: float = 0.0
    text: str | None = None
    error: str | None = None
    kind: str = ""  # e.g. "audio" / "vision" in the mixed load
    ref: str | None = None  # reference transcript (audio)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Round:
    """Requests sent together at one concurrency; wall time from the first send to the last answer."""

    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict:
        return summarize(self.samples, self.wall_s, self.concurrency)


def summarize(samples: Sequence[Sample], wall_s: float, concurrency: int | None = None) -> dict:
    """Figures of one round: counts, latency percentiles of the successful requests, throughput, rps."""
    ok = [s for s in samples if s.ok]
    lat = [s.latency_s for s in ok]
    audio_s = sum(s.audio_s for s in ok)
    errors = [s.error for s in samples if not s.ok]
    return {
        "concurrency": concurrency,
        "n": len(samples),
        "ok": len(ok),
        "failures": len(errors),
        "wall_s": wall_s,
        "audio_s": audio_s,
        "throughput": throughput(audio_s, wall_s) if audio_s else None,
        "rps": len(ok) / wall_s if wall_s > 0 else None,
        "p50_s": percentile(lat, 50),
        "p95_s": percentile(lat, 95),
        "mean_s": sum(lat) / len(lat) if lat else None,
        "max_s": max(lat) if lat else None,
        "errors": sorted(Counter(errors).items(), key=lambda kv: -kv[1])[:3],
    }


def merge_rounds(rounds: Iterable[Round]) -> dict:
    """Several rounds at the SAME concurrency (e.g. repetitions) as one: walls add up, samples pool."""
    rounds = list(rounds)
    if not rounds:
        raise ValueError("no rounds to merge")
    levels = {r.concurrency for r in rounds}
    if len(levels) != 1:
        raise ValueError(f"rounds of different concurrency cannot be merged: {sorted(levels)}")
    samples = [s for r in rounds for s in r.samples]
    summary = summarize(samples, sum(r.wall_s for r in rounds), levels.pop())
    summary["rounds"] = len(rounds)
    # The spread over repeated rounds (min, max), so one lucky or unlucky round cannot pass for the figure.
    for key in ("throughput", "rps", "p50_s"):
        per = [v for v in (r.summary()[key] for r in rounds) if v is not None]
        summary[f"{key}_spread"] = [min(per), max(per)] if per else None
    return summary


def long_summary(rounds: Sequence[Round]) -> dict:
    """Rounds of one long file: the merged figures plus its real-time factor (wall / audio: < 1 = faster than
    real time) and the word error rate over its transcriptions."""
    from mmcpu.dev import speech

    merged = merge_rounds(rounds)
    ok = [x for r in rounds for x in r.samples if x.ok]
    merged["rtf"] = ratio(1.0, merged["throughput"])
    merged["wer"] = speech.word_error_rate([x.ref for x in ok], [x.text for x in ok]) if ok else None
    return merged


# --- py-spy profiles -------------------------------------------------------------------------------

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# py-spy names files relative to their sys.path entry ("triton/runtime/interpreter.py"); absolute paths also work.
_TRITON = re.compile(r"(^|/)triton/")
_VLLM = re.compile(r"(^|/)vllm/")
_INTERPRETER = "triton/runtime/interpreter.py"
NO_FRAME = ("<no Python frame>", "")


def _frame(text: str) -> tuple[str, str]:
    m = _FRAME.match(text.strip())
    if not m:
        return text.strip(), ""
    return m["func"], m["file"]


def _short(path: str) -> str:
    """site-packages/vllm/v1/x.py -> vllm/v1/x.py: the import path, not where the venv happens to live."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _name(func: str, path: str) -> str:
    return f"{func} ({_short(path)})" if path else func


def parse_pyspy_raw(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """py-spy ``--format raw`` (collapsed stacks: ``root;...;leaf COUNT``) -> [(frames root first, count)]."""
    stacks = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:120]!r}")
        # a sample can have no Python frame at all (the thread was in native code only): keep it in the total
        stacks.append(([_frame(f) for f in stack.split(";")] if stack else [NO_FRAME], int(count)))
    return stacks


def _is_kernel_file(path: str) -> bool:
    """Not Triton and not the standard library (the GridExecutor also calls inspect.* before the body)."""
    top = _short(path).split("/", 1)[0].removesuffix(".py")
    return bool(path) and not _TRITON.search(path) and top not in sys.stdlib_module_names


def launch_of(frames: Sequence[tuple[str, str]]) -> tuple[str, str | None] | None:
    """For a stack under Triton's interpreter: (the call site that launched the kernel, the ``@triton.jit``
    function whose Python body the interpreter's GridExecutor is running - None while the interpreter is still
    doing its launch work: argument conversion, patching ``tl``). None for a stack outside the interpreter."""
    if not any(_INTERPRETER in f for _, f in frames):
        return None
    site, in_triton = None, False
    for i, (func, path) in enumerate(frames):
        if _TRITON.search(path):
            in_triton = True
            if func.startswith("GridExecutor.") and i + 1 < len(frames) and _is_kernel_file(frames[i + 1][1]):
                return site or "an unknown call site", _name(*frames[i + 1])
        elif not in_triton:
            site = _name(func, path)
    return site or "an unknown call site", None


def kernel_of(frames: Sequence[tuple[str, str]]) -> str | None:
    """The kernel a stack is in under the interpreter; the interpreter's launch work is charged to its call site."""
    launch = launch_of(frames)
    if launch is None:
        return None
    site, kernel = launch
    return kernel or f"interpreter launch work, called from {site}"


def profile_summary(text: str, top: int = 12) -> dict:
    """Where the samples went: share under Triton's interpreter, kernels by inclusive samples, Triton launches
    by call site (kernel body + launch work), Python frames by self samples (the leaf), vLLM frames inclusive."""
    stacks = parse_pyspy_raw(text)
    total = sum(c for _, c in stacks)
    kernels: Counter[str] = Counter()
    sites: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    vllm_incl: Counter[str] = Counter()
    interp = 0
    for frames, count in stacks:
        if any(_INTERPRETER in f for _, f in frames):
            interp += count
        launch = launch_of(frames)
        if launch:
            site, kernel = launch
            sites[site] += count
            kernels[kernel or f"interpreter launch work, called from {site}"] += count
        func, path = frames[-1]
        leaves[_name(func, path)] += count
        for name in {_name(fn, p) for fn, p in frames if _VLLM.search(p)}:
            vllm_incl[name] += count

    def table(counter: Counter[str]) -> list[dict]:
        return [{"frame": k, "samples": v, "share": v / total} for k, v in counter.most_common(top)]

    return {
        "samples": total,
        "interpreter_share": interp / total if total else None,
        "kernels": table(kernels),
        "launch_sites": table(sites),
        "self_frames": table(leaves),
        "vllm_inclusive": table(vllm_incl),
    }


# --- the Markdown report ----------------------------------------------------------------------------


# --- start-up breakdown from vLLM's log ----------------------------------------------------------------------

# "(EngineCore pid=7) INFO 12-01 11:05:56 [core.py:116] ..." - the prefix is missing before vLLM sets it.
_STAMP = re.compile(r"^(?:\((?P<proc>\w+) pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) (?P<when>\d\d-\d\d \d\d:\d\d:\d\d) ")
# (stage, the marker that ends it): a predicate on (process, line), or "api-last" = the API server's last line
# before the EngineCore process's first (unprefixed) one - there the EngineCore is spawned. A stage begins where
# the one before ended.
STARTUP_STAGES = (
    ("imports, API server", lambda proc, text: proc == "APIServer"),
    ("config + tokenizer, API server", "api-last"),
    ("EngineCore spawn + imports", lambda proc, text: proc == "EngineCore"),
    ("device + worker init", lambda proc, text: "Loading model from scratch" in text or "Starting to load model" in text),
    ("model load", lambda proc, text: "Model loading took" in text),
    ("warm-up + profile + KV cache", lambda proc, text: "init engine (profile, create kv cache, warmup model)" in text),
)


def startup_breakdown(log: str, started_at: float, ready_s: float, year: int) -> dict[str, float]:
    """Seconds per start-up stage of one engine, from its log's (second-resolution, local-time) stamps:
    ``started_at`` = wall clock of the spawn, ``ready_s`` = spawn to /health 200. The last stage, "API ready",
    runs to ready. Stages whose marker is missing are left out (their time falls into the next one)."""
    stamped = [(m["proc"], line, dt.datetime.strptime(f"{year}-{m['when']}", "%Y-%m-%d %H:%M:%S").timestamp())
               for line in log.splitlines() if (m := _STAMP.match(line))]
    marks: list[tuple[str, float]] = []
    i = 0
    for name, ends in STARTUP_STAGES:
        if ends == "api-last":
            # The first unprefixed line after the API server began: the EngineCore importing vLLM.
            j = next((k for k in range(i, len(stamped)) if stamped[k][0] is None), None)
            last = [k for k in range(i, j if j is not None else 0) if stamped[k][0] == "APIServer"]
            if not last:
                continue
            i = last[-1]
        else:
            j = next((k for k in range(i, len(stamped)) if ends(stamped[k][0], stamped[k][1])), None)
            if j is None:
                continue
            i = j
        marks.append((name, stamped[i][2]))
    out: dict[str, float] = {}
    previous = started_at
    for name, when in marks:
        out[name] = round(max(0.0, when - previous), 1)
        previous = max(previous, when)
    out["API ready"] = round(max(0.0, started_at + ready_s - previous), 1)
    return out


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:.0f}{unit}"
    return f"{value:.{digits}f}{unit}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value < 0.01:
        return f"{value:.4f}×"
    return f"{value:.3g}×"


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**30


def audio_level(results: dict, system: str, level: int | str) -> dict | None:
    return results.get("audio", {}).get(system, {}).get("levels", {}).get(str(level))


def headline_ratios(results: dict, ours: str, peers: Sequence[str]) -> list[dict]:
    """ours/peer for each audio figure: throughput per concurrency (higher is better for ours), p50 latency,
    peak RSS and cold start (lower is better for ours)."""
    rows = []
    systems = results.get("systems", {})
    audio = results.get("audio", {})
    levels = results.get("config", {}).get("audio_levels", [])
    for peer in peers:
        if peer not in audio or ours not in audio:
            continue
        for level in levels:
            a, b = audio_level(results, ours, level), audio_level(results, peer, level)
            if a and b:
                rows.append({"peer": peer, "figure": f"throughput @c={level}",
                             "ratio": ratio(a["throughput"], b["throughput"])})  # fmt: skip
        if levels:  # latency at the lowest concurrency: one request alone, no queueing
            a, b = audio_level(results, ours, levels[0]), audio_level(results, peer, levels[0])
            if a and b:
                rows.append({"peer": peer, "figure": f"p50 latency @c={levels[0]}",
                             "ratio": ratio(a["p50_s"], b["p50_s"])})  # fmt: skip
        for key, label in (("peak_rss_bytes", "peak RSS"), ("ready_s", "cold start to ready")):
            rows.append({"peer": peer, "figure": label,
                         "ratio": ratio(systems.get(ours, {}).get(key), systems.get(peer, {}).get(key))})  # fmt: skip
    return rows


def _pooled_rps(per_kind: dict, level: int | str) -> float | None:
    """Requests per second at one level over all chat kinds (1- and 2-image) pooled: ok requests / wall."""
    rows = [per[str(level)] for per in per_kind.values() if str(level) in per]
    wall = sum(r["wall_s"] for r in rows)
    return sum(r["ok"] for r in rows) / wall if rows and wall > 0 else None


def headline(results: dict) -> dict[str, float]:
    """The figures issues ask for, as plain numbers (throughput ratios: > 1 = ours faster; p50 ratio: < 1 = ours
    faster). vLLM-vs-vLLM ratios compare phases; ours-vs-faster-whisper ratios pair rounds of the same phase.
    A figure that was not measured in this run is left out rather than guessed."""
    audio, paired, vis = results.get("audio", {}), results.get("paired", {}), results.get("vision", {})
    systems = results.get("systems", {})
    out: dict[str, float | None] = {}

    def tp(table: dict, who: str, c: int, key: str = "throughput") -> float | None:
        return (table.get(who, {}).get("levels", table.get(who, {})).get(str(c)) or {}).get(key)

    for c in (1, 4, 8):
        out[f"mrv2_native/v1@c={c}"] = ratio(tp(audio, "mrv2_native", c), tp(audio, "v1", c))
    out["mrv2_native/mrv2_interpreter@c=1"] = ratio(tp(audio, "mrv2_native", 1), tp(audio, "mrv2_interpreter", 1))
    if "mrv2_native" in vis and "v1" in vis:
        out["vision_mrv2_native/v1@c=1"] = ratio(_pooled_rps(vis["mrv2_native"], 1), _pooled_rps(vis["v1"], 1))
    native, v1 = paired.get("mrv2_native", {}), paired.get("v1", {})
    for c in (1, 4, 8):
        out[f"mrv2_native/fw_int8@c={c}"] = ratio(tp(native, "mrv2_native", c), tp(native, "fw-int8", c))
    out["p50_mrv2_native/fw_int8@c=1"] = ratio(tp(native, "mrv2_native", 1, "p50_s"), tp(native, "fw-int8", 1, "p50_s"))
    out["v1/fw_int8@c=8"] = ratio(tp(v1, "v1", 8), tp(v1, "fw-int8", 8))
    for who, key in (("mrv2_native", "mrv2_native"), ("fw-int8", "fw_int8")):
        for name, r in results.get("long", {}).get(who, {}).items():
            out[f"rtf_{key}@{name}"] = r.get("rtf")
    start = results.get("startup", {})
    ready = start.get("cold", {}).get("ready_s") or systems.get("mrv2_native", {}).get("ready_s")
    out["engine_ready_cold_s"] = round(ready, 1) if ready else None
    out["engine_ready_warm_s"] = start.get("warm", {}).get("ready_s")
    out["compose_up_to_serving_s"] = results.get("compose", {}).get("compose_up_to_serving_s")
    rss = systems.get("mrv2_native", {}).get("peak_rss_bytes")
    out["engine_peak_rss_gib"] = round(rss / 2**30, 2) if rss else None
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items() if v is not None}


def ratio_range(values: Sequence[float | None]) -> str:
    """'0.07×–0.14×' over the ratios that exist (one value: just it)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return "n/a"
    if len(vals) == 1 or fmt_ratio(vals[0]) == fmt_ratio(vals[-1]):
        return fmt_ratio(vals[0])
    return f"{fmt_ratio(vals[0])}–{fmt_ratio(vals[-1])}"


def summary_bullets(results: dict) -> list[str]:
    """The findings in one line each, computed from the figures (ranges over concurrency levels)."""
    audio, vis, systems = results.get("audio", {}), results.get("vision", {}), results.get("systems", {})
    levels = results.get("config", {}).get("audio_levels", [])
    ours = results.get("config", {}).get("ours", "mrv2_native")
    out = []

    def tp(a: str, b: str) -> str:
        return ratio_range([ratio((audio_level(results, a, c) or {}).get("throughput"),
                                  (audio_level(results, b, c) or {}).get("throughput")) for c in levels])  # fmt: skip

    pairs = [(ours, p) for p in ("fw-int8", "fw-float32", "v1", "mrv2_interpreter") if p in audio and p != ours]
    if ours != "v1" and "v1" in audio:
        pairs += [("v1", p) for p in ("fw-int8", "fw-float32") if p in audio]
    if ours in audio and pairs:
        lv = f"c={levels[0]}..{levels[-1]}" if levels else ""
        out.append(f"Transcription throughput ({lv}): " + "; ".join(
            f"{_label(results, a)} / {_label(results, b)} = {tp(a, b)}" for a, b in pairs) + ".")  # fmt: skip
    if ours in vis and "v1" in vis and ours != "v1":
        rps = [ratio(r.get("rps"), vis["v1"].get(kind, {}).get(c, {}).get("rps"))
               for kind, per in vis[ours].items() for c, r in per.items()]  # fmt: skip
        pair = f"{_label(results, ours)} / {_label(results, 'v1')}"
        out.append(f"Vision requests per second, {pair}: {ratio_range(rps)}.")
    wers = [f"{_label(results, k)} {fmt(d.get('wer'), 3)}" for k, d in audio.items() if d.get("wer") is not None]
    if wers:
        out.append("WER on the same clips (same weights, greedy): " + ", ".join(wers) + ".")
    starts = [f"{_label(results, k)} {fmt(s_.get('ready_s'), 1)} s" for k, s_ in systems.items() if s_.get("ready_s")]
    if starts:
        out.append("Cold start to ready: " + ", ".join(starts) + ".")
    mixed = results.get("mixed")
    if mixed:
        t = mixed["total"]
        out.append(f"Mixed load through the gateway: {t['n']} requests at concurrency {mixed['concurrency']}, "
                   f"{t['failures']} failures, p95 {fmt(t['p95_s'])} s.")  # fmt: skip
    return out


def _spread(r: dict, key: str = "throughput") -> str:
    sp = r.get(f"{key}_spread")
    return f"({fmt(sp[0])}–{fmt(sp[1])})" if sp and r.get("rounds", 1) > 1 else ""


def _label(results: dict, key: str) -> str:
    return results.get("systems", {}).get(key, {}).get("label", key)


def render_markdown(results: dict) -> str:
    """docs/benchmarks.md from the results dict written by scripts/bench.py."""
    meta = results.get("meta", {})
    cfg = results.get("config", {})
    systems = results.get("systems", {})
    audio = results.get("audio", {})
    ours = cfg.get("ours", "mrv2_native")
    peers = [k for k in ("fw-int8", "fw-float32", "v1", "mrv2_interpreter") if k in audio and k != ours]
    out: list[str] = []
    w = out.append
    w("# Benchmarks: vLLM MRV2 on CPU (native kernels) vs the interpreter, the V1 runner and faster-whisper\n")
    w(f"Generated by `make bench` (`scripts/bench.py`) on {meta.get('date', '?')}; raw figures in "
      f"[`bench/results.json`](bench/results.json), plot [`bench/throughput.png`](bench/throughput.png). "
      f"Total run time {fmt(meta.get('elapsed_s'), 0)} s.\n")  # fmt: skip
    rounds = results.get("rounds", [])
    flagged = [r for r in rounds if r.get("flagged")]
    cpu = results.get("cpu") or {}
    w(f"CPU: **{cpu.get('model', 'not recorded')}** ({cpu.get('vendor', '?')} family {cpu.get('family', '?')}), "
      f"ISA class `{cpu.get('isa', '?')}`, flags {' '.join(cpu.get('flags', [])) or '?'}; vLLM's native ops: "
      f"{', '.join(cpu.get('vllm_c', [])) or '?'}. Figures from another CPU do not carry over (FACTS: bf16 has "
      "no hardware support on AVX2-only CPUs).\n")
    w(f"Machine: {meta.get('cpus', '?')} CPUs, {fmt(gib(meta.get('mem_bytes')), 0)} GiB, no GPU; load average "
      f"{meta.get('loadavg_start', '?')} at the start, {meta.get('loadavg_end', '?')} at the end. Each vLLM "
      "configuration ran alone (no other vLLM engine resident); faster-whisper's rounds were interleaved with "
      f"each one's. **{len(flagged)} of {len(rounds)} rounds** ran while other processes used more than "
      f"{meta.get('foreign_cores_limit', '?')} cores (flagged below)"
      + (" — this was a quick run (`--quick`), not the full one." if meta.get("quick") else ".") + "\n")  # fmt: skip

    head = results.get("headline", {})
    if head:
        w("## Headline (`headline` in results.json)\n")
        w("Throughput ratios: > 1 means the first system is faster. `p50_...` is a latency ratio (< 1 = faster). "
          "vLLM/vLLM ratios compare the configurations' phases; `.../fw_int8` ratios pair each vLLM phase with "
          "the faster-whisper int8 rounds taken in the same phase.\n")  # fmt: skip
        w("| figure | value |")
        w("|---|---|")
        for key, value in head.items():
            shown = fmt(value, 1, " s") if key.endswith("_s") else fmt(value, 2, " GiB") if key.endswith("_gib") \
                else fmt(value, 3) if key.startswith("rtf_") else fmt_ratio(value)
            w(f"| `{key}` | {shown} |")
        w("")

    paired = results.get("paired", {})
    if paired:
        w("## Each vLLM configuration against faster-whisper in the same phase\n")
        w("| phase | concurrency | vLLM audio s / s (spread) | fw int8 (spread) | vLLM / fw int8 | fw float32 | "
          "vLLM / fw float32 |")  # fmt: skip
        w("|---|---|---|---|---|---|---|")
        for phase, per in paired.items():
            for level, r in per.get(phase, {}).items():
                a, b = per.get("fw-int8", {}).get(level, {}), per.get("fw-float32", {}).get(level, {})
                w(f"| {_label(results, phase)} | {level} | {fmt(r['throughput'])} {_spread(r)} | "
                  f"{fmt(a.get('throughput'))} {_spread(a)} | {fmt_ratio(ratio(r['throughput'], a.get('throughput')))} | "
                  f"{fmt(b.get('throughput'))} | {fmt_ratio(ratio(r['throughput'], b.get('throughput')))} |")
        w("")

    bullets = summary_bullets(results)
    if bullets:
        w("## In short\n")
        for b in bullets:
            w(f"- {b}")
        w("")

    # headline
    w("## Headline: ours / peer\n")
    w(f"Ours = **{_label(results, ours)}**. Throughput ratio > 1 means we are faster; latency, memory and "
      "cold-start ratios > 1 mean we are slower / bigger.\n")  # fmt: skip
    blocks = [(ours, headline_ratios(results, ours, peers))]
    if "v1" in audio and ours != "v1":
        blocks.append(("v1", headline_ratios(results, "v1", [p for p in peers if p.startswith("fw")])))
    columns = list(dict.fromkeys((o, r["peer"]) for o, block in blocks for r in block))
    figures = list(dict.fromkeys(r["figure"] for _, block in blocks for r in block))
    if columns:
        w("| figure | " + " | ".join(f"{_label(results, o)} / {_label(results, p)}" for o, p in columns) + " |")
        w("|---|" + "---|" * len(columns))
        lookup = {(o, r["peer"], r["figure"]): r["ratio"] for o, block in blocks for r in block}
        for fig in figures:
            w(f"| {fig} | " + " | ".join(fmt_ratio(lookup.get((o, p, fig))) for o, p in columns) + " |")
        w("")
    vis = results.get("vision", {})
    if ours in vis and "v1" in vis and ours != "v1":
        w("Vision, " + _label(results, ours) + " / " + _label(results, "v1") + ":\n")
        w("| chat | concurrency | rps ratio | p50 latency ratio |")
        w("|---|---|---|---|")
        for kind in ("1img", "2img"):
            for level, a in vis[ours].get(kind, {}).items():
                b = vis["v1"].get(kind, {}).get(level)
                if b:
                    w(f"| {kind.replace('img', ' image(s)')} | {level} | {fmt_ratio(ratio(a['rps'], b['rps']))} | "
                      f"{fmt_ratio(ratio(a['p50_s'], b['p50_s']))} |")  # fmt: skip
        w("")

    start = results.get("startup", {})
    if start:
        w("## Start-up of " + _label(results, ours) + " (Whisper engine)\n")
        cold = start.get("cold", {})
        w("Cold = the first start, with the page cache dropped "
          + ("(it was)" if cold.get("page_cache_dropped") else "(**it could not be**: not root)")
          + "; warm = the second start. Stages from the engine log's stamps (1 s resolution; "
          "`mmcpu.dev.bench.startup_breakdown`).\n")  # fmt: skip
        kinds = [k for k in ("cold", "warm") if k in start]
        stages = list(dict.fromkeys(st for k in kinds for st in start[k].get("stages", {})))
        w("| stage | " + " | ".join(f"{k} (s)" for k in kinds) + " |")
        w("|---|" + "---|" * len(kinds))
        for st in stages:
            w(f"| {st} | " + " | ".join(fmt(start[k]["stages"].get(st), 1) for k in kinds) + " |")
        w("| **spawn to /health 200** | " + " | ".join(f"**{fmt(start[k].get('ready_s'), 1)}**" for k in kinds) + " |")
        w("")
    compose = results.get("compose", {})
    if compose:
        if "error" in compose:
            w(f"Compose start-up not measured: {compose['error']}\n")
        else:
            runs = compose.get("runs_serving_s")
            w(f"`docker compose up -d` (the runtime image) to the gateway serving (its `/health` 200, one engine up): "
              f"**{fmt(compose.get('compose_up_to_serving_s'), 1)} s**; to every engine up: "
              f"{fmt(compose.get('compose_up_to_all_engines_s'), 1)} s"
              + (f" (runs: {', '.join(fmt(x, 1) for x in runs)} s)" if runs else "")
              + (f". {compose['note']}" if compose.get("note") else "") + ".\n")  # fmt: skip

    # systems
    w("## Systems\n")
    w("| system | how it is called | cold start to ready (s) | peak RSS (GiB) | LLaVA engine: ready (s) / "
      "peak RSS (GiB) | gateway peak RSS (GiB) |")  # fmt: skip
    w("|---|---|---|---|---|---|")
    for key, s in systems.items():
        vision = "n/a"
        if s.get("vision_ready_s") is not None or s.get("peak_rss_vision_bytes") is not None:
            vision = f"{fmt(s.get('vision_ready_s'), 1)} / {fmt(gib(s.get('peak_rss_vision_bytes')), 2)}"
        w(f"| {s.get('label', key)} | {s.get('how', '')} | {fmt(s.get('ready_s'), 1)} | "
          f"{fmt(gib(s.get('peak_rss_bytes')), 2)} | {vision} | "
          f"{fmt(gib(s.get('peak_rss_gateway_bytes')), 2)} |")  # fmt: skip
    w("")
    for note in cfg.get("notes", []):
        w(f"- {note}")
    w("")

    # audio
    if audio:
        w("## Transcription (Whisper tiny.en, the same weights everywhere)\n")
        w("Clips: espeak-ng speech at 130 wpm, 16 kHz mono: "
          + ", ".join(f"{c['seconds']:.1f} s" for c in results.get("clips", [])) + ". "
          "Throughput = seconds of audio transcribed per wall-clock second over the round "
          "(all requests of a round are sent at once, at most *concurrency* in flight). Each level has its own "
          "request list (see Method; MRV2's time budget), so compare systems within a level; across levels the "
          "clip mix changes, and short clips cost more per audio second (Whisper's encoder always sees 30 s).\n")  # fmt: skip
        w("| system | concurrency | rounds | requests | failures | audio s | wall s | throughput (audio s / s) "
          "| spread over rounds | p50 s | p95 s |")  # fmt: skip
        w("|---|---|---|---|---|---|---|---|---|---|---|")
        for key, data in audio.items():
            for level, r in data.get("levels", {}).items():
                w(f"| {_label(results, key)} | {level} | {r.get('rounds', 1)} | {r['n']} | {r['failures']} | "
                  f"{fmt(r['audio_s'], 1)} | {fmt(r['wall_s'], 1)} | {fmt(r['throughput'], 2)} | {_spread(r)} | "
                  f"{fmt(r['p50_s'], 2)} | {fmt(r['p95_s'], 2)} |")  # fmt: skip
        w("")
        w("| system | WER (all its transcriptions pooled) | transcriptions |")
        w("|---|---|---|")
        for key, data in audio.items():
            w(f"| {_label(results, key)} | {fmt(data.get('wer'), 3)} | {data.get('wer_n', 0)} |")
        w("")
        w("![throughput vs concurrency](bench/throughput.png)\n")

    if vis:
        w("## Vision (tiny random-weight LLaVA, 16 output tokens)\n")
        w("| system | chat | concurrency | requests | failures | rps | spread over rounds | p50 s | p95 s |")
        w("|---|---|---|---|---|---|---|---|---|")
        for key, data in vis.items():
            for kind in ("1img", "2img"):
                for level, r in data.get(kind, {}).items():
                    w(f"| {_label(results, key)} | {kind.replace('img', ' image(s)')} | {level} | {r['n']} | "
                      f"{r['failures']} | {fmt(r['rps'], 2)} | {_spread(r, 'rps')} | {fmt(r['p50_s'], 2)} | "
                      f"{fmt(r['p95_s'], 2)} |")  # fmt: skip
        w("")

    long = results.get("long", {})
    if long:
        w("## Long files (real-time factor = wall / audio; < 1 is faster than real time)\n")
        w("The benchmark's speech clips end to end; vLLM splits a file into Whisper's 30 s windows, faster-whisper "
          "segments it itself. One request at a time, the two systems interleaved.\n")  # fmt: skip
        w("| system | file | audio s | wall s | real-time factor | WER |")
        w("|---|---|---|---|---|---|")
        for who, per in long.items():
            for name, r in per.items():
                w(f"| {_label(results, who)} | {name} | {fmt(r['audio_s'], 1)} | {fmt(r['wall_s'], 1)} | "
                  f"{fmt(r['rtf'], 3)} | {fmt(r['wer'], 3)} |")
        w("")

    mixed = results.get("mixed")
    if mixed:
        w("## Mixed load through the gateway\n")
        t = mixed["total"]
        mix = ", ".join(f"{k}: {v['n']}" for k, v in mixed["by_kind"].items())
        w(f"{t['n']} requests ({mix}) at concurrency "
          f"{mixed['concurrency']} through the gateway to {_label(results, mixed['system'])}: "
          f"**{t['failures']} failures**, p95 {fmt(t['p95_s'])} s, p50 {fmt(t['p50_s'])} s, "
          f"wall {fmt(t['wall_s'], 1)} s.\n")  # fmt: skip
        w("| kind | requests | failures | p50 s | p95 s |")
        w("|---|---|---|---|---|")
        for kind, r in mixed["by_kind"].items():
            w(f"| {kind} | {r['n']} | {r['failures']} | {fmt(r['p50_s'])} | {fmt(r['p95_s'])} |")
        if t["errors"]:
            w("\nErrors: " + "; ".join(f"{n}× {e}" for e, n in t["errors"]))
        w("")

    image = results.get("image")
    if image:
        w("## Image size\n")
        for line in image.get("lines", []):
            w(f"- {line}")
        w("")

    prof = results.get("profile", {})
    if prof:
        w("## Profiles (py-spy on the engine's worker process)\n")
        w("Sampled with `py-spy record --nonblocking --format raw` on vLLM's worker process (the model runner). "
          "*Kernel* = the `@triton.jit` function whose Python body Triton's interpreter was executing (inclusive "
          "samples; the interpreter's own launch work is charged to the launching call site); *self* = the "
          "innermost Python frame, including native code it called; 'an unknown call site' = samples whose stack "
          "py-spy read only partly (non-blocking sampling). With native kernels no sample is under the "
          "interpreter; the self frames show where the time goes instead.\n")  # fmt: skip
        for name, p in prof.items():
            if "error" in p:
                w(f"### {name}\n\nnot profiled: {p['error']}\n")
                continue
            w(f"### {name}: {p['samples']} samples, {fmt(100 * (p['interpreter_share'] or 0), 1)} % under "
              "Triton's interpreter\n")  # fmt: skip
            tables = (("Triton launches by call site (kernel body + the interpreter's launch work)", "launch_sites"),
                      ("Triton kernels (inclusive)", "kernels"), ("Python frames (self)", "self_frames"),
                      ("vLLM frames (inclusive)", "vllm_inclusive"))  # fmt: skip
            for title, key in tables:
                if key not in p:
                    continue
                w(f"{title}:\n")
                w("| frame | samples | share |")
                w("|---|---|---|")
                for row in p[key][:10]:
                    w(f"| `{row['frame']}` | {row['samples']} | {fmt(100 * row['share'], 1)} % |")
                w("")
    if rounds:
        w("## Rounds and load\n")
        w("Every timed round: the 1-minute load average when it started, and the cores used during it by "
          "processes outside the benchmark's own tree (flagged above the limit).\n")  # fmt: skip
        w("| kind | phase | system | concurrency | throughput / rps | load 1m | foreign cores | flagged |")
        w("|---|---|---|---|---|---|---|---|")
        for r in rounds:
            value = r.get("throughput") if r["kind"] == "audio" else r.get("rps")
            w(f"| {r['kind']} | {r['phase']} | {r['system']} | {r['concurrency']} | {fmt(value)} | "
              f"{r['loadavg_1m']} | {r['foreign_cores']} | {'**yes**' if r['flagged'] else ''} |")
        w("")
    w("## Method and caveats\n")
    for note in cfg.get("method", []):
        w(f"- {note}")
    w("")
    return "\n".join(out)
