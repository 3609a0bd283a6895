"""vLLM's multimodal processor cache sized from the container's memory (MMCPU_MM_CACHE_GIB, mmcpu.launch.mm_cache_gib).

vLLM keeps up to 4 GiB of processed multimodal items in the API server and again in the EngineCore
(``--mm-processor-cache-gb``). A 3-4 GiB container would be OOM-killed long before that fills with distinct inputs
(a Whisper clip is a 0.96 MB log-mel window whatever its length). The slow test proves the sized cache evicts:
with distinct inputs far beyond its size, the engine's memory stops growing and it keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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


def assert_memory_plateaus(engine, send: Callable[[int], object], phase: int, bound_mib: float) -> None:
    """Warm up, send ``phase`` distinct inputs (``send(i)``, 4 at a time), then ``phase`` more: the second phase
    must leave the engine's memory within ``bound_mib`` of where the first left it, and the engine up."""

    def run(start: int) -> int:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(send, range(start, start + phase)))
        return engine.rss_bytes()

    list(map(send, range(-8, 0)))  # warm-up: buffers and allocator pools reach their working size
    first = run(0)
    second = run(phase)
    assert engine.alive()
    growth = (second - first) / 2**20
    print(
        f"\n[{engine.name}, mm cache {MM_CACHE_GIB} GiB: RSS {first / 2**20:.0f} -> {second / 2**20:.0f} MiB "
        f"after {phase} more distinct inputs]"
    )
    assert growth < bound_mib, f"memory grew {growth:.0f} MiB over {phase} distinct inputs: the cache does not evict"


@pytest.mark.slow
def test_distinct_audio_far_beyond_the_cache_plateaus(whisper_engine):
    """The session's Whisper engine runs with a small cache (mmcpu_dev.servers.TEST_MM_CACHE_GIB, ~31 clips of 0.96 MB).
    Without
    eviction one phase of 64 distinct clips adds ~61 MB to the EngineCore (vLLM's API server keeps only each
    item's metadata); with it, the second phase leaves memory where the first left it."""
    engine = whisper_engine
    assert f"--mm-processor-cache-gb {MM_CACHE_GIB:g}" in engine.log()
    client = engine.client()

    def transcribe(i: int) -> str:
        clip = audio_file(1.0, tone_hz=200.0 + 3.0 * i)  # a distinct clip (its own hash) per i
        # One token is enough to send the clip through the processor and the encoder.
        return client.audio.transcriptions.create(
            **transcription_kwargs(clip, model=engine.name), extra_body={"max_completion_tokens": 1}
        ).text

    assert_memory_plateaus(engine, transcribe, phase=64, bound_mib=24)
