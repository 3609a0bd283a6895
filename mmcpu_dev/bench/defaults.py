"""``python -m mmcpu_dev.bench defaults``: measure this CPU's row of mmcpu/cpu_defaults.json.

Every candidate dtype x quantisation of a role is served by its own MRV2 engine (native kernels), all of the role's
engines up at once and idle but one: the rounds rotate between them level by level, so a drift in the machine's
load hits every candidate alike. Audio sends the benchmark's fixed workload (greedy, language en) at each level and
scores WER over every answer; vision sends the benchmark's image chats. ``mmcpu_dev.bench.rule.pick`` then chooses, and
the row for this CPU's ISA class is rewritten with every candidate's figures (``--dry-run``: printed only).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import defaultdict
from pathlib import Path

from mmcpu import cpu, defaults
from mmcpu.config import Settings, get_settings
from mmcpu.defaults import Candidate, Choice, Row
from mmcpu_dev.bench import inputs
from mmcpu_dev.bench import plan as plans
from mmcpu_dev.bench.rule import pick, score
from mmcpu_dev.bench.run import vision_requests
from mmcpu_dev.bench.runners import Http, log, undisturbed
from mmcpu_dev.bench.stats import Round, merge_rounds, wer
from mmcpu_dev.payloads import test_image
from mmcpu_dev.servers import Engine

LEVELS = {"audio": [1, 8], "vision": [1, 4]}


def candidates(role: str, settings: Settings, isa: str) -> list[tuple[Choice, Path]]:
    """(choice, checkpoint) of every configuration worth measuring for ``role`` on this ISA class."""
    model = plans.configured_model(role, settings)
    dtypes = ["float32", "bfloat16"] if isa in defaults.BF16_ISAS else ["float32"]  # bf16 emulated elsewhere
    out = [(Choice(dtype=d), model) for d in dtypes]
    if role == "audio" and (int8 := defaults.int8_sibling(str(model))) is not None:
        out += [(Choice(dtype=d, quantization="int8"), int8) for d in dtypes]
    return out


FATAL = [
    re.compile(p)
    for p in (
        r"Fatal Python error",
        r"Segmentation fault|Illegal instruction|Aborted",
        r"EngineCore.*(died|failed|dead)",
        r"^\S*Error: ",
    )
]


def death(engine: Engine, what: str) -> str:
    """Why a candidate's engine stopped serving, in one line: the log's fatal line (e.g. "Fatal Python error:
    Illegal instruction") if it has one, else ``what`` (the failed request's error)."""
    lines = engine.log().splitlines()
    for pattern in FATAL:  # most telling first: a signal's report beats the exception it caused downstream
        if hit := next((ln.strip() for ln in lines if pattern.search(ln)), None):
            return f"{what}; engine log: {hit[:300]}"
    return what


def first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def measure_role(role: str, settings: Settings, isa: str, reps: int, logs: Path) -> list[Candidate]:
    """Every candidate's figures; a candidate whose engine does not start or fails a request is recorded with
    its error (``Candidate.error``, never picked) and leaves the rotation: one broken kernel on one CPU must not
    hide what the others measured."""
    found = candidates(role, settings, isa)
    _, extra, _ = plans.role_engine(role, settings)
    role_args = [x for o, v in plans.pairs(extra) if o != "--dtype" for x in (o, v) if x is not None]
    engines: dict[str, Engine] = {}
    failed: dict[str, str] = {}
    keys = [f"{choice.dtype}-{choice.quantization}" for choice, _ in found]

    def fail(key: str, eng: Engine, what: str) -> None:
        failed[key] = death(eng, what)
        log(f"{role} {key}: dropped: {failed[key]}")
        engines.pop(key, None)
        eng.stop()

    try:
        for (choice, model), key in zip(found, keys, strict=True):
            log(f"{role}: starting {key} ({model.name})")
            eng = Engine(model, logs / f"defaults-{role}-{key}.log", vllm_args=[*role_args, "--dtype", choice.dtype])
            try:
                engines[key] = eng.start()
            except Exception as e:
                fail(key, eng, f"did not start: {first_line(e)}")
        clips = inputs.clips(plans.workload(), settings.cache_dir / "bench" / "clips")
        chats = vision_requests(48)  # 48: a round of the benchmark's 16 takes ~1 s, too short against the noise
        https = {k: Http(e.base_url, audio_model=e.name, vision_model=e.name) for k, e in engines.items()}
        for key, http in https.items():  # the first request pays lazy initialisation; it is not timed
            try:
                http.transcribe(clips[0]) if role == "audio" else http.chat([test_image(1)])
            except Exception as e:
                fail(key, engines[key], f"first request failed: {first_line(e)}")
        rounds: dict[str, dict[int, list[Round]]] = defaultdict(lambda: defaultdict(list))
        for n, c in enumerate(LEVELS[role]):
            for rep in range(reps):
                live = [k for k in keys if k in engines]
                shift = (n * reps + rep) % max(len(live), 1)
                for key in live[shift:] + live[:shift]:
                    http = https[key]
                    rnd, load = undisturbed(
                        lambda http=http, c=c: (
                            http.audio_round(clips, c) if role == "audio" else http.vision_round(chats, c)
                        ),
                        f"{role} {key} c={c}",
                    )
                    s = rnd.summary()
                    log(
                        f"{role} {key:16s} c={c} {s.ok}/{s.n} ok, {s.throughput or s.rps:.2f} "
                        f"{'audio-s/s' if role == 'audio' else 'rps'} (load {load['loadavg_1m']}, foreign "
                        f"{load['foreign_cores']} cores)"
                    )
                    if s.failures:
                        fail(key, engines[key], f"{s.failures} of {s.n} requests failed at c={c}: {s.errors}")
                        continue
                    rounds[key][c].append(rnd)
    finally:
        for eng in engines.values():
            eng.stop()
    out = []
    for (choice, _), key in zip(found, keys, strict=True):
        if key in failed:
            out.append(Candidate(choice=choice, throughput={}, error=failed[key]))
            continue
        merged = {c: merge_rounds(rs) for c, rs in rounds[key].items()}
        metric = "throughput" if role == "audio" else "rps"
        samples = [s for rs in rounds[key].values() for r in rs for s in r.samples]
        out.append(
            Candidate(
                choice=choice,
                throughput={c: round(getattr(m, metric), 3) for c, m in merged.items()},
                wer=round(wer(samples), 4) if role == "audio" else None,
            )
        )
    return out


def run(reps: int, dry_run: bool = False, roles: tuple[str, ...] = ("audio", "vision")) -> int:
    """Measure ``roles`` (a role left out keeps the candidates its row already has, e.g. to re-measure one role
    whose rounds ran under foreign load) and rewrite this CPU's row."""
    settings, info = get_settings(), cpu.current()
    logs = settings.cache_dir / "logs" / "bench"
    logs.mkdir(parents=True, exist_ok=True)
    log(f"CPU {info.line()}: measuring the defaults of isa class {info.isa}")
    kept = defaults.table().rows[info.isa].candidates
    if missing := [r for r in ("audio", "vision") if r not in roles and r not in kept]:
        raise SystemExit(f"error: the {info.isa} row has no measured {', '.join(missing)} candidates to keep")
    measured = {
        role: measure_role(role, settings, info.isa, reps, logs) if role in roles else kept[role]
        for role in ("audio", "vision")
    }
    ref = next(c for c in measured["audio"] if c.choice == Choice(dtype="float32"))
    if ref.error:
        raise SystemExit(
            f"error: the audio role's float32 reference failed, nothing to hold the others against: {ref.error}"
        )
    chosen = {role: pick(role, cands) for role, cands in measured.items()}
    lines = []
    for role, cands in measured.items():
        for c in cands:
            figs = ", ".join(f"c={lvl} {v:g}" for lvl, v in c.throughput.items())
            if c.error:
                lines.append(f"{role} {c.choice.dtype}/{c.choice.quantization}: failed ({c.error})")
                continue
            lines.append(
                f"{role} {c.choice.dtype}/{c.choice.quantization}: {figs}"
                + (f", WER {c.wer:.3f}" if c.wer is not None else "")
                + (f" ({score(c) / score(ref):.2f}x float32)" if role == "audio" else "")
            )
    evidence = (
        f"`python -m mmcpu_dev.bench defaults`, {reps} round(s) per level and candidate, rounds rotating "
        f"between the candidates' engines; audio in audio-s/s on the fixed workload "
        f"({len(plans.workload())} requests), vision in requests/s: " + "; ".join(lines)
    )
    row = Row(
        audio=chosen["audio"],
        vision=chosen["vision"],
        measured_on=info.line(),
        date=dt.date.today().isoformat(),
        evidence=evidence,
        candidates=measured,
    )
    print(json.dumps({info.isa: row.model_dump(mode="json")}, indent=2))
    if not dry_run:
        data = json.loads(defaults.TABLE_PATH.read_text())
        data["rows"][info.isa] = row.model_dump(mode="json")
        defaults.TABLE_PATH.write_text(json.dumps(data, indent=2) + "\n")
        log(f"wrote the {info.isa} row of {defaults.TABLE_PATH}: audio {chosen['audio']}, vision {chosen['vision']}")
    return 0
