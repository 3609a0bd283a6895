"""A realtime transcription client for tests and benchmarks: the unmodified ``openai`` SDK (``AsyncOpenAI``'s
``realtime.connect``, GA shape) streaming a clip at a chosen pace and recording every server event with its time.

``pace`` 1.0 sends the audio in real time (100 ms every 100 ms, as a microphone does); 4.0 four times faster;
0 as fast as the connection takes it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai
from websockets.exceptions import ConnectionClosed

from mmcpu_dev.payloads import SERVER_VAD, pcm16_base64, realtime_session

COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"
FAILED = "conversation.item.input_audio_transcription.failed"
QUIET_S = 1.5


@dataclass
class Item:
    item_id: str
    started: float | None = None  # wall times (time.monotonic) of its events
    committed: float | None = None
    first_delta: float | None = None
    completed: float | None = None
    audio_start_ms: int | None = None
    deltas: list[str] = field(default_factory=list)
    transcript: str | None = None
    failed: dict[str, Any] | None = None


@dataclass
class Run:
    t0: float  # wall time the first audio was sent
    sent_until: float = 0.0  # wall time the last audio was sent
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    items: dict[str, Item] = field(default_factory=dict)  # in the order they appeared

    def item(self, item_id: str) -> Item:
        return self.items.setdefault(item_id, Item(item_id))

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [ev for _, ev in self.events if ev["type"] == kind]

    @property
    def completed(self) -> list[Item]:
        return [i for i in self.items.values() if i.transcript is not None]

    def waiting(self) -> list[Item]:
        """Committed items with neither a transcript nor a failure yet."""
        return [i for i in self.items.values() if i.committed and i.transcript is None and not i.failed]

    def text(self) -> str:
        return " ".join(i.transcript.strip() for i in self.completed)

    def record(self, t: float, ev: dict[str, Any]) -> None:
        self.events.append((t, ev))
        item_id = ev.get("item_id")
        kind = ev["type"]
        if kind == "input_audio_buffer.speech_started":
            it = self.item(item_id)
            it.started, it.audio_start_ms = t, ev["audio_start_ms"]
        elif kind == "input_audio_buffer.committed":
            self.item(item_id).committed = t
        elif kind == DELTA:
            it = self.item(item_id)
            it.first_delta = it.first_delta or t
            it.deltas.append(ev["delta"])
        elif kind == COMPLETED:
            it = self.item(item_id)
            it.completed, it.transcript = t, ev["transcript"]
        elif kind == FAILED:
            self.item(item_id).failed = ev["error"]


class SessionClosed(AssertionError):
    """The server closed the session before every committed turn had its transcript."""

    def __init__(self, closed: ConnectionClosed, run: Run, sent_all: bool) -> None:
        open_items = [i.item_id for i in run.waiting()]
        last = [ev for _, ev in run.events[-5:]]
        super().__init__(
            f"the server closed the session ({closed}) {time.monotonic() - run.t0:.1f} s in, "
            f"{'after' if sent_all else 'before'} the client sent all its audio; committed items "
            f"without a transcript: {open_items}; its last events: {last}"
        )


def client(base_url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


async def stream(
    base_url: str,
    model: str,
    audio: np.ndarray,
    *,
    rate: int = 16_000,
    pace: float = 1.0,
    chunk_ms: int = 100,
    turn_detection: dict[str, Any] | None = SERVER_VAD,
    commits: list[int] | None = None,
    language: str | None = None,
    api_key: str = "unused",
    settle_s: float = 120.0,
) -> Run:
    """Stream ``audio`` (int16 at ``rate``) through one session; ``commits``: sample indices after which the client
    commits (with ``turn_detection`` None). Returns once every committed item has its ``completed`` / ``failed``
    (at most ``settle_s`` after the last audio)."""
    chunk = rate * chunk_ms // 1000
    cuts = sorted(commits or [])
    async with client(base_url, api_key).realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.session.update(
            session=realtime_session(model, rate=rate, language=language, turn_detection=turn_detection)
        )
        run = Run(time.monotonic())
        done_sending = asyncio.Event()

        async def send() -> None:
            pos = 0
            for cut in sorted(set(cuts) | {audio.size}):
                while pos < cut:
                    end = min(pos + chunk, cut)
                    if pace > 0:  # the chunk's audio ends at this wall time
                        await asyncio.sleep(max(0.0, run.t0 + end / rate / pace - time.monotonic()))
                    await conn.input_audio_buffer.append(audio=pcm16_base64(audio[pos:end]))
                    pos = end
                if cut in cuts:
                    await conn.input_audio_buffer.commit()
            run.sent_until = time.monotonic()
            done_sending.set()

        def settled() -> bool:
            return done_sending.is_set() and not run.waiting()

        async def receive() -> None:
            # Once every committed item has its transcript, the session is done when nothing more comes for a
            # moment (a turn the VAD is still closing would send its events).
            while True:
                if sender.done() and not sender.cancelled() and (exc := sender.exception()):
                    raise exc  # a client that could not send is the failure, not the wait that follows
                try:
                    ev = await asyncio.wait_for(conn.recv(), QUIET_S if settled() else 1.0)
                except TimeoutError:
                    if settled():
                        return
                    continue
                except ConnectionClosed as exc:  # the server ended the session first: say what it last said
                    raise SessionClosed(exc, run, done_sending.is_set()) from None
                run.record(time.monotonic(), ev.to_dict())

        sender = asyncio.create_task(send())
        try:
            await asyncio.wait_for(
                receive(), timeout=audio.size / rate / max(pace, 1e-9) + settle_s if pace > 0 else settle_s
            )
        except TimeoutError:  # say how far the session got, not only that it ran out of time
            raise TimeoutError(
                f"not settled {settle_s:g} s after the audio: {len(run.completed)} turns transcribed, "
                f"{len(run.waiting())} committed still waiting"
            ) from None
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
    return run
