"""The autoscaling gauges on a real router's /metrics, in front of scripted workers whose
rates are set by hand (a millisecond of prefill a token: 1,000 tokens a second each)."""

from __future__ import annotations

import re

import httpx

from router.http.app import create_app
from router.settings import RouterSettings
from tests.support.eventually import eventually
from tests.support.servers import ScriptedWorker, UvicornServer


def gauge(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


async def test_the_demand_ratio_is_uncached_tokens_a_second_over_the_fleets_capacity() -> None:
    async with ScriptedWorker() as one, ScriptedWorker() as two:
        settings = RouterSettings(workers=(one.url, two.url), health_interval=0.1, seed=3,
                                  rates="prefill=0.001", learn_rates=False)
        async with UvicornServer(create_app(settings)) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await eventually(lambda: client.get("/ready"), "two workers ready",
                             until=lambda r: r.status_code == 200
                             and r.json()["workers"] == 2)
            idle = (await client.get("/metrics")).text
            assert gauge(idle, "kvroute_prefill_capacity_tokens_per_second") == 2000.0
            assert gauge(idle, "kvroute_uncached_prompt_tokens_per_second") == 0.0
            assert gauge(idle, "kvroute_prefill_demand_ratio") == 0.0
            body = {"model": "kvroute-sim", "prompt": "y" * 640, "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            text = (await client.get("/metrics")).text
            demand = gauge(text, "kvroute_uncached_prompt_tokens_per_second")
            assert demand > 0
            assert gauge(text, "kvroute_prefill_capacity_tokens_per_second") == 2000.0
            assert gauge(text, "kvroute_prefill_demand_ratio") == demand / 2000.0
