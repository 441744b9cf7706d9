"""The tiny model the stock-engine tests serve, and the trace shrinking of the live benchmark."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from bench.stock_live import MAX_MODEL_LEN, _text_of, main, shrink, unlimited_hit_bound
from bench.tiny_model import MODEL_CONFIG, write_tiny_llama
from bench.workloads import DEFAULT_TRACE, WorkloadRequest, load_trace
from openai_request.chat import render_chat
from openai_request.tokenizer import load_tokenizer


def test_the_tiny_model_is_a_consistent_llama_folder(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    raw = (folder / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = len(raw) - 8 - length
    assert max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__") == data
    assert header["model.embed_tokens.weight"]["shape"] == [config["vocab_size"],
                                                           config["hidden_size"]]
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] >= 64
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.vocab_size <= MODEL_CONFIG["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"],
                                                                config["eos_token_id"])
    assert tokenizer.encode("hello", add_special_tokens=True)[0] == tokenizer.bos_token_id
    text = render_chat([{"role": "user", "content": "hi"}], tokenizer.chat_template,
                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    again = write_tiny_llama(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


def test_shrinking_keeps_the_traces_sharing_and_fits_the_model() -> None:
    trace = load_trace(DEFAULT_TRACE, limit=120)
    small = shrink(trace, 16, 8)
    for big, cut in zip(trace, small, strict=True):
        assert cut.input_length <= MAX_MODEL_LEN - cut.output_length
        assert cut.output_length == min(big.output_length, 8)
        assert len(cut.token_ids()) == cut.input_length
    # the trace's shared prefixes stay shared: k common blocks, 16 k common tokens
    shared = 0
    ids = [r.token_ids() for r in small]
    for i, x in enumerate(small):
        for j in range(i + 1, len(small)):
            pairs = zip(x.segments, small[j].segments, strict=False)
            k = next((n for n, (p, q) in enumerate(pairs) if p != q),
                     min(len(x.segments), len(small[j].segments)))
            if k:
                shared += 1
                n = min(16 * k, len(ids[i]), len(ids[j]))
                assert ids[i][:n] == ids[j][:n]
    assert shared > 0
    with pytest.raises(ValueError):
        shrink(trace, 0, 8)


def test_text_prompts_re_encode_to_as_many_tokens_and_keep_prefixes(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "m")
    as_text, tokenizer = _text_of(folder), load_tokenizer(str(folder))
    ids = [4 + (7 * i) % 256 for i in range(300)]
    assert len(tokenizer.encode(as_text(ids))) == len(ids)
    assert as_text([*ids, 9, 10]).startswith(as_text(ids))


def test_the_hit_bound_counts_leading_blocks_seen_before() -> None:
    a = tuple(range(4, 68))  # two blocks of 32
    first = WorkloadRequest("a", 0.0, (a,), 64, 1)
    again = WorkloadRequest("b", 1.0, (a[:32], tuple(range(100, 132))), 64, 1)
    assert unlimited_hit_bound([first, again], 32) == 32 / 128


def test_without_vllm_the_benchmark_says_how_to_install_it_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVROUTE_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    assert main(["--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make vllm-cpu" in err, err
