"""The torch side of KV over CUDA IPC: the handle's JSON form, the host key, no backend off
CUDA, and (on a GPU) a second process that opens a pool's handle and copies named blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.lazy import LazyModule, require
from workers.torch.kv_wire import TransferError

require("torch")
# Imported by the first test that reads them: collecting this module imports no torch.
torch = LazyModule("torch")
torch_kv = LazyModule("workers.torch.kv")
torch_kv_ipc = LazyModule("workers.torch.kv_ipc")

SHARED = (0, b"\x01" * 64, 4096, 512, b"/torch_123_456", 8, b"\x02" * 64, True)


def _kv(device: str, blocks: int = 8) -> torch_kv.PagedKV:
    return torch_kv.PagedKV(num_layers=2, block_size=4, kv_heads=2, head_dim=8,
                            num_blocks=blocks, host_blocks=0, dtype=torch.float32,
                            device=torch.device(device))


def test_a_handle_survives_its_json_form_but_the_device_is_the_openers() -> None:
    wire = json.loads(json.dumps(torch_kv_ipc.encode_handle(SHARED)))
    assert torch_kv_ipc.decode_handle(wire) == SHARED


@pytest.mark.parametrize("field,value", [
    ("handle", "not base64!"), ("handle", ""), ("size", -1), ("size", "4096"),
    ("event_sync_required", 1), ("ref_counter_handle", None)])
def test_a_bad_handle_is_refused_naming_its_field(field: str, value: object) -> None:
    wire = torch_kv_ipc.encode_handle(SHARED) | {field: value}
    with pytest.raises(TransferError, match="handle"):
        torch_kv_ipc.decode_handle(wire)


def test_the_host_key_names_the_boot_and_the_ipc_namespace() -> None:
    key = torch_kv_ipc.host_key("boot-1", "ipc:[4026531839]")
    assert key == torch_kv_ipc.host_key("boot-1", "ipc:[4026531839]") and len(key) == 32
    assert key != torch_kv_ipc.host_key("boot-2", "ipc:[4026531839]")
    assert key != torch_kv_ipc.host_key("boot-1", "ipc:[4026532000]")
    assert torch_kv_ipc.host_key() == torch_kv_ipc.host_key()  # this process's, read from /proc


def test_kv_off_cuda_has_no_ipc_backend() -> None:
    assert torch_kv_ipc.cuda_ipc_for(None) is None
    assert torch_kv_ipc.cuda_ipc_for(_kv("cpu")) is None


_CHILD = r"""
import json, sys, torch
from workers.torch.kv import PagedKV
from workers.torch.kv_ipc import CudaIpc
msg = json.loads(sys.stdin.read())
kv = PagedKV(num_layers=2, block_size=4, kv_heads=2, head_dim=8, num_blocks=8, host_blocks=0,
             dtype=torch.float32, device=torch.device("cuda"))
ipc = CudaIpc(kv)
pool = ipc.open(msg["handle"], msg["blocks"])
ipc.copy(pool, msg["src"], msg["dst"])
print(json.dumps({"identity": list(ipc.identity()),
                  "sums": [float(kv.device_blocks[b].sum()) for b in msg["dst"]]}))
"""


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="no CUDA device")
def test_another_process_copies_named_blocks_out_of_the_shared_pool() -> None:
    kv = _kv("cuda")
    for b in range(kv.num_blocks):
        kv.device_blocks[b].fill_(b + 1)
    ipc = torch_kv_ipc.CudaIpc(kv)
    ipc.sync()
    message = {"handle": ipc.export(), "blocks": kv.num_blocks + 1, "src": [5, 2, 7],
               "dst": [0, 1, 3]}
    root = Path(__file__).resolve().parents[3]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(message),
                           capture_output=True, text=True, env=env, timeout=120, check=False)
    assert child.returncode == 0, child.stderr
    answer = json.loads(child.stdout.strip().splitlines()[-1])
    per_block = kv.device_blocks[0].numel()
    assert answer["sums"] == [6.0 * per_block, 3.0 * per_block, 8.0 * per_block]
    assert answer["identity"] == list(ipc.identity())


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="no CUDA device")
def test_a_copy_refuses_a_block_outside_the_pool() -> None:
    kv = _kv("cuda")
    with pytest.raises(TransferError, match="outside"):
        torch_kv_ipc.CudaIpc(kv).copy(kv.device_blocks, [kv.num_blocks + 1], [0])
