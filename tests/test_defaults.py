"""Per-CPU defaults (mmcpu.defaults, mmcpu/cpu_defaults.json): the table's rows follow their own measurements, the
launcher loads what the row (or MMCPU_DTYPE / MMCPU_QUANTIZATION) says, and says so in its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmcpu import cpu, defaults, launch
from mmcpu.config import Settings, get_settings
from mmcpu.defaults import Candidate, Choice, Refused, Row, Table
from mmcpu_dev.bench import rule
from mmcpu_dev.fixtures import config_only

F32, BF16 = Choice(dtype="float32"), Choice(dtype="bfloat16")
F32_INT8, BF16_INT8 = Choice(dtype="float32", quantization="int8"), Choice(dtype="bfloat16", quantization="int8")


def test_every_isa_class_has_a_row_and_bf16_only_where_the_hardware_has_it():
    rows = defaults.table().rows
    assert set(rows) == set(defaults.ISAS)
    for isa in ("avx512", "avx2", "baseline"):  # bf16 is emulated there (whisper-base 4.3x slower on the AVX2 EPYC)
        for role in ("audio", "vision"):
            assert getattr(rows[isa], role).dtype == "float32", (isa, role)
    flags = [
        (),
        ("avx2", "fma"),
        ("avx2", "avx512f"),
        ("avx2", "avx512f", "avx512_bf16"),
        ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"),
    ]
    assert {cpu.CpuInfo("m", "v", "1", 2, f).isa for f in flags} == set(rows)  # every class a CPU can fall in


def test_measured_rows_hold_what_their_own_measurements_pick():
    """A row written by `bench defaults` carries every candidate's figures; editing its choice by hand, or a rule
    change without a new measurement, fails here. An unmeasured row has no figures and says so."""
    for isa, row in defaults.table().rows.items():
        if row.measured_on is None:
            assert not row.candidates and row.evidence.startswith("Not measured"), isa
            continue
        assert row.date and set(row.candidates) == {"audio", "vision"}, isa
        audio = row.candidates["audio"]
        assert F32 in [c.choice for c in audio], f"{isa}: the float32 reference was not measured"
        assert all(c.wer is not None for c in audio if c.error is None), isa
        assert next(c for c in audio if c.choice == F32).error is None, f"{isa}: the float32 reference failed"
        if isa not in defaults.BF16_ISAS:
            assert all("bf" not in c.choice.dtype and c.choice.dtype != "auto" for c in audio), isa
        for role in ("audio", "vision"):
            assert rule.pick(role, row.candidates[role]) == getattr(row, role), (isa, role)


def cand(choice: Choice, c1: float, c8: float, wer: float | None = None) -> Candidate:
    return Candidate(choice=choice, throughput={1: c1, 8: c8}, wer=wer)


def test_pick_trades_at_most_the_wer_slack_for_speed():
    ref = cand(F32, 15, 20, wer=0.107)
    assert rule.pick("audio", [ref, cand(F32_INT8, 18, 24, wer=0.107 + 0.019)]) == F32_INT8
    assert rule.pick("audio", [ref, cand(F32_INT8, 18, 24, wer=0.107 + 0.021)]) == F32  # faster, too wrong
    # the geometric mean: one fast level does not hide a slow one (3*30 < 15*20... per level: 0.2x and 1.5x)
    assert rule.pick("audio", [ref, cand(BF16, 3, 30, wer=0.1)]) == F32
    assert rule.pick("vision", [cand(F32, 10, 12), cand(Choice(dtype="auto"), 11, 13)]) == Choice(dtype="auto")
    # within 5 % the lighter candidate wins (half the weights and KV cache), beyond it the faster
    assert rule.pick("vision", [cand(F32, 20, 63), cand(BF16, 21, 55.5)]) == BF16
    assert rule.pick("vision", [cand(F32, 20, 63), cand(BF16, 18, 50)]) == F32
    assert rule.pick("audio", [ref, cand(BF16, 33.8, 47.4, 0.107), cand(BF16_INT8, 32.8, 51.1, 0.107)]) == BF16_INT8
    # a candidate that failed (its engine died) is never picked, however fast its rounds before it died
    died = Candidate(choice=BF16, throughput={1: 99, 8: 99}, error="Fatal Python error: Illegal instruction")
    assert rule.pick("vision", [cand(F32, 20, 63), died]) == F32
    assert rule.pick("audio", [ref, died]) == F32
    with pytest.raises(StopIteration):  # no float32 reference: nothing to hold the WER against
        rule.pick("audio", [cand(BF16, 3, 30, wer=0.1)])


# --- what the launcher loads -------------------------------------------------------------------------------------
def checkpoint(path: Path, *, whisper: bool = True, quantized: bool = False) -> str:
    return str(config_only(path, whisper=whisper, quantized=quantized))


@pytest.fixture
def table(monkeypatch):
    """Every ISA class's row set to one choice: what the launcher does with a row, whichever CPU runs the test."""

    def use(audio: Choice, vision: Choice = F32) -> None:
        row = Row(audio=audio, vision=vision, evidence="Not measured: test")
        monkeypatch.setattr(defaults, "table", lambda: Table(rule="test", rows={i: row for i in defaults.ISAS}))

    return use


def test_int8_row_loads_the_int8_checkpoint_beside_the_model_under_the_models_name(tmp_path, table):
    model = checkpoint(tmp_path / "whisper-x")
    int8 = checkpoint(tmp_path / "whisper-x-int8", quantized=True)
    table(BF16_INT8)
    got = defaults.resolve("audio", model, dtype=None, quantization="auto", speech=True)
    assert (got.model, got.dtype, got.quantization) == (int8, "bfloat16", "int8")
    assert "per-CPU default for isa" in got.why
    [(_, argv, _)] = launch.role_commands("audio", Settings(audio_model=model), cpus=launch.Cpus((0, 1)))
    assert argv[argv.index("--model") + 1] == int8
    assert argv[argv.index("--served-model-name") + 1] == "whisper-x"  # clients keep the name they know
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    # mmcpu-serve serves the checkpoint it is given unless int8 is asked for
    assert (
        defaults.resolve(
            "audio", model, dtype=None, quantization="auto", speech=True, apply_table_quantization=False
        ).model
        == model
    )
    # settings override the row
    got = defaults.resolve("audio", model, dtype="float32", quantization="none", speech=True)
    assert (got.model, got.dtype, got.quantization) == (model, "float32", "none")
    assert "MMCPU_DTYPE" in got.why and "MMCPU_QUANTIZATION" in got.why


def test_interpreter_mode_turns_a_bf16_default_into_float32_but_keeps_an_explicit_dtype(tmp_path, table):
    """Triton's interpreter cannot compute in bfloat16 (the proof line serves that way): the launcher takes
    float32 instead of refusing to start, and says why; an explicit MMCPU_DTYPE is still the user's."""
    model = checkpoint(tmp_path / "whisper-z")
    table(BF16)
    got = defaults.resolve("audio", model, dtype=None, quantization="auto", speech=True, interpreter=True)
    assert got.dtype == "float32" and "MMCPU_KERNELS=interpreter" in got.why and "bfloat16" in got.why
    assert defaults.resolve("audio", model, dtype=None, quantization="auto", speech=True).dtype == "bfloat16"
    got = defaults.resolve("audio", model, dtype="bfloat16", quantization="auto", speech=True, interpreter=True)
    assert got.dtype == "bfloat16" and "MMCPU_DTYPE" in got.why
    [(_, argv, _)] = launch.role_commands(
        "audio", Settings(audio_model=model, kernels="interpreter"), cpus=launch.Cpus((0, 1))
    )
    assert argv[argv.index("--dtype") + 1] == "float32"


def test_int8_default_without_an_int8_checkpoint_serves_float_and_says_why(tmp_path, table):
    model = checkpoint(tmp_path / "whisper-y")
    table(F32_INT8)
    got = defaults.resolve("audio", model, dtype=None, quantization="auto", speech=True)
    assert (got.model, got.quantization) == (model, "none") and "no whisper-y-int8" in got.why
    table(F32)
    vision = checkpoint(tmp_path / "llava", whisper=False)
    assert defaults.resolve("vision", vision, dtype=None, quantization="auto", speech=False).quantization == "none"


@pytest.mark.parametrize(
    "case, needle",
    [
        ("int8-missing", "no int8 checkpoint beside"),
        ("int8-vision", "applies to Whisper checkpoints only"),
        ("none-quantized", "is itself a quantised checkpoint"),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused_in_one_line(tmp_path, table, case, needle):
    table(F32)
    whisper, llava = checkpoint(tmp_path / "w"), checkpoint(tmp_path / "l", whisper=False)
    quantized = checkpoint(tmp_path / "q", quantized=True)
    role, model, speech, q = {
        "int8-missing": ("audio", whisper, True, "int8"),
        "int8-vision": ("vision", llava, False, "int8"),
        "none-quantized": ("audio", quantized, True, "none"),
    }[case]
    with pytest.raises(Refused, match=needle) as err:
        defaults.resolve(role, model, dtype=None, quantization=q, speech=speech)
    assert "\n" not in str(err.value)


def test_launcher_logs_the_choice_and_refuses_with_exit_2(monkeypatch, capsys, tmp_path, table):
    started = []
    monkeypatch.setattr(launch, "run", lambda *a, **k: started.append(a[0]) or 0)
    monkeypatch.setattr(launch, "ROLE_FILE", tmp_path / "role")
    monkeypatch.setattr(launch, "preflight", lambda settings, **_: None)
    model = checkpoint(tmp_path / "whisper-z")
    checkpoint(tmp_path / "whisper-z-int8", quantized=True)
    table(F32_INT8)
    monkeypatch.setenv("MMCPU_AUDIO_MODEL", model)
    get_settings.cache_clear()
    try:
        assert launch.entrypoint(["audio"]) == 0
        err = capsys.readouterr().err
        assert (
            f"[mmcpu] audio: dtype float32, quantization int8 ({model}-int8): dtype and quantization: per-CPU "
            "default for isa" in err
        )
        assert f"[mmcpu] audio: CPU {cpu.current().line()}" in err  # the ISA the choice was made for
        assert launch.main(["--model", model]) == 0  # mmcpu-serve: the model as given
        assert f"[mmcpu] engine: dtype float32, quantization none ({model})" in capsys.readouterr().err
        monkeypatch.setenv("MMCPU_QUANTIZATION", "int8")
        monkeypatch.setenv("MMCPU_AUDIO_MODEL", str(tmp_path / "whisper-z-int8"))
        get_settings.cache_clear()
        assert launch.main(["--model", str(tmp_path / "none")]) == 2
        assert "refusing to start: MMCPU_QUANTIZATION=int8 applies to Whisper" in capsys.readouterr().err
        assert len(started) == 2
    finally:
        get_settings.cache_clear()
