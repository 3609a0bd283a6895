"""One realtime transcription session: client events in, server events out, turns sent to the engine.

Tasks of a session, all ended with it (disconnect, idle timeout, a client that stops reading):
- the reader: client events, in order; audio goes through the resampler and the VAD
  into the input buffer, whose commits queue turns (it never waits for the engine: see ``BACKLOG_S``);
- the writer: server events out, each send bounded by ``realtime_send_timeout_s``;
- the transcriber: committed turns in commit order, one engine request at a time, then ``completed``; with
  server_vad a turn's final decode may have started already, in the pause before its commit
  (``realtime_final_after_ms``: the turn's audio ends there; speech resuming cancels it);
- the interim loop: every ``realtime_interim_s`` a decode of the open turn so far (one in flight at most, none
  while a committed turn of any session of the engine waits: finals first; none in a pause, which may end the
  turn: an interim decode still at the engine when the turn ends competes with its final), turned into
  append-only ``delta`` events.
Cancelling a task cancels its engine request (the connection closes; vLLM aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from mmcpu import vad
from mmcpu.config import Settings
from mmcpu.gateway.upstream import Upstreams
from mmcpu.realtime import protocol as p
from mmcpu.realtime.audio import ENGINE_RATE, AudioError, Resampler, decode_pcm16
from mmcpu.realtime.engine import EngineError, Transcript, engine_for, transcribe
from mmcpu.realtime.turns import Commit, InputBuffer, Pause, Resumed, Started, Stopped

log = logging.getLogger("mmcpu.realtime")

MIN_COMMIT_S = 0.1  # OpenAI's: a commit of less audio is an error (input_audio_buffer_commit_empty)
MIN_INTERIM_S = 0.5  # less audio than this is not worth a decode
# Committed audio waiting for the engine per session, in seconds. The reader never stops reading to wait for the
# engine: a WebSocket that is not read does not read the client's pongs either, and the session would die of a
# keepalive ping timeout. A session that falls this far behind is closed with an error saying so instead.
BACKLOG_S = 120
# Server events waiting for a client that does not read them: a session makes a few per second, so this many means
# the client stopped reading (or floods the session with bad events without reading the errors); it is closed.
OUTBOX = 1024


class Hub:
    """Per gateway app: the session counts (total and per engine) behind the limits, and their metrics."""

    def __init__(self, settings: Settings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.total = 0
        self.per_engine: Counter[str] = Counter()
        self.interims: Counter[str] = Counter()  # interim decodes in flight per engine
        self.finals: Counter[str] = Counter()  # committed turns queued or at the engine, per engine (finals first)
        self.sessions = Gauge(
            "mmcpu_realtime_sessions",
            "Open realtime sessions, by the engine of their model ('' = no model yet)",
            ["engine"],
            registry=registry,
        )
        self.requests = Gauge(
            "mmcpu_realtime_engine_requests",
            "Engine requests of realtime sessions in flight, by kind (final, interim)",
            ["kind"],
            registry=registry,
        )
        self.turns = PromCounter(
            "mmcpu_realtime_turns",
            "Committed realtime turns, by outcome (completed, failed)",
            ["outcome"],
            registry=registry,
        )

    def open(self) -> bool:
        if self.total >= self.settings.realtime_max_sessions:
            return False
        self.total += 1
        self.sessions.labels("").inc()
        return True

    def move(self, old: str | None, new: str | None) -> bool:
        """Count a session under engine ``new`` instead of ``old`` (None: no model); False if ``new`` is full."""
        if new == old:
            return True
        if new is not None:
            if self.per_engine[new] >= self.settings.realtime_sessions_per_engine:
                return False
            self.per_engine[new] += 1
        self.sessions.labels(new or "").inc()
        self._leave(old)
        return True

    def _leave(self, engine: str | None) -> None:
        self.sessions.labels(engine or "").dec()
        if engine is not None:
            self.per_engine[engine] -= 1

    def interim_slot(self, engine: str) -> bool:
        """Take one of the engine's interim slots (MMCPU_REALTIME_INTERIMS_PER_ENGINE); False: all taken."""
        if self.interims[engine] >= self.settings.realtime_interims_per_engine:
            return False
        self.interims[engine] += 1
        return True

    def close(self, engine: str | None) -> None:
        self.total -= 1
        self._leave(engine)


@dataclass
class Turn:
    item_id: str
    audio: np.ndarray
    config: p.Config
    emitted: p.Emitted
    engine: str  # the engine counted in Hub.finals while the turn waits ('' = no model)
    early: asyncio.Task[Transcript] | None = None  # its final decode, started in the pause before the commit


Receive = Callable[[], Awaitable[str | bytes | None]]  # None: the client is gone
Send = Callable[[str], Awaitable[None]]


class Closed(Exception):
    """The session ends (the reason was sent to the client if it could be)."""


class Session:
    def __init__(
        self,
        hub: Hub,
        upstreams: Upstreams,
        receive: Receive,
        send: Send,
        *,
        beta: bool = False,
        model: str | None = None,
    ) -> None:
        self.hub, self.settings, self.upstreams = hub, hub.settings, upstreams
        self._receive, self._send = receive, send
        self.beta = beta
        self.id = p.new_id("sess")
        self.config = p.Config()
        self.engine: str | None = None
        self.initial_model = model
        self.resampler = Resampler(self.config.rate)
        self.buffer = InputBuffer(
            vad.session(), self.config.turn_detection, self._max_samples(), self.settings.realtime_final_after_ms
        )
        self.item_id: str | None = None  # the open turn's item
        self.previous_item_id: str | None = None
        self.emitted = p.Emitted()
        self.outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.unread = asyncio.Event()  # the outbox overflowed
        self.turns: asyncio.Queue[Turn] = asyncio.Queue()
        self.backlog = 0  # samples of the committed turns not transcribed yet
        self.busy = False  # the transcriber holds a turn
        self.active = time.monotonic()  # the client's last event or the session's last transcript
        self.interim: asyncio.Task | None = None
        self.turn_opened = 0.0  # monotonic time the open turn began (first interim is due interim_s after)
        self.last_interim = 0.0
        self.interim_samples = 0  # the open turn's length at its last interim decode
        self.early: tuple[int, asyncio.Task[Transcript]] | None = None  # (samples, decode) started in a pause

    def _max_samples(self) -> int:
        return int(self.settings.realtime_buffer_s * ENGINE_RATE)

    # --- out ------------------------------------------------------------------------------------------
    def emit(self, kind: str, **fields: Any) -> None:
        self._put(p.event(kind, **fields))

    def error(self, exc: p.ProtocolError | EngineError, event_id: str | None = None) -> None:
        self._put(p.error_event(exc.message, type=exc.type, code=exc.code, param=exc.param, event_id=event_id))

    def _put(self, ev: dict[str, Any]) -> None:
        if self.outbox.qsize() >= OUTBOX:
            self.unread.set()
            return
        self.outbox.put_nowait(ev)

    async def _writer(self) -> None:
        while (ev := await self.outbox.get()) is not None:
            try:
                async with asyncio.timeout(self.settings.realtime_send_timeout_s):
                    await self._send(json.dumps(ev))
            except TimeoutError:
                raise Closed("the client did not read its events") from None

    # --- the session --------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the session until the client leaves or it is closed; every task and engine request ends here."""
        writer = asyncio.create_task(self._writer(), name=f"{self.id} writer")
        tasks: list[asyncio.Task[Any]] = [asyncio.create_task(self._transcriber(), name=f"{self.id} transcriber")]
        if self.settings.realtime_interim_s > 0:
            tasks.append(asyncio.create_task(self._interims(), name=f"{self.id} interims"))
        reader = asyncio.create_task(self._reader(), name=f"{self.id} reader")
        tasks.append(asyncio.create_task(self.unread.wait(), name=f"{self.id} unread events"))
        try:
            done, _ = await asyncio.wait({reader, writer, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) and not isinstance(exc, Closed):
                    log.error("realtime session %s: %s failed", self.id, task.get_name(), exc_info=exc)
            if reader in done and not writer.done():
                # What the reader queued last (an idle timeout's error) still goes out, within the send bound.
                self.outbox.put_nowait(None)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.settings.realtime_send_timeout_s):
                        await asyncio.shield(writer)
        finally:
            self._drop_early()
            for each in (reader, writer, *tasks, self.interim):
                if each is not None:
                    each.cancel()
            await asyncio.gather(
                reader, writer, *tasks, *([self.interim] if self.interim else []), return_exceptions=True
            )
            while not self.turns.empty():  # turns never sent: no longer ahead of anyone's interim decodes
                turn = self.turns.get_nowait()
                self.hub.finals[turn.engine] -= 1
                if turn.early is not None:
                    turn.early.cancel()
            self.hub.close(self.engine)

    async def _reader(self) -> None:
        created = "transcription_session.created" if self.beta else "session.created"
        failed = None
        if self.initial_model:  # ?model=: the transcription model until a session update says otherwise
            try:
                await self._set_config(replace(self.config, model=self.initial_model), None)
            except EngineError as exc:
                failed = replace_param(exc, "model")
        self.emit(created, session=p.session_object(self.id, self.config, beta=self.beta))
        if failed:
            self.error(failed)
        limit = int(self.settings.realtime_max_event_mb * 2**20)
        idle = self.settings.realtime_idle_s
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that arrives as the
                # awaited call completes, which for a client that floods is every time (the session never ends).
                # (At least 0.5 s: past the idle time with transcripts pending, it looks again twice a second.)
                async with asyncio.timeout(max(0.5, self.active + idle - time.monotonic())):
                    message = await self._receive()
                self.active = time.monotonic()
            except TimeoutError:
                if self.busy or not self.turns.empty() or time.monotonic() - self.active < idle:
                    continue  # waiting for its transcripts is not idling
                self.error(
                    p.ProtocolError(
                        f"No event for {self.settings.realtime_idle_s:g} s: session closed (MMCPU_REALTIME_IDLE_S)",
                        code="idle_timeout",
                    )
                )
                return
            if message is None:
                return
            if len(message) > limit:
                self.error(
                    p.ProtocolError(
                        f"Event of {len(message)} bytes is over the limit of {limit} (MMCPU_REALTIME_MAX_EVENT_MB)",
                        code="event_too_large",
                    )
                )
                continue
            if isinstance(message, bytes):
                self.error(p.ProtocolError("Binary frames are not events: send JSON text", code="invalid_event"))
                continue
            await self._handle(message)
            # A queued message is received without suspending: yield, or a flooding client would hold the event
            # loop (every other session and request of the gateway) for as long as it sends.
            await asyncio.sleep(0)

    async def _handle(self, message: str) -> None:
        try:
            ev = json.loads(message)
        except ValueError as exc:
            self.error(p.ProtocolError(f"The event is not valid JSON: {exc}", code="invalid_json"))
            return
        if not isinstance(ev, dict):
            self.error(p.ProtocolError("An event must be a JSON object", code="invalid_event"))
            return
        event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
        kind = ev.get("type")
        try:
            handler = HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise p.ProtocolError(
                    f"Invalid value: {kind!r}. Supported event types in a transcription session: {', '.join(HANDLERS)}",
                    param="type",
                    code="invalid_value",
                )
            await handler(self, ev)
        except (p.ProtocolError, EngineError) as exc:
            self.error(exc, event_id)

    # --- client events ---------------------------------------------------------------------------------------
    async def _session_update(self, ev: dict[str, Any]) -> None:
        config = p.apply_ga(self.config, ev.get("session"))
        await self._set_config(config, ev)
        self.emit("session.updated", session=p.session_object(self.id, self.config, beta=False))

    async def _beta_update(self, ev: dict[str, Any]) -> None:
        self.beta = True
        config = p.apply_beta(self.config, ev.get("session"))
        await self._set_config(config, ev)
        self.emit("transcription_session.updated", session=p.session_object(self.id, self.config, beta=True))

    async def _set_config(self, config: p.Config, ev: dict[str, Any] | None) -> None:
        """Take ``config`` whole or not at all: its model must be served, by an engine with room."""
        param = (
            "session.audio.input.transcription.model"
            if ev is None or ev.get("type") == "session.update"
            else "session.input_audio_transcription.model"
        )
        engine = self.engine
        if config.model != self.config.model:
            if config.model is None:
                engine = None
            else:
                try:
                    engine = await engine_for(self.upstreams, config.model)
                except EngineError as exc:
                    raise replace_param(exc, param) from None
        if engine != self.engine:
            if not self.hub.move(self.engine, engine):
                raise EngineError(
                    f"The {engine} engine holds its limit of {self.settings.realtime_sessions_per_engine} realtime "
                    "sessions (MMCPU_REALTIME_SESSIONS_PER_ENGINE): try again later",
                    code="session_limit_reached",
                    param=param,
                )
            self.engine = engine
        if config.rate != self.config.rate:
            self.resampler = Resampler(config.rate)
        if config.turn_detection != self.config.turn_detection:
            self.buffer.set_options(config.turn_detection)
        self.config = config

    async def _append(self, ev: dict[str, Any]) -> None:
        try:
            samples = self.resampler(decode_pcm16(ev.get("audio")))
        except AudioError as exc:
            raise p.ProtocolError(str(exc), param="audio") from None
        await self._feed(samples)

    async def _feed(self, samples: np.ndarray) -> None:
        if self.item_id is None and self.config.turn_detection is None and samples.size:
            self._open_turn()
        for change in self.buffer.append(samples):
            if isinstance(change, Started):
                self._open_turn()
                self.emit(
                    "input_audio_buffer.speech_started", item_id=self.item_id, audio_start_ms=change.audio_start_ms
                )
            elif isinstance(change, Pause):
                self._start_early(change.upto)
            elif isinstance(change, Resumed):
                self._drop_early()
            elif isinstance(change, Stopped):
                self.emit("input_audio_buffer.speech_stopped", item_id=self.item_id, audio_end_ms=change.audio_end_ms)
            elif isinstance(change, Commit):
                await self._commit(change.audio)

    async def _commit_event(self, ev: dict[str, Any]) -> None:
        await self._feed(self.resampler.flush())
        if self.buffer.samples < MIN_COMMIT_S * ENGINE_RATE:
            raise p.ProtocolError(
                f"Error committing input audio buffer: buffer too small. Expected at least {MIN_COMMIT_S * 1000:.0f}ms "
                f"of audio, but buffer only has {self.buffer.samples * 1000 / ENGINE_RATE:.2f}ms of audio.",
                code="input_audio_buffer_commit_empty",
            )
        if self.item_id is None:
            self._open_turn()
        await self._commit(self.buffer.take())

    async def _clear(self, ev: dict[str, Any]) -> None:
        self._drop_early()
        self.buffer.clear()
        self._close_turn()
        self.emit("input_audio_buffer.cleared")

    # --- turns -----------------------------------------------------------------------------------------------
    def _start_early(self, upto: int) -> None:
        """The open turn pauses: its final decode starts now, over the audio the commit will take if the pause
        lasts (the same samples, so the same request and answer as a decode started at the commit)."""
        self._drop_early()
        config = self.config
        if config.model is None or self.item_id is None:
            return
        audio = self.buffer.audio(upto)
        if audio.size < MIN_COMMIT_S * ENGINE_RATE:
            return
        if self.interim is not None:
            self.interim.cancel()  # the final decodes it all
        task = asyncio.create_task(self._decode("final", audio, config), name=f"{self.id} final (early)")
        # Read its outcome even when the speech resumes and nobody awaits it (no "never retrieved" warning).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.early = (audio.size, task)

    def _drop_early(self) -> None:
        if self.early is not None:
            self.early[1].cancel()  # its engine request is aborted with it
            self.early = None

    async def _decode(self, kind: str, audio: np.ndarray, config: p.Config) -> Transcript:
        assert config.model is not None
        self.hub.requests.labels(kind).inc()
        try:
            return await transcribe(self.upstreams, config.model, audio, language=config.language, prompt=config.prompt)
        finally:
            self.hub.requests.labels(kind).dec()

    def _open_turn(self) -> None:
        self._drop_early()
        self._close_turn()
        self.item_id = p.new_id("item")
        self.emitted = p.Emitted()
        self.turn_opened = time.monotonic()
        self.interim_samples = 0

    def _close_turn(self) -> None:
        if self.interim is not None:
            self.interim.cancel()  # the final decodes it all: its interim decode is no longer wanted
            self.interim = None
        self.item_id = None

    async def _commit(self, audio: np.ndarray) -> None:
        early, self.early = self.early, None
        if early is not None and (early[0] != audio.size or early[1].done() and early[1].cancelled()):
            early[1].cancel()  # another cut (the longest turn): not this turn's decode
            early = None
        item_id, emitted = self.item_id or p.new_id("item"), self.emitted
        self._close_turn()
        self.emit("input_audio_buffer.committed", item_id=item_id, previous_item_id=self.previous_item_id)
        item = p.user_item(item_id, None, beta=self.beta)
        self.emit(
            "conversation.item.created" if self.beta else "conversation.item.added",
            previous_item_id=self.previous_item_id,
            item=item,
        )
        self.previous_item_id = item_id
        self.backlog += audio.size
        if self.backlog > BACKLOG_S * ENGINE_RATE:
            self.error(
                EngineError(
                    f"The engine is {self.backlog / ENGINE_RATE:.0f} s of audio behind this session "
                    f"(over {BACKLOG_S} s of committed turns wait): session closed, try again later",
                    code="engine_overloaded",
                )
            )
            raise Closed("the engine fell too far behind")
        self.hub.finals[self.engine or ""] += 1  # counted as queued: other sessions' interim decodes wait for it
        self.turns.put_nowait(
            Turn(item_id, audio, self.config, emitted, self.engine or "", early[1] if early is not None else None)
        )

    async def _transcriber(self) -> None:
        while True:
            turn = await self.turns.get()
            self.busy = True
            try:
                await self._final(turn)
            finally:
                self.hub.finals[turn.engine] -= 1
                self.backlog -= turn.audio.size
                self.busy = False
                self.active = time.monotonic()  # the idle time counts from the last transcript too

    async def _final(self, turn: Turn) -> None:
        config = turn.config
        try:
            if turn.early is not None:
                result = await turn.early
            elif config.model is None:
                raise EngineError(
                    "No transcription model: set session.audio.input.transcription.model",
                    type="invalid_request_error",
                    code="model_required",
                    param="session.audio.input.transcription.model",
                )
            else:
                result = await self._decode("final", turn.audio, config)
        except EngineError as exc:
            self.hub.turns.labels("failed").inc()
            self.emit(
                "conversation.item.input_audio_transcription.failed",
                item_id=turn.item_id,
                content_index=0,
                error=exc.fields(),
            )
            return
        self.hub.turns.labels("completed").inc()
        # The rest of the final text as one more delta when it continues what the deltas carried; else the deltas
        # stop here and `completed` carries the text that counts (docs/realtime.md).
        if delta := turn.emitted.extend(result.text, hold_last=False):
            self.emit(
                "conversation.item.input_audio_transcription.delta", item_id=turn.item_id, content_index=0, delta=delta
            )
        self.emit(
            "conversation.item.input_audio_transcription.completed",
            item_id=turn.item_id,
            content_index=0,
            transcript=result.text,
            usage={"type": "duration", "seconds": result.seconds},
        )
        if not self.beta:
            self.emit(
                "conversation.item.done", previous_item_id=None, item=p.user_item(turn.item_id, result.text, beta=False)
            )

    async def _interims(self) -> None:
        every = self.settings.realtime_interim_s
        while True:
            await asyncio.sleep(min(0.1, every))
            now, engine = time.monotonic(), self.engine
            if (
                self.item_id is None
                or self.interim is not None
                or self.busy
                or not self.turns.empty()
                or engine is None
                or self.hub.finals[engine]
                or self.config.model is None
                or not self.buffer.speech
                or self.buffer.pausing
                or now - self.turn_opened < every
                or now - self.last_interim < every
                or self.buffer.samples < MIN_INTERIM_S * ENGINE_RATE
                or self.buffer.samples <= self.interim_samples
                or not self.hub.interim_slot(engine)
            ):
                continue
            self.last_interim = now
            self.interim_samples = self.buffer.samples
            self.interim = task = asyncio.create_task(self._interim(self.item_id, self.buffer.audio(), self.config))
            try:
                await asyncio.wait({task})  # a commit cancels the decode, not this loop
            finally:
                self.hub.interims[engine] -= 1
            if self.interim is task:
                self.interim = None

    async def _interim(self, item_id: str, audio: np.ndarray, config: p.Config) -> None:
        try:
            result = await self._decode("interim", audio, config)  # a model is named: _interims checked it
        except EngineError as exc:
            log.info("realtime session %s: interim decode failed: %s", self.id, exc.message)
            return
        if item_id == self.item_id and (delta := self.emitted.extend(result.text, hold_last=True)):
            self.emit(
                "conversation.item.input_audio_transcription.delta", item_id=item_id, content_index=0, delta=delta
            )


def replace_param(exc: EngineError, param: str) -> EngineError:
    return EngineError(exc.message, type=exc.type, code=exc.code, param=param)


HANDLERS: dict[str, Callable[[Session, dict[str, Any]], Awaitable[None]]] = {
    "session.update": Session._session_update,
    "transcription_session.update": Session._beta_update,
    "input_audio_buffer.append": Session._append,
    "input_audio_buffer.commit": Session._commit_event,
    "input_audio_buffer.clear": Session._clear,
}
