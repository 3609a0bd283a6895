"""Whisper's log-mel features computed only up to the clip's end (mmcpu/features.py) against transformers' own
extractor, differentially: random clips of every length, batches, quiet and loud audio, silence inside and at the
ends, through the extractor's own entry point. Exact: every value bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import WhisperFeatureExtractor
from transformers.models.whisper import feature_extraction_whisper

from mmcpu import features, plugin
from mmcpu.config import get_settings

ORIGINAL = getattr(feature_extraction_whisper.WhisperFeatureExtractor, features.ATTRIBUTE)
ORIGINAL = getattr(ORIGINAL, "__wrapped__", ORIGINAL)  # the plugin may have installed it in this process
TRIMMED = features.trimmed(ORIGINAL)
SAMPLES = 30 * 16000


@pytest.fixture(scope="module")
def extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor.from_pretrained(get_settings().models_dir / "whisper-tiny.en")


def clip(rng: np.random.Generator, n: int, batch: bool) -> np.ndarray:
    x = np.zeros((1, SAMPLES) if batch else SAMPLES, dtype=np.float32)
    audio = rng.standard_normal(n) * rng.choice([1e-4, 0.01, 0.3, 1.0])
    if n > 1000 and rng.random() < 0.5:  # silence inside the clip and at its end
        a = int(rng.integers(0, n - 500))
        audio[a : a + int(rng.integers(1, 500))] = 0
        audio[-int(rng.integers(1, min(n, 2000))) :] = 0
    x[..., :n] = audio.astype(np.float32)
    return x


@pytest.mark.parametrize("seed", range(2))
def test_trimmed_features_equal_the_originals(extractor, seed):
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 159, 160, 161, 400, 16000, SAMPLES - 400, SAMPLES - 1, SAMPLES]
    for n in lengths + [int(rng.integers(1, SAMPLES)) for _ in range(6)]:
        for batch in (False, True):
            x = clip(rng, n, batch)
            want, got = ORIGINAL(extractor, x, "cpu"), TRIMMED(extractor, x, "cpu")
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want, err_msg=f"length {n}, batch {batch}")


def test_silence_and_batches_of_clips_of_different_lengths(extractor):
    rng = np.random.default_rng(7)
    silent = np.zeros(SAMPLES, dtype=np.float32)
    np.testing.assert_array_equal(TRIMMED(extractor, silent, "cpu"), ORIGINAL(extractor, silent, "cpu"))
    rows = np.zeros((3, SAMPLES), dtype=np.float32)  # a batch is trimmed at its longest clip
    for i, n in enumerate((800, 48000, 5)):
        rows[i, :n] = rng.standard_normal(n).astype(np.float32) * 0.1
    np.testing.assert_array_equal(TRIMMED(extractor, rows, "cpu"), ORIGINAL(extractor, rows, "cpu"))


def test_dither_keeps_the_original(extractor, monkeypatch):
    """Dithering adds noise over the whole padded clip: nothing is silent, so the original runs."""
    calls = []

    def original(self, waveform, device="cpu"):
        calls.append(waveform.shape)
        return ORIGINAL(self, waveform, device)

    x = np.zeros(SAMPLES, dtype=np.float32)
    x[:16000] = np.random.default_rng(1).uniform(0.1, 0.5, 16000)  # no zero before sample 16000
    monkeypatch.setattr(extractor, "dither", 1e-5)
    features.trimmed(original)(extractor, x.copy(), "cpu")  # (transformers dithers the array it is given in place)
    monkeypatch.setattr(extractor, "dither", 0.0)
    features.trimmed(original)(extractor, x, "cpu")
    # dithered: all of it; else up to the clip's end, one window (400) and two hops (160) more, in whole hops
    assert calls == [(SAMPLES,), (16800,)]


def test_plugin_installs_it_once_and_the_extractor_uses_it(extractor, monkeypatch):
    cls = feature_extraction_whisper.WhisperFeatureExtractor
    monkeypatch.setattr(cls, features.ATTRIBUTE, ORIGINAL)
    plugin.trim_whisper_features(feature_extraction_whisper)
    installed = getattr(cls, features.ATTRIBUTE)
    assert installed.__wrapped__ is ORIGINAL
    plugin.trim_whisper_features(feature_extraction_whisper)
    assert getattr(cls, features.ATTRIBUTE) is installed  # idempotent: not wrapped twice
    audio = clip(np.random.default_rng(2), 3 * 16000, False)
    got = extractor(audio[: 3 * 16000], sampling_rate=16000, return_tensors="np").input_features
    monkeypatch.setattr(cls, features.ATTRIBUTE, ORIGINAL)
    want = extractor(audio[: 3 * 16000], sampling_rate=16000, return_tensors="np").input_features
    assert got.shape == (1, 80, 3000)
    np.testing.assert_array_equal(got, want)


# The memo: the word alignment's features call after the decode's (mmcpu/features.py, MEMO_BYTES).


@pytest.fixture
def memo(extractor, monkeypatch) -> features.Memo:
    """A fresh memo around the trimmed log-mel, installed on the extractor class as the plugin installs it."""
    memo = features.Memo()
    cls = feature_extraction_whisper.WhisperFeatureExtractor
    monkeypatch.setattr(cls, features.ATTRIBUTE, features.memoised(TRIMMED, memo))
    return memo


def uncached(extractor, audio, **kwargs) -> np.ndarray:
    return extractor(audio, sampling_rate=16000, return_tensors="np", **kwargs).input_features


def test_the_same_clip_hits_and_gets_the_same_bits(extractor, memo, monkeypatch):
    audio = clip(np.random.default_rng(3), 5 * 16000, False)[: 5 * 16000]
    # The multimodal processor's call (torch tensors, truncation) then the alignment's (numpy): one computation.
    first = extractor(audio, sampling_rate=16000, truncation=True, return_tensors="pt").input_features.numpy()
    second = extractor(audio, sampling_rate=16000, truncation=True, return_tensors="np").input_features
    assert (memo.hits, memo.misses) == (1, 1)
    second[..., :10] = 99.0  # the caller's own copy: the memo's stays intact
    third = uncached(extractor, audio)
    assert (memo.hits, memo.misses) == (2, 1)
    monkeypatch.setattr(feature_extraction_whisper.WhisperFeatureExtractor, features.ATTRIBUTE, ORIGINAL)
    want = uncached(extractor, audio)
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(third, want)


def test_another_clip_or_call_misses(extractor, memo):
    rng = np.random.default_rng(4)
    audio = clip(rng, 4 * 16000, False)[: 4 * 16000]
    uncached(extractor, audio)
    other = audio.copy()
    other[1000] += 1e-3  # one sample
    uncached(extractor, other)
    uncached(extractor, audio, do_normalize=True)  # a different waveform reaches the log-mel
    uncached(extractor, audio[:-160])  # another length, padded to the same 30 s: a different waveform
    more_mels = WhisperFeatureExtractor(feature_size=128)  # another extractor: other mel filters
    got = uncached(more_mels, audio)
    assert got.shape == (1, 128, 3000)
    assert (memo.hits, memo.misses) == (0, 5)
    uncached(extractor, other)
    assert (memo.hits, memo.misses) == (1, 5)


def test_dithered_calls_are_never_remembered(extractor, memo, monkeypatch):
    monkeypatch.setattr(extractor, "dither", 1e-5)
    audio = clip(np.random.default_rng(5), 16000, False)[:16000]
    a, b = uncached(extractor, audio), uncached(extractor, audio)
    assert (memo.hits, memo.misses) == (0, 0) and not memo.items
    assert not np.array_equal(a, b)  # noise: each call its own


def test_the_memo_is_bounded_in_bytes_least_recently_used_out():
    block = np.zeros((80, 3000), dtype=np.float32)  # one window: 960 000 bytes
    memo = features.Memo(max_bytes=3 * block.nbytes)
    for k in (b"a", b"b", b"c"):
        memo.put(k, block)
    assert memo.get(b"a") is not None  # a is now the most recent
    memo.put(b"d", block)
    assert memo.bytes == 3 * block.nbytes and set(memo.items) == {b"a", b"c", b"d"}
    memo.put(b"huge", np.zeros(4 * block.size, dtype=np.float32))  # larger than the whole memo: not kept
    assert set(memo.items) == {b"a", b"c", b"d"}
