"""Whisper's word alignment reusing the decode's log-mel features and encoder output, on a real engine in this
process (vLLM's ``LLM``, MRV2, the environment and arguments mmcpu-serve gives an engine; uniproc executor, so the
API-server side and the worker share this process as they share the serving's processes).

    python -m mmcpu_dev.align_reuse [--model DIR] [--wav FILE] [--reps 5]

Decodes the clip's first 30 s window, then computes the alignment's features as the serving does
(:meth:`mmcpu.whisper_align.WordTimestamps.features`) and runs the alignment worker method with the encoder stash
and without it, ``--reps`` times each. Prints one JSON document: the feature memo's and the stash's hit counts, the
largest difference between the two alignment matrices, whether the words and their times are the same, and the
worker method's median time each way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from mmcpu.config import get_settings

RATE = 16_000
WINDOW = 30 * RATE


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getframerate() == RATE and w.getnchannels() == 1 and w.getsampwidth() == 2, path
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


def engine(model: Path) -> Any:
    """vLLM's ``LLM`` as mmcpu-serve would start the engine (its environment, its vLLM arguments), in-process."""
    from mmcpu import launch

    settings = get_settings().model_copy(update={"executor": "uni"})
    spec = launch.EngineSpec("engine", str(model), 0)
    process = spec.process(settings, spec.choose(settings))
    os.environ.update(process.env)
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = process.argv[3:]  # after `python -m vllm.entrypoints.openai.api_server`
    drop = {"--host", "--port", "--served-model-name"}
    args: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in drop:
            i += 2
            continue
        args.append(argv[i])
        i += 1
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(args))
    return LLM(**{k: v for k, v in vars(engine_args).items() if not k.startswith("_")})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=get_settings().models_dir / "whisper-tiny.en")
    parser.add_argument("--wav", type=Path, help="16 kHz mono 16-bit clip (default: two spoken sentences)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.wav is None:
        from mmcpu_dev import speech

        tmp = Path(tempfile.mkdtemp())
        args.wav, _ = speech.conversation(tmp / "clip.wav", speech.SENTENCES[:2], pause_s=1.0)
    audio = read_wav(args.wav)[:WINDOW]

    llm = engine(args.model)
    from vllm import SamplingParams

    from mmcpu import encoder_stash, features
    from mmcpu.whisper_align import WORKER_METHOD, WordTimestamps, words_for_window

    model_config = llm.llm_engine.model_config
    tokenizer = llm.get_tokenizer()
    aligner = WordTimestamps(model_config, tokenizer)
    assert aligner.heads is not None, "the model has no alignment heads"
    features.MEMO.clear()
    prompt = {
        "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (audio, RATE)}},
        "decoder_prompt": "<|startoftranscript|><|notimestamps|>",
    }
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)
    text_tokens = [t for t in out.outputs[0].token_ids if t < aligner.eot]
    memo_before = (features.MEMO.hits, features.MEMO.misses)
    mel, num_frames = aligner.features(audio)  # as the serving's align() computes them
    memo_after = (features.MEMO.hits, features.MEMO.misses)
    tokens, n_sot = aligner.alignment_tokens(out.prompt_token_ids or [], text_tokens)
    heads = [list(h) for h in aligner.heads]
    rpc_args = (mel.tobytes(), list(mel.shape), tokens, heads, num_frames)

    def align(reuse: bool) -> tuple[np.ndarray, list[float]]:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            [(raw, shape)] = llm.collective_rpc(WORKER_METHOD, args=rpc_args, kwargs={"reuse": reuse})
            times.append(time.perf_counter() - t0)
        return np.frombuffer(raw, dtype=np.float32).reshape(tuple(shape)), times

    [stash_before] = llm.collective_rpc(encoder_stash.STATS_METHOD)
    reused, reused_s = align(True)
    [stash_after] = llm.collective_rpc(encoder_stash.STATS_METHOD)
    computed, computed_s = align(False)

    def words(matrix: np.ndarray) -> list[tuple[str, float, float]]:
        [segment] = words_for_window(
            matrix[n_sot:-1], [text_tokens], aligner.decode, language="en", offset=0.0, duration=len(audio) / RATE
        )
        return [(w.word, w.start, w.end) for w in segment]

    result = {
        "text": tokenizer.decode(text_tokens),
        "dtype": str(model_config.dtype),
        "feature_memo": {"hits": memo_after[0] - memo_before[0], "misses": memo_after[1] - memo_before[1]},
        "stash": {"before": stash_before, "after": stash_after},
        "max_abs_diff": float(np.abs(reused - computed).max()),
        "same_words": words(reused) == words(computed),
        "words": words(reused),
        "rpc_ms": {
            "reused": statistics.median(reused_s) * 1e3,
            "computed": statistics.median(computed_s) * 1e3,
        },
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # the in-process engine's threads would hold the interpreter
