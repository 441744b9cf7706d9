"""Per-worker configuration: the same keys from a config file, flags, environment and the
admin API, and a clear refusal for each bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.fleet.worker_config import WorkerConfig, format_worker, parse_worker, parse_workers
from router.settings import SettingsError, load_settings
from tests.fixtures.tokenizer_files import write_tiny_tokenizer

VLLM = WorkerConfig("http://10.0.0.5:8000", engine="vllm", events="tcp://10.0.0.5:5557",
                    replay="tcp://10.0.0.5:5558", block_size=32)


def test_flat_text_starts_a_worker_at_each_url_and_gives_it_the_options_after() -> None:
    text = ("http://10.0.0.5:8000,engine=vllm,events=tcp://10.0.0.5:5557,"
            "replay=tcp://10.0.0.5:5558,block_size=32; http://k:1 http://s:2,engine=sglang")
    assert parse_workers(text) == (VLLM, WorkerConfig("http://k:1"),
                                   WorkerConfig("http://s:2", engine="sglang"))
    assert parse_workers("http://a:1,http://b:2/") == (WorkerConfig("http://a:1"),
                                                       WorkerConfig("http://b:2"))


def test_the_flat_form_round_trips() -> None:
    assert parse_worker(format_worker(VLLM)) == VLLM
    capped = WorkerConfig("http://v:1", engine="vllm", max_num_seqs=8)
    assert parse_worker(format_worker(capped)) == capped
    assert format_worker(WorkerConfig("http://k:1")) == "http://k:1"


def test_toml_tables_json_lists_flags_and_environment_agree(tmp_path: Path) -> None:
    llama = write_tiny_tokenizer(tmp_path)  # the settings refuse a missing one
    toml = tmp_path / "router.toml"
    toml.write_text(f'tokenizer = "{llama}"\n[[workers]]\nurl = "http://10.0.0.5:8000"\n'
                    'engine = "vllm"\nevents = "tcp://10.0.0.5:5557"\n'
                    'replay = "tcp://10.0.0.5:5558"\nblock_size = 32\n')
    json_file = tmp_path / "router.json"
    json_file.write_text('{"workers": [{"url": "http://10.0.0.5:8000", "engine": "vllm", '
                         '"events": "tcp://10.0.0.5:5557", "replay": "tcp://10.0.0.5:5558", '
                         '"block_size": 32}]}')
    flat = format_worker(VLLM)
    from_toml = load_settings({}, env={}, config_file=str(toml))
    assert from_toml.tokenizer == str(llama)
    for settings in (from_toml, load_settings({}, env={}, config_file=str(json_file)),
                     load_settings({"workers": [flat]}, env={}),
                     load_settings({}, env={"KVROUTE_WORKERS": flat})):
        assert parse_workers(list(settings.workers)) == (VLLM,)


@pytest.mark.parametrize("value, reason", [
    ("http://a:1,engine=tgi", "engine 'tgi' is not one of kvroute, vllm, sglang, trtllm"),
    ("http://a:1,engine=vllm,events=10.0.0.5:5557", "not a ZeroMQ endpoint"),
    ("http://a:1,engine=vllm,replay=tcp://a:2", "a replay endpoint needs an events endpoint"),
    ("http://a:1,engine=vllm,block_size=0", "block_size 0 is not positive"),
    ("http://a:1,engine=vllm,block_size=big", "block_size 'big' is not an integer"),
    ("http://a:1,events=tcp://a:2", "a kvroute worker describes its own events"),
    ("engine=vllm,http://a:1", "comes before any worker URL"),
    ("http://a:1,colour=red", "unknown keys \\['colour'\\]"),
    ("http://a:1,engine=vllm,engine=sglang", "engine is given twice"),
    ("ftp://a:1", "is not an http\\(s\\) URL nor key=value"),
    ("http://a:1,dp_size=0", "dp_size 0 is not in 1..1024"),
    ("http://a:1,dp_size=two", "dp_size 'two' is not an integer"),
    ("http://a:1,engine=vllm,max_num_seqs=0", "max_num_seqs 0 is not positive"),
    ("http://a:1,max_num_seqs=8", "a kvroute worker says its max_num_seqs"),
])
def test_each_bad_worker_is_refused_with_its_reason(value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_workers(value)
    with pytest.raises(SettingsError, match=reason):
        load_settings({}, env={"KVROUTE_WORKERS": value})


def test_a_table_needs_a_url_and_string_values() -> None:
    with pytest.raises(ValueError, match="needs a url"):
        parse_worker({"engine": "vllm"})
    with pytest.raises(ValueError, match="engine must be a string"):
        parse_worker({"url": "http://a:1", "engine": 3})
    with pytest.raises(ValueError, match="must be an integer"):
        parse_worker({"url": "http://a:1", "engine": "vllm", "block_size": True})


def test_dp_size_reads_from_every_form_and_round_trips(tmp_path: Path) -> None:
    ranked = WorkerConfig("http://10.0.0.5:8000", engine="vllm", dp_size=2)
    assert parse_workers("http://10.0.0.5:8000,engine=vllm,dp_size=2") == (ranked,)
    table = {"url": "http://10.0.0.5:8000", "engine": "vllm", "dp_size": 2}
    assert parse_worker(table) == ranked
    assert parse_worker(format_worker(ranked)) == ranked
    toml = tmp_path / "router.toml"
    toml.write_text('[[workers]]\nurl = "http://10.0.0.5:8000"\nengine = "vllm"\n'
                    'dp_size = 2\n')
    from_toml = load_settings({}, env={}, config_file=str(toml))
    assert parse_workers(list(from_toml.workers)) == (ranked,)
    # A kvroute worker may be told its ranks too (it also reports them itself).
    assert parse_worker("http://k:1,dp_size=4").dp_size == 4
