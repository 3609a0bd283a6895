"""The bench's proof that every peer's layout uses the cores it is given (mmcpu_dev.bench): OpenVINO GenAI's
replicas unpinned, the cores a round's processes kept busy (CPU time / wall, from /proc through psutil), the check
that fails a run whose replicas did not run in parallel, and ours measured through the stack beside the bare
engine. Made-up figures, plus real processes burning CPU for a second; no peer or engine is started here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmcpu.config import Settings
from mmcpu_dev.bench import plan as plans
from mmcpu_dev.bench import report, runners
from mmcpu_dev.bench.inputs import Clip
from mmcpu_dev.bench.results import Meta, Results, SystemResult
from mmcpu_dev.bench.stats import Round, Sample
from mmcpu_dev.fixtures import config_only


def _peer_module():
    spec = importlib.util.spec_from_file_location("bench_peer", Path(runners.__file__).with_name("peer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_openvino_replicas_are_unpinned_and_a_single_one_keeps_its_pinning():
    config = _peer_module().ov_config
    assert config(2, 1) == {"INFERENCE_NUM_THREADS": 2, "PERFORMANCE_HINT": "LATENCY"}  # OpenVINO's default: pinned
    assert config(1, 2) == {"INFERENCE_NUM_THREADS": 1, "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}
    assert config(2, 4)["ENABLE_CPU_PINNING"] is False


@pytest.mark.parametrize(
    ("threads", "workers", "c", "cores", "can", "underused", "idle"),
    [
        (1, 2, 4, 1.02, 2, True, True),  # two replicas on one core: the pinned OpenVINO layout
        (1, 2, 4, 1.93, 2, False, False),  # two replicas on two cores
        (1, 2, 1, 0.98, 1, False, False),  # one request in flight: one replica at work, one core is all it can use
        (1, 4, 8, 1.40, 2, True, True),  # four replicas, capped at the 2 CPUs
        (2, 1, 4, 1.20, 2, True, False),  # one replica, two threads: flagged, not failed (its serial parts)
        (1, 1, 8, 0.95, 1, False, False),  # one core's use: never flagged
        (2, 2, 8, None, 2, False, False),  # not measured: not flagged
    ],
)
def test_a_layout_that_leaves_its_cores_idle_is_flagged_and_idle_replicas_fail(
    threads, workers, c, cores, can, underused, idle
):
    use = runners.layout_use(cores, threads, workers, c, cpus=2)
    assert use == {"layout": f"{threads}x{workers}", "layout_cores": can, "underused": underused}
    assert runners.replicas_idle(workers, c, use, flagged=False) is idle
    assert runners.replicas_idle(workers, c, use, flagged=True) is False  # other work ran: not the layout's fault


def _spinner(seconds: float, processes: int) -> subprocess.Popen:
    """A process spinning for ``seconds``, with ``processes - 1`` children spinning beside it."""
    code = (
        f"import multiprocessing as mp, time\n"
        f"def spin():\n    t = time.monotonic() + {seconds}\n    while time.monotonic() < t: pass\n"
        f"if __name__ == '__main__':\n"
        f"    ps = [mp.Process(target=spin) for _ in range({processes - 1})]\n"
        f"    [p.start() for p in ps]\n    spin()\n    [p.join() for p in ps]\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def test_cpu_use_counts_the_measured_tree_over_the_round():
    """Real processes: one spinning on one core kept at most one core busy, and visibly some (a shared machine
    may give it less than all of one); a parent's count takes its spinning child's time."""
    import psutil

    one = _spinner(2.0, 1)
    two = _spinner(2.0, 2)
    try:
        time.sleep(0.3)  # both up, the child too
        use = runners.CpuUse(lambda: [one.pid, None])
        time.sleep(1.0)
        got = use.stop()
        (child,) = psutil.Process(two.pid).children()
        child_s = sum(child.cpu_times()[:2])
        parent_s = sum(psutil.Process(two.pid).cpu_times()[:2])
        tree_s = runners.tree_cpu_s([two.pid])
    finally:
        for p in (one, two):
            p.wait(timeout=30)
    print(
        f"\n[one spinning process over 1 s: {got}; parent {parent_s:.2f} + child {child_s:.2f} = tree "
        f"{tree_s:.2f} CPU s]"
    )
    assert set(got) == {"cpu_s", "cores"} and 0.05 < got["cores"] <= 1.15
    assert tree_s >= parent_s + child_s > parent_s  # the child's time is in the tree's
    assert runners.tree_cpu_s([two.pid]) == 0.0  # gone: nothing, not an error
    assert runners.CpuUse(None).stop() == {}  # nothing to measure: no figure rather than 0


@pytest.mark.parametrize(
    ("threads", "workers", "c", "cores", "idle"),
    [
        (1, 2, 4, 1.02, True),  # two replicas on one core: pinned, in a search round too
        (1, 4, 8, 1.40, False),  # a search round's tail (measured on a Xeon: 1.37-1.49), not a shared core
        (1, 2, 4, 1.24, True),  # under 62.5 % of 2 cores
    ],
)
def test_a_search_round_fails_the_run_only_when_its_replicas_shared_a_core(threads, workers, c, cores, idle):
    use = {"cores": cores, **runners.layout_use(cores, threads, workers, c, cpus=2)}  # as Bench.measure records it
    assert use["underused"] and runners.replicas_idle(workers, c, use, flagged=False)  # a measured round fails
    assert runners.replicas_idle(workers, c, use, flagged=False, search=True) is idle


class _Peer:
    """A peer whose rounds take no CPU of their own (the cores each round 'used' are made up below)."""

    pid = None

    def audio_round(self, clips, concurrency, threads, workers, batch=0):
        return Round(concurrency, 1.0, [Sample(0.5, c.seconds, c.text, None, "audio", c.text) for c in clips])

    def stop(self) -> None:
        pass


def _bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: dict[tuple[int, int], float]):
    """A Bench over a quick plan whose only peer is ov_int8, each layout's round 'using' ``cores[layout]``."""
    from mmcpu_dev.bench import run

    config_only(tmp_path / "whisper-tiny.en")
    plan = plans.build("quick", Settings(models_dir=tmp_path), variants=[], lines=False)
    plan.fw_grid = [(1, 1), (2, 1), (1, 2)]
    bench = object.__new__(run.Bench)
    bench.plan, bench.args = plan, SimpleNamespace(no_profile=True)
    bench.results = Results(
        cpu={"model": "Test CPU", "isa": "avx2", "cpus": 2},
        plan=plan,
        meta=Meta(date="2026-12-05", host="h", cpus=2, mem_bytes=2**34, loadavg_start="0.1", foreign_cores_limit=0.25),
        systems={s.key: SystemResult(spec=s) for s in plan.systems},
    )
    bench.peers = {"ov_int8": {"default": _Peer()}}
    layout: list[tuple[int, int]] = []
    real_round = _Peer.audio_round
    monkeypatch.setattr(
        _Peer,
        "audio_round",
        lambda self, clips, c, t, w, batch=0: layout.append((t, w)) or real_round(self, clips, c, t, w, batch),
    )

    class Use:
        def __init__(self, pids) -> None:
            self.pids = pids

        def stop(self) -> dict:
            if self.pids() != [None]:  # ours (the peers' fake has no process)
                return {"cpu_s": 3.0, "cores": 1.5}
            return {"cpu_s": cores[layout[-1]], "cores": cores[layout[-1]]}

    monkeypatch.setattr(run, "CpuUse", Use)
    monkeypatch.setattr(
        run, "undisturbed", lambda take, what: (take(), {"loadavg_1m": 0.1, "foreign_cores": 0.0, "flagged": False})
    )
    clips = [Clip(path=tmp_path / f"{i}.wav", seconds=2.0, text="a b", name=f"c{i}") for i in range(8)]
    return bench, clips


def test_a_search_whose_replicas_share_a_core_fails_the_run_and_says_so(tmp_path, monkeypatch):
    bench, clips = _bench(tmp_path, monkeypatch, {(1, 1): 0.99, (2, 1): 1.9, (1, 2): 1.01})
    bench.fw_search(clips)
    rows = {(x.concurrency, x.cpu_threads, x.num_workers): x for x in bench.results.fw_search}
    assert rows[4, 1, 2].cores == 1.01 and rows[4, 1, 2].underused and not rows[4, 2, 1].underused
    assert not rows[1, 1, 1].underused  # c=1: 1x1 only, one core is all it can use
    failed = [f for f in bench.results.meta.failed if f.startswith("ov_int8")]
    assert failed == [
        "ov_int8 c=4: layout 1x2 (cpu_threads x num_workers) kept 1.01 of its 2 cores busy: its "
        "replicas did not run in parallel"
    ]  # only the level with two replicas at work
    rec = next(x for x in bench.results.rounds if (x.concurrency, x.layout) == (4, "1x2"))
    assert (rec.cores, rec.layout_cores, rec.underused) == (1.01, 2, True)
    md = report.render(bench.results)
    assert "1×2: " in md and "(1.01 cores, **underused**)" in md and "1.01 of 2 (1x2), **underused**" in md


def test_a_search_whose_replicas_use_both_cores_passes(tmp_path, monkeypatch):
    bench, clips = _bench(tmp_path, monkeypatch, {(1, 1): 0.99, (2, 1): 1.8, (1, 2): 1.97})
    bench.fw_search(clips)
    assert bench.results.meta.failed == []
    assert not any(x.underused for x in bench.results.fw_search)
    assert {x.cores for x in bench.results.fw_search if x.num_workers == 2} == {1.97}


def test_ours_runs_through_the_stack_in_its_own_phase_with_its_peers(tmp_path, monkeypatch):
    """The stack's rounds: ours through the gateway, its peers interleaved, recorded in the stack's phase (the
    headline's pairs), with the CPU of every process of the stack."""
    bench, clips = _bench(tmp_path, monkeypatch, {(1, 1): 1.0, (2, 1): 1.9, (1, 2): 1.95})
    plan = bench.plan
    plan.system(plan.ours).peers = ["ov_int8"]
    from collections import defaultdict

    bench.audio = defaultdict(lambda: defaultdict(list))
    bench.paired = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    bench.results.systems["ov_int8"].fw_best = {1: (1, 1), 4: (1, 2)}

    def ours(c: int) -> Round:
        return Round(c, 2.0, [Sample(0.5, x.seconds, x.text, None, "audio", x.text) for x in clips])

    stack = plan.system(plan.stack)
    bench.rounds(plan.system(plan.ours), stack, ours, lambda: [1, 2, 3], clips, None)
    assert set(bench.paired[plan.stack]) == {plan.stack, "ov_int8"}
    assert set(bench.paired[plan.stack][plan.stack]) == set(plan.audio_levels)
    assert plan.ours not in bench.paired  # the bare engine's pairs are its own phase's
    kinds = {(x.phase, x.system, x.layout, x.cores) for x in bench.results.rounds}
    assert kinds == {
        (plan.stack, plan.stack, None, 1.5),
        (plan.stack, "ov_int8", "1x1", 1.0),
        (plan.stack, "ov_int8", "1x2", 1.95),
    }
