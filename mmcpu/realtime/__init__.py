"""Realtime transcription on OpenAI's wire, served by the gateway (``/v1/realtime``; docs/realtime.md).

The WebSocket ends in the gateway process. Audio is resampled to 16 kHz (:mod:`.audio`), cut into turns by Silero
VAD or by the client's commits (:mod:`.turns`), and every turn, and every interim decode of the open one, is sent
to the engine serving the session's model as an ordinary ``POST /v1/audio/transcriptions`` (:mod:`.engine`): the
final text is the HTTP API's for the same audio, and concurrent sessions share the engine's batch.
"""
