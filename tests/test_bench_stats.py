"""The benchmark's arithmetic (mmcpu.dev.bench): percentiles, throughput, ratios, round pooling, py-spy profile
parsing and the report. Quick, no servers; no timing is asserted anywhere."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from mmcpu.dev import bench
from mmcpu.config import REPO_ROOT


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 100) == 4.0
    assert bench.percentile(values, 50) == pytest.approx(2.5)
    # rank 0.95 * 3 = 2.85 -> 3 + 0.85 * (4 - 3)
    assert bench.percentile(values, 95) == pytest.approx(3.85)
    assert bench.percentile([7.0], 95) == 7.0
    assert bench.percentile([], 50) is None
    with pytest.raises(ValueError):
        bench.percentile(values, 101)


def test_throughput_and_ratio_edge_cases():
    assert bench.throughput(30.0, 10.0) == pytest.approx(3.0)
    assert bench.throughput(30.0, 0.0) is None
    assert bench.ratio(1.0, 4.0) == pytest.approx(0.25)
    assert bench.ratio(None, 4.0) is None
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(1.0, math.nan) is None


def test_summary_counts_only_successful_requests():
    samples = [
        bench.Sample(2.0, audio_s=10.0, text="a"),
        bench.Sample(4.0, audio_s=20.0, text="b"),
        bench.Sample(9.0, audio_s=30.0, error="APIError: boom"),
    ]
    s = bench.Round(4, wall_s=5.0, samples=samples).summary()
    assert (s["n"], s["ok"], s["failures"]) == (3, 2, 1)
    assert s["audio_s"] == 30.0  # the failed request's audio is not throughput
    assert s["throughput"] == pytest.approx(6.0)
    assert s["rps"] == pytest.approx(0.4)
    assert s["p50_s"] == pytest.approx(3.0)
    assert s["max_s"] == 4.0
    assert s["errors"] == [("APIError: boom", 1)]


def test_vision_round_has_rps_but_no_throughput():
    s = bench.summarize([bench.Sample(0.5), bench.Sample(1.5)], wall_s=2.0, concurrency=2)
    assert s["throughput"] is None
    assert s["rps"] == pytest.approx(1.0)


def test_merge_rounds_adds_walls_and_pools_samples():
    r1 = bench.Round(2, 4.0, [bench.Sample(1.0, 8.0), bench.Sample(3.0, 8.0)])
    r2 = bench.Round(2, 6.0, [bench.Sample(5.0, 4.0)])
    m = bench.merge_rounds([r1, r2])
    assert m["rounds"] == 2 and m["n"] == 3
    assert m["wall_s"] == 10.0
    assert m["throughput"] == pytest.approx(2.0)
    assert m["p50_s"] == 3.0
    with pytest.raises(ValueError):
        bench.merge_rounds([r1, bench.Round(4, 1.0, [])])
    with pytest.raises(ValueError):
        bench.merge_rounds([])


# py-spy --format raw: root first, files relative to their sys.path entry; " 1" = a sample without Python frames
PYSPY_RAW = """\
run (vllm/v1/worker/gpu/model_runner.py:10);gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py:241);run (triton/runtime/interpreter.py:1470);GridExecutor.__call__ (triton/runtime/interpreter.py:1357);_gumbel_sample_kernel (vllm/v1/worker/gpu/sample/gumbel.py:210);mul (triton/language/core.py:2502) 5
run (vllm/v1/worker/gpu/model_runner.py:10);gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py:241);run (triton/runtime/interpreter.py:1470);_implicit_cvt (triton/runtime/interpreter.py:700);getmembers (inspect.py:50) 1
run (vllm/v1/worker/gpu/model_runner.py:10);gumbel_sample (vllm/v1/worker/gpu/sample/gumbel.py:241);run (triton/runtime/interpreter.py:1470);GridExecutor.__call__ (triton/runtime/interpreter.py:1340);getcallargs (inspect.py:1500) 1
run (vllm/v1/worker/gpu/model_runner.py:10);write (vllm/v1/worker/gpu/buffer_utils.py:9);run (/venv/lib/python3.11/site-packages/triton/runtime/interpreter.py:1470);GridExecutor.__call__ (/venv/lib/python3.11/site-packages/triton/runtime/interpreter.py:1357);_apply_write_kernel (/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu/buffer_utils.py:40) 1
run (vllm/v1/worker/gpu/model_runner.py:10);apply (vllm/triton_utils/fake.py:3);forward (torch/nn/modules/module.py:1) 1
 1
"""


def test_profile_summary_attributes_samples_to_kernels_and_frames():
    p = bench.profile_summary(PYSPY_RAW)
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
        bench.parse_pyspy_raw("this is a flamegraph svg, not collapsed stacks")


def _results() -> dict:
    def level(c, tp, p50):
        return {"concurrency": c, "n": 4, "ok": 4, "failures": 0, "wall_s": 10.0, "audio_s": 10.0 * tp,
                "throughput": tp, "rps": 0.4, "p50_s": p50, "p95_s": p50 * 2, "mean_s": p50, "max_s": p50 * 2,
                "errors": []}  # fmt: skip

    return {
        "meta": {"date": "2026-11-30", "cpus": 2, "mem_bytes": 24 * 2**30, "loadavg_start": "1.0"},
        "config": {"ours": "mrv2", "audio_levels": [1, 4], "notes": [], "method": []},
        "systems": {
            "mrv2": {"label": "MRV2", "ready_s": 200.0, "peak_rss_bytes": 4 * 2**30},
            "v1": {"label": "V1", "ready_s": 100.0, "peak_rss_bytes": 4 * 2**30},
            "fw-int8": {"label": "fw int8", "ready_s": 2.0, "peak_rss_bytes": 2**29},
        },
        "audio": {
            "mrv2": {"levels": {"1": level(1, 0.5, 10.0), "4": level(4, 1.0, 20.0)}, "wer": 0.2, "wer_n": 4},
            "v1": {"levels": {"1": level(1, 20.0, 0.25), "4": level(4, 50.0, 0.5)}, "wer": 0.2, "wer_n": 4},
            "fw-int8": {"levels": {"1": level(1, 10.0, 0.5), "4": level(4, 25.0, 1.0)}, "wer": 0.21, "wer_n": 4},
        },
    }


def test_headline_ratios_are_ours_over_peer():
    rows = bench.headline_ratios(_results(), "mrv2", ["fw-int8", "v1"])
    got = {(r["peer"], r["figure"]): r["ratio"] for r in rows}
    assert got[("fw-int8", "throughput @c=1")] == pytest.approx(0.05)
    assert got[("v1", "throughput @c=4")] == pytest.approx(0.02)
    assert got[("fw-int8", "p50 latency @c=1")] == pytest.approx(20.0)
    assert got[("v1", "cold start to ready")] == pytest.approx(2.0)
    assert got[("fw-int8", "peak RSS")] == pytest.approx(8.0)


def test_report_shows_the_ratios():
    md = bench.render_markdown(_results())
    assert "| throughput @c=1 | 0.05× |" in md
    assert "MRV2 / fw int8" in md and "V1 / fw int8" in md
    # the one-line summary gives the range over concurrency levels: 0.5/10 and 1/25
    assert "MRV2 / fw int8 = 0.04×–0.05×" in md


def test_ratio_range():
    assert bench.ratio_range([0.5, None, 0.25]) == "0.25×–0.5×"
    assert bench.ratio_range([0.123, 0.1234]) == "0.123×"
    assert bench.ratio_range([None]) == "n/a"


def _bench_script():
    spec = importlib.util.spec_from_file_location("bench_script", REPO_ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_round_plans_fill_every_slot_and_use_every_clip():
    script = _bench_script()
    seconds = [2, 4, 5, 8, 20, 29]
    clips = [script.Clip(f"c{i}", REPO_ROOT / f"c{i}.wav", float(s), f"t{i}") for i, s in enumerate(seconds)]
    plans = {c: script.requests_for(c, clips) for c in (1, 4, 8)}
    assert [c.seconds for c in plans[1]] == [2, 5, 29]
    assert all(len(plan) >= c for c, plan in plans.items())  # every slot busy
    assert {c.name for plan in plans.values() for c in plan} == {c.name for c in clips}
    words = [len(t.split()) for t in script.clip_texts()]
    assert words == sorted(words) and words[0] <= 5 and words[-1] >= 60  # 130 wpm: ~2 s .. ~29 s


def _round(c: int, wall: float, audio: float, lat: float = 1.0) -> bench.Round:
    return bench.Round(c, wall, [bench.Sample(lat, audio_s=audio, text="x")])


def test_merge_rounds_reports_the_spread_over_rounds():
    merged = bench.merge_rounds([_round(1, 2.0, 10.0), _round(1, 5.0, 10.0)])
    assert merged["throughput_spread"] == pytest.approx([2.0, 5.0])  # 10/5 .. 10/2
    assert merged["throughput"] == pytest.approx(20.0 / 7.0)  # pooled, not the mean of the rounds


def test_headline_pairs_fw_with_the_same_phase_and_skips_what_was_not_measured():
    level = lambda tp, p50=1.0: {"throughput": tp, "p50_s": p50, "ok": 4, "wall_s": 4 / tp}  # noqa: E731
    results = {
        "audio": {"mrv2_native": {"levels": {"1": level(30.0, 0.2)}}, "v1": {"levels": {"1": level(20.0)}},
                  "mrv2_interpreter": {"levels": {"1": level(3.0)}}},
        # fw-int8 measured twice as fast during the native phase as its pooled figure would say
        "paired": {"mrv2_native": {"mrv2_native": {"1": level(30.0, 0.2)}, "fw-int8": {"1": level(15.0, 0.4)}}},
        "vision": {"mrv2_native": {"1img": {"1": {"ok": 10, "wall_s": 1.0}}},
                   "v1": {"1img": {"1": {"ok": 10, "wall_s": 2.0}}}},
        "systems": {"mrv2_native": {"ready_s": 42.04, "peak_rss_bytes": 3 * 2**30}},
    }
    head = bench.headline(results)
    assert head["mrv2_native/v1@c=1"] == pytest.approx(1.5)
    assert head["mrv2_native/mrv2_interpreter@c=1"] == pytest.approx(10.0)
    assert head["mrv2_native/fw_int8@c=1"] == pytest.approx(2.0)
    assert head["p50_mrv2_native/fw_int8@c=1"] == pytest.approx(0.5)
    assert head["vision_mrv2_native/v1@c=1"] == pytest.approx(2.0)
    assert head["engine_ready_cold_s"] == 42.0 and head["engine_peak_rss_gib"] == 3.0
    assert "mrv2_native/v1@c=8" not in head  # not measured: left out, not invented
    report = bench.render_markdown({"headline": head, "config": {"ours": "mrv2_native"}})
    assert "`mrv2_native/fw_int8@c=1` | 2×" in report


def test_startup_breakdown_from_a_vllm_log():
    import datetime as dt

    log = "\n".join([
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
    ])
    spawned = dt.datetime(2026, 12, 1, 11, 5, 33).timestamp()
    got = bench.startup_breakdown(log, spawned, ready_s=57.0, year=2026)
    assert got == {"imports, API server": 7.0, "config + tokenizer, API server": 7.0,
                   "EngineCore spawn + imports": 9.0, "device + worker init": 1.0, "model load": 1.0,
                   "warm-up + profile + KV cache": 28.0, "API ready": 4.0}
    assert sum(got.values()) == 57.0
    # A log cut short (engine still loading): the stages seen, the rest in "API ready".
    cut = "\n".join(log.splitlines()[:7])
    partial = bench.startup_breakdown(cut, spawned, ready_s=30.0, year=2026)
    assert list(partial) == ["imports, API server", "config + tokenizer, API server", "EngineCore spawn + imports",
                             "API ready"] and sum(partial.values()) == 30.0


def test_long_file_summary_gives_the_real_time_factor_and_wer():
    rnd = bench.Round(1, 6.0, [bench.Sample(6.0, 60.0, "the cat sat on the mat", None, "audio",
                                            "the cat sat on a mat")])
    got = bench.long_summary([rnd])
    assert got["rtf"] == pytest.approx(0.1) and got["throughput"] == pytest.approx(10.0)
    assert got["wer"] == pytest.approx(1 / 6)
    failed = bench.Round(1, 1.0, [bench.Sample(1.0, 60.0, None, "HTTP 500", "audio", "x")])
    assert bench.long_summary([failed])["rtf"] is None and bench.long_summary([failed])["wer"] is None
