"""The media-URL policy against real DNS and web servers on public addresses, in a network namespace made for the
run (mmcpu_dev/netlab.py: ``unshare --net --mount``, root): listed hosts are fetched, their redirects followed only
to listed public hosts, their 5xx and timeouts are the one fixed 400, and no private, loopback or metadata address
that listens there ever sees a connection - also when the DNS answer flips between a public address and loopback
on every lookup (rebinding)."""

from __future__ import annotations

import pytest

from mmcpu_dev import netlab

SCENARIOS = netlab.scenarios(internal_port=1)  # the names and expectations; the port is the lab's own at run time


@pytest.fixture(scope="module")
def lab() -> dict:
    return netlab.run()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario(lab, scenario):
    result = lab["scenarios"][scenario.name]
    assert result["outcome"] == scenario.expect, result
    # Every refusal and failure ends within the fetch timeout (slow servers included), none hangs a request.
    assert result["seconds"] < netlab.FETCH_TIMEOUT_S + 1.5, result


def test_nothing_internal_was_connected_to(lab):
    """Loopback (v4 and v6), a private address and the metadata address all listened throughout."""
    assert lab["internal_hits"] == {address: 0 for address in netlab.INTERNAL}
    assert lab["public_hits"][netlab.PUBLIC] > 0  # the lab's public server did answer the allowed fetches


def test_rebinding_cannot_swap_the_address(lab):
    """One lookup per fetch, and the connection goes to what that lookup returned: the fetches whose answer was
    public succeed, those whose answer was loopback are refused, alternately."""
    rebind = lab["scenarios"]["rebinding"]
    assert [r["lookups"] for r in rebind] == [1] * len(rebind)
    assert [r["outcome"] for r in rebind] == ["ok", "failed"] * (len(rebind) // 2)
