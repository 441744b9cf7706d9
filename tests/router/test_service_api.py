"""What the HTTP and EPP shells read of the service: the fleet and the tokenizer through
:class:`router.service.RouterService`'s own verbs, as the registry and tokenizer have them."""

from __future__ import annotations

import httpx
import pytest

from router.fleet.unavailable import NO_WORKER_CONFIGURED
from router.fleet.worker_table import WorkerInfo
from router.routing.policy import policy_named
from router.service import RouteRequest, RouterService
from router.settings import RouterSettings


async def test_the_fleet_and_tokenizer_read_through_the_service() -> None:
    async with httpx.AsyncClient() as http:
        service = RouterService(RouterSettings(seed=1, policy="dynamo"), http)
        assert service.policy is policy_named("dynamo")
        assert service.workers() == service.registry.entries() == []
        assert service.healthy() == service.candidates() == []
        assert service.unavailable() == NO_WORKER_CONFIGURED
        assert service.shortest_model_len() == 0
        assert service.max_bytes_per_token == service.tokenizer.max_bytes_per_token
        answer = service.tokenize_answer({"prompt": "hi there"}, 0)
        assert answer["tokens"] == service.tokenize({"prompt": "hi there"},
                                                    "completions").token_ids
        with pytest.raises(ValueError):
            service.tokenize_answer({"prompt": 5}, 0)


async def test_a_route_carries_its_request_and_is_decided_again_from_it() -> None:
    # Flow control holds routes, not calls: deciding one again reads what it was asked.
    async with httpx.AsyncClient() as http:
        service = RouterService(RouterSettings(seed=1, block_size=4), http)
        for w in range(2):
            service.registry.adopt(WorkerInfo(url=f"http://w{w}", model="m", block_size=4,
                                              tokenizer=service.tokenizer.identity,
                                              instance_id=f"i{w}"))
        body = {"model": "m", "prompt": "the same prompt, decided twice"}
        first = service.decide(body, "completions", fetch=False)
        assert first.request == RouteRequest(body, "completions", fetch=False)
        service.dispatched(first, first.worker)  # its blocks are predicted there now
        again = service.decide_again(first)
        assert again.request == first.request and again.prompt is first.prompt
        assert again.request_id != first.request_id
        # decided now: the first one's booking is seen
        held = again.decision.terms(first.decision.worker).matched_blocks
        assert held == len(first.hashes) > 0
        assert first.decision.chosen.matched_blocks == 0
