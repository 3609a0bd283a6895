"""vLLM's multimodal processor cache sized from the container's memory (MMCPU_MM_CACHE_GIB, mmcpu.launch.mm_cache_gib).

vLLM keeps up to 4 GiB of processed multimodal items in the API server and again in the EngineCore
(``--mm-processor-cache-gb``). A 3-4 GiB container would be OOM-killed long before that fills with distinct inputs
(a Qwen2-VL 448x448 image is 1.2 MB). vLLM keeps none for encoder-decoder models (Whisper). The cache's eviction
and the engine's memory under distinct images are proven on the vision engine (tests/test_qwen2_vl.py).
"""

from __future__ import annotations

import pytest

from mmcpu import launch
from mmcpu.config import Settings
from mmcpu_dev.payloads import audio_file, transcription_kwargs
from mmcpu_dev.servers import TEST_MM_CACHE_GIB as MM_CACHE_GIB

GIB = 2**30


@pytest.mark.parametrize(("limit_gib", "expected"), [(3, 0.12), (4, 0.16), (24, 0.96), (512, 4.0)])
def test_default_is_a_share_of_the_memory_limit_capped_at_vllms(limit_gib, expected):
    assert launch.mm_cache_gib(Settings(), int(limit_gib * GIB)) == expected


def test_setting_wins_and_reaches_vllm():
    assert launch.mm_cache_gib(Settings(mm_cache_gib=0), 3 * GIB) == 0
    argv = launch.engine_argv("/models/m", Settings(mm_cache_gib=0.5), port=8001)
    assert argv[argv.index("--mm-processor-cache-gb") + 1] == "0.5"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "3221225472\n"}, 3 * GIB),
        ({"memory.max": "max\n"}, None),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # cgroup v1 "unlimited"
        ({"memory/memory.limit_in_bytes": "4294967296\n"}, 4 * GIB),
        ({}, None),
    ],
)
def test_cgroup_memory_limit(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert launch.cgroup_memory_limit(tmp_path) == expected


def test_whisper_engines_keep_no_processed_audio(whisper_engine):
    """vLLM turns the processor cache off for encoder-decoder models (Whisper): the setting sizes the vision
    engines' cache only, and an audio engine's memory cannot grow with distinct clips through it. Its counter of
    cache lookups stays at 0 while the same clip is sent twice (the vision test in tests/test_qwen2_vl.py shows the
    same counter moving)."""
    engine = whisper_engine
    assert f"--mm-processor-cache-gb {MM_CACHE_GIB:g}" in engine.log()
    assert "Encoder-decoder model detected, disabling mm processor cache" in engine.log()
    client = engine.client()
    clip = audio_file(1.0, tone_hz=211.0)
    for _ in range(2):
        client.audio.transcriptions.create(
            **transcription_kwargs(clip, model=engine.name), extra_body={"max_completion_tokens": 1}
        )
    assert engine.sample("vllm:mm_cache_queries_total") == 0
