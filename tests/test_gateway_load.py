"""A bounded load test of the real gateway process (mmcpu_dev.gateway_load): while many clients hold slow uploads
open to one engine and many more send requests at once, /health keeps answering within a second, the excess is
refused 429 at once, every admitted request is answered and the other engine keeps serving. The full-size run is
`make bench-gateway` (figures in docs/gateway.md)."""

from __future__ import annotations

import copy
import json

import pytest

from mmcpu_dev import gateway_load

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    log = tmp_path_factory.mktemp("gateway-load") / "gateway.log"
    out = gateway_load.run(slow=100, fast=40, seconds=8, log=log, chat_clients=5, pace_s=2.0)
    print("\n" + json.dumps(out))
    return out


def test_slow_uploads_cannot_starve_health_or_the_other_engine(result) -> None:
    limit = result["settings"]["engine_concurrency"] + result["settings"]["engine_queue"]
    # the slow clients filled the audio engine's places and queue, the rest of them were refused; each one held
    # was answered once its upload was complete
    slow = result["slow_clients"]
    assert slow["held, then 200"] == limit and slow.get("429", 0) + slow.get("503", 0) == 100 - limit, slow
    # every request to the full engine refused with 429, the median well within the bench's 100 ms p99 bound
    overflow = result["overflow"]
    assert set(overflow["status"]) == {"429"} and overflow["count"] > 30 and overflow["p50_ms"] < 100, overflow
    # The other bounds as make bench-gateway holds them; its refusal p99 relaxed, as the test sessions share their
    # 2 CPUs with real engines (the bench phase keeps 100 ms and reports the machine's load beside it).
    assert gateway_load.verdict(result, gateway_load.BOUNDS | {"reject_p99_ms": 1000.0}) == [], result


def test_verdict_names_each_broken_bound(result) -> None:
    """The bench phase's exit status rests on verdict: each bound broken alone is named."""
    breaks = {
        "/health took": lambda r: r["health"].update(max_ms=1000.0),
        "/health not always 200": lambda r: r["health"]["status"].update({"503": 1}),
        "chats to the other engine": lambda r: r["other_engine_chats"]["status"].update({"ReadTimeout": 1}),
        "transcriptions not answered": lambda r: r["overflow"]["status"].update({"500": 1}),
        "excess refused in p99": lambda r: r["overflow"].update(p99_ms=100.1),
        "slow uploads held open": lambda r: r["slow_clients"].update({"held, then no answer": 1}),
        "neither held nor refused": lambda r: r["slow_clients"].update({"reset": 1}),
        "gateway peak RSS": lambda r: r.update(gateway_peak_rss_mib=300.1),
    }
    kept = copy.deepcopy(result)  # the real run's shape, its refusal p99 inside the bound (see above)
    kept["overflow"]["p99_ms"] = min(kept["overflow"]["p99_ms"], 100.0)
    assert gateway_load.verdict(kept) == []
    for words, breaking in breaks.items():
        broken = copy.deepcopy(kept)
        breaking(broken)
        found = gateway_load.verdict(broken)
        assert len(found) == 1 and words in found[0], (words, found)
