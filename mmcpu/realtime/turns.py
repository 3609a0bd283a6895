"""The input audio buffer of a realtime session and its turns.

Audio arrives at 16 kHz (int16) in chunks of any size. Silero VAD runs over it as a stream (512-sample frames with
the 64 samples before each and the LSTM state carried over, as :func:`mmcpu.vad.speech_probabilities` runs it over
a whole clip), so each frame is judged once, as the audio comes.

With ``server_vad`` (:class:`mmcpu.vad.Options`: ``threshold``, ``pad_ms`` = ``prefix_padding_ms``,
``min_silence_ms`` = ``silence_duration_ms``) a turn starts at the first frame at or above the threshold, with
``prefix_padding_ms`` of the audio before it; it ends once the frames stay below ``threshold - 0.15`` for
``silence_duration_ms`` (the same hysteresis as the HTTP API's VAD), and is committed with that silence, or with
only its first ``final_after_ms`` when that is shorter: then, once the silence is that long, a :class:`Pause`
says where the turn's audio would end, so its final decode can start before the turn is committed (a
:class:`Resumed` withdraws it when the speech goes on). Between turns only the padding is kept. Without VAD the
client commits; the buffer then keeps everything. Either way a turn that reaches the longest turn (``max_samples``)
is committed there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmcpu import vad

FRAME, CONTEXT = vad.FRAME, vad.CONTEXT
RATE = vad.SAMPLE_RATE


def ms(samples: int) -> int:
    return int(samples * 1000 // RATE)


class StreamingVad:
    """Silero VAD over a stream: :meth:`feed` returns the probabilities of the frames the new samples complete."""

    def __init__(self, sess) -> None:
        self.sess = sess
        self.h = np.zeros(vad.STATE_SHAPE, dtype=np.float32)
        self.c = np.zeros(vad.STATE_SHAPE, dtype=np.float32)
        self.context = np.zeros(CONTEXT, dtype=np.float32)
        self.rest = np.zeros(0, dtype=np.float32)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        audio = np.concatenate([self.rest, np.asarray(samples, dtype=np.float32) / 32768.0])
        n = audio.size // FRAME
        self.rest = audio[n * FRAME :]
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        frames = audio[: n * FRAME].reshape(n, FRAME)
        context = np.empty((n, CONTEXT), dtype=np.float32)
        context[0] = self.context
        context[1:] = frames[:-1, -CONTEXT:]
        self.context = frames[-1, -CONTEXT:].copy()
        probs, self.h, self.c = self.sess.run(
            None, {"input": np.concatenate([context, frames], axis=1), "h": self.h, "c": self.c}
        )
        return np.asarray(probs, dtype=np.float32).reshape(-1)


@dataclass(frozen=True)
class Started:
    audio_start_ms: int


@dataclass(frozen=True)
class Stopped:
    audio_end_ms: int


@dataclass(frozen=True)
class Pause:
    upto: int  # session sample index: the turn's audio ends here if the pause goes on until the commit


@dataclass(frozen=True)
class Resumed:
    """The speech went on after a :class:`Pause`: the turn continues."""


@dataclass(frozen=True)
class Commit:
    audio: np.ndarray  # int16 at 16 kHz
    reason: str  # "vad" (a pause), "full" (the longest turn)


class InputBuffer:
    """The session's uncommitted audio. :meth:`append` returns what happened in order (:class:`Started`,
    :class:`Pause`, :class:`Resumed`, :class:`Stopped`, :class:`Commit`); :meth:`take` commits by hand."""

    def __init__(self, sess, options: vad.Options | None, max_samples: int, final_after_ms: int = 0) -> None:
        self.vad = StreamingVad(sess)
        self.max_samples = max_samples
        self._data = np.empty(max_samples + RATE, dtype=np.int16)
        self._len = 0
        self.start = 0  # session sample index of _data[0]
        self.total = 0  # samples appended in the session
        self.speech = False  # a frame of the buffered audio was speech (server_vad: a turn is open)
        self._silence_from: int | None = None
        self._paused = False  # a Pause was reported for the current silence
        self.final_after_ms = final_after_ms
        self.set_options(options)

    def set_options(self, options: vad.Options | None) -> None:
        self.options = options
        self.speech = False
        self._silence_from = None
        self._paused = False

    def _tail(self) -> int | None:
        """Samples of silence a VAD turn keeps (and after which its :class:`Pause` comes); None: the whole pause."""
        opts = self.options
        if opts is None or not 0 < self.final_after_ms < opts.min_silence_ms:
            return None
        return RATE * self.final_after_ms // 1000

    @property
    def pausing(self) -> bool:
        """With server_vad: the open turn's last frames are below the threshold (it may be about to end)."""
        return self._silence_from is not None

    @property
    def samples(self) -> int:
        return self._len

    def audio(self, upto: int | None = None) -> np.ndarray:
        """A copy of the buffered audio, up to session sample ``upto`` (default: all of it)."""
        cut = self._len if upto is None else max(0, min(upto - self.start, self._len))
        return self._data[:cut].copy()

    def clear(self) -> None:
        self.start += self._len
        self._len = 0
        self.speech = False
        self._silence_from = None
        self._paused = False

    def take(self, upto: int | None = None) -> np.ndarray:
        """Remove and return the buffered audio up to session sample ``upto`` (default: all of it)."""
        cut = self._len if upto is None else max(0, min(upto - self.start, self._len))
        audio = self._data[:cut].copy()
        self._drop(cut)
        self.speech = False
        self._silence_from = None
        self._paused = False
        return audio

    def _drop(self, n: int) -> None:
        if n <= 0:
            return
        keep = self._len - n
        self._data[:keep] = self._data[n : self._len]
        self._len = keep
        self.start += n

    def _store(self, samples: np.ndarray) -> None:
        need = self._len + samples.size
        if need > self._data.size:
            grown = np.empty(max(need, 2 * self._data.size), dtype=np.int16)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len : need] = samples
        self._len = need

    def append(self, samples: np.ndarray) -> list[Started | Stopped | Commit]:
        events: list[Started | Stopped | Commit] = []
        # Chunks no longer than the longest turn, so a commit for length always finds its audio buffered.
        for i in range(0, samples.size, self.max_samples):
            self._append(samples[i : i + self.max_samples], events)
        return events

    def _append(self, samples: np.ndarray, events: list) -> None:
        frame0 = self.total - self.vad.rest.size  # session index of the first frame the new samples complete
        self._store(samples)
        self.total += samples.size
        probs = self.vad.feed(samples)
        opts = self.options
        tail = self._tail()
        for i, p in enumerate(probs):
            pos = frame0 + i * FRAME  # the frame's first sample
            end = pos + FRAME
            if opts is None:
                self.speech = self.speech or p >= 0.5
                continue
            if not self.speech:
                if p >= opts.threshold:
                    self.speech = True
                    self._silence_from = None
                    turn_start = max(self.start, pos - RATE * opts.pad_ms // 1000)
                    self._drop(turn_start - self.start)
                    events.append(Started(ms(turn_start)))
                continue
            if p >= opts.threshold:
                if self._paused:
                    events.append(Resumed())
                self._silence_from = None
                self._paused = False
            elif p < opts.neg_threshold and self._silence_from is None:
                self._silence_from = pos
            silent_from = self._silence_from
            if silent_from is not None and tail is not None and not self._paused and end - silent_from >= tail:
                self._paused = True
                events.append(Pause(silent_from + tail))
            if silent_from is not None and end - silent_from >= RATE * opts.min_silence_ms / 1000:
                events.append(Stopped(ms(silent_from)))
                events.append(Commit(self.take(end if tail is None else silent_from + tail), "vad"))
            elif end - self.start >= self.max_samples:  # cut at the longest turn exactly (Whisper's window)
                cut = self.start + self.max_samples
                events.append(Stopped(ms(cut)))
                events.append(Commit(self.take(cut), "full"))
        if opts is not None and not self.speech:
            # Between turns only the padding before the next one is kept (and the frame in progress).
            keep_from = self.total - self.vad.rest.size - RATE * opts.pad_ms // 1000
            self._drop(keep_from - self.start)
        elif opts is None:
            while self._len >= self.max_samples:
                events.append(Commit(self.take(self.start + self.max_samples), "full"))
