"""Assertions on real responses, shared by the tests, the compose smoke check and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai


class CheckFailed(AssertionError):
    pass


def openai_error_body(response_json: Any) -> dict[str, Any]:
    """Return the ``error`` object of an OpenAI-style error body, or raise :class:`CheckFailed`."""
    if not isinstance(response_json, dict) or not isinstance(response_json.get("error"), dict):
        raise CheckFailed(f"not an OpenAI error body: {response_json!r}")
    error = response_json["error"]
    if not isinstance(error.get("message"), str) or not error["message"]:
        raise CheckFailed(f"OpenAI error without a message: {response_json!r}")
    if not isinstance(error.get("type"), str):
        raise CheckFailed(f"OpenAI error without a type: {response_json!r}")
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
