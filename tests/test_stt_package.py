"""mmcpu.stt without an engine: segments from a timestamped decode or from aligned words, the subtitle documents
(parsed by the `srt` and `webvtt-py` libraries), and how the launcher loads the endpoint plugin.
tests/test_stt_plugin.py serves it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import srt
import webvtt

from mmcpu import launch
from mmcpu.config import Settings
from mmcpu.stt import PLUGIN_NAME, formats
from mmcpu.stt.plugin import SttPlugin

TS, EOT = 1000, 900  # timestamp_begin and eot of a toy vocabulary: <|0.00|> = 1000, <|0.02|> = 1001, ...


def ts(seconds: float) -> int:
    return TS + round(seconds / formats.TIMESTAMP_STEP_S)


def decode(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


def segments(tokens: list[int], start: float = 10.0, end: float = 40.0) -> list[formats.Segment]:
    return formats.window_segments(
        tokens, [-0.5] * len(tokens), decode, timestamp_begin=TS, eot=EOT, window_start=start, window_end=end
    )


def test_segments_between_timestamps_in_clip_time():
    out = segments([ts(0), 1, 2, ts(2.5), ts(3), 3, ts(4.2), EOT, 5])
    assert [(s.start, s.end, s.text) for s in out] == [(10.0, 12.5, " w1 w2"), (13.0, 14.2, " w3")]
    assert out[0].seek == 1000 and out[0].tokens == [1, 2] and out[0].avg_logprob == -0.5
    # as OpenAI's verbose_json segment, numbered by the caller
    assert formats.Segment.as_openai(out[1], 7, 0.0)["id"] == 7


def test_text_after_the_last_timestamp_is_kept_to_the_window_end():
    out = segments([ts(0), 1, ts(1), 2, 3])
    assert [(s.start, s.end, s.text) for s in out] == [(10.0, 11.0, " w1"), (11.0, 40.0, " w2 w3")]


def test_times_stay_in_the_window():
    (seg,) = segments([ts(29.9), 1, ts(29.98)], start=0.0, end=20.0)
    assert (seg.start, seg.end) == (20.0, 20.0)
    assert segments([ts(0), ts(1), EOT]) == []  # no text, no segment


def test_aligned_words_are_grouped_at_sentence_ends_pauses_and_length():
    words = [(" One", 0.0, 0.3), (" two", 0.3, 0.6), (".", 0.6, 0.7), (" Three", 1.0, 1.3), (" four", 1.3, 1.6)]
    words += [(" five", 3.0, 3.3), (",", 3.3, 3.4)]  # a 1.4 s pause before "five"; punctuation never opens one
    assert formats.group_words(words) == [range(0, 3), range(3, 5), range(5, 7)]
    # a segment never outgrows SEGMENT_MAX_S: the word that would is the next one's first
    steady = [(f" w{i}", i * 0.5, i * 0.5 + 0.4) for i in range(60)]
    groups = formats.group_words(steady)
    assert [i for g in groups for i in g] == list(range(60))  # every word, once, in order
    assert all(steady[g[-1]][2] - steady[g[0]][1] <= formats.SEGMENT_MAX_S for g in groups) and len(groups) > 1
    assert formats.group_words([]) == []


def test_pauses_absorbed_by_the_alignment_are_given_back():
    # DTW spreads a 2 s silence over "down" and "Could": both over-long; "went" is not touched
    words = [(" the", 0.0, 0.3), (" sun", 0.3, 0.6), (" went", 0.6, 0.9), (" down", 0.9, 2.6), (" Could", 2.6, 4.0)]
    words += [(" you", 4.0, 4.3), (" open", 4.3, 4.6)]
    out = formats.trim_pauses(words)
    longest = 2 * 0.3
    assert out[2] == words[2] and out[3][1] == 0.9 and out[3][2] == pytest.approx(0.9 + longest)
    assert out[4][1] == pytest.approx(4.0 - longest) and out[4][2] == 4.0
    assert formats.group_words(out) == [range(0, 4), range(4, 7)]
    # one word over a silence, its neighbours of normal length: the silence is after it
    lone = [(" a", 0.0, 0.3), (" b", 0.3, 0.6), (" c", 0.6, 2.9), (" d", 2.9, 3.2), (" e", 3.2, 3.5)]
    assert formats.trim_pauses(lone)[2][2] == pytest.approx(0.6 + longest)
    # a sentence's final mark stays with its word, whatever the durations
    end = [(" a", 0.0, 0.3), (" b", 0.3, 2.0), (".", 2.0, 3.5), (" c", 3.5, 3.8)]
    assert formats.trim_pauses(end)[1:3] == end[1:3]
    assert formats.group_words(formats.trim_pauses(end)) == [range(0, 3), range(3, 4)]


HOSTILE = [" first line\n\nsecond line", " a --> b", " <b>bold</b> & co", "   "]


def cues_of(document: str, fmt: str) -> list[tuple[float, float, str]]:
    if fmt == "srt":
        return [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt.parse(document)]
    return [(c.start_in_seconds, c.end_in_seconds, c.text) for c in webvtt.from_string(document)]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_parse_whatever_the_text(fmt):
    segs = [formats.Segment(i, i + 0.5, text, [], 0.0, 0) for i, text in enumerate(HOSTILE)]
    cues = cues_of(formats.subtitles(segs, fmt), fmt)
    texts = [c[2] for c in cues]
    # one line per cue, no timing line inside
    assert texts[:2] == ["first line second line", "a -> b" if fmt == "srt" else "a -&gt; b"], texts
    # WebVTT's markup characters are escaped, so a player shows them instead of reading a tag (webvtt-py gives the
    # cue text as written); SRT has no escapes
    assert texts[2] == ("<b>bold</b> & co" if fmt == "srt" else "&lt;b&gt;bold&lt;/b&gt; &amp; co")
    assert len(cues) == 3  # the blank segment makes no cue
    assert [c[0] for c in cues] == [0, 1, 2]


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_silence_is_an_empty_document_not_an_empty_cue(fmt):
    document = formats.subtitles([], fmt)
    assert cues_of(document, fmt) == []
    assert document == ("" if fmt == "srt" else "WEBVTT\n\n")


def test_vllm_plugins_named_only_when_the_package_serves_speech():
    plugin = Settings()  # the default: the package serves speech engines
    assert plugin.stt_routes == "plugin"
    assert launch.plugins_env(Settings(stt_routes="vllm"), "audio", None) is None  # opt out: nothing changes
    assert launch.plugins_env(plugin, "vision", None) is None
    assert launch.plugins_env(plugin, "audio", None) == f"mmcpu,{PLUGIN_NAME}"
    assert launch.plugins_env(plugin, "audio", "mmcpu,other") == f"mmcpu,other,{PLUGIN_NAME}"


def test_the_launcher_refuses_a_plugin_that_is_missing_or_broken(monkeypatch):
    declared = tomllib.loads(Path("pyproject.toml").read_text())["project"]["entry-points"]["vllm.endpoint_plugins"]
    assert declared == {PLUGIN_NAME: "mmcpu.stt.plugin:factory"}
    real = importlib.metadata.EntryPoint(PLUGIN_NAME, declared[PLUGIN_NAME], "vllm.endpoint_plugins")

    def installed(*points):
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: list(points))

    installed(real)
    assert launch.stt_plugin_preflight() is None
    assert isinstance(real.load()(), SttPlugin)
    installed()
    assert "not installed" in launch.stt_plugin_preflight()
    installed(importlib.metadata.EntryPoint(PLUGIN_NAME, "mmcpu.stt.nowhere:factory", "vllm.endpoint_plugins"))
    installed(real)
    with monkeypatch.context() as m:
        m.setattr(launch, "mrv2_logits_processors", lambda: False)  # a vLLM like 0.26 (detection: the next test)
        assert "MMCPU_STT_ROUTES=vllm" in launch.stt_plugin_preflight()
    installed(importlib.metadata.EntryPoint(PLUGIN_NAME, "mmcpu.stt.nowhere:factory", "vllm.endpoint_plugins"))
    assert "does not load" in launch.stt_plugin_preflight()
    # preflight asks only under MMCPU_STT_ROUTES=plugin (the default) and only for a speech engine
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    cxx = {"CXX": "/bin/true"}
    assert launch.preflight(Settings(runner="v2", triton_interpret=False, stt_routes="vllm"), env=cxx) is None
    assert launch.preflight(Settings(runner="v2", triton_interpret=False), env=cxx, kinds=("vision",)) is None
    reason = launch.preflight(Settings(runner="v2", triton_interpret=False), env=cxx, kinds=("vision", "audio"))
    assert reason and "does not load" in reason


def test_the_logits_processor_interface_is_detected_in_the_vllm_on_the_path(tmp_path):
    """The check the launcher's preflight runs, on this venv's vLLM (0.32: present) and on a vLLM tree without the
    interface put in front of it, as a proof-line overlay is (absent)."""
    probe = [sys.executable, "-c", "from mmcpu import launch; print(launch.mrv2_logits_processors())"]
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == "True"
    (tmp_path / "vllm" / "v1").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert subprocess.run(probe, capture_output=True, text=True, check=True, env=env).stdout.strip() == "False"
