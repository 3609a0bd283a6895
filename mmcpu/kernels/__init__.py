"""CPU-native (torch) implementations of vLLM Model Runner V2's Triton kernels.

One module per vLLM source file it mirrors (``block_table.py`` <-> ``vllm/v1/worker/gpu/block_table.py``, ...).
:mod:`mmcpu.kernels.dispatch` routes every interpreted Triton launch to them. :mod:`mmcpu.plugin` (vLLM's
``vllm.general_plugins`` entry point) calls :func:`install_from_settings` in each CPU worker that builds MRV2
and logs :func:`summary` after warm-up and at shutdown (at shutdown only when vLLM's teardown order lets it);
the counts that cannot be lost are in the file ``MMCPU_KERNEL_STATS``, rewritten every second
(:class:`mmcpu.kernels.dispatch.StatsWriter`). :mod:`mmcpu.kernels.reachability` says which kernels a serving
request can reach; :mod:`mmcpu.kernels.check` (``python -m mmcpu.kernels check``, run by the image build and at
the engine's start) fails when one of them has no native version whose guard matches the installed vLLM.
"""

from __future__ import annotations

from mmcpu.kernels.dispatch import REGISTRY, STATS, install, interpret, native, uninstall

__all__ = ["REGISTRY", "STATS", "install", "install_from_settings", "interpret", "native", "summary", "uninstall"]


# Why MMCPU_KERNELS=interpreter refuses a bfloat16 engine (the sampler's logits are in the model's dtype).
INTERPRETER_BF16 = (
    "MMCPU_KERNELS=interpreter cannot serve a bfloat16 model: Triton's interpreter keeps bfloat16 as raw uint16 "
    "bits and has no bfloat16 constants, so MRV2's min_p / penalties / logit-bias kernels would fail or compute on "
    "bit patterns; run it with MMCPU_DTYPE=float32 (vLLM's --dtype auto picks bfloat16 on CPUs that have it), or "
    "use MMCPU_KERNELS=native"
)


def install_from_settings(model_dtype: object = None) -> bool:
    """Install the dispatcher in the mode ``MMCPU_KERNELS`` asks for (default ``native``), for an engine whose
    model computes in ``model_dtype`` (a torch dtype; None = not known). Raises for a combination that would
    fail at a request instead (:data:`INTERPRETER_BF16`)."""
    from mmcpu.config import Settings

    settings = Settings()
    if settings.kernels == "interpreter" and str(model_dtype) == "torch.bfloat16":
        raise RuntimeError(INTERPRETER_BF16)
    return install(settings.kernels, settings.kernel_stats)


def summary() -> str:
    """One line for the engine log: how many launches ran natively and how many in the interpreter."""
    return STATS.summary()
