"""Whisper's encoder outputs kept for the word alignment (mmcpu/encoder_stash.py): what the wrapped encoder entry
stores, what the alignment finds, the bounds, and the hook point in this vLLM. The real engine's hits:
tests/test_stt_plugin.py and tests/test_word_timestamps.py (slow)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from mmcpu import encoder_stash as es


class Encoder:
    """Stands in for vLLM's ``WhisperModel``: per window (mel bins x frames) a deterministic (frames/2 x d) output,
    iterating its input as ``WhisperEncoder.forward`` does."""

    calls = 0

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(4, 6, kernel_size=3, stride=2, padding=1)

    def get_encoder_outputs(self, input_features):
        type(self).calls += 1
        rows = []
        for features in input_features:
            out = self.conv(features.to(self.conv.weight.dtype)).transpose(-1, -2)
            rows.append(out if out.dim() == 3 else out[None])
        return torch.cat(rows).to(input_features[0].dtype)


@pytest.fixture
def stash(monkeypatch) -> es.Stash:
    monkeypatch.setattr(Encoder, "get_encoder_outputs", es.stashing(Encoder.get_encoder_outputs, stash := es.Stash()))
    return stash


def windows(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, 4, 20, generator=torch.Generator().manual_seed(n)).to(dtype)


@torch.inference_mode()
@pytest.mark.parametrize("as_list", [False, True])
def test_each_window_of_a_batch_is_found_by_its_features(stash, as_list):
    model, batch = Encoder(), windows(3)
    out = model.get_encoder_outputs(list(batch[:, None]) if as_list else batch)  # list of 3-D, or one batched
    assert stash.stats()["stored"] == 3
    calls = Encoder.calls
    for i in range(3):
        found, hit = es.encoder_output(model, batch[i].clone(), stash)  # another tensor, the same bytes
        assert hit and torch.equal(found, out[i])
    assert Encoder.calls == calls  # no encoder pass for a window the decode encoded
    assert (stash.hits, stash.misses) == (3, 0)


@torch.inference_mode()
def test_other_features_or_dtype_miss_and_are_computed(stash):
    model, batch = Encoder(), windows(2)
    model.get_encoder_outputs(batch)
    other = batch[0].clone()
    other[0, 0] += 1e-3
    for features in (other, batch[0].to(torch.bfloat16), windows(1)[0]):
        found, hit = es.encoder_output(model, features, stash)
        assert not hit
        torch.testing.assert_close(found, model.get_encoder_outputs([features])[0], rtol=0, atol=0)
    assert stash.hits == 0 and stash.misses == 3


def test_bounded_by_windows_and_bytes_least_recently_used_out():
    row = torch.zeros(1500, 384)  # tiny's encoder output in float32: 2.3 MB
    size = row.numel() * row.element_size()
    stash = es.Stash(max_items=3, max_bytes=10 * size)
    for k in (b"a", b"b", b"c"):
        stash.put(k, row.clone())
    assert stash.get(b"a") is not None
    stash.put(b"d", row.clone())
    assert set(stash.items) == {b"a", b"c", b"d"} and stash.bytes == 3 * size
    small = es.Stash(max_items=10, max_bytes=2 * size)
    for k in (b"a", b"b", b"c"):
        small.put(k, row.clone())
    assert set(small.items) == {b"b", b"c"} and small.bytes == 2 * size


def test_the_stash_keeps_a_copy_not_the_batch(stash):
    model, batch = Encoder(), windows(4)
    with torch.inference_mode():
        model.get_encoder_outputs(batch)
    for value in stash.items.values():
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


def test_the_hook_point_is_in_this_vllm_and_wrapped_once(monkeypatch):
    import inspect

    from vllm.model_executor.models import whisper

    entry = whisper.WhisperModel.get_encoder_outputs
    original = entry.__wrapped__ if getattr(entry, "_mmcpu_stashing", False) else entry
    monkeypatch.setattr(whisper.WhisperModel, "get_encoder_outputs", original)
    es.add_stash(whisper)
    wrapped = whisper.WhisperModel.get_encoder_outputs
    es.add_stash(whisper)
    assert whisper.WhisperModel.get_encoder_outputs is wrapped and wrapped.__wrapped__ is original
    # MRV2's encoder runner reaches it through embed_multimodal (the alignment calls it directly).
    assert "self.model.get_encoder_outputs(" in inspect.getsource(whisper.WhisperForConditionalGeneration)


def test_a_vllm_without_the_hook_point_serves_on_with_one_line(caplog):
    module = types.ModuleType("vllm.model_executor.models.whisper")
    with caplog.at_level(logging.WARNING, logger="vllm.mmcpu.encoder_stash"):
        es.add_stash(module)
    assert len(caplog.records) == 1 and "recomputes the encoder" in caplog.records[0].getMessage()
