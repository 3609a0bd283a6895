"""The regression proof: the same stack with the image without the three seed patches (upstream PR #50073) must
fail, and with the known error, under MRV2 - so the patched stack's pass is the patches' doing."""

from __future__ import annotations

import pytest

from mmcpu_dev.servers import MRV2_LOG_LINE

pytestmark = pytest.mark.e2e

KNOWN_ERROR = "Found no NVIDIA driver on your system"


def test_smoke_fails(unpatched_run):
    assert unpatched_run.exit_code is not None, "the unpatched stack did not end within E2E_TIMEOUT_S"
    assert unpatched_run.exit_code != 0, "the unpatched stack PASSED the smoke: the regression proof is void"


def test_first_requests_get_http_500(unpatched_run):
    """The smoke's first requests, one transcription and one two-image chat sent together, both get the 500."""
    together = " ".join(line for line in unpatched_run.smoke_lines if "FAIL audio-and-vision-together" in line)
    assert "audio: HTTP 500" in together, f"no HTTP 500 for the transcription: {unpatched_run.smoke_lines[:4]}"
    assert "vision: HTTP 500" in together, f"no HTTP 500 for the two-image chat: {unpatched_run.smoke_lines[:4]}"


@pytest.mark.parametrize("svc", ["audio", "vision"])
def test_engines_fail_with_the_known_error_under_mrv2(unpatched_run, svc: str):
    engine_log = unpatched_run.audio_log if svc == "audio" else unpatched_run.vision_log
    assert MRV2_LOG_LINE in engine_log, f"the unpatched {svc} engine did not run MRV2"
    assert KNOWN_ERROR in engine_log, f"the unpatched {svc} engine failed, but not with {KNOWN_ERROR!r}"
