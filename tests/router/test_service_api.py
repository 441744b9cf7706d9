"""What the HTTP and EPP shells read of the service: the fleet and the tokenizer through
:class:`router.service.RouterService`'s own verbs, as the registry and tokenizer have them."""

from __future__ import annotations

import httpx
import pytest

from router.fleet.unavailable import NO_WORKER_CONFIGURED
from router.routing.policy import policy_named
from router.service import RouterService
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
