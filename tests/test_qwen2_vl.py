"""The tiny Qwen2-VL fixture: its files offline, then a real vLLM server under MRV2 (and V1 for reference).

Qwen2-VL is the family with dynamic resolution (an image gives (h/28) x (w/28) tokens after the processor's
smart resize) and M-RoPE (3-D positions; MRV2 computes them with ``_prepare_rope_positions_kernel``, which no
LLaVA or Whisper request reaches). The slow tests start one MRV2 engine and one V1 engine for this module.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")  # the fixture needs the engine venv (.cache/venv)

from PIL import Image  # noqa: E402

from mmcpu.config import VISION_LIMIT_ARGS, get_settings  # noqa: E402
from mmcpu_dev import payloads  # noqa: E402  (not `import test_image`: pytest would collect it)
from mmcpu_dev.fixtures import qwen2_vl  # noqa: E402
from mmcpu_dev.servers import MRV2_LOG_LINE, Engine, test_engine  # noqa: E402
from mmcpu_dev.servers import TEST_MM_CACHE_GIB as MM_CACHE_GIB  # noqa: E402

slow = pytest.mark.slow

# (width, height) -> image tokens, worked out by hand from the processor's rule: round each side to a multiple
# of 28, scale up to >= 56x56 or down to <= 28x28x1280 pixels keeping the aspect ratio, one token per 28x28.
SIZES = {
    (56, 56): 4,  # 2x2: exactly min_pixels
    (224, 112): 32,  # 8 wide x 4 high
    (96, 320): 33,  # 3.4 -> 3 wide, 11.4 -> 11 high
    (28, 28): 4,  # below min_pixels: scaled up to 56x56
    (1400, 1400): 1225,  # above max_pixels (1003520): scaled down to 980x980, 35x35
}


def image(seed: int, width: int, height: int):
    return payloads.test_image(seed, max(width, height)).resize((width, height))


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# --- the fixture's files (no vLLM server) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return qwen2_vl.build(tmp_path_factory.mktemp("fixture") / "tiny-qwen2-vl")


@pytest.fixture(scope="module")
def processor(model_dir):
    return transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)


def test_build_is_idempotent_and_deterministic(model_dir, tmp_path):
    before = _digest(model_dir)
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert qwen2_vl.build(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime, "a complete folder must be skipped"
    assert _digest(qwen2_vl.build(tmp_path / "again")) == before
    assert not list(tmp_path.glob(".again.tmp-*")), "the temporary build folder must be renamed away"


def test_cli_reports_unwritable_output(capsys):
    assert qwen2_vl.main(["--out", "/proc/tiny-qwen2-vl"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot build tiny-qwen2-vl into /proc/tiny-qwen2-vl") and "\n" not in err


def test_config_has_the_real_shape(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert type(config).__name__ == "Qwen2VLConfig" and config.architectures == ["Qwen2VLForConditionalGeneration"]
    text, vision = config.text_config, config.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert text.rope_parameters["mrope_section"] == qwen2_vl.MROPE_SECTION
    assert sum(qwen2_vl.MROPE_SECTION) == head_dim // 2
    assert text.num_key_value_heads < text.num_attention_heads  # grouped-query attention, as the real models
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)
    assert (text.num_hidden_layers, vision.depth) == (2, 2)
    assert vision.hidden_size == text.hidden_size  # the merger projects into the text model's width
    # The hub file's shape: flat text fields and rope_scaling (transformers 5 reads it into text_config).
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["rope_scaling"] == {"type": "mrope", "mrope_section": qwen2_vl.MROPE_SECTION}
    assert "text_config" not in raw and raw["hidden_size"] == text.hidden_size


def test_tokenizer_has_qwen2_vl_special_tokens(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    for name, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert tok.convert_tokens_to_ids(token) == getattr(config, name), name
        assert tok.encode(token) == [getattr(config, name)]  # a special token, never split
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert len(tok) <= config.text_config.vocab_size
    assert len(tok.tokenize(" picture")) == 1
    for text in ["The picture shows a red square.", "Zebra 42 naïve — ünïcödé ✓"]:
        assert tok.decode(tok.encode(text)) == text  # byte-level: unseen text round-trips


def test_chat_template_is_qwen2_vl_instruct(processor):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "Describe the two images."},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{vision}{vision}Describe the two images.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == prompt


@pytest.mark.parametrize(("width", "height"), list(SIZES))
def test_processor_dynamic_resolution(processor, width, height):
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    inputs = processor(
        text="<|vision_start|><|image_pad|><|vision_end|>", images=[image(1, width, height)], return_tensors="pt"
    )
    tokens = inputs["input_ids"][0].tolist().count(qwen2_vl.IMAGE_PAD_ID)
    assert tokens == SIZES[(width, height)] == qwen2_vl.num_image_tokens(width, height)
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert (t, h * w // 4) == (1, tokens) and w / h == pytest.approx(width / height, rel=0.25)


def test_weights_load_and_images_change_the_answer(model_dir, processor):
    import torch

    model, info = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        model_dir, local_files_only=True, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def answer(img):
        inputs = processor(text=prompt, images=[img], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    first, second = answer(image(1, 56, 56)), answer(image(2, 56, 56))
    assert first != second, "different images must change the greedy answer"
    special = set(range(len(qwen2_vl.SPECIAL_TOKENS)))
    for ids in (first, second):
        assert len(ids) == 8 and not special & set(ids)
        assert processor.decode(ids).isprintable()


# --- a real vLLM server: MRV2 (patched, native kernels) and V1 -------------------------------------------

# The requests both runners answer: each image size alone, two different images (both orders), text only.
REQUESTS = {
    **{f"{w}x{h}": [(1, w, h)] for (w, h) in SIZES},
    "two-images": [(2, 224, 112), (3, 96, 320)],
    "two-images-swapped": [(3, 96, 320), (2, 224, 112)],
    # 2 x 1225 image tokens: more than the CPU server's 2048-token step budget, so the prefill is chunked and
    # the second chunk's M-RoPE positions start mid-prompt.
    "two-large-images": [(4, 1400, 1400), (5, 1400, 1400)],
    "text-only": [],
}
STEP_TOKENS = 2048  # vLLM's default max_num_batched_tokens for the OpenAI server on CPU
STEP_KERNEL = "_gather_block_tables_kernel"  # MRV2 launches it once per engine step
PROMPT = "Describe the image."


def _ask(engine: Engine, images: list[tuple[int, int, int]], **create_kwargs) -> tuple[int, str]:
    """One chat (images as (seed, width, height)); greedy unless ``create_kwargs`` say otherwise (``temperature``
    None: left out). Returns usage.prompt_tokens and the answer."""
    kwargs = payloads.image_chat_kwargs([image(*spec) for spec in images], model=engine.name, prompt=PROMPT)
    kwargs.update(create_kwargs)
    if kwargs["temperature"] is None:
        del kwargs["temperature"]
    result = engine.client().chat.completions.create(**kwargs)
    return result.usage.prompt_tokens, result.choices[0].message.content


def _answers(engine: Engine, count_steps: bool = False) -> tuple[dict[str, tuple[int, str]], dict[str, int]]:
    """Every request of REQUESTS once, in order: {name: (prompt tokens, answer)} and, with ``count_steps``
    (MRV2 only), {name: engine steps it took}, from the launch counts of a once-per-step kernel."""
    answers, steps = {}, {}
    before = engine.kernel_counts() if count_steps else None
    for name, images in REQUESTS.items():
        answers[name] = _ask(engine, images)
        if count_steps:
            after = engine.kernel_counts()
            steps[name] = after.native[STEP_KERNEL] - before.native[STEP_KERNEL]
            before = after
    return answers, steps


@pytest.fixture(scope="module")
def qwen_model() -> Path:
    return qwen2_vl.build(get_settings().models_dir / "tiny-qwen2-vl")


class _Starting:
    """An engine started in a thread, so that its start (import, load, profile: mostly one core) overlaps
    another's."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.error = engine, None
        self.thread = threading.Thread(target=self._run, name=f"start-{engine.log_path.stem}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.engine.start()
        except BaseException as exc:
            self.error = exc

    def ready(self) -> Engine:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.engine


@pytest.fixture(scope="module")
def v1_starting(qwen_model: Path, patched_vllm: Path, logs_dir: Path):
    """The V1 reference engine, starting in the background while the MRV2 one starts and answers."""
    engine = Engine(
        model=qwen_model, log_path=logs_dir / "tiny-qwen2-vl-v1.log", runner="v1", vllm_args=VISION_LIMIT_ARGS
    )
    starting = _Starting(engine)
    yield starting
    starting.thread.join()
    engine.stop()


@pytest.fixture(scope="module")
def qwen_engine(qwen_model: Path, patched_vllm: Path, logs_dir: Path, v1_starting: _Starting):
    from mmcpu_dev.servers import assert_native_then_stop

    engine = test_engine(
        qwen_model, logs_dir, "mrv2-patched", vllm_args=VISION_LIMIT_ARGS
    )  # the session's small mm cache
    engine.start()
    print(f"\n[qwen2-vl MRV2 ready in {engine.ready_s:.0f}s, RSS {engine.rss_bytes() / 2**30:.1f} GiB]")
    yield engine
    counts = assert_native_then_stop(engine)
    assert counts.native["_prepare_rope_positions_kernel"] > 0


@pytest.fixture(scope="module")
def mrv2_run(qwen_engine: Engine) -> tuple[dict[str, tuple[int, str]], dict[str, int]]:
    return _answers(qwen_engine, count_steps=True)


@pytest.fixture(scope="module")
def mrv2_answers(mrv2_run) -> dict[str, tuple[int, str]]:
    return mrv2_run[0]


@pytest.fixture(scope="module")
def v1_answers(v1_starting: _Starting) -> dict[str, tuple[int, str]]:
    engine = v1_starting.ready()
    print(f"\n[qwen2-vl V1 ready in {engine.ready_s:.0f}s, RSS {engine.rss_bytes() / 2**30:.1f} GiB]")
    answers, _ = _answers(engine)
    engine.stop()  # done with it: its memory back for the rest of the session
    return answers


@slow
def test_mrv2_in_use(qwen_engine):
    assert MRV2_LOG_LINE in qwen_engine.log()
    assert "Qwen2VLForConditionalGeneration" in qwen_engine.log()


@slow
def test_dynamic_resolution_sets_the_prompt_length(mrv2_answers):
    """usage.prompt_tokens = the text-only prompt + <|vision_start|> + the image's tokens + <|vision_end|>."""
    text_only = mrv2_answers["text-only"][0]
    got = {size: mrv2_answers[f"{size[0]}x{size[1]}"][0] - text_only - 2 for size in SIZES}
    print(f"\nimage tokens per size: {got}")
    assert got == SIZES


@slow
def test_two_different_images_in_one_request(mrv2_answers):
    text_only = mrv2_answers["text-only"][0]
    tokens, answer = mrv2_answers["two-images"]
    assert tokens == text_only + (2 + SIZES[(224, 112)]) + (2 + SIZES[(96, 320)])
    assert answer.strip() and answer.isprintable()
    # Both images and their order reach the model (M-RoPE positions follow each image's grid).
    assert mrv2_answers["two-images-swapped"][1] != answer
    assert mrv2_answers["224x112"][1] != answer


@slow
def test_prompt_longer_than_a_step_with_two_large_images(mrv2_run):
    """Two images at max_pixels: 2 x 1225 tokens, a prefill in two chunks (the second chunk's M-RoPE positions
    are read from the staged table at an offset): one engine step more than a prompt that fits in one."""
    answers, steps = mrv2_run
    print(f"\nengine steps per request: {steps}")
    tokens, answer = answers["two-large-images"]
    assert tokens == answers["text-only"][0] + 2 * (2 + SIZES[(1400, 1400)])
    assert tokens > STEP_TOKENS and answer.strip()
    assert len({steps[name] for name in REQUESTS if name != "two-large-images"}) == 1  # all fit in one step
    assert steps["two-large-images"] == steps["1400x1400"] + 1


@slow
def test_each_resolution_gets_its_own_answer(mrv2_answers):
    """The same picture at other sizes: other grids, other tokens and positions, other answers. (28x28 is left
    out: the processor scales it up to the 56x56 grid, so it is nearly the 56x56 input.)"""
    answers = [mrv2_answers[f"{w}x{h}"][1] for (w, h) in SIZES if (w, h) != (28, 28)]
    assert len(set(answers)) == len(answers), answers


@slow
def test_greedy_output_equals_v1(mrv2_answers, v1_answers):
    """Same requests at temperature 0: MRV2 with native kernels (M-RoPE positions included) answers exactly
    what the V1 runner answers, prompt length and text."""
    assert mrv2_answers == v1_answers


@slow
def test_requests_without_sampling_parameters(qwen_engine, mrv2_answers):
    """No temperature (what OpenAI clients send by default): vLLM takes the model's generation_config
    (temperature 0.01, top_k 1, top_p 0.001, as Qwen2-VL-Instruct's), so the answer is the greedy one."""
    assert _ask(qwen_engine, [(1, 224, 112)], temperature=None) == mrv2_answers["224x112"]
    # Real sampling (temperature 1, no top-k/top-p cut): seeded, so repeatable; another seed, another text.
    sampled = [
        _ask(qwen_engine, [(1, 224, 112)], temperature=1.0, top_p=1.0, seed=seed, extra_body={"top_k": -1})[1]
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    assert all(s.strip() for s in sampled)


@slow
def test_mrope_kernel_runs_natively(qwen_engine, mrv2_answers):
    counts = qwen_engine.kernel_counts()
    print(f"\nMRV2 launches: {dict(counts.native)}")
    assert counts.native["_prepare_rope_positions_kernel"] > 0
    assert not counts.interpreted, dict(counts.interpreted)


def assert_memory_plateaus(engine: Engine, send: Callable[[int], object], phase: int, bound_mib: float) -> None:
    """Warm up, send ``phase`` distinct inputs (``send(i)``, 4 at a time), then ``phase`` more: the second phase
    must leave the engine's memory within ``bound_mib`` of where the first left it, and the engine up."""

    def run(start: int) -> int:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, range(start, start + phase)))
        return engine.rss_bytes()

    list(map(send, range(-8, 0)))  # warm-up: buffers and allocator pools reach their working size
    first = run(0)
    second = run(phase)
    assert engine.alive()
    growth = (second - first) / 2**20
    print(f"\n[{engine.name}: RSS {first / 2**20:.0f} -> {second / 2**20:.0f} MiB after {phase} more distinct inputs]")
    assert growth < bound_mib, f"memory grew {growth:.0f} MiB over {phase} distinct inputs: the cache does not evict"


# A Qwen2-VL image in the processor cache: (h/14) x (w/14) patches of 2 x 3 x 14 x 14 = 1,176 values, uint8 (vLLM
# 0.32 normalises Qwen2-VL's pixels on the device). 448x448: 1,024 patches, 1.2 MB, so the session's 0.03 GiB
# cache (32.2 MB) holds 26; 1400x1400 is scaled to 980x980: 4,900 patches, 5.8 MB, 5 of them.
CACHE_ITEM_448 = 1024 * 1176


@slow
def test_the_sized_cache_hits_repeats_and_evicts_the_least_recent(qwen_engine):
    """vLLM's own cache counters (vllm:mm_cache_queries, vllm:mm_cache_hits) on the session's 0.03 GiB cache. An
    image sent again hits. After 16 distinct 448x448 images (19 MB, within the cache) it still hits; after 32 more
    (38.5 MB, beyond it) it misses, evicted as the least recently used; sent once more it hits again. Under vLLM's
    default 4 GiB the fourth lookup would hit too."""
    client = qwen_engine.client()
    capacity = int(MM_CACHE_GIB * 2**30)
    assert 16 * CACHE_ITEM_448 < capacity < 32 * CACHE_ITEM_448

    def chat(image: Image.Image) -> None:
        client.chat.completions.create(**payloads.image_chat_kwargs([image], model=qwen_engine.name, max_tokens=1))

    def lookups(image: Image.Image) -> tuple[float, float]:
        """(lookups, hits) that one request with ``image`` added to the counters."""
        names = "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total"
        before = qwen_engine.samples(*names)
        chat(image)
        after = qwen_engine.samples(*names)
        queries, hits = (after[n] - before[n] for n in names)
        return queries, hits

    probe = payloads.test_image(1000, size=448)
    seen = [lookups(probe), lookups(probe)]
    for distinct in (range(1001, 1017), range(1017, 1049)):
        for seed in distinct:
            chat(payloads.test_image(seed, size=448))
        seen.append(lookups(probe))
    seen.append(lookups(probe))
    print(f"\n[(lookups, hits) of each request with the probe image: {seen}]")
    assert all(queries == 1 for queries, _ in seen), seen
    assert [hits for _, hits in seen] == [0, 1, 1, 0, 1], seen


@slow
def test_distinct_real_sized_images_far_beyond_the_cache_plateau(qwen_engine):
    """2 x 24 distinct 1400x1400 images (5.8 MB cache items, 5 fit in the session's cache) would add 138 MB to the
    EngineCore without eviction; with it the second 24 leave memory where the first left it. Measured on an Intel
    Xeon (AMX): -22 MiB with the session's cache; the same run with MMCPU_MM_CACHE_GIB=4 (vLLM's default) grew
    111 MiB and fails the bound."""
    client = qwen_engine.client()

    def chat(i: int) -> str:
        image = payloads.test_image(2000 + i, size=1400)  # distinct per i: its own hash
        kwargs = payloads.image_chat_kwargs([image], model=qwen_engine.name, max_tokens=1)
        return client.chat.completions.create(**kwargs).choices[0].message.content

    assert_memory_plateaus(qwen_engine, chat, phase=24, bound_mib=40)
