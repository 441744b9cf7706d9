"""``--tokenize match``: the router tokenizes a long prompt only as far as some worker holds
(or is predicted to hold) its blocks, estimates the rest, and its hashes are a prefix of the
exact mode's; ``--tokenize full`` tokenizes everything, as the workers do."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from openai_request import prompts
from openai_request.segment_cache import SegmentedTokenizer
from router.fleet.worker_table import WorkerInfo
from router.routing.prompt_path import request_hashes
from router.service import RouterService
from router.settings import RouterSettings
from tests.fixtures.tokenizer_files import write_tiny_tokenizer

#: About 40 KB: ten steps of the walk's first 4,096 characters.
BODY = {"model": "m", "prompt": " ".join(f"the router holds block {i} of the cached prompt"
                                         for i in range(900))}


def service_for(tmp_path: Path, http: httpx.AsyncClient, tokenize: str) -> RouterService:
    write_tiny_tokenizer(tmp_path)
    service = RouterService(RouterSettings(tokenizer=str(tmp_path), block_size=16, seed=1,
                                           tokenize=tokenize), http)
    for w in range(2):
        service.registry.adopt(WorkerInfo(url=f"http://w{w}", model="m", block_size=16,
                                          tokenizer=service.tokenizer.identity,
                                          instance_id=f"i{w}", max_model_len=1 << 20))
    return service


async def test_a_new_prompt_is_tokenized_only_past_its_first_unheld_block(tmp_path: Path
                                                                          ) -> None:
    async with httpx.AsyncClient() as http:
        service = service_for(tmp_path, http, "match")
        assert isinstance(service.tokenizer, SegmentedTokenizer)
        exact = service.tokenizer.inner.encode(BODY["prompt"], add_special_tokens=True)
        first = service.decide(BODY, "completions")
        known = len(first.prompt.token_ids)
        # Nothing is held: the walk stopped after its first step, a prefix of the exact ids.
        assert 0 < known < len(exact) // 5
        assert first.prompt.token_ids == exact[:known]
        assert first.hashes == request_hashes(first.prompt, service._fleet(
            service.registry.candidates(), "m").terms)
        # The estimate of the rest, from the ratio of what was tokenized, is near the truth.
        assert abs(first.prompt.total_tokens - len(exact)) < 0.2 * len(exact)
        assert service.tokenizer.stats().estimated_tokens == first.prompt.estimated_tokens
        # Once the worker is predicted to hold those blocks, the next walk goes one step
        # further and matches all of them.
        service.dispatched(first, first.worker)
        again = service.decide(BODY, "completions")
        assert again.decision.worker == first.decision.worker
        assert again.decision.chosen.matched_blocks == len(first.hashes)
        assert len(again.prompt.token_ids) > known
        assert again.prompt.token_ids == exact[:len(again.prompt.token_ids)]
        assert service.tokenizer.stats().hits > 0  # the first step came from the cache


async def test_full_mode_tokenizes_every_token(tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http:
        service = service_for(tmp_path, http, "full")
        assert not isinstance(service.tokenizer, SegmentedTokenizer)
        route = service.decide(BODY, "completions")
        exact = service.tokenizer.encode(BODY["prompt"], add_special_tokens=True)
        assert route.prompt.token_ids == exact and route.prompt.estimated_tokens == 0
        assert len(route.hashes) == len(exact) // 16


async def test_both_modes_match_the_same_held_prefix(tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http:
        for mode in ("full", "match"):
            (tmp_path / mode).mkdir()
        full = service_for(tmp_path / "full", http, "full")
        match = service_for(tmp_path / "match", http, "match")
        hashes = full.decide(BODY, "completions").hashes
        held = len(hashes) * 3 // 5
        for service in (full, match):  # the second worker holds 60% of the prompt
            worker = service.registry.candidates()[1].id
            service.index.store_hashes(worker, hashes[:held])
        exact, walked = full.decide(BODY, "completions"), match.decide(BODY, "completions")
        assert walked.decision.worker == exact.decision.worker
        assert walked.decision.chosen.matched_blocks == exact.decision.chosen.matched_blocks \
            == held
        # The walk went past the held blocks, and not to the end.
        assert held < len(walked.hashes) < len(hashes)
        assert walked.hashes == hashes[:len(walked.hashes)]


async def test_a_walk_tokenizes_a_bounded_amount_the_cache_lacks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers hold the whole prompt but this router never saw it (another replica routed
    # it): the walk stops after the limit of uncached characters, estimating the rest; once
    # those segments are cached, the next request walks further at the same cost.
    monkeypatch.setattr(prompts, "WALK_ENCODE_LIMIT_CHARS", 8192)
    async with httpx.AsyncClient() as http:
        (tmp_path / "full").mkdir()
        (tmp_path / "match").mkdir()
        hashes = service_for(tmp_path / "full", http, "full").decide(BODY, "completions").hashes
        service = service_for(tmp_path / "match", http, "match")
        service.index.store_hashes(service.registry.candidates()[0].id, hashes)
        first = service.decide(BODY, "completions")
        assert first.prompt.estimated_tokens > 0
        assert 8192 <= len(service.tokenizer.decode(first.prompt.token_ids)) < 3 * 8192
        second = service.decide(BODY, "completions")
        assert len(second.prompt.token_ids) > len(first.prompt.token_ids)
        assert second.hashes == hashes[:len(second.hashes)]
        assert second.decision.chosen.matched_blocks == len(second.hashes)


async def test_the_walk_is_driven_by_its_caller_and_ends_as_the_whole_prompt(
        tmp_path: Path) -> None:
    # The tokenizer asks nothing of the router: walk_prompt hands back the walk, the caller
    # advances it, and walked to its end it is build_prompt's prompt.
    async with httpx.AsyncClient() as http:
        tokenizer = service_for(tmp_path, http, "match").tokenizer
    options = {"mm_tokens_per_image": 1, "max_image_bytes": 1 << 20, "fetch": None}
    walk = prompts.walk_prompt(BODY, "completions", tokenizer, **options)
    assert isinstance(walk, prompts.PromptWalk)
    assert len(walk.ids) <= 1  # nothing encoded yet: at most the special-token head
    steps = 0
    while walk.advance():
        steps += 1
    assert steps == 3  # 4,096, 8,192 and 16,384 characters of ~40 KB; the fourth step ends it
    assert walk.prompt() == prompts.build_prompt(BODY, "completions", tokenizer, **options)
    assert not walk.advance()  # done: nothing more
    short = prompts.walk_prompt(BODY, "completions", tokenizer, **options)
    assert isinstance(short, prompts.PromptWalk) and short.advance()
    cut = short.prompt()
    assert len(cut.token_ids) > 0 and cut.estimated_tokens > 0 and not short.advance()
    ids = prompts.walk_prompt({"prompt": [5, 6, 7]}, "completions", tokenizer, **options)
    assert ids == prompts.PromptTokens([5, 6, 7])  # token ids: nothing to walk
