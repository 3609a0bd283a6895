"""Regression proof for upstream PR #50073: under MRV2 on CPU the unpatched vLLM 0.26.0 fails on multimodal
requests with the known error, and the same requests pass with the three fixes applied.

The unpatched server runs vLLM 0.26.0 from its wheel (``unpatched_vllm`` overlay, shadowing the venv's patched
copy on PYTHONPATH); "patched" is the session's server on the venv, which carries every patch in patches/.
"""

from __future__ import annotations

import openai
import pytest

from mmcpu.dev import speech
from mmcpu.dev.checks import WER_LIMIT
from mmcpu.config import VISION_LIMIT_ARGS
from mmcpu.dev.payloads import image_chat_kwargs, test_image, transcription_kwargs
from mmcpu.dev.servers import MRV2_LOG_LINE, Engine

pytestmark = pytest.mark.slow
KNOWN_ERROR = "Found no NVIDIA driver on your system"


def assert_fails_with_known_error(engine: Engine, send) -> None:
    with pytest.raises(openai.InternalServerError) as exc_info:
        send()
    assert exc_info.value.status_code == 500
    log = engine.log()
    assert MRV2_LOG_LINE in log
    assert KNOWN_ERROR in log, log[-3000:]
    # The engine core died and took the server with it: later requests fail (HTTP 500 while it shuts down,
    # then connection refused) and the process exits on its own.
    with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
        send()
    engine.proc.wait(timeout=120)
    assert not engine.alive()


def test_whisper_unpatched_fails_patched_passes(whisper_model, unpatched_vllm, whisper_engine, clips, logs_dir):
    path, text = clips[0]
    with Engine(model=whisper_model, log_path=logs_dir / "whisper-mrv2-unpatched.log", pythonpath=unpatched_vllm) as bad:
        client = bad.client()
        assert_fails_with_known_error(
            bad, lambda: client.audio.transcriptions.create(**transcription_kwargs(path, model=bad.name, language="en"))
        )

    good = whisper_engine.client().audio.transcriptions.create(
        **transcription_kwargs(path, model=whisper_engine.name, language="en")
    )
    assert speech.word_error_rate([text], [good.text]) < WER_LIMIT


def test_two_images_unpatched_fails_patched_passes(llava_model, unpatched_vllm, llava_engine, logs_dir):
    images = [test_image(1), test_image(2)]  # two DIFFERENT images: identical ones are deduplicated upstream
    with Engine(
        model=llava_model,
        log_path=logs_dir / "tiny-llava-mrv2-unpatched.log",
        pythonpath=unpatched_vllm,
        vllm_args=VISION_LIMIT_ARGS,
    ) as bad:
        client = bad.client()
        assert_fails_with_known_error(
            bad, lambda: client.chat.completions.create(**image_chat_kwargs(images, model=bad.name))
        )

    good = llava_engine.client().chat.completions.create(**image_chat_kwargs(images, model=llava_engine.name))
    assert good.choices[0].message.content.strip()
