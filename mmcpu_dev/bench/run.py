"""Carry a plan out: full / quick (measure, then write the report) and latency (print MRV2 vs V1 per request).

Everything runs on 127.0.0.1, one vLLM engine at a time (each system alone; ours is measured again, and the mixed
load runs, with ours' two engines behind the gateway, as `make up` serves them). The peers first search their best
(cpu_threads, num_workers) per level with no engine up, then their rounds are interleaved with each vLLM system's in
that system's phase, so a change in the machine's load hits both; every round records the load, the cores other
processes used and the cores the measured system's own processes kept busy. Nothing is asserted about speed: the
exit code is 1 only when a system could not be measured, the mixed load had failures or a peer's replicas did not
run in parallel.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import psutil

from mmcpu import cpu
from mmcpu.config import REPO_ROOT, get_settings
from mmcpu_dev.bench import inputs, profiles, report
from mmcpu_dev.bench.peers import PeerUnavailable, Setup
from mmcpu_dev.bench.plan import Plan, System
from mmcpu_dev.bench.results import (
    Meta,
    Mixed,
    Results,
    RoundRecord,
    SearchRow,
    Startup,
    SystemResult,
    headline,
    missing,
)
from mmcpu_dev.bench.runners import (
    FOREIGN_CORES_LIMIT,
    PEER,
    CpuUse,
    FasterWhisper,
    Gateway,
    Http,
    Peer,
    Profiler,
    RssSampler,
    layout_use,
    log,
    replicas_idle,
    run_round,
    undisturbed,
    worker_cpus,
    worker_pid,
)
from mmcpu_dev.bench.stats import Round, merge_rounds, ratio, summarize, wer
from mmcpu_dev.payloads import test_image
from mmcpu_dev.servers import Engine

# Published size of upstream's CPU image, for the comparison with ours (see the report for what each figure is).
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


def vllm_c_variant() -> list[str]:
    """Which ``_C`` build vLLM loads on this CPU, asked of a fresh interpreter (this one must not load vLLM)."""
    code = "import json, vllm._custom_ops; from mmcpu import cpu; print(json.dumps(cpu.loaded_vllm_c()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if done.returncode == 0 and lines else []


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
        done = subprocess.run(
            [str(REPO_ROOT / "scripts" / "docker-e2e"), "serving"], capture_output=True, text=True, timeout=900
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)[:300]}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    log(f"compose: {lines[-1]}")
    return json.loads(lines[-1])


def image_size_lines() -> list[str]:
    size = torch = None
    if docker := shutil.which("docker"):
        try:
            done = subprocess.run(
                [docker, "image", "inspect", "mmcpu:latest", "--format", "{{.Size}}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            size = int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else None
            if size:  # the torch build inside the image, as it is (CPU index or PyPI's CUDA build)
                done = subprocess.run(
                    [
                        docker,
                        "run",
                        "--rm",
                        "--network",
                        "none",
                        "--entrypoint",
                        "python",
                        "mmcpu:latest",
                        "-c",
                        "import torch; print(torch.__version__)",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                torch = done.stdout.strip() if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    if size:
        kind = (
            "unknown"
            if torch is None
            else "the PyTorch CPU index's build"
            if torch.endswith("+cpu")
            else "PyPI's CUDA build"
        )
        return [
            f"Ours, `mmcpu:latest` (`docker image inspect`, uncompressed on disk): **{size / 1e9:.2f} GB**, with "
            f"torch {torch or '(not read)'}, {kind} (docker/e2e.mk: the PyTorch CPU index gives a ~3 GB smaller "
            "image where it is reachable).",
            *UPSTREAM_IMAGE,
        ]
    return [
        "Ours: no `mmcpu:latest` image on this machine when the run ended (or no docker), so not measured in "
        "this run; `make image` builds it.",
        *UPSTREAM_IMAGE,
    ]


def vision_requests(n: int) -> list[list]:
    """The chats of every vision round: alternately one image and two different ones."""
    return [[test_image(1)] if i % 2 == 0 else [test_image(2), test_image(3)] for i in range(n)]


class Bench:
    """One run: the engines and peers it started (stopped at the end whatever happens) and what it measured."""

    def __init__(self, plan: Plan, args) -> None:
        self.plan, self.args, self.settings = plan, args, get_settings()
        self.logs = self.settings.cache_dir / "logs" / "bench"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.bench_python = args.bench_venv / "bin" / "python"
        self.extra = args.engine_args.split()
        self.results = Results(
            cpu={**cpu.current().as_dict(), "vllm_c": vllm_c_variant()},
            plan=plan,
            meta=Meta(
                date=dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                host=platform.node(),
                cpus=len(os.sched_getaffinity(0)),
                mem_bytes=psutil.virtual_memory().total,
                loadavg_start=loadavg(),
                versions=versions(),
                foreign_cores_limit=FOREIGN_CORES_LIMIT,
                engine_args=args.engine_args,
            ),
            systems={s.key: SystemResult(spec=s) for s in plan.systems},
        )
        self.sampler = RssSampler()
        self.cleanup: list[Callable[[], None]] = []
        self.peers: dict[str, dict[str, Peer]] = {}  # peer system -> variant ("default", a forced ISA) -> process
        self.audio: dict[str, dict[int, list[Round]]] = defaultdict(lambda: defaultdict(list))
        self.paired: dict[str, dict[str, dict[int, list[Round]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(list))
        )
        self.vision: dict[str, dict[int, list[Round]]] = defaultdict(lambda: defaultdict(list))
        self.long: dict[str, dict[str, list[Round]]] = defaultdict(lambda: defaultdict(list))
        self.raw_profiles: dict[str, list[str]] = defaultdict(list)

    @property
    def failed(self) -> list[str]:
        return self.results.meta.failed

    # --- processes ---------------------------------------------------------------------------------------------
    def engine(self, system: System) -> Engine:
        eng = Engine(
            system.model,
            self.logs / f"{system.key}.log",
            runner=system.runner,
            python=system.python,
            env=dict(system.env),
            vllm_args=[*system.vllm_args, *self.extra],
        )
        self.cleanup.append(eng.stop)
        self.sampler.watch(system.key, lambda: eng.proc.pid if eng.proc and eng.proc.poll() is None else None)
        return eng

    def start(self, eng: Engine, system: System) -> bool:
        deadline = time.monotonic() + 600
        while psutil.virtual_memory().available < self.args.min_free_gib * 2**30 and time.monotonic() < deadline:
            log(f"waiting for {self.args.min_free_gib} GiB of free memory before starting {system.key}")
            time.sleep(15)
        log(f"starting {system.label} alone (load {loadavg()})")
        res = self.results.systems[system.key]
        try:
            if system.python and not system.python.is_file():
                raise RuntimeError(f"the vllm-cpu {system.line} venv's {system.python} is missing (make venv-proof)")
            eng.start()
            if system.line and res.ready_s is None:
                # another line's first start may read its venv from disk: the second is compared (both warm)
                res.first_ready_s = eng.ready_s
                eng.stop()
                eng.start()
        except Exception as exc:
            self.failed.append(f"{system.key}: {str(exc)[:500]}")
            res.error = res.error or str(exc)[:500]
            log(f"{system.key} FAILED to start: {str(exc)[:300]}")
            return False
        if system.python and not res.versions:
            res.versions = line_versions(system.python)
        res.ready_s, res.worker_cpus = res.ready_s or eng.ready_s, worker_cpus(eng)
        log(f"{system.key} ready after {eng.ready_s:.0f} s; worker threads on CPUs {res.worker_cpus}")
        return True

    def warm(self, key: str, call: Callable[[], object]) -> None:
        try:  # the first request pays lazy initialisation; it is not timed
            call()
        except Exception as exc:
            log(f"warm-up of {key} failed: {str(exc)[:300]}")

    def measured(
        self,
        kind: str,
        phase: str,
        who: str,
        c: int,
        fn: Callable[[], Round],
        profile: tuple[str, Engine] | None = None,
        pids: Callable[[], list[int | None]] | None = None,
        layout: tuple[int, int] | None = None,
    ) -> Round:
        """One round with its load record (a disturbed one is taken again: runners.undisturbed); under py-spy on
        the engine's worker when profile=(title, engine). ``pids``: the measured system's processes, whose CPU
        time over the round is recorded (cpu / wall: the cores it kept busy); ``layout``: a peer's
        (cpu_threads, num_workers), checked against those cores (runners.layout_use)."""

        def take() -> tuple[Round, str | None, dict]:
            use = CpuUse(pids)
            if not profile or self.args.no_profile:
                rnd = fn()
                return rnd, None, use.stop()
            title, eng = profile
            out = self.logs / f"profile-{len(self.raw_profiles)}-{len(self.raw_profiles[title])}.txt"
            with Profiler(self.bench_python.parent / "py-spy", worker_pid(eng), out) as prof:
                rnd = fn()
            cpu = use.stop()
            return rnd, f"error: {prof.error}" if prof.error else prof.raw(), cpu

        (rnd, raw, cpu), load = undisturbed(take, f"{kind} {who} c={c}")
        if raw is not None:
            self.raw_profiles[profile[0]].append(raw)
        if layout:
            cpu |= layout_use(cpu.get("cores"), *layout, c, self.results.meta.cpus)
            if replicas_idle(layout[1], c, cpu, load["flagged"], search=kind == "search"):
                self.failed.append(
                    f"{who} c={c}: layout {cpu['layout']} (cpu_threads x num_workers) kept "
                    f"{cpu['cores']} of its {cpu['layout_cores']} cores busy: its replicas did not "
                    "run in parallel"
                )
        s = rnd.summary()
        self.results.rounds.append(
            RoundRecord(
                kind=kind,
                phase=phase,
                system=who,
                concurrency=c,
                throughput=s.throughput,
                rps=s.rps,
                p50_s=s.p50_s,
                failures=s.failures,
                profiled=bool(profile),
                **load,
                **cpu,
            )
        )
        used = f", {cpu['cores']} cores" if "cores" in cpu else ""
        used += (
            f" of {cpu['layout_cores']} ({cpu['layout']}){' UNDERUSED' if cpu['underused'] else ''}" if layout else ""
        )
        log(
            f"{kind:6s} {who:22s} c={c:<2d} {s.ok}/{s.n} ok, {report.fmt(s.throughput)} audio-s/s, "
            f"{report.fmt(s.rps)} rps, p50 {report.fmt(s.p50_s)} s{used} (load {load['loadavg_1m']}, foreign "
            f"{load['foreign_cores']} cores){' FLAGGED: other work ran' if load['flagged'] else ''}"
        )
        return rnd

    # --- phases ------------------------------------------------------------------------------------------------
    def peer_processes(self, peer: System) -> tuple[Path, dict[str, Peer]]:
        """The peer's weights and its process per variant: faster-whisper in the bench venv, once per ISA searched
        (CT2_FORCE_CPU_ISA is read at start); OpenVINO and whisper.cpp in their own venvs (built if need be)."""
        log_path = self.logs / f"{peer.key.replace(':', '-')}.log"
        if peer.engine == "faster-whisper":
            model = inputs.ct2_dir(peer.ct2_source, self.settings.cache_dir)
            procs = {}
            for isa in self.plan.fw_isas:
                env = {} if isa == "default" else {"CT2_FORCE_CPU_ISA": isa}
                procs[isa] = FasterWhisper(
                    self.bench_python, model, peer.compute_type, log_path.with_suffix(f".{isa}.log"), env
                )
                self.cleanup.append(procs[isa].stop)
            return model, procs
        python, model = self.setup.prepare(peer.engine, peer.checkpoint, peer.compute_type)
        cmd = {"openvino": "ov", "whisper.cpp": "wcpp"}[peer.engine]
        proc = Peer(python, [cmd, "--model", str(model)], peer.label, log_path)
        self.cleanup.append(proc.stop)
        return model, {"default": proc}

    def start_peers(self) -> None:
        self.setup = Setup(self.settings.cache_dir, python=self.args.peer_python)
        for peer in self.plan.peer_systems():
            log(f"starting {peer.label}")
            res = self.results.systems[peer.key]
            try:
                model, procs = self.peer_processes(peer)
            except (PeerUnavailable, RuntimeError, OSError) as exc:  # reported as not built here, not dropped
                res.error = str(exc)[:1500]
                log(f"{peer.key} NOT AVAILABLE: {res.error}")
                continue
            self.peers[peer.key] = procs
            first = next(iter(procs.values()))
            self.sampler.watch(peer.key, lambda first=first: first.pid)
            res.spec.model, res.ready_s = model, first.ready_s
            res.versions = {**first.versions, "venv": str(Path(first.proc.args[0]).parent.parent)}

    def fw_search(self, clips: list[inputs.Clip]) -> None:
        """Every peer's (cpu_threads, num_workers) of the grid at every level (num_workers <= level: more replicas
        than requests in flight change nothing), faster-whisper's also with each ISA forced, on every
        fw_search_every-th request; the best throughput wins."""
        subset = clips[:: self.plan.fw_search_every]
        for key, procs in list(self.peers.items()):
            try:
                self.search_peer(key, procs, subset)
            except RuntimeError as exc:  # a peer that crashes is reported with its error, the run goes on
                self.drop_peer(key, f"died in its configuration search: {exc}")

    def drop_peer(self, key: str, error: str) -> None:
        """A peer that failed mid-run: its error goes into the report (never dropped quietly), its processes stop
        and it leaves the later phases."""
        res = self.results.systems[key]
        res.error = error[:1500]
        log(f"{key} FAILED: {res.error}")
        for peer in self.peers.pop(key, {}).values():
            try:
                peer.stop()
            except Exception as exc:
                log(f"stopping {key}: {exc}")

    def search_peer(self, key: str, procs: dict[str, Peer], subset: list[inputs.Clip]) -> None:
        """One peer's grid at each of its levels; the best throughput without failures wins."""
        for c in self.plan.levels_of(key):
            rows = []
            for isa, peer in procs.items():
                for t, w in [g for g in self.plan.fw_grid if g[1] <= c] or self.plan.fw_grid[:1]:
                    fn = lambda t=t, w=w, c=c, peer=peer: peer.audio_round(subset, c, t, w)  # noqa: E731
                    s = self.measured(
                        "search",
                        "",
                        key + ("" if isa == "default" else f"@{isa}"),
                        c,
                        fn,
                        pids=lambda peer=peer: [peer.pid],
                        layout=(t, w),
                    ).summary()
                    rec = self.results.rounds[-1]
                    rows.append(
                        SearchRow(
                            system=key,
                            concurrency=c,
                            cpu_threads=t,
                            num_workers=w,
                            throughput=s.throughput,
                            p50_s=s.p50_s,
                            failures=s.failures,
                            isa=None if isa == "default" else isa,
                            cores=rec.cores,
                            underused=rec.underused,
                        )
                    )
            best = max(rows, key=lambda r: (r.failures == 0, r.throughput or 0))
            best.chosen = True
            res = self.results.systems[key]
            res.fw_best[c] = (best.cpu_threads, best.num_workers)
            if best.isa:
                res.fw_isa[c] = best.isa
            self.results.fw_search += rows
            log(
                f"search {key} c={c}: cpu_threads={best.cpu_threads} num_workers={best.num_workers}"
                f"{' ' + best.isa if best.isa else ''} won"
            )

    def fw_round(self, key: str, clips: list[inputs.Clip], c: int, batch: int = 0) -> Round:
        res = self.results.systems[key]
        threads, workers = res.fw_best.get(c, (len(os.sched_getaffinity(0)), 1))
        return self.peers[key][res.fw_isa.get(c, "default")].audio_round(clips, c, threads, workers, batch)

    def startup(self, eng: Engine, kind: str, dropped: bool | None = None) -> None:
        stages = profiles.startup_breakdown(eng.log(), eng.started_at, eng.ready_s, dt.datetime.now().year)
        self.results.startup[kind] = Startup(ready_s=round(eng.ready_s, 1), stages=stages, page_cache_dropped=dropped)
        log(f"{kind} start: {eng.ready_s:.1f} s = " + ", ".join(f"{k} {v}" for k, v in stages.items()))

    def audio_phase(self, system: System, clips: list[inputs.Clip], long: list[inputs.Clip]) -> None:
        """One vLLM system alone, its peers' rounds interleaved (order rotating per level). Ours then runs again
        through the stack (the plan's ``stack``: the gateway in front, the vision engine beside it) with its peers
        interleaved again, then the mixed load."""
        eng = self.engine(system)
        if not self.start(eng, system):
            return
        if system.ours:
            self.startup(eng, "warm")
        http = Http(eng.base_url, audio_model=eng.name)
        self.warm(system.key, lambda: http.transcribe(clips[0]))
        self.rounds(system, system, lambda c: http.audio_round(clips, c), lambda: [eng.proc.pid], clips, eng)
        if system.ours:  # long files one at a time: ours, faster-whisper int8 (plain, batched), interleaved
            for clip in long:
                for who, batch in ((system.key, 0), (self.plan.peer, 0), (self.plan.peer, self.plan.fw_batch_size)):
                    if who != system.key and who not in self.peers:
                        continue
                    fn = (
                        (lambda clip=clip: http.audio_round([clip], 1))
                        if who == system.key
                        else (lambda clip=clip, who=who, batch=batch: self.fw_round(who, [clip], 1, batch))
                    )
                    name = clip.name + (f" batched (batch_size {batch})" if batch else "")
                    self.long[who][name].append(self.measured("long", system.key, who, 1, fn))
        if system.ours and (self.plan.stack or self.plan.mixed):
            self.through_stack(eng, clips)
        eng.stop()

    def rounds(
        self,
        system: System,
        phase: System,
        ours: Callable[[int], Round],
        pids: Callable[[], list[int | None]],
        clips: list[inputs.Clip],
        eng: Engine,
    ) -> None:
        """``system``'s rounds at each of its levels, interleaved with its peers' (the order rotating per level),
        recorded as ``phase``'s (the pairs of the headline's ratios)."""
        players: dict[str, Callable[[int], Round]] = {phase.key: ours}
        players |= {p: lambda c, p=p: self.fw_round(p, clips, c) for p in system.peers if p in self.peers}
        levels = self.plan.levels_of(system.key)
        for n, c in enumerate(levels):
            order = list(players)[n % len(players) :] + list(players)[: n % len(players)]
            for who in order:
                for rep in range(system.reps or self.plan.reps):
                    if who not in players:  # a peer that died in an earlier round
                        continue
                    prof = None
                    if system.ours and who == phase.key and rep == 0 and c in (levels[0], levels[-1]):
                        prof = (f"Whisper transcription, {phase.label}, concurrency {c}", eng)
                    who_pids, layout = (pids, None) if who == phase.key else self.peer_use(who, c)
                    try:
                        rnd = self.measured(
                            "audio",
                            phase.key,
                            who,
                            c,
                            lambda who=who, c=c: players[who](c),
                            prof,
                            pids=who_pids,
                            layout=layout,
                        )
                    except RuntimeError as exc:
                        if who == phase.key:
                            raise
                        self.drop_peer(who, f"died in the {phase.key} phase at c={c}: {exc}")
                        players.pop(who)
                        continue
                    self.audio[who][c].append(rnd)
                    self.paired[phase.key][who][c].append(rnd)

    def peer_use(self, key: str, c: int) -> tuple[Callable[[], list[int | None]], tuple[int, int]]:
        """The process and (cpu_threads, num_workers) a peer's round at level c runs on (fw_round's choice)."""
        res = self.results.systems[key]
        proc = self.peers[key][res.fw_isa.get(c, "default")]
        return (lambda: [proc.pid]), res.fw_best.get(c, (len(os.sched_getaffinity(0)), 1))

    def through_stack(self, audio: Engine, clips: list[inputs.Clip]) -> None:
        """Ours' audio engine as `make up` serves it: the gateway in front, the vision engine started beside it
        (idle unless asked). Ours' rounds through the gateway (the plan's ``stack``, peers interleaved), then the
        mixed load; both stop after, so that every other system runs alone."""
        plan, system = self.plan, self.plan.system(self.plan.vision_ours)
        vision = self.engine(system)
        if not self.start(vision, system):
            return
        gw = Gateway({"audio": audio.base_url, "vision": vision.base_url}, self.logs / "gateway.log")
        self.cleanup.append(gw.stop)
        http = Http(gw.url, audio_model=audio.name, vision_model=vision.name)
        self.warm("gateway", lambda: http.chat([test_image(1)]))
        if plan.stack:
            stack = plan.system(plan.stack)
            log(f"{stack.label}: {gw.url}")
            self.warm(stack.key, lambda: http.transcribe(clips[0]))
            self.rounds(
                plan.system(plan.ours),
                stack,
                lambda c: http.audio_round(clips, c),
                lambda: [audio.proc.pid, vision.proc.pid, gw.pid],
                clips,
                audio,
            )
        if plan.mixed:
            self.mixed(http, clips)
        gw.stop()
        vision.stop()

    def mixed(self, http: Http, clips: list[inputs.Clip]) -> None:
        """Ours' two engines behind the gateway: transcriptions and image chats, half of them with sampling."""
        plan = self.plan
        n_audio = round(plan.mixed * plan.mixed_audio_share)
        kinds = ["audio"] * n_audio + ["vision"] * (plan.mixed - n_audio)
        random.Random(5).shuffle(kinds)
        calls, meta, chats = [], [], vision_requests(4)
        for i, kind in enumerate(kinds):
            if kind == "audio":
                clip = clips[i % len(clips)]
                calls.append(lambda clip=clip: http.transcribe(clip))
                meta.append((clip.seconds, "audio", clip.text))
            else:  # half of the chats with sampling options, as clients send them
                sampling = {"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}
                calls.append(lambda imgs=chats[i % 4], sampling=sampling: http.chat(imgs, **sampling))
                meta.append((0.0, "vision", None))
        log(f"mixed load: {plan.mixed} requests at concurrency {plan.mixed_concurrency} via {http.url}")
        rnd = run_round(calls, plan.mixed_concurrency, meta)
        by_kind = {k: summarize([s for s in rnd.samples if s.kind == k], rnd.wall_s) for k in ("audio", "vision")}
        self.results.mixed = Mixed(
            system=plan.ours, concurrency=plan.mixed_concurrency, total=rnd.summary(), by_kind=by_kind
        )
        total = self.results.mixed.total
        log(f"mixed load: {total.failures} failures, p95 {report.fmt(total.p95_s)} s, wall {total.wall_s:.0f} s")
        if total.failures:
            self.failed.append(f"mixed load: {total.failures} failures: {total.errors}")

    def vision_phase(self, system: System) -> None:
        eng = self.engine(system)
        if not self.start(eng, system):
            return
        http = Http(eng.base_url, vision_model=eng.name)
        self.warm(system.key, lambda: http.chat([test_image(1)]))
        chats = vision_requests(self.plan.vision_requests)
        for c in system.levels or self.plan.vision_levels:
            for rep in range(system.reps or self.plan.reps):
                prof = (f"LLaVA chats, {system.label}", eng) if system.ours and rep == 0 else None
                self.vision[system.key][c].append(
                    self.measured(
                        "vision",
                        system.key,
                        system.key,
                        c,
                        lambda c=c: http.vision_round(chats, c),
                        prof,
                        pids=lambda: [eng.proc.pid],
                    )
                )
        eng.stop()

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self) -> Results:
        t0, plan, cache = time.monotonic(), self.plan, self.settings.cache_dir
        self.sampler.start()
        try:
            log(f"load average {loadavg()}; synthesizing the workload, extracting the CTranslate2 weights")
            clips = inputs.clips(plan.requests, cache / "bench" / "clips")
            self.results.clips = [
                {"name": c.name, "seconds": round(c.seconds, 2), "sentences": r.sentences}
                for c, r in zip(clips, plan.requests, strict=True)
            ]
            long = inputs.long_files(clips, cache / "bench" / "clips", plan.long_s)
            self.start_peers()
            self.fw_search(clips)
            ours = plan.system(plan.ours)
            if plan.mode == "full":  # a cold start: the page cache dropped (the whole machine's: not in quick)
                cold, dropped = self.engine(ours), drop_page_cache()
                if self.start(cold, ours):
                    self.startup(cold, "cold", dropped)
                    cold.stop()
            for system in plan.audio_phases():
                self.audio_phase(system, clips, long)
            for system in [s for s in plan.systems if s.engine == "vllm" and s.role == "vision"]:
                self.vision_phase(system)
        finally:
            for stop in reversed(self.cleanup):
                try:
                    stop()
                except Exception as exc:
                    log(f"cleanup: {exc}")
            self.sampler.stop_event.set()
            self.sampler.join(5)
        self.collect()
        if not self.args.no_compose:
            self.results.compose = compose_serving()  # after every engine of ours stopped: the stack alone
        self.results.image = image_size_lines()
        if self.plan.mode == "full":  # no engine resident: the kernels alone, on the same CPU as the rounds
            from mmcpu_dev.bench import attention

            self.results.attention = attention.headline()
        self.results.meta.loadavg_end, self.results.meta.elapsed_s = loadavg(), time.monotonic() - t0
        self.results.headline = headline(self.results)
        if gaps := missing(self.results):
            log(f"headline figures not measured in this run: {', '.join(gaps)}")
        return self.results

    def collect(self) -> None:
        res = self.results
        for who, per_level in self.audio.items():
            sys_ = res.systems[who]
            sys_.audio = {c: merge_rounds(rs) for c, rs in per_level.items()}
            samples = [s for rs in per_level.values() for r in rs for s in r.samples]
            sys_.wer, sys_.wer_n = wer(samples), sum(1 for s in samples if s.ok)
            sys_.examples = sorted({(s.ref, s.text) for s in samples if s.ok})[:6]
        res.paired = {
            phase: {who: {c: merge_rounds(rs) for c, rs in per.items()} for who, per in by_who.items()}
            for phase, by_who in self.paired.items()
        }
        for key, per_level in self.vision.items():
            res.systems[key].vision = {c: merge_rounds(rs) for c, rs in per_level.items()}
        for who, per_file in self.long.items():
            res.systems[who].long = {name: merge_rounds(rs) for name, rs in per_file.items()}
        for title, raws in self.raw_profiles.items():
            ok = [r for r in raws if not r.startswith("error: ")]
            res.profile[title] = (
                profiles.profile_summary("".join(ok))
                if "".join(ok).strip()
                else {"error": "; ".join(r for r in raws if r not in ok) or "no samples"}
            )
        for key, peak in self.sampler.peak.items():
            if peak and key in res.systems:
                res.systems[key].peak_rss_bytes = peak


def setup_peers(plan: Plan, python: str) -> int:
    """Build what the plan's OpenVINO and whisper.cpp peers load (cached: a second call rebuilds nothing); print
    each one's weights or why it is not available here. Exit 1 if any is not."""
    setup = Setup(get_settings().cache_dir, python=python)
    bad = 0
    for peer in plan.peer_systems():
        if peer.engine == "faster-whisper":
            continue
        t0 = time.monotonic()
        try:
            py, model = setup.prepare(peer.engine, peer.checkpoint, peer.compute_type)
            log(f"{peer.key}: {model} ({py}) in {time.monotonic() - t0:.0f} s")
        except PeerUnavailable as exc:
            bad += 1
            log(f"{peer.key}: NOT AVAILABLE: {exc}")
    log(f"setup log: {setup.log_path}")
    return 1 if bad else 0


def line_versions(python: Path) -> dict[str, str]:
    """vllm-cpu and torch of another line's venv, asked of its interpreter."""
    code = (
        "import json; from importlib import metadata as m; print(json.dumps({d: m.version(d) for d in "
        "('vllm-cpu', 'torch')}))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else {}


def write(results: Results, out_dir: Path, bench_python: Path, record: bool = False) -> int:
    """results.json, the plot (bench venv) and benchmarks.md (docs/bench/analysis.md appended) under out_dir;
    ``record`` (a full run): its CPU's entry of the runs on record (bench/cpus.json) replaced by this run's."""
    from mmcpu_dev.bench import record as records

    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench" / "results.json"
    json_path.write_text(results.model_dump_json(indent=2) + "\n")
    cpus = out_dir / "bench" / "cpus.json"
    runs = records.update(cpus, results) if record else records.load(cpus)
    png = out_dir / "bench" / "throughput.png"
    plot = subprocess.run([str(bench_python), "-P", str(PEER), "plot", "--json", str(json_path), "--out", str(png)])
    analysis = REPO_ROOT / "docs" / "bench" / "analysis.md"
    extra = "\n" + analysis.read_text() if analysis.is_file() else ""
    (out_dir / "benchmarks.md").write_text(report.render(results, runs) + extra)
    log(f"wrote {out_dir / 'benchmarks.md'}, {json_path}, {png}")
    for f in results.meta.failed:
        print(f"error: {f}", file=sys.stderr)
    if plot.returncode != 0:
        print("error: the plot failed", file=sys.stderr)
    return 1 if plot.returncode != 0 or results.meta.failed else 0


def latency(plan: Plan, args) -> int:
    """Per-request latency, MRV2 against V1, one request at a time, plus ready time and RSS per engine."""
    settings = get_settings()
    logs = settings.cache_dir / "logs" / "bench"
    clips = inputs.clips(plan.requests[: args.requests], settings.cache_dir / "bench" / "clips")
    rows = []
    for key in (plan.ours, plan.v1, plan.vision_ours, plan.vision_v1):
        system = plan.system(key)
        with Engine(
            system.model,
            logs / f"latency-{key}.log",
            runner=system.runner,
            vllm_args=[*system.vllm_args, *args.engine_args.split()],
        ) as eng:
            http = Http(eng.base_url, audio_model=eng.name, vision_model=eng.name)
            if system.role == "audio":
                http.transcribe(clips[0])  # warm-up
                rnd = http.audio_round(clips, 1)
            else:
                http.chat([test_image(1)])
                rnd = http.vision_round(vision_requests(args.requests), 1)
            lat = [s.latency_s for s in rnd.samples if s.ok]
            s = rnd.summary()
            rows.append(
                {
                    "system": key,
                    "model": system.model.name,
                    "runner": system.runner,
                    "ready_s": round(eng.ready_s, 1),
                    "rss_gib": round(eng.rss_bytes() / 2**30, 2),
                    "p50_s": s.p50_s,
                    "min_s": min(lat, default=None),
                    "max_s": max(lat, default=None),
                    "requests": s.n,
                    "failures": s.failures,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'system':<16}{'model':<20}{'runner':<8}{'ready s':>9}{'RSS GiB':>9}{'p50 s':>9}{'min s':>9}{'max s':>9}")
    for r in rows:
        print(
            f"{r['system']:<16}{r['model']:<20}{r['runner']:<8}{r['ready_s']:>9}{r['rss_gib']:>9}"
            + "".join(f"{report.fmt(r[k], 3):>9}" for k in ("p50_s", "min_s", "max_s"))
        )
    for a, b in ((rows[0], rows[1]), (rows[2], rows[3])):
        print(f"{a['model']}: MRV2 / V1 p50 latency = {report.fmt_ratio(ratio(a['p50_s'], b['p50_s']))}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(r["failures"] for r in rows) else 0
