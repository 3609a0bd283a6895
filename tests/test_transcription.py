"""/v1/audio/transcriptions on a real vLLM server: MRV2 on CPU, the patched default vLLM line, real Whisper tiny.en."""

from __future__ import annotations

import hashlib

import pytest

from mmcpu_dev import speech
from mmcpu_dev.checks import WER_LIMIT, expect_client_error, subtitle_text
from mmcpu_dev.payloads import transcription_kwargs
from mmcpu_dev.servers import MRV2_LOG_LINE

pytestmark = pytest.mark.slow


def transcribe_all(engine, clips, **kwargs) -> list[str]:
    client = engine.client()
    out = []
    for path, _text in clips:
        result = client.audio.transcriptions.create(**transcription_kwargs(path, model=engine.name, **kwargs))
        out.append(result if isinstance(result, str) else result.text)
    return out


def test_speech_is_deterministic(tmp_path):
    """The same text gives the same samples (sox dithers unless told not to): a WER bound then judges the model, not
    the noise of one synthesis."""
    digests = {
        hashlib.sha256(speech.synthesize(speech.SENTENCES[1], tmp_path / f"{i}.wav").read_bytes()).hexdigest()
        for i in range(3)
    }
    assert len(digests) == 1


@pytest.mark.parametrize("language", ["en", None], ids=["language=en", "no-language"])
def test_wer_json(whisper_engine, clips, language):
    hyps = transcribe_all(whisper_engine, clips, language=language)
    wer = speech.word_error_rate([t for _, t in clips], hyps)
    print(f"\nWER {wer:.3f} language={language}: {hyps}")
    assert all(h.strip() for h in hyps), f"empty transcription: {hyps}"
    assert wer < WER_LIMIT


def test_response_format_text(whisper_engine, clips):
    """OpenAI's text format is the bare transcript (mmcpu/stt), not a JSON document."""
    hyps = transcribe_all(whisper_engine, clips[:2], language="en", response_format="text")
    assert all(isinstance(h, str) and h.strip() and not h.lstrip().startswith("{") for h in hyps), hyps
    assert speech.word_error_rate([t for _, t in clips[:2]], hyps) < WER_LIMIT


@pytest.mark.parametrize("response_format", ["srt", "vtt"])
def test_response_format_subtitles(whisper_engine, clips, response_format):
    (document,) = transcribe_all(whisper_engine, clips[1:2], response_format=response_format)
    text = subtitle_text(document, response_format)
    assert speech.word_error_rate([clips[1][1]], [text]) < WER_LIMIT


def test_non_english_language_rejected(whisper_engine, clips):
    client = whisper_engine.client()
    error = expect_client_error(
        lambda: client.audio.transcriptions.create(
            **transcription_kwargs(clips[0][0], model=whisper_engine.name, language="de")
        ),
        {400},
    )
    assert "English-only" in error["message"]


def test_mrv2_in_use(whisper_engine):
    # Evidence from the server itself: vLLM's CPU worker logs which runner it built.
    assert MRV2_LOG_LINE in whisper_engine.log()


BAD_AUDIO = {
    "empty-file": b"",
    "non-audio-bytes": b"this is not audio at all, just text pretending to be a wav file" * 20,
    # a WAV cut inside its 44-byte header: RIFF/WAVE/fmt chunk started, no format fields, no data
    "truncated-wav": b"RIFF\x24\x08\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00",
}


@pytest.mark.parametrize("name", BAD_AUDIO)
def test_bad_audio_is_4xx_and_server_survives(whisper_engine, clips, name):
    client = whisper_engine.client()
    error = expect_client_error(
        lambda: client.audio.transcriptions.create(
            **transcription_kwargs(BAD_AUDIO[name], model=whisper_engine.name, language="en")
        )
    )
    print(f"\n{name}: {error}")
    good = client.audio.transcriptions.create(**transcription_kwargs(clips[0][0], model=whisper_engine.name))
    assert speech.word_error_rate([clips[0][1]], [good.text]) < WER_LIMIT


def test_wav_cut_mid_data_is_shorter_audio(whisper_engine, clips):
    """Only the header makes a WAV unreadable; cut inside the samples it is a shorter clip (200, its words)."""
    data = clips[0][0].read_bytes()
    result = whisper_engine.client().audio.transcriptions.create(
        **transcription_kwargs(data[: len(data) // 2], model=whisper_engine.name)
    )
    assert speech.normalize(result.text).split()[:2] == ["the", "quick"]


def test_unknown_model_is_404(whisper_engine, clips):
    client = whisper_engine.client()
    expect_client_error(
        lambda: client.audio.transcriptions.create(**transcription_kwargs(clips[0][0], model="no-such-model")),
        {404},
    )
    assert whisper_engine.alive()
