"""The compilation evaluation's own parts (mmcpu_dev/bench/compile_eval.py, docs/bench/compile.md): how it splits
an EngineCore's py-spy samples, and the stand-in compiler that proves a warm compiled start needs no compiler."""

from __future__ import annotations

import os
import subprocess

from mmcpu import launch
from mmcpu_dev.bench.compile_eval import fake_compiler, stack_share

CORE = "run_engine_core (vllm/v1/engine/core.py:900);step (vllm/v1/engine/core.py:400)"
RUN = f"{CORE};execute_model (vllm/v1/worker/gpu/model_runner.py:700)"
RAW = "\n".join(
    [
        f"{RUN};forward (vllm/model_executor/models/whisper.py:650) 6",
        f"{RUN};__call__ (vllm/compilation/decorators.py:400);call (/tmp/inductor/ab/cabc.py:90) 2",
        f"{CORE};prepare_inputs (vllm/v1/worker/gpu/input_batch.py:50) 3",
        f"{RUN};_execute_mm_encoder (vllm/v1/worker/gpu/mm/encoder_runner.py:80);"
        "forward (vllm/model_executor/models/whisper.py:560) 4",
        "not a stack line",
    ]
)


def test_stack_share_splits_encoder_forward_and_host() -> None:
    share = stack_share(RAW)
    assert share == {"encoder": round(4 / 15, 3), "forward": round(8 / 15, 3), "host": 0.2, "samples": 15.0}


def test_stack_share_of_nothing() -> None:
    assert stack_share("") == {"encoder": 0.0, "forward": 0.0, "host": 0.0, "samples": 0.0}


def test_fake_compiler_fails_logs_and_passes_preflight(tmp_path, monkeypatch) -> None:
    bin_dir, log = fake_compiler(tmp_path)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    # The launcher's check finds "g++" on that PATH (so a compiled engine is let through to start) ...
    monkeypatch.setenv("PATH", path)
    assert launch.cxx_compiler({}) == str(bin_dir / "g++")
    # ... but any build inductor attempts with it fails, and is recorded.
    done = subprocess.run(["g++", "-O3", "k.cpp", "-o", "k.so"], capture_output=True, env={**os.environ, "PATH": path})
    assert done.returncode != 0
    assert log.read_text().split()[1:] == ["-O3", "k.cpp", "-o", "k.so"]
