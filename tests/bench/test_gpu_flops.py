"""bench.gpu.flops: a pass's arithmetic and a window's floor, checked against the model's own
parameter count and against itself (a chunk's attention is the prompt's in parts). The module
imports no torch: collecting this file would fail (conftest.py) if it did."""

from __future__ import annotations

import pytest

from bench.gpu.flops import attention_flops, floor, linear_flops, main
from workers.torch.shapes import CONFIGS

LLAMA = CONFIGS["llama-1b"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_tokens_linear_work_is_twice_the_layers_weights(name: str) -> None:
    c = CONFIGS[name]
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    norms = c.num_layers * 2 * c.hidden_size + c.hidden_size
    assert linear_flops(c, 1) == 2 * (c.num_params - embeddings - norms)
    assert linear_flops(c, 1000) == 1000 * linear_flops(c, 1)


def test_a_prompts_attention_is_the_sum_of_its_chunks_over_their_context() -> None:
    whole = attention_flops(LLAMA, 20_000)
    chunks = sum(attention_flops(LLAMA, 8192, start) for start in (0, 8192)) + attention_flops(
        LLAMA, 20_000 - 16_384, 16_384)
    assert chunks == pytest.approx(whole)
    # A decode step: one token over its context, as many pairs as positions it sees.
    assert attention_flops(LLAMA, 1, 999) == attention_flops(LLAMA, 1000) - attention_flops(
        LLAMA, 999)


def test_the_floor_is_each_class_over_its_rate() -> None:
    prompts = [1000, 30_000, 12_000]
    f = floor(LLAMA, prompts, 800, 400)
    assert f.tokens == 43_000 and f.requests == 3
    assert f.seconds == pytest.approx(f.linear / 800e12 + f.attention / 400e12)
    assert floor(LLAMA, prompts, 1600, 800).seconds == pytest.approx(f.seconds / 2)
    assert floor(LLAMA, prompts, 800, float("inf")).seconds == pytest.approx(f.linear / 800e12)
    # Longer prompts: attention's share grows with the square.
    assert floor(LLAMA, [60_000]).attention_share > floor(LLAMA, [2_000]).attention_share
    with pytest.raises(ValueError, match="positive"):
        floor(LLAMA, prompts, 0, 400)


def test_the_command_prints_the_traces_window_and_refuses_a_bad_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", "0:5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace 0:5: 5 prompts") and "prompt tok/s" in out
    assert main(["--trace", "5"]) == 2
    assert "--trace must be FIRST:COUNT" in capsys.readouterr().err

