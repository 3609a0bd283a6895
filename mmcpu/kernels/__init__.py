"""CPU-native (torch) implementations of vLLM Model Runner V2's Triton kernels.

One module per vLLM source file it mirrors (``block_table.py`` <-> ``vllm/v1/worker/gpu/block_table.py``, ...).
:mod:`mmcpu.kernels.dispatch` routes every interpreted Triton launch to them; patches/0008 calls
:func:`install_from_settings` in each CPU worker process and logs :func:`summary` after warm-up and at shutdown
(at shutdown only when vLLM's teardown order lets it); the counts that cannot be lost are in the file
``MMCPU_KERNEL_STATS``, rewritten every second (:class:`mmcpu.kernels.dispatch.StatsWriter`).
"""

from __future__ import annotations

from mmcpu.kernels.dispatch import REGISTRY, STATS, install, interpret, native, uninstall

__all__ = ["REGISTRY", "STATS", "install", "install_from_settings", "interpret", "native", "summary", "uninstall"]


def install_from_settings() -> bool:
    """Install the dispatcher in the mode ``MMCPU_KERNELS`` asks for (default ``native``)."""
    from mmcpu.config import Settings

    settings = Settings()
    return install(settings.kernels, settings.kernel_stats)


def summary() -> str:
    """One line for the engine log: how many launches ran natively and how many in the interpreter."""
    return STATS.summary()
