"""The tiny LLaVA fixture: files round-trip through transformers offline, and the images reach the model.

The real vLLM server path (two different images in one chat request) is exercised by the slow engine tests;
these tests check the pieces vLLM relies on without starting it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")  # the fixture needs the engine venv (.cache/venv)

from mmcpu_dev import payloads  # noqa: E402  (not `import test_image`: pytest would collect it)
from mmcpu_dev.fixtures import tiny_llava  # noqa: E402

IMAGE_TOKENS = (tiny_llava.IMAGE_SIZE // tiny_llava.PATCH_SIZE) ** 2  # CLS dropped by the "default" strategy


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llava.build(tmp_path_factory.mktemp("fixture") / "tiny-llava")


@pytest.fixture(scope="module")
def processor(model_dir):
    return transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True)


def _messages(image_part: dict, n_images: int = 2, text: str = "Describe the two images.") -> list[dict]:
    return [{"role": "user", "content": [image_part] * n_images + [{"type": "text", "text": text}]}]


def test_build_is_idempotent_and_deterministic(model_dir, tmp_path):
    before = _digest(model_dir)
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_llava.build(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime, "a complete folder must be skipped"

    other = tiny_llava.build(tmp_path / "again")
    assert _digest(other) == before
    assert not list(tmp_path.glob(".again.tmp-*")), "the temporary build folder must be renamed away"


def test_incomplete_folder_is_rebuilt(model_dir, tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a half-written earlier build: no marker
    tiny_llava.build(target)
    assert _digest(target) == _digest(model_dir)


def test_cli_reports_unwritable_output(capsys):
    assert tiny_llava.main(["--out", "/proc/tiny-llava"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot build tiny-llava into /proc/tiny-llava") and "\n" not in err


def test_config_and_tokenizer_agree(model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert config.architectures == ["LlavaForConditionalGeneration"]
    assert len(tok) == config.text_config.vocab_size
    assert tok.convert_tokens_to_ids("<image>") == config.image_token_index
    assert tok.encode("<image>", add_special_tokens=False) == [config.image_token_index]
    text_cfg = config.text_config
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        text_cfg.bos_token_id,
        text_cfg.eos_token_id,
        text_cfg.pad_token_id,
    )
    # A real BPE: common corpus words are single tokens, unseen text still round-trips byte for byte.
    assert len(tok.tokenize(" picture")) == 1
    for text in ["The picture shows a red square.", "Zebra 42 naïve — ünïcödé ✓"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("image_part", [{"type": "image"}, {"type": "image_url", "image_url": {"url": "x"}}])
def test_chat_template_renders_images_then_text(processor, image_part):
    prompt = processor.apply_chat_template(_messages(image_part), add_generation_prompt=True, tokenize=False)
    assert prompt == "<s>USER: <image>\n<image>\nDescribe the two images.\nASSISTANT:"
    tok_prompt = processor.tokenizer.apply_chat_template(
        _messages(image_part), add_generation_prompt=True, tokenize=False
    )
    assert tok_prompt == prompt  # vLLM may take the template from either


def test_chat_template_multi_turn(processor):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert prompt == "<s>SYSTEM: Be brief.\nUSER: Hi\nASSISTANT: Hello</s>\nUSER: Again\n"


def test_processor_expands_each_image_token(processor, model_dir):
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert type(processor).__name__ == "LlavaProcessor"
    prompt = processor.apply_chat_template(_messages({"type": "image"}), add_generation_prompt=True, tokenize=False)
    images = [payloads.test_image(1), payloads.test_image(2, size=200)]  # any size is resized to 64x64
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(config.image_token_index) == 2 * IMAGE_TOKENS == 2 * config.image_seq_length
    assert tuple(inputs["pixel_values"].shape) == (2, 3, tiny_llava.IMAGE_SIZE, tiny_llava.IMAGE_SIZE)


def test_checkpoint_uses_vllm_layout(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    prefixes = (
        "language_model.model.",
        "language_model.lm_head.",
        "vision_tower.vision_model.",
        "multi_modal_projector.",
    )
    assert all(k.startswith(prefixes) for k in keys), sorted(k for k in keys if not k.startswith(prefixes))
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in keys
    assert "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight" in keys


def test_weights_load_and_images_change_the_answer(model_dir, processor):
    import torch

    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, local_files_only=True, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]

    prompt = processor.apply_chat_template(_messages({"type": "image"}), add_generation_prompt=True, tokenize=False)

    def answer(seeds):
        inputs = processor(text=prompt, images=[payloads.test_image(s) for s in seeds], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    first, second = answer((1, 2)), answer((3, 4))
    assert first != second, "different images must change the greedy answer"
    # Special tokens are never the greedy pick: the answer runs to max_tokens and decodes to printable text.
    special = set(range(len(tiny_llava.SPECIAL_TOKENS)))
    for ids in (first, second):
        assert len(ids) == 16 and not special & set(ids)
        text = processor.decode(ids)
        assert text.strip() and text.isprintable()
