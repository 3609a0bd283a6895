"""Assertions on real responses, shared by the tests, the compose smoke check and the benchmarks."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import openai

# Word error rate a transcription of the espeak-ng test sentences must stay under: the fixture tiny.en scores
# ~0.2 on them (0.21 with transformers, 0.19-0.23 through vLLM), so 0.35 catches a broken path, not a bad day.
WER_LIMIT = 0.35


class CheckFailed(AssertionError):
    pass


def openai_error_body(response_json: Any, *, strict: bool = False) -> dict[str, Any]:
    """Return the ``error`` object of an OpenAI-style error body, or raise :class:`CheckFailed`.

    ``strict``: OpenAI's full schema, ``{"error": {"message", "type", "param", "code"}}`` (param and code may
    be null but must be there; code a string, an int or null)."""
    if not isinstance(response_json, dict) or not isinstance(response_json.get("error"), dict):
        raise CheckFailed(f"not an OpenAI error body: {response_json!r}")
    error = response_json["error"]
    if not isinstance(error.get("message"), str) or not error["message"]:
        raise CheckFailed(f"OpenAI error without a message: {response_json!r}")
    if not isinstance(error.get("type"), str):
        raise CheckFailed(f"OpenAI error without a type: {response_json!r}")
    if strict:
        missing = [key for key in ("param", "code") if key not in error]
        if missing:
            raise CheckFailed(f"OpenAI error without {missing}: {response_json!r}")
        if error["param"] is not None and not isinstance(error["param"], str):
            raise CheckFailed(f"OpenAI error param is not a string: {response_json!r}")
        if error["code"] is not None and not isinstance(error["code"], (str, int)):
            raise CheckFailed(f"OpenAI error code is not a string or int: {response_json!r}")
    return error


def expect_client_error(call: Callable[[], Any], statuses: range | set[int] = range(400, 500)) -> dict[str, Any]:
    """Run an ``openai`` client call that must fail with a 4xx OpenAI error; return the error object."""
    try:
        result = call()
    except openai.APIStatusError as exc:
        if exc.status_code not in statuses:
            raise CheckFailed(f"expected HTTP {statuses}, got {exc.status_code}: {exc.response.text[:300]}") from exc
        return openai_error_body(exc.response.json())
    raise CheckFailed(f"expected an HTTP error, got a success: {str(result)[:200]}")


_SRT_CUE = re.compile(r"(\d+)\n(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})\n(.+)")
_VTT_CUE = re.compile(r"(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\n(.+)")


def subtitle_text(document: str, response_format: str) -> str:
    """Validate an SRT or WebVTT document (numbering, timestamps, order) and return its cues' text."""
    blocks = document.strip().split("\n\n")
    if response_format == "vtt":
        if blocks[0] != "WEBVTT":
            raise CheckFailed(f"WebVTT without its header: {document[:200]!r}")
        blocks = blocks[1:]
    pattern = _SRT_CUE if response_format == "srt" else _VTT_CUE
    cues = [pattern.fullmatch(block) for block in blocks]
    if not cues or not all(cues):
        raise CheckFailed(f"malformed {response_format}: {document[:300]!r}")
    groups = [c.groups() if response_format == "vtt" else c.groups()[1:] for c in cues]
    if response_format == "srt" and [int(c.group(1)) for c in cues] != list(range(1, len(cues) + 1)):
        raise CheckFailed(f"SRT cues not numbered 1..n: {document[:300]!r}")
    if any(start > end for start, end, _ in groups):
        raise CheckFailed(f"{response_format} cue ends before it starts: {document[:300]!r}")
    return " ".join(text for _, _, text in groups)
