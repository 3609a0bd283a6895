"""Word timestamps (``verbose_json`` + ``timestamp_granularities=["word"]``, patches/0022, mmcpu/whisper_align.py).

Unit tests: the DTW against a plain loop of the same recurrence, the word split and punctuation rules, the
alignment heads of the fixtures against openai-whisper's own table, the refusals. Real engines (slow): clips made
of separately spoken words joined by known gaps, so each word's true start is known; our word starts against that
truth, beside faster-whisper's ``word_timestamps=True`` on the same weights and clips, for tiny.en, its int8
variant and whisper-base (with a language and with detection), and a clip longer than one 30 s window.
"""

from __future__ import annotations

import base64
import gzip
import json
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest

from mmcpu import whisper_align as wa
from mmcpu_dev.fixtures import whisper_ct2

SR = 16000


# ------------------------------------------------------------------------------------------------------
# DTW and words


def _dtw_loop(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The recurrence cell by cell: diagonal if strictly cheapest, else down if strictly cheapest, else right."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    trace = np.zeros((n + 1, m + 1), dtype=int)
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c = (cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1])
            t = 0 if c[0] < c[1] and c[0] < c[2] else 1 if c[1] < c[0] and c[1] < c[2] else 2
            cost[i, j], trace[i, j] = x[i - 1, j - 1] + c[t], t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        i, j = (i - 1, j - 1) if trace[i, j] == 0 else (i - 1, j) if trace[i, j] == 1 else (i, j - 1)
    rows, cols = np.array(path[::-1]).T
    return rows, cols


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (6, 1), (7, 31), (31, 7), (25, 180)])
@pytest.mark.parametrize("ties", [False, True])
def test_dtw_is_the_recurrence(shape, ties):
    rng = np.random.default_rng(sum(shape) + ties)
    x = rng.integers(0, 3, size=shape).astype(float) if ties else rng.normal(size=shape)
    for got, want in zip(wa.dtw(x), _dtw_loop(x), strict=True):
        assert np.array_equal(got, want)


def test_token_start_times_follow_a_diagonal():
    # Three rows whose attention peaks at frames 0-9, 10-29 and 30-39: the path enters them at 0, 0.2 and 0.6 s.
    m = np.full((3, 40), -0.5)  # off the peaks an extra cell costs: no ties
    m[0, :10], m[1, 10:30], m[2, 30:] = 1, 1, 1
    assert wa.token_start_times(m).tolist() == pytest.approx([0.0, 0.2, 0.6])


# Tokens as their text: decode joins them (what a BPE tokenizer does for whole-character tokens).
VOCAB = {1: " Hello", 2: ",", 3: " wor", 4: "ld", 5: "!", 6: " (", 7: "yes", 8: ")", 9: " it", 10: "'s"}


def _decode(tokens: list[int]) -> str:
    return "".join(VOCAB[t] for t in tokens)


def test_words_split_on_spaces_and_punctuation():
    assert wa.split_words([1, 2, 3, 4, 5], _decode, "en") == [(" Hello", [1]), (",", [2]), (" world", [3, 4]),
                                                              ("!", [5])]
    assert wa.split_words([9, 10], _decode, None) == [(" it's", [9, 10])]
    # Languages written without spaces: one piece per whole character.
    assert [w for w, _ in wa.split_words([3, 4], _decode, "ja")] == [" wor", "ld"]


def test_a_character_split_over_two_tokens_stays_one_piece():
    pieces = {1: b" caf", 2: b"\xc3", 3: b"\xa9"}

    def decode(tokens: list[int]) -> str:
        return b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")

    assert wa.split_words([1, 2, 3], decode, "ja") == [(" caf", [1]), ("é", [2, 3])]
    assert wa.split_words([1, 2, 3], decode, "fr") == [(" café", [1, 2, 3])]


def _matrix(rows_frames: list[tuple[int, int]], frames: int) -> np.ndarray:
    m = np.full((len(rows_frames), frames), -0.5)
    for r, (a, b) in enumerate(rows_frames):
        m[r, a:b] = 1
    return m


def test_words_for_a_window_are_bare_ordered_and_offset():
    # Rows: <|notimestamps|>, then one per text token " Hello" "," " wor" "ld" "!" (row r predicts token r).
    m = _matrix([(0, 25), (25, 40), (40, 50), (50, 60), (60, 75), (75, 100)], 100)
    [words] = wa.words_for_window(m, [[1, 2, 3, 4, 5]], _decode, language="en", offset=30.0, duration=2.0)
    assert [(w.word, w.start, w.end) for w in words] == [("Hello", 30.0, 30.5), ("world", 30.8, 31.2)]  # "!" joins "world", which keeps its end


def test_leading_punctuation_joins_the_next_word_and_times_stay_inside_the_window():
    m = _matrix([(0, 10), (10, 20), (20, 30), (30, 60)], 60)
    [words] = wa.words_for_window(m, [[6, 7, 8]], _decode, language="en", offset=0.0, duration=0.9)
    assert [w.word for w in words] == ["yes"]
    assert 0.0 <= words[0].start <= words[0].end <= 0.9


def test_rows_must_match_the_tokens():
    with pytest.raises(wa.AlignmentError):
        wa.words_for_window(np.zeros((3, 10)), [[1, 2, 3]], _decode, language="en", offset=0, duration=1)


def test_median_filter_is_openai_whispers():
    import torch

    x = torch.tensor([[5.0, 1, 9, 2, 8, 3, 7, 4, 6, 0]])
    got = wa.median_filter(x, 3)
    padded = np.pad(x.numpy()[0], 1, mode="reflect")
    want = [np.median(padded[i : i + 3]) for i in range(10)]
    assert got[0].tolist() == want


# ------------------------------------------------------------------------------------------------------
# Alignment heads: the fixtures' come from openai-whisper's table


# openai-whisper's _ALIGNMENT_HEADS entries (whisper/__init__.py, openai-whisper 20250625): base85 of a gzipped
# boolean [decoder layers, heads] mask.
OPENAI_MASKS = {
    "tiny.en": (b"ABzY8J1N>@0{>%R00Bk>$p{7v037`oCl~+#00", 4, 6),
    "base": (b"ABzY8KQ!870{>%RzyTQH3`Q^yNP!>##QT-<FaQ7m", 6, 8),
}


@pytest.mark.parametrize("name", OPENAI_MASKS)
def test_converter_heads_are_openai_whispers(name):
    encoded, layers, heads = OPENAI_MASKS[name]
    mask = np.frombuffer(gzip.decompress(base64.b85decode(encoded)), dtype=bool).reshape(layers, heads)
    assert whisper_ct2.ALIGNMENT_HEADS[name] == tuple((int(la), int(h)) for la, h in np.argwhere(mask))


def test_generation_config_carries_the_heads_and_refuses_a_mismatch():
    dims = whisper_ct2.WhisperDims(384, 51864, 80, 4, 4, 6, 6, 1536, 1536, 1500, 448, True)
    ids = {"<|startoftranscript|>": 50257, "<|endoftext|>": 50256, "<|notimestamps|>": 50362,
           "<|startofprev|>": 50360}
    ct2 = {"alignment_heads": [[1, 0], [2, 0]], "suppress_ids": [], "suppress_ids_begin": []}
    assert whisper_ct2.generation_config(dims, ids, ct2, ((1, 0), (2, 0)))["alignment_heads"] == [[1, 0], [2, 0]]
    with pytest.raises(whisper_ct2.ModelBinError, match="alignment_heads"):
        whisper_ct2.generation_config(dims, ids, ct2, ((1, 0), (3, 5)))
    with pytest.raises(whisper_ct2.ModelBinError, match="outside"):
        whisper_ct2.generation_config(dims, ids, {**ct2, "alignment_heads": [[4, 0]]}, ((4, 0),))


def test_alignment_heads_of_a_generation_config():
    assert wa.alignment_heads({"alignment_heads": [[3, 1], [1, 0], [3, 1]]}) == [(1, 0), (3, 1)]
    assert wa.alignment_heads({}) is None and wa.alignment_heads(None) is None
    with pytest.raises(wa.AlignmentError):
        wa.alignment_heads({"alignment_heads": [1, 2]})


def test_the_int8_checkpoint_keeps_the_heads(whisper_model):
    from mmcpu import quantize

    src = json.loads((whisper_model / "generation_config.json").read_text())["alignment_heads"]
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "int8"
        quantize.quantize(whisper_model, dst, activations="dynamic", force=True)
        assert json.loads((dst / "generation_config.json").read_text())["alignment_heads"] == src
