"""The kvroute worker's control answers parsed as typed structs: good ones exactly, bad ones
refused with the field named."""

from __future__ import annotations

import json

import pytest

from router.fleet.worker_answers import MalformedAnswer, parse_load, parse_model_info
from router.fleet.worker_table import IncompatibleWorker
from router.routing.load import ReportedLoad

INFO = {"model": "m", "block_size": 32, "tokenizer": "bytes-v1", "instance_id": "i-1",
        "events_endpoint": "tcp://127.0.0.1:5557", "data_parallel_rank": 2,
        "capacity": {"num_blocks": 4096, "host_blocks": 0, "max_num_seqs": 256},
        "max_model_len": 65536, "kv_snapshot": True, "lora_adapters": ["a"],
        "extra": {"trtllm_image_routing_version": 1}, "a_future_field": [1, 2]}


def test_a_model_info_is_read_field_by_field() -> None:
    info = parse_model_info("http://w", json.dumps(INFO).encode())
    assert (info.model, info.block_size, info.instance_id) == ("m", 32, "i-1")
    assert (info.data_parallel_rank, info.num_blocks, info.max_num_seqs) == (2, 4096, 256)
    assert (info.max_model_len, info.snapshot, info.lora_adapters) == (65536, True, ("a",))
    assert info.image_routing_version == 1 and info.replay_endpoint is None


@pytest.mark.parametrize(("change", "named"), [
    ({"data_parallel_rank": "x"}, "data_parallel_rank"),
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"data_parallel_size": 1 << 20}, "data_parallel_size"),
    ({"max_model_len": 1 << 50}, "max_model_len"),
    ({"max_model_len": -1}, "max_model_len"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": None}, "block_size"),
    ({"capacity": {"num_blocks": 2.5}}, "num_blocks"),
    ({"lora_adapters": [1]}, "lora_adapters"),
    ({"instance_id": 7}, "instance_id"),
])
def test_a_malformed_model_info_is_refused_naming_the_field(change: dict, named: str) -> None:
    with pytest.raises(MalformedAnswer, match=named):
        parse_model_info("http://w", json.dumps({**INFO, **change}).encode())


def test_a_model_info_number_past_any_float_is_refused() -> None:
    raw = json.dumps(INFO).encode().replace(b'"max_model_len": 65536', b'"max_model_len": 1e999')
    with pytest.raises(MalformedAnswer, match="max_model_len"):
        parse_model_info("http://w", raw)


@pytest.mark.parametrize("raw", [b"", b"[]", b"not json", b'{"model": "m"}'])
def test_a_model_info_that_is_not_one_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedAnswer, match="/model_info"):
        parse_model_info("http://w", raw)


@pytest.mark.parametrize("endpoint", ["here", "tcp://127.0.0.1:99999", "tcp://*:x",
                                      "tcp://127.0.0.1", "tcp://h:p:5557", "udp://h:5557",
                                      "tcp://[::1:5557"])
def test_an_event_endpoint_that_is_not_one_is_incompatible(endpoint: str) -> None:
    with pytest.raises(IncompatibleWorker, match="events_endpoint") as refused:
        parse_model_info("http://w", json.dumps({**INFO, "events_endpoint": endpoint}).encode())
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("endpoint, resolved", [
    ("tcp://*:5557", "tcp://w:5557"),
    ("tcp://0.0.0.0:5557", "tcp://w:5557"),
    ("tcp://:5557", "tcp://w:5557"),
    ("tcp://:::5557", "tcp://w:5557"),
    ("tcp://[::1]:5557", "tcp://[::1]:5557"),
    ("ipc:///tmp/kv.sock", "ipc:///tmp/kv.sock"),
])
def test_an_event_endpoint_is_read_as_the_router_can_reach_it(endpoint: str,
                                                              resolved: str) -> None:
    info = parse_model_info("http://w", json.dumps({**INFO, "events_endpoint": endpoint}).encode())
    assert info.events_endpoint == resolved


def test_a_load_report_is_read_in_blocks_and_missing_figures_are_zero() -> None:
    raw = b'{"running": 3, "waiting": 1, "pending_prefill_tokens": 64, "decode_blocks": 7.5,' \
          b' "kv_usage": 0.5}'
    assert parse_load(raw, 32) == ReportedLoad(3, 1, 2.0, 7.5, kv_usage=0.5)
    assert parse_load(b"{}", 32) == ReportedLoad()


@pytest.mark.parametrize(("raw", "named"), [
    (b'{"running": 1e999}', "running"),
    (b'{"running": 1.5}', "running"),
    (b'{"waiting": -1}', "waiting"),
    (b'{"pending_prefill_tokens": 1e999}', "pending_prefill_tokens"),
    (b'{"decode_blocks": "many"}', "decode_blocks"),
    (b'{"kv_usage": 1.5}', "kv_usage"),
    (b"[1, 2]", "object"),
    (b"{", "truncated"),
])
def test_a_malformed_load_report_is_refused_naming_the_field(raw: bytes, named: str) -> None:
    with pytest.raises(MalformedAnswer, match=named):
        parse_load(raw, 32)
