"""A bounded load test of the real gateway process (mmcpu_dev.gateway_load): while many clients hold slow uploads
open to one engine, /health keeps answering within a second, the excess is refused 429 at once, and the other
engine keeps serving. The full-size figures are in docs/gateway.md."""

from __future__ import annotations

import json

import pytest

from mmcpu_dev import gateway_load

pytestmark = pytest.mark.timeout(120)


def test_slow_uploads_cannot_starve_health_or_the_other_engine(tmp_path) -> None:
    result = gateway_load.run(slow=100, overflow=100, seconds=8, log=tmp_path / "gateway.log")
    print("\n" + json.dumps(result))
    limit = result["settings"]["engine_concurrency"] + result["settings"]["engine_queue"]
    # the slow clients filled the audio engine's places and queue; the rest of them were refused
    assert result["slow_clients"] == {"held": limit, "429": 100 - limit}, result["slow_clients"]
    # every overflow request refused fast with 429 (the budget allows for a shared, busy 2-CPU machine)
    overflow = result["overflow"]
    assert overflow["status"] == {"429": 100}, overflow
    assert overflow["p50_ms"] < 100 and overflow["max_ms"] < 1000, overflow
    health = result["health"]
    assert health["status"] == {"200": health["count"]} and health["count"] > 20 and health["max_ms"] < 1000, health
    chats = result["other_engine_chats"]
    assert set(chats["status"]) == {"200"} and chats["count"] > 10, chats
    assert result["gateway_peak_rss_mib"] < 300
