"""Voice-activity chunking for speech-to-text (``chunking_strategy``): Silero VAD before the engine.

The speech package (mmcpu.stt) calls this in vLLM's API-server process, on the thread pool where it already
decodes audio. Long audio is then cut at pauses instead of at fixed 30 s, and only speech is encoded:

1. :func:`speech_probabilities`: Silero VAD v6 (faster-whisper 1.2.1's packaged ONNX file, MIT; fetched by
   ``python -m mmcpu_dev.fixtures silero-vad`` into ``MMCPU_MODELS_DIR/silero-vad/``) over 512-sample frames at
   16 kHz, each with the 64 samples before it, the LSTM state carried across frames - as faster-whisper runs it.
2. :func:`speech_spans`: the frames' probabilities to padded speech spans (faster-whisper's hysteresis: start at
   ``threshold``, end after ``min_silence_ms`` below ``threshold - 0.15``; no span longer than a window).
3. :func:`windows`: consecutive spans packed into as few windows of at most the model's 30 s as possible, cut
   at the longest pauses; each window is the concatenation of its spans' samples (silence removed).
4. :class:`SpeechMap`: times in the concatenated windows back to the original clip, piecewise through the removed
   silence (faster-whisper's ``SpeechTimestampsMap``). Segment times use it, and word times can use the same
   :meth:`SpeechMap.to_original`.

No speech at all = no window: the serving answers an empty text without running the engine (Whisper invents
words for silence).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_RATE = 16_000  # Silero VAD v6 at 16 kHz: 512-sample frames (32 ms) with 64 samples of context
FRAME = 512
CONTEXT = 64
STATE_SHAPE = (1, 1, 128)
MODEL_FILE = "silero_vad_v6.onnx"
MODEL_DIR = "silero-vad"  # under MMCPU_MODELS_DIR
PARAM = "chunking_strategy"  # the request field, and the `param` of its 400s
FIELDS = ("type", "threshold", "prefix_padding_ms", "silence_duration_ms")
# Frames per onnxruntime call: one call runs the LSTM over the whole batch with the state carried in order, so
# fewer, larger calls cost less; 10k frames (320 s of audio, ~23 MB of float32 input) bounds the memory.
BATCH_FRAMES = 10_000


class VadUnavailable(RuntimeError):
    """The VAD cannot run here (no ONNX file, no onnxruntime): a deployment problem, not the request's."""


class StrategyError(ValueError):
    """A malformed ``chunking_strategy`` (the serving answers 400 with param ``chunking_strategy``)."""


@dataclass(frozen=True)
class Options:
    """How speech is found. ``auto`` = faster-whisper's ``vad_filter=True`` defaults; a ``server_vad`` object sets
    ``threshold``, ``prefix_padding_ms`` (padding kept on both sides of a span) and ``silence_duration_ms`` (the
    pause that ends a span), OpenAI's fields."""

    threshold: float = 0.5
    pad_ms: int = 400
    min_silence_ms: int = 2000

    @property
    def neg_threshold(self) -> float:
        return max(self.threshold - 0.15, 0.01)


AUTO = Options()
# OpenAI's server_vad defaults for fields a request leaves out (its Realtime/transcription VAD docs).
# The Realtime API's bound of the same fields (mmcpu.realtime.protocol): padding or a pause beyond 10 s is no VAD.
MAX_MS = 10_000
SERVER_VAD_DEFAULTS = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 200}


# --- the request field ----------------------------------------------------------------------------------------
def parse_strategy(value: Any, bracketed: Mapping[str, Any] | None = None) -> Options | None:
    """``chunking_strategy`` as a request sends it, to :class:`Options` (None: not set).

    ``value``: the form field - ``"auto"``, a JSON object, or an already parsed dict. ``bracketed``: the fields of
    an object sent the way OpenAI's SDKs send one in a multipart form (``chunking_strategy[type]=server_vad``),
    keyed by the name inside the brackets. Anything else raises :class:`StrategyError`."""
    if bracketed:
        if value is not None:
            raise StrategyError(f"{PARAM} given both as a value and as {PARAM}[...] fields")
        value = dict(bracketed)
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return AUTO
        if not text.startswith("{"):
            raise StrategyError(f"unknown {PARAM} {value!r}: expected 'auto' or a server_vad object")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StrategyError(f"{PARAM} is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise StrategyError(f"{PARAM} must be 'auto' or an object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise StrategyError(f"unknown {PARAM} field(s) {', '.join(unknown)}; expected {', '.join(FIELDS)}")
    if value.get("type") != "server_vad":
        raise StrategyError(f"{PARAM}.type must be 'server_vad', not {value.get('type')!r}")
    fields = {**SERVER_VAD_DEFAULTS, **{k: v for k, v in value.items() if k != "type"}}
    threshold = _number(fields["threshold"], "threshold", integer=False)
    if not 0.0 <= threshold <= 1.0:
        raise StrategyError(f"{PARAM}.threshold must be between 0 and 1, not {threshold}")
    padding = _number(fields["prefix_padding_ms"], "prefix_padding_ms", integer=True)
    silence = _number(fields["silence_duration_ms"], "silence_duration_ms", integer=True)
    for name, ms in (("prefix_padding_ms", padding), ("silence_duration_ms", silence)):
        if not 0 <= ms <= MAX_MS:
            raise StrategyError(f"{PARAM}.{name} must be 0 to {MAX_MS} milliseconds, not {ms}")
    return Options(threshold=float(threshold), pad_ms=int(padding), min_silence_ms=int(silence))


def _number(value: Any, name: str, *, integer: bool) -> float:
    """A form field arrives as text, a JSON object's as a number: accept both, but not bools or fractions of ms."""
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise StrategyError(f"{PARAM}.{name} must be {kind}, not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        kind = "an integer" if integer else "a number"
        raise StrategyError(f"{PARAM}.{name} must be {kind}, not {value!r}")
    if not math.isfinite(value):
        raise StrategyError(f"{PARAM}.{name} must be finite, not {value!r}")
    return value


def is_field(name: str) -> bool:
    """A request's form field that belongs to ``chunking_strategy`` (the value or one ``[field]``)."""
    return name == PARAM or (name.startswith(PARAM + "[") and name.endswith("]"))


def request_strategy(extra: Mapping[str, Any] | None, default: Options | None) -> Options | None:
    """The strategy of one request from its extra form fields (vLLM's request models keep unknown fields), else
    ``default`` (:func:`default_strategy`)."""
    extra = extra or {}
    prefix = PARAM + "["
    bracketed = {k[len(prefix) : -1]: v for k, v in extra.items() if k.startswith(prefix) and k.endswith("]")}
    options = parse_strategy(extra.get(PARAM), bracketed)
    return default if options is None else options


def default_strategy(served_names: Iterable[str]) -> Options | None:
    """``auto`` when MMCPU_VAD_DEFAULT names one of the engine's served models (or is ``*``), else None: vLLM's
    fixed 30 s windows, exactly as without this module. The engine's launcher passes its environment on to vLLM's
    API server, which calls this once at start."""
    from mmcpu.config import get_settings

    listed = get_settings().vad_default
    if "*" in listed or set(listed) & set(served_names):
        return AUTO
    return None


# --- Silero VAD -------------------------------------------------------------------------------------------------
def model_path() -> Path:
    from mmcpu.config import get_settings

    return get_settings().models_dir / MODEL_DIR / MODEL_FILE


_session = None
_session_lock = threading.Lock()


def load(path: Path):
    """An onnxruntime session of the Silero VAD model at ``path``. One intra-op thread: the model is a small LSTM
    over 32 ms frames that runs hundreds of times faster than real time on one core, and this process shares the
    CPUs with the engine's compute threads; more threads would only add synchronisation and contend with them."""
    path = Path(path)
    if not path.is_file():
        raise VadUnavailable(
            f"Silero VAD model not found at {path}: chunking_strategy needs it (set MMCPU_MODELS_DIR, or fetch "
            "it with `python -m mmcpu_dev.fixtures silero-vad`, which `make models` runs)"
        )
    try:
        import onnxruntime
    except ImportError as exc:
        raise VadUnavailable(f"chunking_strategy needs onnxruntime, which cannot be imported: {exc}") from exc
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def session() -> Any:
    """The process's one session (:func:`load` of :func:`model_path`, on first use). onnxruntime runs one session
    from several threads at once; each call here passes its own LSTM state."""
    global _session
    if _session is None:
        with _session_lock:
            if _session is None:
                _session = load(model_path())
    return _session


def speech_probabilities(audio: np.ndarray, sess=None) -> np.ndarray:
    """Speech probability of each 512-sample frame of 16 kHz ``audio`` (the last frame zero-padded)."""
    sess = session() if sess is None else sess
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if audio.size == 0:
        return np.zeros(0, dtype=np.float32)
    padded = np.pad(audio, (0, -audio.size % FRAME))
    frames = padded.reshape(-1, FRAME)
    # Each frame is fed with the last 64 samples of the frame before it (zeros before the first).
    context = np.zeros((frames.shape[0], CONTEXT), dtype=np.float32)
    context[1:] = frames[:-1, -CONTEXT:]
    batched = np.concatenate([context, frames], axis=1)
    h = np.zeros(STATE_SHAPE, dtype=np.float32)
    c = np.zeros(STATE_SHAPE, dtype=np.float32)
    out = []
    for i in range(0, batched.shape[0], BATCH_FRAMES):
        probs, h, c = sess.run(None, {"input": batched[i : i + BATCH_FRAMES], "h": h, "c": c})
        out.append(np.asarray(probs, dtype=np.float32).reshape(-1))
    return np.concatenate(out)


# --- spans, windows and the time map ------------------------------------------------------------------------------
def speech_spans(
    probs: np.ndarray,
    n_samples: int,
    options: Options = AUTO,
    *,
    max_span_s: float = math.inf,
    sample_rate: int = SAMPLE_RATE,
) -> list[tuple[int, int]]:
    """Padded speech spans ``[(start, end), ...]`` in samples from per-frame probabilities: faster-whisper 1.2.1's
    ``get_speech_timestamps`` (the same hysteresis, minimum silence, splitting of over-long spans at their last
    pause of 98 ms or more, and padding that splits gaps shorter than two paddings in the middle). Spans are sorted,
    disjoint and inside ``[0, n_samples]``; with ``max_span_s`` none is longer than that."""
    pad = sample_rate * options.pad_ms / 1000
    max_speech = sample_rate * max_span_s - FRAME - 2 * pad
    min_silence = sample_rate * options.min_silence_ms / 1000
    min_silence_at_max = sample_rate * 98 / 1000
    threshold, neg_threshold = options.threshold, options.neg_threshold

    triggered = False
    spans: list[list[int]] = []
    start = 0
    temp_end = prev_end = next_start = 0
    for i, p in enumerate(np.asarray(probs, dtype=np.float64)):
        pos = FRAME * i
        if p >= threshold and temp_end:
            temp_end = 0
            if next_start < prev_end:
                next_start = pos
        if p >= threshold and not triggered:
            triggered, start = True, pos
            continue
        if triggered and pos - start > max_speech:
            if prev_end:
                spans.append([start, prev_end])
                if next_start < prev_end:  # silence since prev_end: the next span starts at the next speech
                    triggered = False
                else:
                    start = next_start
                prev_end = next_start = temp_end = 0
            else:  # no pause at all: cut here
                spans.append([start, pos])
                prev_end = next_start = temp_end = 0
                triggered = False
                continue
        if p < neg_threshold and triggered:
            if not temp_end:
                temp_end = pos
            if pos - temp_end > min_silence_at_max:
                prev_end = temp_end
            if pos - temp_end < min_silence:
                continue
            spans.append([start, temp_end])
            prev_end = next_start = temp_end = 0
            triggered = False
    if triggered and n_samples - start > 0:
        spans.append([start, n_samples])

    for i, span in enumerate(spans):
        if i == 0:
            span[0] = int(max(0, span[0] - pad))
        if i != len(spans) - 1:
            gap = spans[i + 1][0] - span[1]
            if gap < 2 * pad:
                span[1] += int(gap // 2)
                spans[i + 1][0] = int(max(0, spans[i + 1][0] - gap // 2))
            else:
                span[1] = int(min(n_samples, span[1] + pad))
                spans[i + 1][0] = int(max(0, spans[i + 1][0] - pad))
        else:
            span[1] = int(min(n_samples, span[1] + pad))
    return [(int(a), int(b)) for a, b in spans if b > a]


def windows(spans: list[tuple[int, int]], max_samples: int) -> list[list[tuple[int, int]]]:
    """Group consecutive spans into windows of at most ``max_samples`` of speech each: as few windows as possible,
    and among those the cuts whose pauses are longest (largest total pause at the cuts). A span longer than
    ``max_samples`` is cut into pieces first (:func:`speech_spans` with ``max_span_s`` avoids that)."""
    pieces: list[tuple[int, int]] = []
    for a, b in spans:
        while b - a > max_samples:
            pieces.append((a, a + max_samples))
            a += max_samples
        pieces.append((a, b))
    n = len(pieces)
    if n == 0:
        return []
    lengths = [b - a for a, b in pieces]
    # best[j]: (windows, -pause at the cuts) of the best grouping of pieces[:j]; cut[j]: where its last window starts
    best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, 0)] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        total = 0
        for i in range(j - 1, -1, -1):
            total += lengths[i]
            if total > max_samples:
                break
            pause = pieces[i][0] - pieces[i - 1][1] if i > 0 else 0
            candidate = (best[i][0] + 1, best[i][1] - pause)
            if candidate < best[j]:
                best[j], cut[j] = candidate, i
    groups: list[list[tuple[int, int]]] = []
    j = n
    while j > 0:
        groups.append(pieces[cut[j] : j])
        j = cut[j]
    return groups[::-1]


@dataclass(frozen=True)
class SpeechMap:
    """Where the concatenated speech of the windows sits in the original clip.

    The windows, laid end to end, form one *speech timeline* (the serving's chunk offsets are window starts on
    it). :meth:`to_original` maps a time on it back to the clip: the span it falls in, plus the silence removed
    before that span."""

    windows: tuple[tuple[tuple[int, int], ...], ...]  # per window, its spans in original samples
    sample_rate: int
    n_samples: int  # of the original clip

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [span for window in self.windows for span in window]

    def window_offsets(self) -> list[float]:
        """Start of each window on the speech timeline, in seconds."""
        offsets, total = [], 0
        for window in self.windows:
            offsets.append(total / self.sample_rate)
            total += sum(b - a for a, b in window)
        return offsets

    def window_durations(self) -> list[float]:
        return [sum(b - a for a, b in window) / self.sample_rate for window in self.windows]

    def to_original(self, t: float, *, window: int | None = None, is_end: bool = False) -> float:
        """Seconds on the speech timeline -> seconds in the original clip. ``window``: the window the time was
        produced in (a segment's or word's); the time is then held inside that window's speech, because Whisper's
        timestamps may run past a window's end into its padding. ``is_end``: a time exactly at the junction of two
        spans belongs to the earlier one (an end), else to the later one (a start)."""
        sr = self.sample_rate
        sample = t * sr
        # (speech-timeline start, original start, length) of each span, in samples
        table, pos = [], 0
        for w, spans in enumerate(self.windows):
            for a, b in spans:
                table.append((w, pos, a, b - a))
                pos += b - a
        if not table:
            return 0.0
        if window is not None:
            rows = [row for row in table if row[0] == window] or table
            lo, hi = rows[0][1], rows[-1][1] + rows[-1][3]
            sample = min(max(sample, lo), hi)
        else:
            rows = table
        chosen = rows[-1]
        for row in rows:
            _, start, _, length = row
            if (sample <= start + length) if is_end else (sample < start + length):
                chosen = row
                break
        _, start, original, length = chosen
        inside = min(max(sample - start, 0), length)
        return round(min(original + inside, self.n_samples) / sr, 3)


@dataclass(frozen=True)
class Plan:
    chunks: list[np.ndarray]  # one array per window: its spans' samples, concatenated
    offsets: list[float]  # window starts on the speech timeline (the serving's chunk_start_offsets)
    speech_map: SpeechMap

    @property
    def speech_s(self) -> float:
        return sum(self.speech_map.window_durations())


def plan(audio: np.ndarray, sample_rate: int, options: Options, max_window_s: float, *, sess=None) -> Plan:
    """Windows of speech only (none for a clip without speech) for ``audio`` at ``sample_rate`` (16 kHz, what
    Whisper and Silero both take), each at most ``max_window_s`` of speech."""
    if sample_rate != SAMPLE_RATE:
        raise ValueError(f"the VAD runs at {SAMPLE_RATE} Hz, not {sample_rate}")
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    probs = speech_probabilities(audio, sess)
    spans = speech_spans(probs, audio.size, options, max_span_s=max_window_s, sample_rate=sample_rate)
    groups = windows(spans, int(max_window_s * sample_rate))
    speech_map = SpeechMap(tuple(tuple(g) for g in groups), sample_rate, int(audio.size))
    chunks = [np.concatenate([audio[a:b] for a, b in group]) for group in groups]
    return Plan(chunks, speech_map.window_offsets(), speech_map)
