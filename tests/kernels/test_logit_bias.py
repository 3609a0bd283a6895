"""``_bias_kernel`` (allowed_token_ids, logit_bias, min_tokens): native vs interpreter, bit-exact.

Logit-bias token ids are unique per request, as vLLM builds them from a dict; with duplicates the kernel's
result would depend on store order (undefined on a GPU). bfloat16 logits: the interpreter runs them but
rounds fp32 -> bf16 by truncation (``_convert_float`` with no rounding mode), while compiled Triton - and
torch - round to nearest even. The kernel copies kept values unchanged and rounds a biased value once on
store, so its bf16 result is the interpreter's fp32 result on the upcast input, rounded to nearest: that is the
reference used, exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from diff import Launch, assert_same, bf16_matches_fp32_reference, differential, native_launches, run_native
from vllm.triton_utils import triton
from vllm.v1.worker.gpu.sample import logit_bias as vmod

from mmcpu.config import REPO_ROOT

SHAPES = [(1, 100), (4, 1000), (6, 5003)]  # (requests, vocab)
K_ALLOWED, K_BIAS, K_STOP = vmod.MAX_NUM_ALLOWED_TOKEN_IDS, vmod.MAX_NUM_LOGIT_BIAS_TOKENS, vmod.MAX_NUM_STOP_TOKEN_IDS


def make_case(num_reqs: int, vocab: int, dtype: torch.dtype, *, logits_block: int = 8192, check_masked: bool = False):
    """``check_masked``: CHECK_ALL_MASKED_ROWS, with rows that min_tokens' stop masking leaves all -inf (the
    rest of the row already -inf, as a grammar bitmask leaves it), some with NaNs, some with a NaN chunk."""

    def make(seed: int) -> Launch:
        g = torch.Generator().manual_seed(seed)
        max_reqs = num_reqs + 3
        req_ids = torch.randperm(max_reqs, generator=g)[:num_reqs]
        # Some requests have draft tokens: their id repeats in the expanded mapping.
        mapping = req_ids.repeat_interleave(torch.randint(1, 3, (num_reqs,), generator=g)).to(torch.int32)
        num_tokens = mapping.numel()
        logits = (torch.randn(num_tokens + 1, vocab + 3, generator=g) * 3).to(dtype)
        on = lambda p: torch.rand(max_reqs, generator=g) < p  # noqa: E731
        upto = lambda k: torch.randint(1, k + 1, (max_reqs,), generator=g, dtype=torch.int32)  # noqa: E731

        num_allowed = torch.where(on(0.4), upto(min(K_ALLOWED, vocab)), 0).to(torch.int32)
        allowed = torch.randint(0, vocab, (max_reqs, K_ALLOWED), generator=g, dtype=torch.int32)
        num_bias = torch.where(on(0.6), upto(min(K_BIAS, vocab)), 0).to(torch.int32)
        bias_ids = torch.stack([torch.randperm(vocab, generator=g)[:K_BIAS] for _ in range(max_reqs)])
        bias_ids = torch.nn.functional.pad(bias_ids, (0, K_BIAS - bias_ids.shape[1])).to(torch.int32)
        bias = torch.randn(max_reqs, K_BIAS, generator=g) * 5
        num_stop = torch.where(on(0.6), upto(K_STOP), 0).to(torch.int32)
        stop = torch.randint(0, vocab, (max_reqs, K_STOP), generator=g, dtype=torch.int32)
        pos = torch.randint(0, 50, (num_tokens,), generator=g)  # int64, as input_batch.positions
        min_lens = torch.randint(0, 50, (max_reqs,), generator=g, dtype=torch.int32)
        restore = on(0.7 if check_masked else 0.3).to(torch.int32)
        if check_masked:
            num_allowed.zero_()  # stop ids and their masking alone decide
            for t in range(num_tokens):
                r = int(mapping[t])
                if torch.rand((), generator=g) < 0.7:
                    row = logits[t]
                    row[:vocab] = float("-inf")
                    ids = stop[r, : int(num_stop[r])].long()
                    vals = torch.randn(ids.numel(), generator=g)
                    vals[torch.rand(ids.numel(), generator=g) < 0.2] = float("inf")
                    row[ids] = vals.to(dtype)
                    pick = float(torch.rand((), generator=g))
                    if pick < 0.2:  # a NaN beside -inf: the chunk max skips it
                        row[int(torch.randint(0, vocab, (), generator=g))] = float("nan")
                    elif pick < 0.3:  # a whole chunk of NaN: the fold propagates it
                        row[: min(vocab, logits_block)] = float("nan")
                    elif pick < 0.4:  # a finite logit elsewhere: not all masked
                        row[int(torch.randint(0, vocab, (), generator=g))] = 1.0
            num_bias.zero_()

        args = (
            logits,
            logits.stride(0),
            vocab,
            mapping,
            num_allowed,
            allowed,
            allowed.stride(0),
            num_bias,
            bias_ids,
            bias_ids.stride(0),
            bias,
            bias.stride(0),
            pos,
            min_lens,
            num_stop,
            restore,
            stop,
            stop.stride(0),
        )
        watch = {
            "logits": logits,
            "mapping": mapping,
            "num_allowed": num_allowed,
            "allowed": allowed,
            "num_bias": num_bias,
            "bias_ids": bias_ids,
            "bias": bias,
            "pos": pos,
            "min_lens": min_lens,
            "num_stop": num_stop,
            "restore": restore,
            "stop": stop,
        }
        block = triton.next_power_of_2(max(K_ALLOWED, K_BIAS, K_STOP))  # as the launcher
        return Launch(
            grid=(num_tokens,),
            args=args,
            kwargs={"BLOCK_SIZE": block, "LOGITS_BLOCK_SIZE": logits_block, "CHECK_ALL_MASKED_ROWS": check_masked},
            watch=watch,
        )

    return make


@pytest.mark.parametrize("num_reqs,vocab", SHAPES)
def test_bias_fp32(num_reqs, vocab):
    assert differential(vmod._bias_kernel, make_case(num_reqs, vocab, torch.float32), range(6)) == 6


def test_bias_fp32_small_logits_block():
    make = make_case(3, 5003, torch.float32, logits_block=1024)
    assert differential(vmod._bias_kernel, make, range(3)) == 3


def test_bias_fp16():
    """float16 logits run in the interpreter directly (numpy float16 rounds to nearest, like compiled Triton)."""
    assert differential(vmod._bias_kernel, make_case(4, 1000, torch.float16), range(3)) == 3


@pytest.mark.parametrize("logits_block", [8192, 64])
@pytest.mark.parametrize("num_reqs,vocab", SHAPES)
def test_bias_restores_stop_tokens_of_all_masked_rows(num_reqs, vocab, logits_block):
    make = make_case(num_reqs, vocab, torch.float32, logits_block=logits_block, check_masked=True)
    assert differential(vmod._bias_kernel, make, range(6)) == 6


def test_bias_all_masked_cases_restore_some_rows():
    """The cases are not vacuous: against the same launch without CHECK_ALL_MASKED_ROWS, some stop logits come
    back, and some that were finite stay -inf (rows not all masked, or not flagged)."""
    restored = kept_masked = 0
    for seed in range(6):
        make = make_case(6, 1000, torch.float32, logits_block=64, check_masked=True)
        on, off = make(seed), make(seed)
        before = on.watch["logits"].clone()
        off.kwargs["CHECK_ALL_MASKED_ROWS"] = False
        run_native(vmod._bias_kernel, on)
        run_native(vmod._bias_kernel, off)
        restored += int((on.watch["logits"].isfinite() & (off.watch["logits"] == float("-inf"))).sum())
        kept_masked += int((before.isfinite() & (on.watch["logits"] == float("-inf"))).sum())
    assert restored > 0 and kept_masked > 0


@pytest.mark.parametrize("num_reqs,vocab", SHAPES[1:])
def test_bias_bf16_matches_fp32_reference(num_reqs, vocab):
    bf16_matches_fp32_reference(vmod._bias_kernel, make_case(num_reqs, vocab, torch.bfloat16), range(3))


def test_dispatch_routes_launcher_to_native():
    """vLLM's ``apply_logit_bias`` reaches the native code and matches the interpreter."""
    ref, got = make_case(4, 1000, torch.float32)(11), make_case(4, 1000, torch.float32)(11)

    def call(c: Launch) -> None:
        logits, _, vocab, m, na, a, _, nb, bi, _, b, _, pos, ml, ns, rs, s, _ = c.args
        vmod.apply_logit_bias(
            logits[: m.numel(), :vocab], m, pos, na, a, nb, bi, b, ml, ns, rs, s, check_all_masked_rows=True
        )

    call(ref)
    with native_launches() as launched:
        call(got)
    assert launched["_bias_kernel"] == 1
    assert_same(ref.watch, got.watch, what="apply_logit_bias via launcher")


# A child process: the CPU worker's torch patches (vllm/v1/worker/cpu/shm.py) are process-wide.
_SAMPLER_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    from types import SimpleNamespace
    import numpy as np, torch
    import vllm.v1.worker.cpu.shm  # noqa: F401  as the CPU worker does
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState
    from mmcpu.kernels import dispatch

    V, cpu = 1000, torch.device("cpu")

    def step(mode):
        if mode:
            dispatch.install(mode)
        try:
            states = RequestState(8, 64, 64, 0, V, cpu)
            # The sampler's states read only the reasoning config from vLLM's config.
            sampler = Sampler(SimpleNamespace(reasoning_config=None), 8, V, cpu, states)
            params = [
                SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
                SamplingParams(temperature=0, logit_bias={5: 3.0, 7: -2.0}, allowed_token_ids=[5, 7, 9, 11, 100]),
                SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[3, 4]),
                SamplingParams(temperature=0),
            ]
            params[2]._all_stop_token_ids = {3, 4}  # what the engine's tokenizer step would fill in
            params[3]._bad_words_token_ids = [[1, 2], [9]]
            g = torch.Generator().manual_seed(0)
            for i, sp in enumerate(params):
                prompt = torch.randint(0, V, (10,), generator=g).tolist()
                states.add_request(f"r{i}", len(prompt), prompt, 0, 16)
                sampler.add_request(states.req_id_to_index[f"r{i}"], sp)
            states.apply_staged_writes()
            sampler.apply_staged_writes()
            idx = np.array([states.req_id_to_index[f"r{i}"] for i in range(4)], dtype=np.int32)
            logits = torch.randn(4, V, generator=g)
            idx_t = torch.from_numpy(idx)
            return sampler.apply_sampling_params(logits, idx_t, idx_t, idx, torch.full((4,), 10),
                                                 torch.tensor([2, 0, 0, 1], dtype=torch.int32),
                                                 torch.zeros(4, dtype=torch.int32), np.full(4, 11, np.int32))
        finally:
            if mode:
                dispatch.uninstall()

    ref, got = step(None), step("native")
    print(json.dumps({"native": dict(dispatch.STATS.native), "equal": bool(torch.equal(ref, got)),
                      "inf_per_row": torch.isinf(got).sum(1).tolist()}))
""")


def test_sampler_step_on_cpu_worker():
    """vLLM's own Sampler on CPU (with the CPU worker's torch patches), one step with penalties, logit_bias +
    allowed_token_ids, min_tokens and bad_words: the states build on CPU, every feature kernel runs natively and the
    processed logits equal the interpreter's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _SAMPLER_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("_bincount_kernel", "_penalties_kernel", "_bias_kernel", "_bad_words_kernel"):
        assert out["native"].get(name) == 1, out
    assert out["equal"], out
    # allowed ids keep 5 of 1000; two stop tokens while below min_tokens; the one-token bad word [9].
    assert out["inf_per_row"][1:] == [995, 2, 1], out
