"""The benchmark's results, typed (docs/bench/results.json is ``Results.model_dump_json()``), and the headline
computed from them: the plan's figures (``Plan.figures``) plus the start-up and memory of ours."""

from __future__ import annotations

from pydantic import BaseModel

from mmcpu_dev.bench.plan import Figure, Plan, System
from mmcpu_dev.bench.stats import LevelStats, ratio


class RoundRecord(BaseModel):
    """One timed round and the load around it (flagged: other processes used more than the limit of cores)."""

    kind: str  # audio, long, vision, search
    phase: str  # the vLLM system whose phase it ran in ("" for the faster-whisper search)
    system: str
    concurrency: int
    throughput: float | None = None
    rps: float | None = None
    p50_s: float | None = None
    failures: int = 0
    profiled: bool = False
    loadavg_1m: float = 0.0
    foreign_cores: float = 0.0
    flagged: bool = False
    # the measured system's own processes (vLLM: the engine's tree, through the stack also the gateway's and the
    # vision engine's; a peer: its process): CPU seconds over the round and cpu / wall, the cores it kept busy
    cpu_s: float | None = None
    cores: float | None = None
    layout: str | None = None  # peers: cpu_threads x num_workers
    layout_cores: int | None = None  # the cores that layout can keep busy at this level (runners.layout_cores)
    underused: bool = False  # it kept fewer than runners.USE_MIN of them


class SearchRow(BaseModel):
    """One faster-whisper configuration tried at one level (on every fw_search_every-th request)."""

    system: str
    concurrency: int
    cpu_threads: int
    num_workers: int
    throughput: float | None
    p50_s: float | None
    failures: int
    chosen: bool = False
    isa: str | None = None  # faster-whisper: CT2_FORCE_CPU_ISA of this configuration (None: CTranslate2's pick)
    cores: float | None = None  # cpu / wall of the peer's process over the round
    underused: bool = False  # it kept fewer than runners.USE_MIN of the cores this layout can keep busy


class Startup(BaseModel):
    ready_s: float
    stages: dict[str, float]
    page_cache_dropped: bool | None = None


class Mixed(BaseModel):
    system: str
    concurrency: int
    total: LevelStats
    by_kind: dict[str, LevelStats]


class SystemResult(BaseModel):
    spec: System
    ready_s: float | None = None  # cold start to ready (vLLM: spawn to /health 200; faster-whisper: model loaded)
    peak_rss_bytes: int | None = None
    versions: dict[str, str] = {}
    worker_cpus: dict[str, int] = {}  # vLLM: CPU list of the model runner's threads -> threads
    audio: dict[int, LevelStats] = {}  # the fixed workload per level, all rounds pooled (every phase for fw)
    vision: dict[int, LevelStats] = {}
    long: dict[str, LevelStats] = {}  # long file -> one request at a time
    wer: float | None = None  # every transcription of the fixed workload, pooled
    wer_n: int = 0
    examples: list[tuple[str, str]] = []  # (reference, transcription)
    fw_best: dict[int, tuple[int, int]] = {}  # peers: level -> the (cpu_threads, num_workers) that won
    fw_isa: dict[int, str] = {}  # faster-whisper: level -> CT2_FORCE_CPU_ISA of the winner, where one was forced
    error: str | None = None  # not measured: why (a peer that could not be built here, an engine that failed)
    first_ready_s: float | None = None  # the proof line: its first start (its venv possibly read from disk)


class Meta(BaseModel):
    date: str
    host: str
    cpus: int
    mem_bytes: int
    loadavg_start: str
    loadavg_end: str = ""
    elapsed_s: float = 0.0
    versions: dict[str, str] = {}
    foreign_cores_limit: float
    engine_args: str = ""
    command: str = ""  # the command line of the run
    failed: list[str] = []


class Results(BaseModel):
    cpu: dict  # mmcpu.cpu.CpuInfo.as_dict() + the _C build vLLM loaded
    meta: Meta
    plan: Plan
    clips: list[dict] = []  # name, seconds, sentences of every request of the workload
    systems: dict[str, SystemResult] = {}
    paired: dict[str, dict[str, dict[int, LevelStats]]] = {}  # phase -> system -> level: rounds of one phase
    fw_search: list[SearchRow] = []
    startup: dict[str, Startup] = {}  # cold / warm start of ours
    compose: dict = {}
    image: list[str] = []
    mixed: Mixed | None = None
    profile: dict[str, dict] = {}
    rounds: list[RoundRecord] = []
    attention: dict = {}  # mmcpu_dev.bench.attention.headline(): bf16 encoder attention GFLOP/s beside the GEMM's
    gateway_load: dict = {}  # mmcpu_dev.bench.gateway (make bench-gateway): the gateway's load test and its verdict
    headline: dict[str, float] = {}

    @property
    def ours(self) -> SystemResult | None:
        return self.systems.get(self.plan.ours)


def level_stats(results: Results, key: str, level: int | None, phase: str | None = None) -> LevelStats | None:
    """A system's figures at one level: from ``phase``'s rounds only when given, else all pooled."""
    if phase is not None:
        return results.paired.get(phase, {}).get(key, {}).get(level)
    sys = results.systems.get(key)
    if sys is None:
        return None
    return (sys.vision if sys.spec.role == "vision" else sys.audio).get(level)


def best_of(results: Results, f: Figure) -> str | None:
    """The system of ``f.best_of`` with the best ``f.metric`` at ``f.level`` (in a's phase when paired): the
    highest throughput / rps, the lowest p50. None: none of them measured there."""
    phase = f.a if f.paired else None
    found = [
        (getattr(s, f.metric), k)
        for k in f.best_of
        if (s := level_stats(results, k, f.level, phase)) and getattr(s, f.metric) is not None
    ]
    if not found:
        return None
    return (min if f.metric == "p50_s" else max)(found)[1]


def figure_value(results: Results, f: Figure) -> float | None:
    if f.metric == "wer":
        return results.systems[f.a].wer if f.a in results.systems else None
    if f.metric in ("ready_s", "peak_rss"):
        a, b = results.systems.get(f.a), results.systems.get(f.b or "")
        attr = "ready_s" if f.metric == "ready_s" else "peak_rss_bytes"
        return ratio(getattr(a, attr), getattr(b, attr)) if a and b else None
    phase = f.a if f.paired else None
    b_key = best_of(results, f) if f.best_of else f.b
    a, b = level_stats(results, f.a, f.level, phase), level_stats(results, b_key or "", f.level, phase)
    return ratio(getattr(a, f.metric), getattr(b, f.metric)) if a and b else None


def meets(f: Figure, value: float | None) -> bool | None:
    if f.target is None or value is None:
        return None
    op, bound = f.target
    return value >= bound if op == ">=" else value <= bound


def headline(results: Results) -> dict[str, float]:
    """The plan's figures (throughput and rps ratios: > 1 = the first faster; p50: < 1 = the first faster; WER)
    and ours' start-up and memory. A figure not measured in this run is left out rather than guessed."""
    out = {f.key: figure_value(results, f) for f in results.plan.figures()}
    ours = results.ours
    start = results.startup
    # no cold start in quick mode: its only start is a warm one, not reported as cold
    cold = start["cold"].ready_s if "cold" in start else None if "warm" in start or not ours else ours.ready_s
    out["engine_ready_cold_s"] = round(cold, 1) if cold else None
    out["engine_ready_warm_s"] = start["warm"].ready_s if "warm" in start else None
    out["compose_up_to_serving_s"] = results.compose.get("compose_up_to_serving_s")
    rss = ours.peak_rss_bytes if ours else None
    out["engine_peak_rss_gib"] = round(rss / 2**30, 2) if rss else None
    # the encoder's bf16 attention rate / the bf16 GEMM rate of the same model (Whisper tiny.en; 1 = GEMM speed)
    out["encoder_attention/gemm_bf16"] = results.attention.get("ratio")
    return {k: round(v, 3) for k, v in out.items() if v is not None}


def missing(results: Results) -> list[str]:
    """The plan's headline figures this run could not form."""
    return [f.key for f in results.plan.figures() if f.key not in results.headline]
