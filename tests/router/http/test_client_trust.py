"""Which clients' flow-control headers the router believes: the tenant, the gateway's
fairness id and objective, the priority (header and body) and the TTFT deadline are read
only from ``trusted_clients`` (loopback by default); from anyone else they are ignored, as if
absent, and the headers are not sent upstream. Flow control's refusal counts stay bounded
whatever tenants clients name."""

from __future__ import annotations

from typing import Any

import pytest

from httpapi.trusted_peers import TrustedPeers
from router.http.client_trust import FLOW_HEADERS, flow_view
from router.http.flow import FlowControl
from router.routing.admission import FlowSettings, Shed
from router.service import Route
from router.settings import RouterSettings, SettingsError
from tests.router.http.test_app_boundary import BODY, router
from tests.support.servers import ScriptedWorker

ASKING = {"x-kvroute-priority": "-7", "x-kvroute-tenant": "alice",
          "x-kvroute-ttft-deadline-ms": "250"}


@pytest.mark.parametrize(("spec", "peer", "trusted"), [
    ("127.0.0.0/8,::1", ("127.0.0.1", 5000), True),
    ("127.0.0.0/8,::1", ("::1", 5000), True),
    ("127.0.0.0/8,::1", ("10.0.0.5", 5000), False),
    ("10.0.0.0/8", ("10.200.1.2", 1), True),
    ("10.0.0.0/8", ("::ffff:10.200.1.2", 1), True),  # an IPv4 peer on a dual-stack socket
    ("any", ("203.0.113.9", 1), True),
    ("none", ("127.0.0.1", 1), False),
    ("127.0.0.0/8", None, False),  # no peer address (a Unix socket): not trusted
    ("127.0.0.0/8", ("not-an-address", 1), False),
])
def test_trusted_peers(spec: str, peer: tuple[str, int] | None, trusted: bool) -> None:
    assert TrustedPeers.parse(spec).trusts(peer) is trusted


@pytest.mark.parametrize("spec", ["10.0.0.0/33", "banana", "10.0.0.1/8/2", "any,10.0.0.0/8"])
def test_a_malformed_trusted_clients_setting_stops_the_start(spec: str) -> None:
    with pytest.raises(SettingsError, match="trusted_clients"):
        RouterSettings(trusted_clients=spec)


def test_an_untrusted_view_drops_every_flow_header_and_the_body_priority() -> None:
    headers = {**ASKING, "x-gateway-inference-fairness-id": "bob",
               "x-gateway-inference-objective": "premium", "authorization": "Bearer k"}
    body: dict[str, Any] = {"prompt": "x", "priority": -100, "cache_salt": "s"}
    asked, seen = flow_view(body, headers, trusted=False)
    assert "priority" not in asked and asked["cache_salt"] == "s"
    assert seen == {"authorization": "Bearer k"}
    assert set(FLOW_HEADERS) <= set(headers)
    assert flow_view(body, headers, trusted=True) == (body, headers)


async def explained(client: Any, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    answer = await client.post("/debug/route", json={**BODY, **body}, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()["flow"]  # type: ignore[no-any-return]


async def test_a_loopback_client_is_trusted_by_default() -> None:
    async with ScriptedWorker() as worker, router(worker) as (_, client):
        flow = await explained(client, ASKING)
        served = await client.post("/v1/completions", json=BODY, headers=ASKING)
    assert (flow["priority"], flow["tenant"]) == (-7, "alice")
    assert served.status_code == 200
    assert {k.lower(): v for k, v in worker.headers[0].items()}["x-kvroute-tenant"] == "alice"


async def test_an_untrusted_clients_flow_headers_and_priority_are_ignored() -> None:
    async with ScriptedWorker() as worker, router(worker, trusted_clients="10.0.0.0/8") as (
            _, client):
        flow = await explained(client, ASKING, priority=-100)
        # a malformed priority would be a 400 from a trusted client; ignored, it is none
        served = await client.post("/v1/completions", json=BODY,
                                   headers={**ASKING, "x-kvroute-priority": "urgent"})
    assert (flow["priority"], flow["tenant"]) == (0, "")
    assert served.status_code == 200, served.text
    sent = {k.lower() for k in worker.headers[0]}
    assert not sent & set(FLOW_HEADERS)


def _never(route: Route) -> Route:
    raise AssertionError("no request waits in this test")


def test_refusal_counts_are_bounded_whatever_tenants_clients_name() -> None:
    flow = FlowControl(FlowSettings(weights={"alice": 2.0}), _never)
    for i in range(1000):
        flow._refuse(Shed(f"r{i}", "queue_full", 1, "full", priority=i - 500,
                          tenant=f"tenant-{i}"))
    flow._refuse(Shed("a", "queue_full", 1, "full", priority=0, tenant="alice"))
    tenants = {tenant for _, _, tenant in flow.shed}
    assert tenants == {"other", "alice"}
    assert len(flow.shed) <= 2 * 23
    assert sum(flow.shed.values()) == 1001
