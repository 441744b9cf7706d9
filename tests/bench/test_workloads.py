"""Workloads: trace expansion is deterministic and exact, generators are seeded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.workloads import (
    TRACE_BLOCK,
    GeneratorConfig,
    generate,
    load_trace,
    scale_rate,
    trace_block_tokens,
)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_expands_each_hash_id_to_the_same_512_tokens_and_cuts_to_input_length(
        tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 250, "input_length": 513, "output_length": 1, "hash_ids": [7, 9]},
    ])
    a, b = load_trace(trace)
    ta, tb = a.token_ids(), b.token_ids()
    # Cut to input_length: the last block is partial.
    assert (len(ta), len(tb)) == (1000, 513)
    # Equal ids at equal positions give equal tokens; different ids differ.
    assert ta[:TRACE_BLOCK] == tb[:TRACE_BLOCK] == trace_block_tokens(7)
    assert ta[TRACE_BLOCK:] == trace_block_tokens(8)[: 1000 - TRACE_BLOCK]
    assert tb[TRACE_BLOCK:] == trace_block_tokens(9)[:1]
    assert trace_block_tokens(8) != trace_block_tokens(9)
    # Token ids are the byte tokenizer's non-special ids, the same in every process.
    assert all(4 <= t < 260 for t in ta)
    assert trace_block_tokens(7)[:4] == trace_block_tokens(7)[:4]
    assert (a.arrival_s, b.arrival_s) == (0.0, 0.25)
    assert (a.output_length, len(a.output_tokens())) == (3, 3)
    assert a.output_tokens() == load_trace(trace)[0].output_tokens()


def test_trace_rejects_an_input_length_that_does_not_fit_its_hash_ids(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match="does not fit"):
        load_trace(trace)


def test_rate_scale_divides_arrival_times(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [1]}])
    assert scale_rate(load_trace(trace), 4.0)[0].arrival_s == 0.25


@pytest.mark.parametrize("name", ["system_prompt", "multi_turn", "agentic", "images"])
def test_generators_are_deterministic_for_a_seed(name: str) -> None:
    config = GeneratorConfig(requests=40, rate=5.0)
    one, two = generate(name, config, seed=3), generate(name, config, seed=3)
    assert [(r.request_id, r.arrival_s, r.token_ids()) for r in one] == [
        (r.request_id, r.arrival_s, r.token_ids()) for r in two]
    assert len(one) == 40
    assert [r.arrival_s for r in one] == sorted(r.arrival_s for r in one)
    assert generate(name, config, seed=4)[5].token_ids() != one[5].token_ids()


def test_multi_turn_extends_the_previous_turn_with_its_reply() -> None:
    reqs = generate("multi_turn", GeneratorConfig(requests=30, rate=0.5), seed=1)
    turns = sorted((r for r in reqs if r.session == reqs[0].session),
                   key=lambda r: r.arrival_s)
    assert len(turns) >= 2
    first, second = turns[0], turns[1]
    expected = first.token_ids() + first.output_tokens()
    assert second.token_ids()[: len(expected)] == expected
    assert second.input_length > len(expected)


def test_images_generator_places_digests_over_placeholder_positions() -> None:
    reqs = generate("images", GeneratorConfig(requests=60, rate=5.0, image_share=0.5), seed=2)
    with_images = [r for r in reqs if r.images]
    assert with_images
    for r in with_images:
        tokens = r.token_ids()
        for span in r.images:
            assert set(tokens[span.start:span.end]) == {3}
            assert len(span.digest) == 64
