"""mmcpu's vLLM plugin: MRV2's Triton kernels run natively in vLLM's CPU worker, media URLs and sizes go through
mmcpu's own connector, and multimodal encoder attention runs vLLM's own CPU attention kernels, without editing vLLM's
files.

Registered in pyproject.toml as the entry point ``mmcpu = "mmcpu.plugin:register"`` of the ``vllm.general_plugins``
group, which vLLM's ``load_general_plugins()`` calls once in every process it runs: the API server
(``EngineArgs``), each EngineCore (``vllm/v1/engine/core.py``) and each worker (``vllm/v1/worker/worker_base.py``),
before the worker class is imported.

:func:`register` waits for vLLM's media connector module, which the API server imports to render chats, and
registers :class:`mmcpu.media.connector.PolicyMediaConnector` in its ``MEDIA_CONNECTOR_REGISTRY`` as ``mmcpu``
(the launcher sets ``VLLM_MEDIA_CONNECTOR=mmcpu``; docs/security.md). It also waits for vLLM's CPU worker module to
be imported - only a process that builds a CPU worker imports it: the EngineCore with the uniproc executor, the
worker with ``mp``; never the API server. Then, whatever the runner, it adds one method to ``CPUWorker``,
:data:`mmcpu.whisper_align.WORKER_METHOD`: the cross-attention pass of Whisper's word timestamps, which the API server
calls with ``collective_rpc`` (mmcpu.stt). Whisper's feature extractor, wherever it is imported, computes its
log-mel frames only up to the clip's end (:mod:`mmcpu.features`: the same features, bit for bit). Once vLLM's
``vit_attn_wrappers`` module has been imported (in the EngineCore or worker that builds a multimodal model, which
runs it, and in the API server, which only imports it), the CPU kernel of its op
``torch.ops.vllm.torch_sdpa_wrapper`` - the encoder attention of Whisper, the CLIP/SigLIP towers and the Qwen2-VL
ViT - becomes :func:`mmcpu.attention.vllm_kernel` (``torch.library``), which picks per shape the first of vLLM's
``_C`` kernels that passes a self-check on this CPU (:mod:`mmcpu.attention`; other platforms, the zentorch platform
and a vLLM without that op are left as shipped, with one log line). With
``TRITON_INTERPRET=1`` (without it there is no interpreter to replace) it also wraps three methods of
``CPUWorker``:

- ``init_device``: when the worker builds MRV2 (``use_v2_model_runner``), first installs
  :mod:`mmcpu.kernels.dispatch` in the mode ``MMCPU_KERNELS`` asks for, with the launch-count file
  ``MMCPU_KERNEL_STATS`` (and refuses ``MMCPU_KERNELS=interpreter`` for a bfloat16 model, whose dtype only the
  worker knows for sure: ``--dtype auto`` resolves there);
- ``compile_or_warm_up_model``: then logs ``MRV2 kernel launches: N native, M interpreted (after warm-up)``;
- ``shutdown``: logs the same ``(at shutdown)``, when vLLM's teardown order lets it.

Hooking these methods leaves ``cpu_worker.py`` unpatched, so a release that changes that file needs no rebase.
A vLLM whose ``CPUWorker`` lacks one of these methods fails the worker's start with one line naming it, instead of
serving with every kernel interpreted.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from mmcpu import encoder_stash

# A child of vLLM's logger: the lines land in the engine log with vLLM's format and level.
logger = logging.getLogger("vllm.mmcpu.plugin")

WORKER_MODULE = "vllm.v1.worker.cpu_worker"
# Where vLLM's media connectors live: only a process that renders chats imports it (the API server).
CONNECTOR_MODULE = "vllm.multimodal.media.connector"
# transformers' Whisper feature extractor: the API server's multimodal processor and mmcpu.whisper_align use it.
WHISPER_FEATURES_MODULE = "transformers.models.whisper.feature_extraction_whisper"
# Registers vLLM's encoder attention op (torch.ops.vllm.torch_sdpa_wrapper) when imported.
ENCODER_ATTENTION_MODULE = "vllm.v1.attention.ops.vit_attn_wrappers"
HOOKED_METHODS = ("init_device", "compile_or_warm_up_model", "shutdown")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (see the module docstring)."""
    after_import(CONNECTOR_MODULE, add_media_connector)
    after_import(WORKER_MODULE, add_word_alignment)
    after_import(WHISPER_FEATURES_MODULE, trim_whisper_features)
    after_import(ENCODER_ATTENTION_MODULE, route_encoder_attention)
    after_import(WORKER_MODULE, encoder_stash.install)  # Whisper's encoder outputs kept for the word alignment
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    after_import(WORKER_MODULE, hook_cpu_worker)


def trim_whisper_features(module: ModuleType) -> None:
    """Whisper's log-mel features computed up to the clip's end, not over all 30 s (:mod:`mmcpu.features`)."""
    from mmcpu import features

    features.install(module)


def route_encoder_attention(module: ModuleType) -> None:
    """vLLM's encoder attention op runs :func:`mmcpu.attention.encoder_attention` on CPU (``attention.install``)."""
    from mmcpu import attention

    attention.install(module)


def add_media_connector(module: ModuleType) -> None:
    """Register :class:`mmcpu.media.connector.PolicyMediaConnector` in the module's ``MEDIA_CONNECTOR_REGISTRY``."""
    if not hasattr(module, "MEDIA_CONNECTOR_REGISTRY"):
        raise RuntimeError(
            f"mmcpu plugin: this vLLM's {CONNECTOR_MODULE} has no MEDIA_CONNECTOR_REGISTRY: the media "
            "URL policy and size limits cannot be installed (mmcpu/media)"
        )
    import mmcpu.media.connector  # noqa: F401 - registers itself


def add_word_alignment(module: ModuleType) -> None:
    """``CPUWorker.<WORKER_METHOD>``: Whisper's alignment-head cross-attention with the worker's loaded model."""
    from mmcpu import whisper_align

    cls = getattr(module, "CPUWorker", None)
    if cls is not None and not hasattr(cls, whisper_align.WORKER_METHOD):
        setattr(cls, whisper_align.WORKER_METHOD, whisper_align.worker_cross_attention)


def hook_cpu_worker(module: ModuleType) -> None:
    """Wrap ``CPUWorker``'s methods (idempotent)."""
    cls = getattr(module, "CPUWorker", None)
    missing = [f"{name}()" for name in HOOKED_METHODS if not callable(getattr(cls, name, None))]
    if cls is None or missing:
        what = "no CPUWorker class" if cls is None else f"CPUWorker without {', '.join(missing)}"
        raise RuntimeError(
            f"mmcpu plugin: this vLLM's {WORKER_MODULE} has {what}: MRV2's native kernels cannot "
            "be installed (mmcpu/plugin.py)"
        )
    if getattr(cls, "_mmcpu_hooked", False):
        return
    init_device, warm_up, shutdown = (getattr(cls, name) for name in HOOKED_METHODS)

    @functools.wraps(init_device)
    def _init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.use_v2_model_runner:
            import mmcpu.kernels

            mmcpu.kernels.install_from_settings(self.model_config.dtype)
        return init_device(self, *args, **kwargs)

    @functools.wraps(warm_up)
    def _compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = warm_up(self, *args, **kwargs)
        if self.use_v2_model_runner:
            log_launches("after warm-up")
        return result

    @functools.wraps(shutdown)
    def _shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "use_v2_model_runner", False):
            log_launches("at shutdown")
        return shutdown(self, *args, **kwargs)

    cls.init_device, cls.compile_or_warm_up_model, cls.shutdown = _init_device, _compile_or_warm_up_model, _shutdown
    cls._mmcpu_hooked = True


def log_launches(when: str) -> None:
    import mmcpu.kernels

    logger.info("MRV2 %s (%s)", mmcpu.kernels.summary(), when)


# ------------------------------------------------------------------------------------------------------
# Run a callback once a module has been imported (now, if it already is).


class _AfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` until ``name`` is imported: finds its spec with the other finders and lets
    its loader call ``callback(module)`` once the module's code has run. The loader object stays vLLM's own
    (tracebacks and ``inspect`` still read the source through it)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = next((s for f in sys.meta_path if (s := _find(f, fullname, path, target)) is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_callback(module: ModuleType) -> None:
            exec_module(module)
            self.callback(module)

        spec.loader.exec_module = exec_then_callback  # this spec's own loader instance
        return spec


def _find(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    find = getattr(finder, "find_spec", None)
    return find(fullname, path, target) if find is not None else None


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if not any(isinstance(f, _AfterImport) and f.name == name and f.callback is callback for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
