"""The typed stream's events, shaped as OpenAI's (openai-python's TranscriptionTextDeltaEvent /
TranscriptionTextDoneEvent), so that OpenAI's SDKs read a streamed transcription or translation as their types."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class StreamInputTokenDetails(BaseModel):
    audio_tokens: int | None = None
    text_tokens: int | None = None


class StreamUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_token_details: StreamInputTokenDetails | None = None


class TextDeltaEvent(BaseModel):
    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str
    # Not in OpenAI's type (its SDKs keep it as an extra): the running usage, with vLLM's stream_include_usage +
    # stream_continuous_usage_stats.
    usage: StreamUsage | None = None


class TextDoneEvent(BaseModel):
    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: StreamUsage | None = None
