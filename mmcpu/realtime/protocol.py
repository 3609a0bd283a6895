"""OpenAI's Realtime transcription wire: the session configuration as the GA and beta events set it, and the
server events, as the openai SDKs' types define them.

GA: ``session.update{session{type:"transcription", audio.input{format, transcription, turn_detection,
noise_reduction}, include}}`` answered by ``session.updated``; the item events are ``conversation.item.added`` /
``.done``. Beta (``OpenAI-Beta: realtime=v1``, or a ``transcription_session.update``):
``transcription_session.update{session{input_audio_format, input_audio_transcription, turn_detection,
input_audio_noise_reduction, include}}`` answered by ``transcription_session.updated``; the item event is
``conversation.item.created``.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from mmcpu import vad
from mmcpu.realtime.audio import RATES

# OpenAI's server_vad defaults for a realtime session (its Realtime API reference).
SERVER_VAD = vad.Options(threshold=0.5, pad_ms=300, min_silence_ms=500)
LOGPROBS = "item.input_audio_transcription.logprobs"
NOISE_REDUCTION = ("near_field", "far_field")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ProtocolError(ValueError):
    """A client event this server cannot take: answered with an ``error`` event, the session stays open."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type


@dataclass(frozen=True)
class Config:
    """What a session transcribes with; every field as OpenAI names it, defaults as OpenAI's."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    rate: int = 24_000
    turn_detection: vad.Options | None = SERVER_VAD
    noise_reduction: str | None = None  # accepted, not applied (docs/api.md)
    include: tuple[str, ...] = ()


# --- reading client events ------------------------------------------------------------------------------
def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"'{param}' must be an object", param=param)
    return value


def _known(value: dict[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ProtocolError(
            f"Unknown parameter '{param}.{unknown[0]}'.", param=f"{param}.{unknown[0]}", code="unknown_parameter"
        )


def _text(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"'{param}' must be a string or null", param=param)
    return value or None


def _number(value: Any, param: str, lo: float, hi: float, *, integer: bool) -> float:
    kind = "an integer" if integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (integer and not float(value).is_integer())
    ):
        raise ProtocolError(f"'{param}' must be {kind}", param=param)
    if not lo <= value <= hi:
        raise ProtocolError(f"'{param}' must be between {lo:g} and {hi:g}, not {value}", param=param)
    return value


# Conversation-only fields of OpenAI's server_vad: they steer responses, which a transcription session has none of.
_VAD_IGNORED = {"create_response", "interrupt_response", "idle_timeout_ms"}


def _turn_detection(value: Any, param: str) -> vad.Options | None:
    if value is None:
        return None
    value = _object(value, param)
    _known(value, {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "eagerness"} | _VAD_IGNORED, param)
    kind = value.get("type", "server_vad")
    if kind == "semantic_vad":
        raise ProtocolError(
            "semantic_vad is not supported: use server_vad or null", param=f"{param}.type", code="unsupported_value"
        )
    if kind != "server_vad":
        raise ProtocolError(
            f"'{param}.type' must be 'server_vad' (or turn_detection null), not {kind!r}", param=f"{param}.type"
        )
    if "eagerness" in value:
        raise ProtocolError("'eagerness' belongs to semantic_vad", param=f"{param}.eagerness", code="unknown_parameter")
    fields = {
        "threshold": SERVER_VAD.threshold,
        "prefix_padding_ms": SERVER_VAD.pad_ms,
        "silence_duration_ms": SERVER_VAD.min_silence_ms,
    }
    fields.update({k: v for k, v in value.items() if k in fields and v is not None})
    return vad.Options(
        threshold=float(_number(fields["threshold"], f"{param}.threshold", 0, 1, integer=False)),
        pad_ms=int(_number(fields["prefix_padding_ms"], f"{param}.prefix_padding_ms", 0, 10_000, integer=True)),
        min_silence_ms=int(
            _number(fields["silence_duration_ms"], f"{param}.silence_duration_ms", 0, 10_000, integer=True)
        ),
    )


def _transcription(value: Any, param: str, config: Config) -> Config:
    if value is None:
        return replace(config, model=None, language=None, prompt=None)
    value = _object(value, param)
    _known(value, {"model", "language", "prompt"}, param)
    changes: dict[str, Any] = {
        name: _text(value[name], f"{param}.{name}") for name in ("model", "language", "prompt") if name in value
    }
    return replace(config, **changes)


def _noise_reduction(value: Any, param: str) -> str | None:
    if value is None:
        return None
    value = _object(value, param)
    _known(value, {"type", "strength"}, param)
    kind = value.get("type", "near_field")
    if kind not in NOISE_REDUCTION:
        raise ProtocolError(f"'{param}.type' must be one of {', '.join(NOISE_REDUCTION)}", param=f"{param}.type")
    return kind


def _include(value: Any, param: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or any(v != LOGPROBS for v in value):
        raise ProtocolError(f"'{param}' may only list '{LOGPROBS}'", param=param)
    return tuple(value)


def _format(value: Any, param: str) -> int:
    value = _object(value, param)
    _known(value, {"type", "rate"}, param)
    kind = value.get("type", "audio/pcm")
    if kind in ("audio/pcmu", "audio/pcma"):
        raise ProtocolError(
            f"{kind} (G.711) is not supported: send audio/pcm", param=f"{param}.type", code="unsupported_value"
        )
    if kind != "audio/pcm":
        raise ProtocolError(f"'{param}.type' must be 'audio/pcm', not {kind!r}", param=f"{param}.type")
    rate = value.get("rate", RATES[0])
    if rate not in RATES or isinstance(rate, bool):
        raise ProtocolError(
            f"'{param}.rate' must be {' or '.join(map(str, RATES))}, not {rate!r}", param=f"{param}.rate"
        )
    return int(rate)


def apply_ga(config: Config, session: Any) -> Config:
    """``session.update``'s ``session`` over ``config``: fields present replace, absent ones stay."""
    session = _object(session, "session")
    _known(session, {"type", "audio", "include", "id", "object"}, "session")
    kind = session.get("type", "transcription")
    if kind != "transcription":
        raise ProtocolError(
            f"Only transcription sessions are served here, not {kind!r}: use "
            "session.type 'transcription' (connect with ?intent=transcription)",
            param="session.type",
            code="unsupported_value",
        )
    if "include" in session:
        config = replace(config, include=_include(session["include"], "session.include"))
    if "audio" not in session:
        return config
    audio = _object(session["audio"], "session.audio")
    _known(audio, {"input"}, "session.audio")
    if "input" not in audio:
        return config
    inp = _object(audio["input"], "session.audio.input")
    _known(inp, {"format", "transcription", "turn_detection", "noise_reduction"}, "session.audio.input")
    if "format" in inp:
        config = replace(config, rate=_format(inp["format"], "session.audio.input.format"))
    if "transcription" in inp:
        config = _transcription(inp["transcription"], "session.audio.input.transcription", config)
    if "turn_detection" in inp:
        config = replace(
            config, turn_detection=_turn_detection(inp["turn_detection"], "session.audio.input.turn_detection")
        )
    if "noise_reduction" in inp:
        config = replace(
            config, noise_reduction=_noise_reduction(inp["noise_reduction"], "session.audio.input.noise_reduction")
        )
    return config


BETA_FORMATS = {"pcm16": None, "g711_ulaw": "G.711 u-law", "g711_alaw": "G.711 A-law"}


def apply_beta(config: Config, session: Any) -> Config:
    """``transcription_session.update``'s ``session`` over ``config`` (beta shape; 24 kHz ``pcm16``)."""
    session = _object(session, "session")
    _known(
        session,
        {
            "input_audio_format",
            "input_audio_transcription",
            "turn_detection",
            "input_audio_noise_reduction",
            "include",
            "modalities",
            "client_secret",
            "id",
            "object",
        },
        "session",
    )
    if "input_audio_format" in session:
        fmt = session["input_audio_format"]
        if fmt not in BETA_FORMATS:
            raise ProtocolError(
                f"'session.input_audio_format' must be 'pcm16', not {fmt!r}", param="session.input_audio_format"
            )
        if BETA_FORMATS[fmt]:
            raise ProtocolError(
                f"{BETA_FORMATS[fmt]} is not supported: send pcm16",
                param="session.input_audio_format",
                code="unsupported_value",
            )
        config = replace(config, rate=RATES[0])
    if "input_audio_transcription" in session:
        config = _transcription(session["input_audio_transcription"], "session.input_audio_transcription", config)
    if "turn_detection" in session:
        config = replace(config, turn_detection=_turn_detection(session["turn_detection"], "session.turn_detection"))
    if "input_audio_noise_reduction" in session:
        config = replace(
            config,
            noise_reduction=_noise_reduction(
                session["input_audio_noise_reduction"], "session.input_audio_noise_reduction"
            ),
        )
    if "include" in session:
        config = replace(config, include=_include(session["include"], "session.include"))
    modalities = session.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ProtocolError(
            "'session.modalities' must be ['text']: a transcription session speaks no audio", param="session.modalities"
        )
    return config


# --- writing server events ------------------------------------------------------------------------------------
def _vad_object(options: vad.Options | None) -> dict[str, Any] | None:
    if options is None:
        return None
    return {
        "type": "server_vad",
        "threshold": options.threshold,
        "prefix_padding_ms": options.pad_ms,
        "silence_duration_ms": options.min_silence_ms,
    }


def _transcription_object(config: Config) -> dict[str, Any]:
    return {"model": config.model, "language": config.language, "prompt": config.prompt}


def session_object(session_id: str, config: Config, *, beta: bool) -> dict[str, Any]:
    noise = {"type": config.noise_reduction} if config.noise_reduction else None
    if beta:
        return {
            "id": session_id,
            "object": "realtime.transcription_session",
            "modalities": ["text"],
            "input_audio_format": "pcm16",
            "input_audio_transcription": _transcription_object(config),
            "turn_detection": _vad_object(config.turn_detection),
            "input_audio_noise_reduction": noise,
            "include": list(config.include),
        }
    return {
        "type": "transcription",
        "id": session_id,
        "object": "realtime.transcription_session",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": config.rate},
                "transcription": _transcription_object(config),
                "turn_detection": _vad_object(config.turn_detection),
                "noise_reduction": noise,
            }
        },
        "include": list(config.include),
    }


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    event_id: str | None = None,
) -> dict[str, Any]:
    return event("error", error={"type": type, "code": code, "message": message, "param": param, "event_id": event_id})


def user_item(item_id: str, transcript: str | None, *, beta: bool) -> dict[str, Any]:
    item = {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_audio", "transcript": transcript}],
    }
    if beta:
        item["object"] = "realtime.item"
    return item


@dataclass
class Emitted:
    """The text one item's deltas have carried so far, as words (deltas are appended text only)."""

    words: list[str] = field(default_factory=list)

    def extend(self, hypothesis: str, *, hold_last: bool) -> str:
        """The delta that takes the emitted words on to ``hypothesis``'s: its words past those emitted, all but its
        last when ``hold_last`` (an interim decode may cut its last word); "" when the hypothesis does not start
        with the emitted words (it changed an earlier word) or adds none."""
        words = hypothesis.split()
        if words[: len(self.words)] != self.words:
            return ""
        new = words[len(self.words) : len(words) - 1 if hold_last else len(words)]
        if not new:
            return ""
        delta = (" " if self.words else "") + " ".join(new)
        self.words.extend(new)
        return delta
