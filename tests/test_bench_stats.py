"""The benchmark's arithmetic and plan (mmcpu_dev.bench): percentiles, throughput, ratios, round pooling, py-spy
profile parsing, start-up stages, the fixed workload, the headline derived from the plan and the report. Quick, no
servers; no timing is asserted anywhere."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import pytest

from mmcpu.config import Settings
from mmcpu_dev import speech
from mmcpu_dev.bench import plan as plans
from mmcpu_dev.bench import profiles, report
from mmcpu_dev.bench.results import Meta, Results, SystemResult, headline, missing
from mmcpu_dev.bench.stats import LevelStats, Round, Sample, merge_rounds, percentile, ratio, summarize, throughput

ISSUE_17_KEYS = {
    "audio_default/fw_int8@c=1",
    "audio_default/fw_int8@c=4",
    "audio_default/fw_int8@c=8",
    "audio_default/fw_int8@c=16",
    "p50_audio_default/fw_int8@c=1",
    "mrv2/v1@c=1",
    "mrv2/v1@c=8",
    "vision_mrv2/v1@c=1",
    "vision_mrv2/v1@c=4",
    "wer_audio_default",
    "wer_fw_int8",
    "wer_float32",
}
PEER_KEYS = {f"audio_default/{peer}_best@c={c}" for peer in ("openvino", "whispercpp") for c in (1, 4, 8, 16)} | {
    "p50_audio_default/openvino_best@c=1",
    "p50_audio_default/whispercpp_best@c=1",
}
# ours as a bare engine beside ours through the stack (the headline's audio_default figures)
BARE_KEYS = {
    k.replace("audio_default/", "bare_audio_default/") for k in ISSUE_17_KEYS | PEER_KEYS if "audio_default/" in k
}
STARTUP_KEYS = {"engine_ready_cold_s", "engine_ready_warm_s", "compose_up_to_serving_s", "engine_peak_rss_gib"}


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)  # rank 0.95 * 3 = 2.85 -> 3 + 0.85 * (4 - 3)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_throughput_and_ratio_edge_cases():
    assert throughput(30.0, 10.0) == pytest.approx(3.0)
    assert throughput(30.0, 0.0) is None
    assert ratio(1.0, 4.0) == pytest.approx(0.25)
    assert ratio(None, 4.0) is None
    assert ratio(1.0, 0.0) is None
    assert ratio(1.0, math.nan) is None


def test_summary_counts_only_successful_requests():
    samples = [
        Sample(2.0, audio_s=10.0, text="a"),
        Sample(4.0, audio_s=20.0, text="b"),
        Sample(9.0, audio_s=30.0, error="APIError: boom"),
    ]
    s = Round(4, wall_s=5.0, samples=samples).summary()
    assert (s.n, s.ok, s.failures) == (3, 2, 1)
    assert s.audio_s == 30.0  # the failed request's audio is not throughput
    assert s.throughput == pytest.approx(6.0)
    assert s.rps == pytest.approx(0.4)
    assert s.p50_s == pytest.approx(3.0) and s.max_s == 4.0
    assert s.errors == [("APIError: boom", 1)]
    assert s.wer is None  # no reference transcripts


def test_vision_round_has_rps_but_no_throughput():
    s = summarize([Sample(0.5), Sample(1.5)], wall_s=2.0, concurrency=2)
    assert s.throughput is None and s.rps == pytest.approx(1.0)


def test_merge_rounds_adds_walls_pools_samples_and_reports_the_spread():
    r1 = Round(2, 4.0, [Sample(1.0, 8.0), Sample(3.0, 8.0)])
    r2 = Round(2, 6.0, [Sample(5.0, 4.0)])
    m = merge_rounds([r1, r2])
    assert m.rounds == 2 and m.n == 3 and m.wall_s == 10.0
    assert m.throughput == pytest.approx(2.0)  # pooled (20 / 10), not the mean of the rounds (4, 0.67)
    assert m.throughput_spread == pytest.approx((4 / 6, 4.0))
    assert m.p50_s == 3.0
    with pytest.raises(ValueError):
        merge_rounds([r1, Round(4, 1.0, [])])
    with pytest.raises(ValueError):
        merge_rounds([])


def test_a_long_file_gets_its_real_time_factor_and_wer():
    rnd = Round(1, 6.0, [Sample(6.0, 60.0, "the cat sat on the mat", None, "audio", "the cat sat on a mat")])
    got = merge_rounds([rnd])
    assert got.rtf == pytest.approx(0.1) and got.throughput == pytest.approx(10.0)
    assert got.wer == pytest.approx(1 / 6)
    failed = merge_rounds([Round(1, 1.0, [Sample(1.0, 60.0, None, "HTTP 500", "audio", "x")])])
    assert failed.rtf is None and failed.wer is None


# py-spy --format raw, verbatim (lines as long as the stacks): root first, files relative to their sys.path
# entry; " 1" = a sample without Python frames
PYSPY_RAW = """\
run (vllm/v1/worker/gpu/model_runner.py:10);gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py:241);run (triton/runtime/interpreter.py:1470);GridExecutor.__call__ (triton/runtime/interpreter.py:1357);_gumbel_sample_kernel (vllm/v1/worker/gpu/sample/gumbel.py:210);mul (triton/language/core.py:2502) 5
run (vllm/v1/worker/gpu/model_runner.py:10);gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py:241);run (triton/runtime/interpreter.py:1470);_implicit_cvt (triton/runtime/interpreter.py:700);getmembers (inspect.py:50) 1
run (vllm/v1/worker/gpu/model_runner.py:10);gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py:241);run (triton/runtime/interpreter.py:1470);GridExecutor.__call__ (triton/runtime/interpreter.py:1340);getcallargs (inspect.py:1500) 1
run (vllm/v1/worker/gpu/model_runner.py:10);write (vllm/v1/worker/gpu/buffer_utils.py:9);run (/venv/lib/python3.11/site-packages/triton/runtime/interpreter.py:1470);GridExecutor.__call__ (/venv/lib/python3.11/site-packages/triton/runtime/interpreter.py:1357);_apply_write_kernel (/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu/buffer_utils.py:40) 1
run (vllm/v1/worker/gpu/model_runner.py:10);apply (vllm/triton_utils/fake.py:3);forward (torch/nn/modules/module.py:1) 1
 1
"""


def test_profile_summary_attributes_samples_to_kernels_and_frames():
    p = profiles.profile_summary(PYSPY_RAW)
    assert p["samples"] == 10
    assert p["interpreter_share"] == pytest.approx(0.8)
    kernels = {k["frame"]: k["samples"] for k in p["kernels"]}
    assert kernels == {
        "_gumbel_sample_kernel (vllm/v1/worker/gpu/sample/gumbel.py)": 5,
        # launch work before the body runs is charged to the launching call site, not to inspect.*
        "interpreter launch work, called from gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py)": 2,
        "_apply_write_kernel (vllm/v1/worker/gpu/buffer_utils.py)": 1,  # absolute paths are shortened
    }
    assert p["kernels"][0]["share"] == pytest.approx(0.5)
    sites = {k["frame"]: k["samples"] for k in p["launch_sites"]}
    assert sites == {
        "gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py)": 7,  # its kernel body + its launch work
        "write (vllm/v1/worker/gpu/buffer_utils.py)": 1,
    }
    leaves = {k["frame"]: k["samples"] for k in p["self_frames"]}
    assert leaves["mul (triton/language/core.py)"] == 5
    assert leaves["forward (torch/nn/modules/module.py)"] == 1  # vllm/triton_utils is not Triton
    assert leaves["<no Python frame>"] == 1
    vllm = {k["frame"]: k["samples"] for k in p["vllm_inclusive"]}
    assert vllm["run (vllm/v1/worker/gpu/model_runner.py)"] == 9
    assert vllm["gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py)"] == 7


def test_profile_parser_rejects_other_formats():
    with pytest.raises(ValueError):
        profiles.parse_pyspy_raw("this is a flamegraph svg, not collapsed stacks")


def test_startup_breakdown_from_a_vllm_log():
    log = "\n".join(
        [
            "[mmcpu] runner=v2 executor=uni kvcache=0.25GiB: python -m vllm.entrypoints.openai.api_server ...",
            "INFO 12-01 11:05:38 [importing.py:53] Triton is installed but 0 active driver(s) found",
            "(APIServer pid=22699) INFO 12-01 11:05:40 [api_utils.py:345] version 0.26.0",
            "(APIServer pid=22699) INFO 12-01 11:05:47 [model.py:623] Resolved architecture: Whisper",
            "INFO 12-01 11:05:54 [importing.py:53] Triton is installed but 0 active driver(s) found",
            "W1201 11:05:55.545000 22813 torch/utils/cpp_extension.py:140] No CUDA runtime is found",
            "(EngineCore pid=22813) INFO 12-01 11:05:56 [core.py:116] Initializing a V1 LLM engine (v0.26.0)",
            "(EngineCore pid=22813) INFO 12-01 11:05:57 [model_runner.py:284] Loading model from scratch...",
            "(EngineCore pid=22813) INFO 12-01 11:05:58 [model_runner.py:305] Model loading took 0.13 GiB and 1.4 s",
            "(EngineCore pid=22813) INFO 12-01 11:06:26 [core.py:347] init engine (profile, create kv cache, warmup "
            "model) took 28.16 s",
            "(APIServer pid=22699) INFO 12-01 11:06:28 [api_server.py:681] Starting vLLM server on http://127.0.0.1:1",
        ]
    )
    spawned = dt.datetime(2026, 12, 1, 11, 5, 33).timestamp()
    got = profiles.startup_breakdown(log, spawned, ready_s=57.0, year=2026)
    assert got == {
        "imports, API server": 7.0,
        "config + tokenizer, API server": 7.0,
        "EngineCore spawn + imports": 9.0,
        "device + worker init": 1.0,
        "model load": 1.0,
        "warm-up + profile + KV cache": 28.0,
        "API ready": 4.0,
    }
    assert sum(got.values()) == 57.0
    # A log cut short (engine still loading): the stages seen, the rest in "API ready".
    partial = profiles.startup_breakdown("\n".join(log.splitlines()[:7]), spawned, ready_s=30.0, year=2026)
    assert (
        list(partial)
        == ["imports, API server", "config + tokenizer, API server", "EngineCore spawn + imports", "API ready"]
        and sum(partial.values()) == 30.0
    )


# --- the plan --------------------------------------------------------------------------------------------------
def test_the_fixed_workload_is_deterministic_and_a_mix_of_2_to_28_s():
    work = plans.workload()
    assert work == plans.workload() and len(work) >= 32
    assert len({r.name for r in work}) == len(work)
    assert sorted(n for n, count in plans.MIX for _ in range(count)) == sorted(r.sentences for r in work)
    words = [len(r.text.split()) for r in work]
    # espeak-ng at 130 wpm, measured: 5 words 2.1-2.6 s, the 76 words of the longest 27.2 s (Whisper's window: 30)
    assert min(words) == 5 and max(words) <= 76
    assert sum(w <= 15 for w in words) >= len(work) // 3 and sum(w >= 40 for w in words) >= 4  # short and long
    assert words != sorted(words)  # shuffled: long requests are not bunched at the end of a round
    sentences = {s.rstrip(".") for s in speech.SENTENCES}
    for r in work:  # whole sentences joined end to end (or the first words of one)
        parts = [p.strip() for p in r.text.split(".") if p.strip()]
        assert all(p in sentences for p in parts) or (r.sentences == plans.SHORT and len(parts) == 1)


def _plan(tmp_path: Path, **settings: object) -> plans.Plan:
    return plans.build("full", Settings(models_dir=tmp_path, **settings), variants=[], lines=False)


def _f32_plan(tmp_path: Path) -> plans.Plan:
    """A plan whose default is float32 unquantised (its own float32 reference) on every CPU, whatever its row."""
    return _plan(tmp_path, dtype="float32")


def test_headline_keys_are_issue_17s_and_follow_the_plan(tmp_path):
    plan = _plan(tmp_path)
    assert {f.key for f in plan.figures()} == ISSUE_17_KEYS | PEER_KEYS | BARE_KEYS
    # the targets are the stack's; the bare engine's figures are reported beside them, without one
    for f in plan.figures():
        if f.key.startswith(("audio_default/", "p50_audio_default/")):
            assert f.a == plan.stack == "audio_stack"
        if "bare_audio_default/" in f.key:
            assert f.a == plan.ours and f.target is None
    stack = plan.system(plan.stack)
    assert stack.via == "stack" and stack.of == plan.ours and stack.peers == plan.system(plan.ours).peers
    assert stack not in plan.audio_phases()  # it runs in ours' phase, not as an engine of its own
    alone = plans.build("full", Settings(models_dir=tmp_path), variants=[], lines=False, stack=False)
    assert alone.stack is None and {f.key for f in alone.figures()} == ISSUE_17_KEYS | PEER_KEYS
    ours, v1 = plan.system(plan.ours), plan.system(plan.v1)
    model, _, argv = plans.role_engine("audio", Settings(models_dir=tmp_path))  # what the launcher runs
    assert ours.ours and ours.model == model and v1.model == model and v1.vllm_args == ours.vllm_args
    assert ours.dtype == v1.dtype == plans.option(argv, "--dtype")  # V1 with the same dtype and quantisation
    # while the default is float32 and unquantised, it is its own float32 reference
    assert (plan.float32 == plan.ours) == (ours.dtype == "float32" and not ours.quantization)
    quick = plans.build("quick", Settings(models_dir=tmp_path), variants=[], audio_levels=[2, 3], lines=False)
    keys = {f.key for f in quick.figures()}
    assert "audio_default/fw_int8@c=3" in keys and "p50_audio_default/fw_int8@c=2" in keys
    assert not any(k.startswith("mrv2/v1") for k in keys)  # its levels (1, 8) were not measured


def test_ours_follows_the_launchers_default(tmp_path):
    plan = _plan(tmp_path, dtype="bfloat16", audio_args="--max-num-seqs 4")
    ours = plan.system(plan.ours)
    assert ours.dtype == "bfloat16" and plans.option(ours.vllm_args, "--max-num-seqs") == "4"
    assert plan.float32 == "float32" and plan.system("float32").dtype == "float32"
    assert {f.a for f in plan.figures() if f.key == "wer_float32"} == {"float32"}


def _stats(c: int, tp: float, p50: float = 1.0, wer: float | None = None, rps: float | None = None) -> LevelStats:
    return LevelStats(
        concurrency=c,
        n=32,
        ok=32,
        wall_s=10.0,
        audio_s=10 * tp,
        throughput=tp,
        rps=rps,
        p50_s=p50,
        p95_s=2 * p50,
        wer=wer,
    )


def _results(plan: plans.Plan) -> Results:
    levels = plan.audio_levels
    res = Results(
        cpu={"model": "Test CPU 9000", "isa": "avx2", "flags": ["avx2", "fma"], "cpus": 2},
        meta=Meta(date="2026-12-02", host="h", cpus=2, mem_bytes=2**34, loadavg_start="0.1", foreign_cores_limit=0.25),
        plan=plan,
        systems={s.key: SystemResult(spec=s) for s in plan.systems},
    )
    ours, fw = res.systems[plan.ours], res.systems[plan.peer]
    ours.audio = {c: _stats(c, 20.0 * c) for c in levels}
    res.systems[plan.v1].audio = {c: _stats(c, 10.0 * c) for c in levels}
    fw.audio = {c: _stats(c, 5.0) for c in levels}
    # faster-whisper measured twice as fast during ours' phase as its pooled figure: the ratio pairs the phase
    res.paired = {
        plan.ours: {
            plan.ours: {c: _stats(c, 20.0 * c, 0.5) for c in levels},
            plan.peer: {c: _stats(c, 10.0, 1.0) for c in levels},
            # OpenVINO: int8 the faster, fp32 the lower p50 (the best of each metric counts)
            "ov_fp32": {c: _stats(c, 8.0, 0.4) for c in levels},
            "ov_int8": {c: _stats(c, 16.0, 0.8) for c in levels},
            "wcpp_f16": {c: _stats(c, 4.0, 2.0) for c in levels},
            "wcpp_q8_0": {c: _stats(c, 5.0, 1.0) for c in levels},
        }
    }
    if plan.stack:  # through the stack: ours 10 % slower, the peers as in the bare phase
        res.paired[plan.stack] = {who: dict(per) for who, per in res.paired[plan.ours].items() if who != plan.ours}
        res.paired[plan.stack][plan.stack] = {c: _stats(c, 18.0 * c, 0.6) for c in levels}
    res.systems[plan.vision_ours].vision = {c: _stats(c, 0, rps=30.0) for c in plan.vision_levels}
    res.systems[plan.vision_v1].vision = {c: _stats(c, 0, rps=20.0) for c in plan.vision_levels}
    ours.wer, fw.wer = 0.2, 0.25
    ours.ready_s, ours.peak_rss_bytes = 42.04, 3 * 2**30
    res.headline = headline(res)
    return res


def test_headline_from_a_typed_result(tmp_path):
    res = _results(_f32_plan(tmp_path))
    head = res.headline
    assert set(head) == (ISSUE_17_KEYS | PEER_KEYS | BARE_KEYS | STARTUP_KEYS) - {
        "engine_ready_warm_s",
        "compose_up_to_serving_s",
    }
    # the headline is ours through the stack; the bare engine's figures are beside it
    assert head["audio_default/openvino_best@c=1"] == pytest.approx(18 / 16)  # against the faster OpenVINO
    assert head["bare_audio_default/openvino_best@c=1"] == pytest.approx(20 / 16)
    assert head["p50_audio_default/openvino_best@c=1"] == pytest.approx(0.6 / 0.4)  # against the lower p50
    assert head["p50_bare_audio_default/openvino_best@c=1"] == pytest.approx(0.5 / 0.4)
    assert head["audio_default/whispercpp_best@c=4"] == pytest.approx(72 / 5)
    assert head["audio_default/fw_int8@c=1"] == pytest.approx(1.8)  # 18 / 10 in the same phase, not 18 / 5
    assert head["bare_audio_default/fw_int8@c=1"] == pytest.approx(2.0)
    assert head["audio_default/fw_int8@c=16"] == pytest.approx(28.8)
    assert head["p50_audio_default/fw_int8@c=1"] == pytest.approx(0.6)
    assert head["mrv2/v1@c=8"] == pytest.approx(2.0)
    assert head["vision_mrv2/v1@c=4"] == pytest.approx(1.5)
    assert head["wer_audio_default"] == head["wer_float32"] == 0.2 and head["wer_fw_int8"] == 0.25
    assert head["engine_ready_cold_s"] == 42.0 and head["engine_peak_rss_gib"] == 3.0
    assert missing(res) == []
    assert "encoder_attention/gemm_bf16" not in head  # no attention measured: no ratio
    res.attention = {"whisper-tiny.en": {"auto": 410.0}, "gemm_bf16": 820.0, "ratio": 0.5}
    assert headline(res)["encoder_attention/gemm_bf16"] == 0.5
    res.attention = {}
    del res.paired[res.plan.stack]
    res.headline = headline(res)
    assert "audio_default/fw_int8@c=1" not in res.headline  # not measured: left out, not invented
    assert "audio_default/fw_int8@c=1" in missing(res)


def test_results_round_trip_through_json_and_the_report_leads_with_the_cpu(tmp_path):
    res = _results(_f32_plan(tmp_path))
    again = Results.model_validate_json(res.model_dump_json())
    assert again == res and again.systems[res.plan.ours].audio[16].throughput == 320.0
    md = report.render(res)
    assert md.splitlines()[2].startswith("**CPU: Test CPU 9000**") and "`avx2`" in md.splitlines()[2]
    assert "| `audio_default/fw_int8@c=8` | 14.4× | >= 2.5 | yes |" in md  # through the stack
    assert "| `bare_audio_default/fw_int8@c=8` | 16× |  |  |" in md
    assert "| `mrv2/v1@c=1` | 2× | >= 1.05 | yes |" in md
    assert "| `wer_fw_int8` | 0.250 |" in md
    assert "**(ours)**" in md


def test_ours_follows_an_int8_default_and_keeps_a_float32_reference(tmp_path, monkeypatch):
    from mmcpu import defaults
    from mmcpu_dev.bench import defaults as sweep
    from mmcpu_dev.fixtures import config_only

    float_model = config_only(tmp_path / "whisper-tiny.en")
    int8_model = config_only(tmp_path / "whisper-tiny.en-int8", quantized=True)
    row = defaults.Row(
        audio=defaults.Choice(dtype="bfloat16", quantization="int8"),
        vision=defaults.Choice(dtype="auto"),
        evidence="Not measured: test",
    )
    monkeypatch.setattr(defaults, "table", lambda: defaults.Table(rule="t", rows={i: row for i in defaults.ISAS}))
    plan = _plan(tmp_path)
    ours, v1 = plan.system(plan.ours), plan.system(plan.v1)
    assert ours.model == v1.model == int8_model and ours.dtype == v1.dtype == "bfloat16"
    assert ours.quantization and ours.quantization == v1.quantization  # V1: the same dtype and quantisation
    ref = plan.system(plan.float32)
    assert (ref.model, ref.dtype, ref.quantization) == (float_model, "float32", None)
    # the defaults sweep: bf16 only where the hardware has it, int8 where the checkpoint is there
    settings = Settings(models_dir=tmp_path)
    got = {(c.dtype, c.quantization, m.name) for c, m in sweep.candidates("audio", settings, "avx2")}
    assert got == {("float32", "none", "whisper-tiny.en"), ("float32", "int8", "whisper-tiny.en-int8")}
    assert len(sweep.candidates("audio", settings, "avx512_bf16")) == 4
    int8_model.joinpath("config.json").unlink()
    assert {c.quantization for c, _ in sweep.candidates("audio", settings, "amx")} == {"none"}


def test_variants_run_fewer_levels_and_their_own_peer_only_there(tmp_path):
    from mmcpu_dev.fixtures import config_only

    config_only(tmp_path / "whisper-tiny.en")
    base = config_only(tmp_path / "whisper-base")
    plan = plans.build("full", Settings(models_dir=tmp_path), variants=[base])
    variant = plan.system("whisper-base")
    assert set(plan.levels_of("whisper-base")) < set(plan.audio_levels) == set(plan.levels_of(plan.ours))
    # faster-whisper (and OpenVINO) on whisper-base's own weights, searched only where it is compared
    (peer,) = [k for k in variant.peers if plan.system(k).engine == "faster-whisper"]
    assert plan.levels_of(peer) == plan.levels_of("whisper-base")
    assert plan.levels_of(plan.peer) == plan.audio_levels  # ours' peer: every level


def test_a_disturbed_round_is_taken_again_up_to_the_bound(monkeypatch):
    from mmcpu_dev.bench import runners

    loads = iter([True, True, False] + [True] * 10)  # other processes ran in the first two rounds

    class Watch:
        def stop(self) -> dict:
            return {"loadavg_1m": 1.0, "foreign_cores": 1.0, "flagged": next(loads)}

    monkeypatch.setattr(runners, "CpuWatch", Watch)
    monkeypatch.setattr(runners, "RETAKE_PAUSE_S", 0)
    taken = []
    result, load = runners.undisturbed(lambda: taken.append(1) or len(taken), "test")
    assert (result, load["flagged"]) == (3, False)  # the first undisturbed round counts
    taken.clear()
    result, load = runners.undisturbed(lambda: taken.append(1) or len(taken), "test")
    assert result == runners.RETAKES + 1 and load["flagged"]  # still disturbed after RETAKES: the last, flagged
