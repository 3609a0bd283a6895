"""The speech API's serving, by composition on vLLM's public pieces (see :mod:`mmcpu.stt`).

One autoregressive decode per audio window for every format it serves: json and text decode as vLLM's own serving
does (the same prompt, the same sampling parameters, so the same words). verbose_json, srt and vtt are timed in one
of two ways (``MMCPU_STT_TIMESTAMPS``):

- ``align`` (the default): the window is decoded exactly as json decodes it, then its text is timed by one
  teacher-forced forward of the engine's model (:mod:`mmcpu.whisper_align`: cross-attention of the alignment heads,
  DTW), and segments are cut from json's own words (:func:`mmcpu.stt.formats.group_words`), so every format carries
  json's words; ``timestamp_granularities=["word"]`` comes from the same alignment.
- ``decode``: one decode under Whisper's timestamp rules (:mod:`mmcpu.whisper_timestamps`, the engine's logits
  processor), the model choosing the timestamps in the same decode that chooses the words.

Requests it does not cover go to vLLM's serving (:meth:`SpeechServing.delegation`)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from mmcpu.stt import formats
from mmcpu.stt.guards import Guards
from mmcpu.stt.protocol import StreamInputTokenDetails, StreamUsage, TextDeltaEvent, TextDoneEvent
from mmcpu.whisper_align import Word

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handlers: in the engine's log
TASKS = {"transcriptions": "transcribe", "translations": "translate"}
# What the package answers itself; only LoRA / unknown model names and diarized_json (and an engine that can time
# nothing) go to vLLM's serving, with the reason in the route header.
COVERED = {
    "response_format": ("json", "text", "verbose_json", "srt", "vtt"),
    "stream": "json and text, as transcript.text.delta / transcript.text.done events (running usage on each delta "
    "with stream_include_usage + stream_continuous_usage_stats)",
    "timestamp_granularities": "segment; word with MMCPU_STT_TIMESTAMPS=align (verbose_json)",
    "sampling": "greedy or sampled (temperature, top_p, top_k, min_p, penalties, seed); beam search: a 400",
    "audio": "any length vLLM decodes: 30 s windows cut as vLLM cuts them, or speech-only windows (chunking_strategy)",
    "language": "given, English for English-only models, else detected from the first window",
    "include[]": "logprobs, with json (OpenAI's logprobs array: token, logprob, bytes)",
}
TIMESTAMPED = ("verbose_json", "srt", "vtt")
# OpenAI's ``include[]``: the form field as it arrives (an unknown field to vLLM's request model); "logprobs" is
# answered for json, as OpenAI does.
INCLUDE_FIELDS = ("include[]", "include")
# openai-whisper's seek over a window's unfinished tail: at most this many re-decodes per window, each at least
# this far past the last, and none for a tail shorter than this (its open text is kept as decoded).
SEEK_MAX = 3
SEEK_MIN_PROGRESS_S = 1.0
SEEK_MIN_TAIL_S = 0.5


@dataclass
class Window:
    audio: np.ndarray
    start: float  # on the clip; with voice-activity chunking, on the speech timeline (the windows end to end)
    end: float


@dataclass
class Clip:
    windows: list[Window]
    duration: float
    speech_map: Any = None  # mmcpu.vad.SpeechMap with voice-activity chunking: speech timeline -> clip

    def to_clip(self, window: int, items: Sequence[Any], seek: bool = False) -> None:
        """Start/end (and seek) of one window's segments or words: speech timeline -> the clip."""
        if self.speech_map is None:
            return
        for item in items:
            item.start = self.speech_map.to_original(item.start, window=window)
            item.end = max(item.start, self.speech_map.to_original(item.end, window=window, is_end=True))
            if seek:  # the window's start in mel frames, in the clip
                item.seek = round(self.speech_map.to_original(self.windows[window].start, window=window) * 100)


def _vllm_envs() -> Any:
    from vllm import envs

    return envs


class SpeechServing:
    """The package's handler for one task (transcribe / translate) of one speech engine."""

    def __init__(self, engine_client: Any, core: Any, task: str) -> None:
        from vllm.model_executor.model_loader import get_model_cls
        from vllm.tokenizers import get_tokenizer

        from mmcpu import vad, whisper_align, whisper_timestamps
        from mmcpu.config import get_settings

        self.engine = engine_client
        self.core = core  # vLLM's serving object for this task: the delegate
        self.task = task
        self.model_config = core.model_config
        self.model_cls = cast(Any, get_model_cls(self.model_config))  # a SupportsTranscription class
        self.asr = self.model_cls.get_speech_to_text_config(self.model_config, task)
        self.default_sampling = self.model_config.get_diff_sampling_param()
        self.served_names = {path.name for path in core.models.base_model_paths}
        self.whisper = bool(getattr(self.model_cls, "supports_segment_timestamp", False))
        self.default_vad = vad.default_strategy(sorted(self.served_names))
        if self.default_vad is not None:
            vad.session()  # MMCPU_VAD_DEFAULT: a missing ONNX file fails the start, not a request
            logger.info("Voice-activity chunking is the default (MMCPU_VAD_DEFAULT).")
        self.tokenizer = None
        self.rules: dict[str, Any] | None = None
        if self.whisper:
            self.tokenizer = get_tokenizer(self.model_config.tokenizer, tokenizer_mode=self.model_config.tokenizer_mode)
            ids = self.tokenizer.convert_tokens_to_ids
            self.timestamp_begin, self.eot = ids("<|0.00|>"), self.tokenizer.eos_token_id
            if whisper_timestamps.FQCN in (self.model_config.logits_processors or []):
                self.rules = whisper_timestamps.request_args(self.timestamp_begin, self.eot, ids("<|notimestamps|>"))
        # The alignment method needs the model's alignment heads; without them the decode method serves.
        self.aligner: whisper_align.WordTimestamps | None = None
        if self.whisper and get_settings().stt_timestamps == "align":
            aligner = whisper_align.WordTimestamps(self.model_config, self.tokenizer)
            self.aligner = aligner if aligner.available else None
        settings = get_settings()
        self.guards = Guards(
            compression_ratio_threshold=settings.stt_compression_ratio_threshold,
            logprob_threshold=settings.stt_logprob_threshold,
            no_speech_threshold=settings.stt_no_speech_threshold,
            fallback=tuple(settings.stt_temperature_fallback),
        )
        # <|nospeech|> (<|nocaptions|> in the English-only checkpoints' vocabulary), for no_speech_prob.
        self.no_speech: int | None = None
        if self.tokenizer is not None:
            vocab = self.tokenizer.get_vocab()
            self.no_speech = vocab.get("<|nospeech|>", vocab.get("<|nocaptions|>"))
        if self.guards.no_speech_threshold is not None and (self.aligner is None or self.no_speech is None):
            logger.warning("MMCPU_STT_NO_SPEECH_THRESHOLD needs the alignment method and <|nospeech|>: it is off")
        # Decoding and resampling audio is CPU work: off the event loop, a few at a time.
        self.executor = ThreadPoolExecutor(
            max_workers=_vllm_envs().VLLM_MAX_AUDIO_PREPROCESS_WORKERS, thread_name_prefix="mmcpu-stt"
        )

    # --- what is covered ------------------------------------------------------------------------------------------
    def delegation(self, request: Any) -> str | None:
        """Why this request goes to vLLM's serving (a short reason for the route header), or None: the package
        answers it (or refuses it with a 400, :meth:`check`). Only what vLLM's own serving does as well or refuses
        correctly is handed on."""
        fmt = request.response_format
        if not self.whisper:
            return "model"
        if request.model and request.model not in self.served_names:
            return "model"  # LoRA adapters and unknown names: vLLM's serving resolves or refuses them
        if request.stream and fmt not in ("json", "text"):
            return None  # the package's 400 naming response_format: no format but text streams
        if fmt not in COVERED["response_format"]:
            return "response_format"  # diarized_json
        if fmt in TIMESTAMPED and self.aligner is None and self.rules is None:
            return "timestamp_rules"  # the engine runs without the processor and the model has no alignment heads
        return None

    def check(self, request: Any) -> Any:
        """400s (OpenAI's error schema, naming the parameter) for what the package does not serve; returns the
        request's voice-activity options (:mod:`mmcpu.vad`), or None for vLLM's fixed windows."""
        from vllm.exceptions import VLLMValidationError

        from mmcpu import vad

        fmt = request.response_format
        try:
            strategy = vad.request_strategy(request.model_extra, self.default_vad)
        except vad.StrategyError as exc:
            raise VLLMValidationError(str(exc), parameter=vad.PARAM) from None
        if request.use_beam_search:
            # vLLM's serving has beam search, but for Whisper it runs one engine request (the encoder included)
            # per token and does not stop at the end of the text: tens of seconds and "[Music]" to the token limit
            # on a 4 s clip (docs/api.md#the-speech-package). Timestamps, streams and VAD windows need a decode.
            raise VLLMValidationError(
                "use_beam_search is not served: Whisper is decoded greedily (temperature 0) or sampled",
                parameter="use_beam_search",
            )
        if request.stream and fmt not in ("json", "text"):
            raise VLLMValidationError(
                f"response_format {fmt!r} cannot be streamed: the stream's events carry text only (json or text)",
                parameter="response_format",
            )
        granularities = set(getattr(request, "timestamp_granularities", None) or [])
        if granularities - {"segment", "word"}:
            raise VLLMValidationError(
                f"timestamp_granularities takes 'segment' and 'word', not {sorted(granularities)}",
                parameter="timestamp_granularities",
            )
        if granularities and fmt not in TIMESTAMPED:
            raise VLLMValidationError(
                f"timestamp_granularities needs response_format 'verbose_json', not {fmt!r}",
                parameter="timestamp_granularities",
            )
        # srt / vtt are rendered from the segments: a granularity changes nothing there.
        if "word" in granularities and fmt == "verbose_json" and self.aligner is None:
            raise VLLMValidationError(
                "timestamp_granularities 'word' needs the alignment method (MMCPU_STT_TIMESTAMPS=align) and a model "
                "whose generation config has alignment_heads",
                parameter="timestamp_granularities",
            )
        include = self.include(request)
        if include - {"logprobs"}:
            raise VLLMValidationError(
                f"include[] takes 'logprobs', not {sorted(include - {'logprobs'})}", parameter="include[]"
            )
        if include and (fmt != "json" or request.stream):
            raise VLLMValidationError(
                "include[]=logprobs needs response_format 'json', not streamed", parameter="include[]"
            )
        unknown = sorted(k for k in request.model_extra or {} if k not in INCLUDE_FIELDS and not vad.is_field(k))
        if unknown:
            # As vLLM's serving: fields its request model does not know are ignored (it logs them too).
            logger.warning("mmcpu.stt ignores unknown field(s) %s", ", ".join(unknown))
        return strategy if self.asr.allow_audio_chunking else None

    @staticmethod
    def include(request: Any) -> set[str]:
        """OpenAI's ``include[]`` values of the request (a form field given once or repeated)."""
        extra = request.model_extra or {}
        out: set[str] = set()
        for key in INCLUDE_FIELDS:
            value = extra.get(key)
            if value is not None:
                out.update([value] if isinstance(value, str) else [str(v) for v in value])
        return out

    def logprobs(self, finals: Sequence[Any]) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs`` array of a json answer: per generated text token, its text, log probability and
        UTF-8 bytes (a token may hold part of a character: its own bytes, not the decoded text's)."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        assert self.tokenizer is not None
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        out = []
        for final in finals:
            gen = final.outputs[0]
            for token, lp in zip(gen.token_ids, gen.logprobs or [], strict=False):
                if token >= self.eot:
                    continue
                piece = self.tokenizer.convert_ids_to_tokens(token)
                raw = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
                entry = lp.get(token) if lp else None
                out.append(
                    {
                        "token": raw.decode("utf-8", errors="replace"),
                        "logprob": entry.logprob if entry is not None else None,
                        "bytes": list(raw),
                    }
                )
        return out

    def _english_only(self) -> bool:
        check = getattr(self.model_cls, "is_english_only", None)
        return bool(check and check(self.model_config))

    # --- the work -------------------------------------------------------------------------------------------------
    async def windows(self, data: bytes, strategy: Any = None) -> Clip:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._windows, data, strategy)

    def _windows(self, data: bytes, strategy: Any = None) -> Clip:
        """The clip decoded at the model's rate and cut into windows as vLLM's serving cuts it; with a
        voice-activity ``strategy`` (:mod:`mmcpu.vad`), windows of speech only cut at pauses (none for a clip
        without speech)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.multimodal.audio import get_audio_duration, split_audio
        from vllm.multimodal.media.audio import load_audio

        from mmcpu import vad

        envs = _vllm_envs()
        try:
            with io.BytesIO(data) as buf:
                y, sr = load_audio(
                    buf,
                    sr=self.asr.sample_rate,
                    mono=True,
                    max_duration_s=envs.VLLM_MAX_AUDIO_DECODE_DURATION_S,
                    max_decode_bytes=envs.VLLM_MAX_AUDIO_DECODE_BYTES,
                )
        except ValueError as exc:
            raise VLLMValidationError(str(exc), parameter="file") from None
        except Exception:
            raise VLLMValidationError("Invalid or unsupported audio file.", parameter="file") from None
        if y.size == 0:
            # Whisper would pad nothing to 30 s of silence and make words up.
            raise VLLMValidationError("Audio file contains no samples.", parameter="file", value=0)
        duration = get_audio_duration(y=y, sr=sr)
        clip = self.asr.max_audio_clip_s
        if strategy is not None:
            plan = vad.plan(y, int(sr), strategy, clip or 30)
            logger.info(
                "Voice-activity chunking: %.1f s of speech in %d window(s), of %.1f s of audio.",
                plan.speech_s,
                len(plan.chunks),
                duration,
            )
            ends = [a + d for a, d in zip(plan.offsets, plan.speech_map.window_durations(), strict=True)]
            vad_windows = [Window(c, a, b) for c, a, b in zip(plan.chunks, plan.offsets, ends, strict=True)]
            return Clip(vad_windows, duration, plan.speech_map)
        if self.asr.allow_audio_chunking and clip is not None and duration > clip:
            chunks = split_audio(
                audio_data=y,
                sample_rate=int(sr),
                max_clip_duration_s=clip,
                overlap_duration_s=self.asr.overlap_chunk_second,
                min_energy_window_size=self.asr.min_energy_split_window_size,
            )
        else:
            chunks = [y]
        out, start = [], 0.0
        for chunk in chunks:  # split_audio's chunks are contiguous
            end = min(start + chunk.shape[-1] / self.asr.sample_rate, duration)
            out.append(Window(chunk, start, end))
            start = end
        return Clip(out, duration)

    def validate(self, request: Any) -> None:
        from vllm.exceptions import VLLMValidationError

        try:
            request.language = self.model_cls.validate_language(request.language)
            if getattr(request, "to_language", None):
                request.to_language = self.model_cls.validate_language(request.to_language)
        except VLLMValidationError:
            raise
        except ValueError as exc:
            raise VLLMValidationError(str(exc), parameter="language", value=request.language) from None
        if request.language is None and self._english_only():
            request.language = "en"  # an English-only model has no language tokens: it hears English

    def prompt(self, request: Any, audio: np.ndarray, timestamped: bool) -> Any:
        """The model class's own prompt for one window; timestamped: without <|notimestamps|>, so that the model
        places timestamps (from the first, within 1 s, under the rules)."""
        prompt = self.model_cls.get_generation_prompt(
            request.build_stt_params(
                audio=audio, stt_config=self.asr, model_config=self.model_config, task_type=self.task
            )
        )
        if timestamped:
            decoder = dict(prompt["decoder_prompt"])
            decoder["prompt"] = decoder["prompt"].replace("<|notimestamps|>", "")
            prompt = {**prompt, "decoder_prompt": decoder}
        return prompt

    def sampling(self, request: Any, timestamped: bool, logprobs: bool = False) -> Any:
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

        max_tokens = get_max_tokens(
            self.model_config.max_model_len, request.max_completion_tokens, 0, self.default_sampling
        )
        params = request.to_sampling_params(max_tokens, self.default_sampling)
        if timestamped or logprobs:
            params.logprobs = 1  # each segment's avg_logprob (the sampled token's: the decode is unchanged)
        if timestamped:
            params.extra_args = {**(params.extra_args or {}), **(self.rules or {})}
        return params

    async def detect_language(self, request: Any, clip: Clip) -> None:
        """A multilingual model without ``language``: one engine request on the first window (the model class's
        detection prompt, one token among the language tokens), as vLLM's serving detects it; "" when the clip has
        no speech (voice-activity chunking left no window)."""
        from vllm.sampling_params import SamplingParams

        if request.language is not None or not getattr(self.model_cls, "supports_explicit_language_detection", False):
            return
        if not clip.windows:
            request.language = ""
            return
        prompt = self.model_cls.get_language_detection_prompt(clip.windows[0].audio, self.asr)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            allowed_token_ids=self.model_cls.get_language_token_ids(self.tokenizer),
        )
        rid = f"mmcpu-stt-{self.task}-{uuid.uuid4().hex}-lang"
        try:
            final = await self._final(prompt, params, rid)
        except BaseException:
            await asyncio.gather(self.engine.abort([rid]), return_exceptions=True)
            raise
        request.language = self.model_cls.parse_language_detection_output(
            list(final.outputs[0].token_ids), self.tokenizer
        )
        logger.info("mmcpu.stt detected language %r", request.language)

    async def prepare(self, request: Any, data: bytes) -> Clip:
        """Checks (400s before any audio is decoded), the clip's windows and the language."""
        strategy = self.check(request)
        self.validate(request)
        clip = await self.windows(data, strategy)
        await self.detect_language(request, clip)
        return clip

    async def _guarded(
        self,
        request: Any,
        window: Window,
        timestamped: bool,
        params: Any,
        rid: str,
        ids: list[str],
        temperatures: list[float | None],
        index: int,
    ) -> Any:
        """One window's decode under Whisper's guards (:mod:`mmcpu.stt.guards`; off unless set): decoded again at
        the fallback's next temperature while its text loops or its logprob is low (``temperatures[index]`` then
        records the one kept); taken as silence (no text) when ``<|nospeech|>`` is likely and the decode not
        confident. Every retry's request id joins ``ids``, so a cancelled request aborts it too."""
        prompt = self.prompt(request, window.audio, timestamped)
        final = await self._final(prompt, params, rid)
        schedule = self.guards.schedule(params.temperature)
        for attempt, temperature in enumerate([*schedule[1:], None], start=1):
            out = final.outputs[0]
            if await self._silence(window, out, index):
                # As openai-whisper: a silent window is not retried (its low logprob is the silence's).
                out.text, out.token_ids, out.logprobs = "", [self.eot], []
                break
            why = self.guards.needs_fallback(self.model_cls.post_process_output(out.text), self._logprobs(out))
            if why is None or temperature is None:
                break
            logger.info("mmcpu.stt window %d: %s, decoded again at temperature %g", index, why, temperature)
            retry = params.clone()
            retry.temperature = temperature
            ids.append(f"{rid}-t{attempt}")
            final = await self._final(prompt, retry, ids[-1])
            temperatures[index] = temperature
        return final

    async def _silence(self, window: Window, out: Any, index: int) -> bool:
        """The no-speech rule on one decode (off unless MMCPU_STT_NO_SPEECH_THRESHOLD): only a decode that is not
        confident pays the engine's encoder pass for no_speech_prob."""
        if self.guards.no_speech_threshold is None or self.aligner is None or self.no_speech is None:
            return False
        logprobs = self._logprobs(out)
        if not self.guards.is_silence(1.0, logprobs):  # confident: speech whatever no_speech_prob is
            return False
        probability = await self.no_speech_probability(window)
        if self.guards.is_silence(probability, logprobs):
            logger.info("mmcpu.stt window %d: no speech (p=%.2f), its text dropped", index, probability)
            return True
        return False

    def _logprobs(self, out: Any) -> list[float | None]:
        """The sampled tokens' logprobs (text tokens and <|endoftext|>, as openai-whisper averages them)."""
        return [
            (lp.get(t).logprob if lp and lp.get(t) is not None else None)
            for t, lp in zip(out.token_ids, out.logprobs or [], strict=False)
        ]

    async def no_speech_probability(self, window: Window) -> float:
        """openai-whisper's no_speech_prob of one window: the engine's encoder pass and one decoder position
        (the alignment's worker method with <|startoftranscript|> alone)."""
        from mmcpu.whisper_align import WORKER_METHOD

        assert self.aligner is not None and self.no_speech is not None
        loop = asyncio.get_running_loop()
        mel, num_frames = await loop.run_in_executor(self.executor, self.aligner.features, window.audio)
        heads = [list(h) for h in self.aligner.heads or []]
        [(_, _, probability)] = await self.engine.collective_rpc(
            WORKER_METHOD, args=(mel.tobytes(), list(mel.shape), [self.aligner.sot], heads, num_frames, self.no_speech)
        )
        return float(probability)

    async def _final(self, prompt: Any, params: Any, request_id: str) -> Any:
        final = None
        async for out in self.engine.generate(prompt, params, request_id):
            final = out
        assert final is not None and final.finished
        return final

    async def answer(self, request: Any, data: bytes) -> dict[str, Any] | str:
        """A whole (non-streamed) answer: the response's JSON document, or the text of text / srt / vtt."""
        clip = await self.prepare(request, data)
        windows, duration = clip.windows, clip.duration
        fmt = request.response_format
        aligned = fmt in TIMESTAMPED and self.aligner is not None
        timestamped = fmt in TIMESTAMPED and not aligned  # decoded under the timestamp rules
        want_logprobs = fmt == "json" and "logprobs" in self.include(request)
        guarded = bool(self.guards.fallback) or self.guards.no_speech_threshold is not None
        params = self.sampling(request, timestamped, logprobs=aligned or want_logprobs or guarded)
        base = f"mmcpu-stt-{self.task}-{uuid.uuid4().hex}"
        ids = [f"{base}-{i}" for i in range(len(windows))]
        temperatures: list[float | None] = [None] * len(windows)
        try:
            finals = await asyncio.gather(
                *(
                    self._guarded(request, w, timestamped, params, rid, ids, temperatures, i)
                    for i, (w, rid) in enumerate(zip(windows, ids, strict=False))
                )
            )
        except BaseException:
            # The client went away (the route's cancellation) or one window failed: stop every window's decode.
            await asyncio.gather(self.engine.abort(ids), return_exceptions=True)
            raise
        usage = {"type": "duration", "seconds": math.ceil(duration)}  # OpenAI rounds up
        texts = [self.model_cls.post_process_output(f.outputs[0].text) for f in finals]
        if aligned:
            granularities = set(getattr(request, "timestamp_granularities", None) or [])
            timed = await asyncio.gather(
                *(
                    self.align(request, w, f, t, temperature)
                    for w, f, t, temperature in zip(windows, finals, texts, temperatures, strict=True)
                )
            )
            for index, (window_segments, window_words) in enumerate(timed):
                clip.to_clip(index, window_segments, seek=True)
                clip.to_clip(index, window_words)
            segments = [s for window_segments, _ in timed for s in window_segments]
            if fmt in ("srt", "vtt"):
                return formats.subtitles(segments, fmt)
            # The text is its segments (json's window texts cut at words): json's words, no leading space.
            doc = self.verbose(request, "".join(s.text for s in segments).strip(), duration, segments, usage)
            if "word" in granularities:
                doc["words"] = [
                    {"word": w.word, "start": w.start, "end": w.end} for _, window_words in timed for w in window_words
                ]
            return doc
        if not timestamped:
            text = self.separator(request).join(texts)
            if fmt == "text":
                return text.strip() + "\n"
            doc = {"text": text, **({"usage": usage} if self.task == "transcribe" else {})}
            if want_logprobs:
                doc["logprobs"] = self.logprobs(finals)
            return doc
        try:
            per_window = await asyncio.gather(
                *(
                    self.seek(request, params, w, f, f"{rid}-seek", ids)
                    for w, f, rid in zip(windows, finals, list(ids), strict=False)
                )
            )
        except BaseException:
            await asyncio.gather(self.engine.abort(ids), return_exceptions=True)
            raise
        for index, window_segments in enumerate(per_window):
            clip.to_clip(index, window_segments, seek=True)
        segments = [s for window_segments in per_window for s in window_segments]
        if fmt in ("srt", "vtt"):
            return formats.subtitles(segments, fmt)
        # The text is its segments: the same words.
        return self.verbose(request, "".join(s.text for s in segments).strip(), duration, segments, usage)

    def verbose(
        self, request: Any, text: str, duration: float, segments: list[formats.Segment], usage: dict[str, Any]
    ) -> dict[str, Any]:
        temperature = request.temperature or 0.0
        doc = {
            "text": text,
            "language": request.language,
            "duration": duration,
            "segments": [s.as_openai(i, temperature) for i, s in enumerate(segments)],
        }
        if self.task == "transcribe":
            doc["usage"] = usage
        return doc

    async def align(
        self, request: Any, window: Window, final: Any, text: str, temperature: float | None = None
    ) -> tuple[list[formats.Segment], list[Word]]:
        """A window's segments and words from json's decode of it (``final``, whose text is ``text``): one
        teacher-forced alignment forward of that decode's tokens in the engine (``collective_rpc``), then DTW and
        segments cut from its words on the API server (off the event loop)."""
        from mmcpu.whisper_align import WORKER_METHOD

        assert self.aligner is not None
        out = final.outputs[0]
        tokens = [t for t in out.token_ids if t < self.eot]
        if not tokens:
            return [], []
        loop = asyncio.get_running_loop()
        mel, num_frames = await loop.run_in_executor(self.executor, self.aligner.features, window.audio)
        ids, n_sot = self.aligner.alignment_tokens(final.prompt_token_ids or [], tokens)
        heads = [list(h) for h in self.aligner.heads or []]
        # The same encoder pass also gives the window's no_speech_prob (openai-whisper's, at <|startoftranscript|>).
        [(raw, shape, *no_speech)] = await self.engine.collective_rpc(
            WORKER_METHOD, args=(mel.tobytes(), list(mel.shape), ids, heads, num_frames, self.no_speech)
        )
        # Rows from <|notimestamps|> to the last text token (the <|endoftext|> row predicts nothing).
        matrix = np.frombuffer(raw, dtype=np.float32).reshape(tuple(shape))[n_sot:-1]
        logprobs = [
            (lp.get(t).logprob if lp and lp.get(t) is not None else None)
            for t, lp in zip(out.token_ids, out.logprobs or [], strict=False)
            if t < self.eot
        ]
        segments, words = await loop.run_in_executor(
            self.executor, self._aligned_segments, request, window, matrix, tokens, logprobs, text
        )
        for segment in segments:
            segment.no_speech_prob = round(float(no_speech[0]), 6) if no_speech else None
            segment.temperature = temperature
        return segments, words

    def _aligned_segments(
        self,
        request: Any,
        window: Window,
        matrix: np.ndarray,
        tokens: list[int],
        logprobs: list[float | None],
        text: str,
    ) -> tuple[list[formats.Segment], list[Word]]:
        from mmcpu.whisper_align import cut_long_words, split_words, token_start_times, words_for_window

        assert self.aligner is not None
        decode = self.aligner.decode
        starts = token_start_times(matrix)
        # Pass 1: Whisper's words with their aligned times (over-long words at sentence ends cut, so that pauses
        # show), to find where segments end.
        pieces = split_words(tokens, decode, request.language)
        words, pos, bounds = [], 0, [0]
        for piece, toks in pieces:
            words.append(Word(piece, toks, float(starts[pos]), float(starts[pos + len(toks)])))
            pos += len(toks)
            bounds.append(pos)  # token index after each word
        cut_long_words(words, [0] * len(words), None)
        spans = formats.trim_pauses([(w.word, w.start, w.end) for w in words])
        groups = formats.group_words(spans)
        per_segment = [tokens[bounds[g.start] : bounds[g.stop]] for g in groups]
        # Pass 2: OpenAI's words per segment, the words at a segment's ends corrected by its times (as Whisper).
        duration = len(window.audio) / self.asr.sample_rate
        timed = words_for_window(
            matrix,
            per_segment,
            decode,
            language=request.language,
            offset=window.start,
            duration=duration,
            segment_times=[(spans[g.start][1], spans[g.stop - 1][2]) for g in groups],
            starts=starts,
        )
        segments: list[formats.Segment] = []
        cuts = self._text_cuts(text, tokens, [bounds[g.start] for g in groups] + [len(tokens)])
        for index, (group, seg_words) in enumerate(zip(groups, timed, strict=True)):
            start = seg_words[0].start if seg_words else round(window.start + spans[group.start][1], 3)
            end = seg_words[-1].end if seg_words else round(window.start + spans[group.stop - 1][2], 3)
            scores = [x for x in logprobs[bounds[group.start] : bounds[group.stop]] if x is not None]
            segments.append(
                formats.Segment(
                    start,
                    max(start, end),
                    cuts[index],
                    per_segment[index],
                    sum(scores) / max(1, len(scores)),
                    round(window.start * 100),
                )
            )
        return segments, [w for seg_words in timed for w in seg_words]

    def _text_cuts(self, text: str, tokens: list[int], at: list[int]) -> list[str]:
        """``text`` (json's text of the window) cut before the tokens at indices ``at`` (ascending, the first 0,
        the last len(tokens)): where the decoded prefix is a prefix of ``text``; otherwise (a text post-processed
        unlike a plain decode) each piece is decoded on its own."""
        assert self.aligner is not None
        decode = self.aligner.decode
        offsets = []
        for index in at:
            prefix = decode(tokens[:index]) if index else ""
            offsets.append(len(prefix) if text.startswith(prefix) else None)
        if offsets[-1] != len(text) or any(o is None for o in offsets):
            return [decode(tokens[a:b]) for a, b in zip(at, at[1:], strict=False)]
        cut = [int(o or 0) for o in offsets]
        return [text[a:b] for a, b in zip(cut, cut[1:], strict=False)]

    async def seek(
        self, request: Any, params: Any, window: Window, final: Any, rid: str, ids: list[str]
    ) -> list[formats.Segment]:
        """A window's segments. Under the timestamp rules the model may end a window's decode unfinished: it leaves
        the speech after its last timestamp to a next window, which vLLM's precut windows do not have, so those
        words would be lost. As openai-whisper's seek does, the window is then cut at that timestamp and the rest
        of its audio decoded again from there (at most SEEK_MAX times), until a decode ends closed, makes no
        progress or brings no text; the open text is then kept as decoded, ending at the window's end."""
        from mmcpu.whisper_timestamps import seek_index

        out: list[formats.Segment] = []
        start, tokens = window.start, final.outputs[0]
        for attempt in range(SEEK_MAX + 1):
            cut = seek_index(tokens.token_ids, self.timestamp_begin, self.eot) if attempt < SEEK_MAX else None
            if cut is not None:
                seek_at = start + formats.TIMESTAMP_STEP_S * (tokens.token_ids[cut] - self.timestamp_begin)
                if seek_at >= start + SEEK_MIN_PROGRESS_S and window.end - seek_at >= SEEK_MIN_TAIL_S:
                    tail = window.audio[round((seek_at - window.start) * self.asr.sample_rate) :]
                    ids.append(f"{rid}{attempt}")  # aborted with the others
                    tail_final = await self._final(self.prompt(request, tail, True), params, ids[-1])
                    tail_tokens = tail_final.outputs[0]
                    if any(t < self.eot for t in tail_tokens.token_ids):  # the tail brought text
                        out += self.segments(tokens, start, window.end, upto=cut + 1)
                        start, tokens = seek_at, tail_tokens
                        continue
            out += self.segments(tokens, start, window.end)
            return out
        return out

    def segments(self, out: Any, start: float, end: float, upto: int | None = None) -> list[formats.Segment]:
        logprobs = [
            (lp.get(t).logprob if lp and lp.get(t) is not None else None)
            for t, lp in zip(out.token_ids, out.logprobs or [], strict=False)
        ]
        return formats.window_segments(
            out.token_ids[:upto],
            logprobs,
            self._decode,
            timestamp_begin=self.timestamp_begin,
            eot=self.eot,
            window_start=start,
            window_end=end,
        )

    def _decode(self, tokens: list[int]) -> str:
        assert self.tokenizer is not None
        return str(self.tokenizer.decode(tokens))

    def separator(self, request: Any) -> str:
        """Between windows' texts: nothing for languages written without spaces, else one space (as vLLM)."""
        language = (request.language or "").lower()
        return "" if language and language in self.model_cls.no_space_languages else " "

    async def stream(self, request: Any, data: bytes) -> AsyncIterator[str]:
        """OpenAI's typed stream as server-sent events: transcript.text.delta events, then transcript.text.done
        with the whole text and the token usage, then [DONE]. Windows are decoded one after another, so the deltas
        come in the clip's order. Validation and audio errors come before the first byte (a 4xx)."""
        clip = await self.prepare(request, data)
        return self._events(request, clip.windows, clip.duration)

    async def _events(self, request: Any, windows: Sequence[Window], duration: float) -> AsyncIterator[str]:
        params = self.sampling(request, False)
        separator = self.separator(request)
        audio_tokens = self.model_cls.get_num_audio_tokens(duration, self.asr, self.model_config) or 0
        prompt_tokens = [0] * len(windows)
        output_tokens = 0
        pieces: list[str] = []
        base = f"mmcpu-stt-{self.task}-{uuid.uuid4().hex}"
        current = ""
        # vLLM's option: the running usage on every delta (the done event always has it, as OpenAI's).
        continuous = bool(
            (getattr(self.core, "enable_force_include_usage", False) or request.stream_include_usage)
            and request.stream_continuous_usage_stats
        )

        def running() -> StreamUsage:
            text_tokens = sum(prompt_tokens)
            return StreamUsage(
                input_tokens=text_tokens + audio_tokens,
                output_tokens=output_tokens,
                total_tokens=text_tokens + audio_tokens + output_tokens,
                input_token_details=StreamInputTokenDetails(audio_tokens=audio_tokens, text_tokens=text_tokens),
            )

        try:
            for i, window in enumerate(windows):
                current = f"{base}-{i}"
                post = self.model_cls.get_streaming_post_processor_cls()()
                first = True
                async for res in self.engine.generate(self.prompt(request, window.audio, False), params, current):
                    if res.prompt_token_ids is not None:
                        prompt_tokens[i] = len(res.prompt_token_ids)
                    out = res.outputs[0]
                    output_tokens += len(out.token_ids)
                    delta = post.process_delta(out.text, out.finish_reason is not None)
                    if not delta:
                        continue  # OpenAI sends no empty deltas
                    if i > 0 and first:
                        delta = separator + delta
                    first = False
                    pieces.append(delta)
                    event = TextDeltaEvent(delta=delta, usage=running() if continuous else None)
                    yield f"data: {event.model_dump_json(exclude_none=True)}\n\n"
            done = TextDoneEvent(text="".join(pieces), usage=running())
            yield f"data: {done.model_dump_json(exclude_none=True)}\n\n"
        except asyncio.CancelledError:
            await asyncio.gather(self.engine.abort([current]), return_exceptions=True)
            raise
        except Exception as exc:  # the status is sent: the error goes as an event, as vLLM's stream does
            logger.exception("mmcpu.stt stream failed")
            error = {
                "error": {
                    "message": str(exc) or type(exc).__name__,
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
            yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)
