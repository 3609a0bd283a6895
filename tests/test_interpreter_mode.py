"""``MMCPU_KERNELS=interpreter`` serves every sampling option (float32 / float16 models) or refuses to start.

It used to die on OpenAI's default sampling (``libdevice.log1p`` is a stub in PyPI's triton; ``_topk_topp_kernel``
fails on ``tl.range`` ints); :mod:`mmcpu.kernels.interpreter` fills both gaps for every interpreted launch. One
real MRV2 engine in that mode (the tiny LLaVA in float32: a 744-token vocabulary keeps the interpreter fast) gets
each sampling option an OpenAI client can send, then must still serve, and must have launched nothing natively.
bfloat16 - what vLLM's ``--dtype auto`` picks on CPUs that have it - the interpreter cannot compute (it keeps
bf16 as raw uint16 bits: min_p died with ``no attribute 'get_bf16'``), so such an engine refuses to start.

The same model served with the native kernels (also float32) must answer seeded requests with the same tokens as
the interpreter: the native versions are proven bit-exact against vLLM's kernels in the interpreter
(tests/kernels), and this is that proof end to end, murmur3 Gumbel noise, top-k/top-p and penalties included.
"""

from __future__ import annotations

import pytest

from mmcpu.config import VISION_LIMIT_ARGS
from mmcpu_dev.payloads import image_chat_kwargs, test_image
from mmcpu_dev.servers import Engine, served_dtype

pytestmark = pytest.mark.slow

SAMPLING = {
    "defaults": {},  # OpenAI's: temperature 1, top_p 1
    "temperature-seed": {"temperature": 0.7, "seed": 11},
    "top_p": {"top_p": 0.9},
    "top_k-min_p": {"extra_body": {"top_k": 20, "min_p": 0.05}},
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 1.0, "extra_body": {"repetition_penalty": 1.3}},
    "logit_bias": {"logit_bias": {"5": -100, "7": 20}},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "prompt_logprobs": {"temperature": 0, "extra_body": {"prompt_logprobs": 2}},
    "n_2": {"n": 2, "seed": 7},
    "bad_words": {"extra_body": {"bad_words": ["the", "a"]}},
    "min_tokens": {"extra_body": {"min_tokens": 4}},
    "structured_choice": {"extra_body": {"structured_outputs": {"choice": ["cat", "dog", "bird"]}}},
}
# Each a sampling feature's kernel; none may have run natively.
FEATURE_KERNELS = {
    "_gumbel_sample_kernel",
    "_temperature_kernel",
    "_topk_topp_kernel",
    "_min_p_kernel",
    "_penalties_kernel",
    "_bias_kernel",
    "_bad_words_kernel",
    "_topk_log_softmax_kernel",
    "_apply_grammar_bitmask_kernel",
}


@pytest.fixture(scope="module")
def interpreter_engine(llava_model, patched_vllm, logs_dir):
    engine = Engine(
        model=llava_model,
        log_path=logs_dir / "tiny-llava-mrv2-interpreter.log",
        vllm_args=VISION_LIMIT_ARGS,
        env={"MMCPU_KERNELS": "interpreter", "MMCPU_DTYPE": "float32"},
    ).start()
    try:
        yield engine
    finally:
        engine.stop()


def test_bfloat16_is_refused_at_start(llava_model, patched_vllm, logs_dir):
    """Before the module's engine starts (one engine at a time): the worker refuses, the engine never serves."""
    from mmcpu.kernels import INTERPRETER_BF16

    engine = Engine(
        model=llava_model,
        log_path=logs_dir / "tiny-llava-mrv2-interpreter-bf16.log",
        vllm_args=VISION_LIMIT_ARGS,
        env={"MMCPU_KERNELS": "interpreter", "MMCPU_DTYPE": "bfloat16"},
    )
    with pytest.raises(RuntimeError, match="exited with"):
        engine.start(timeout_s=600)
    assert INTERPRETER_BF16 in engine.log()


def chat(engine: Engine, **sampling):
    kwargs = image_chat_kwargs([test_image(3)], model=engine.name, prompt="What is in the image?", max_tokens=6)
    del kwargs["temperature"]
    kwargs.update(sampling)
    return engine.client().chat.completions.create(**kwargs)


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_sampling_option_in_the_interpreter(interpreter_engine, sampling):
    result = chat(interpreter_engine, **sampling)
    assert all(c.finish_reason in ("stop", "length") for c in result.choices)
    assert len(result.choices) == sampling.get("n", 1) and result.usage.completion_tokens > 0
    if sampling.get("logprobs"):
        assert all(len(t.top_logprobs) == 3 for t in result.choices[0].logprobs.content)
    if "structured_outputs" in sampling.get("extra_body", {}):
        assert result.choices[0].message.content in ("cat", "dog", "bird")
    assert chat(interpreter_engine, temperature=0).choices[0].message.content.strip()  # still serving


def test_nothing_ran_natively(interpreter_engine):
    for sampling in SAMPLING.values():  # whatever ran before (or was deselected), every feature once more
        chat(interpreter_engine, **sampling)
    counts = interpreter_engine.kernel_counts()
    assert not counts.native, dict(counts.native)
    assert FEATURE_KERNELS <= set(counts.interpreted), FEATURE_KERNELS - set(counts.interpreted)
    assert "MMCPU_KERNELS=interpreter" in interpreter_engine.log()


# Seeded requests whose sampled tokens must not depend on the kernels' mode (each on a fresh seed).
SEEDED = {
    "defaults": {"seed": 101},
    "temperature": {"temperature": 0.7, "seed": 11},
    "top_p": {"top_p": 0.9, "seed": 12},
    "top_k-min_p": {"extra_body": {"top_k": 20, "min_p": 0.05}, "seed": 13},
    "penalties": {
        "presence_penalty": 1.5,
        "frequency_penalty": 1.0,
        "extra_body": {"repetition_penalty": 1.3},
        "seed": 14,
    },
    "logit_bias": {"logit_bias": {"5": -100, "7": 20}, "seed": 15},
    "n_2": {"n": 2, "seed": 7},
    "bad_words": {"extra_body": {"bad_words": ["the", "a"]}, "seed": 16},
    "structured_choice": {"extra_body": {"structured_outputs": {"choice": ["cat", "dog", "bird"]}}, "seed": 17},
}


def test_seeded_sampling_matches_the_native_kernels(interpreter_engine, llava_model, logs_dir, request):
    # The session's vision engine is native; where this CPU serves it in float32 it is the reference itself.
    shared = served_dtype(llava_model) == "float32"
    native = (
        request.getfixturevalue("llava_engine")
        if shared
        else Engine(
            model=llava_model,
            log_path=logs_dir / "tiny-llava-mrv2-native-f32.log",
            vllm_args=VISION_LIMIT_ARGS,
            env={"MMCPU_KERNELS": "native", "MMCPU_DTYPE": "float32"},
        ).start()
    )
    try:
        for name, sampling in SEEDED.items():
            want = [(c.message.content, c.finish_reason) for c in chat(interpreter_engine, **sampling).choices]
            got = [(c.message.content, c.finish_reason) for c in chat(native, **sampling).choices]
            assert got == want, name
        counts = native.kernel_counts()
    finally:
        if not shared:
            native.stop()
    assert counts.native["_gumbel_sample_kernel"] > 0 and not counts.interpreted, dict(counts.interpreted)
