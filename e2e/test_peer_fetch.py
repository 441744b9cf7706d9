"""Peer KV fetch between two real ``kvroute worker`` processes on 127.0.0.1, without a
router: the request to the receiver carries the fetch instruction a router would add. The
receiver reads the holder's blocks by key (``POST /kv_transfer/read``), takes them into its
cache, publishes them (its snapshot shows them), and serves the request from them; with the
shared secret, an instruction without the router's token is not followed, and a read
without the bearer is refused. The torch pair decodes the tokens of a worker that computed
the prompt itself."""

from __future__ import annotations

from pathlib import Path

import httpx

from e2e.harness import Process, Worker, metric
from tests.support.lazy import require

SECRET = "e2e-transfer-secret-0123456789"
PROMPT = "A prefix the holder computed, which the receiver fetches instead. " * 4
BLOCKS = len(PROMPT.encode()) // 32  # the BOS token makes the prompt one longer


def _complete(worker: Worker, headers: dict[str, str] | None = None) -> httpx.Response:
    answer = httpx.post(f"{worker.url}/v1/completions", headers=headers, timeout=120,
                        json={"prompt": PROMPT, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    return answer


def _instruction(holder: Worker, token: str | None = None) -> dict[str, str]:
    headers = {"x-kvroute-fetch-source": holder.url, "x-kvroute-fetch-blocks": str(BLOCKS)}
    return headers | ({"x-kvroute-transfer-token": token} if token else {})


def _pair(tmp_path: Path, processes: list[Process], env: dict[str, str] | None = None,
          **settings: object) -> tuple[Worker, Worker]:
    holder, receiver = Worker(0, tmp_path, **settings), Worker(1, tmp_path, **settings)
    for w in (holder, receiver):
        w.env |= env or {}
        w.start()
        processes.append(w)
    for w in (holder, receiver):
        w.wait_healthy(timeout=120)
    return holder, receiver


def test_a_sim_worker_fetches_a_prefix_from_another_with_the_shared_secret(
        tmp_path: Path, processes: list[Process]) -> None:
    secret = tmp_path / "transfer-secret"
    secret.write_text(SECRET + "\n")
    # The secret file under the name the router reads too.
    holder, receiver = _pair(tmp_path, processes,
                             env={"KVROUTE_KV_TRANSFER_SECRET_FILE": str(secret)})
    assert httpx.get(f"{receiver.url}/model_info").json()["kv_fetch"]["receive"] is True
    _complete(holder)

    # Without the router's token the instruction is not followed.
    ignored = _complete(receiver, _instruction(holder))
    assert ignored.headers["x-kvroute-fetch-result"] == "failed;reason=untrusted"
    # A read without the bearer is refused by the holder.
    keyless = httpx.post(f"{holder.url}/kv_transfer/read", json={"block_keys": []})
    assert keyless.status_code == 401

    fresh = PROMPT.replace("holder", "owner")  # a prompt the receiver has not computed
    before = set(receiver.resident())
    httpx.post(f"{holder.url}/v1/completions", timeout=60,
               json={"prompt": fresh, "max_tokens": 1}).raise_for_status()
    answer = httpx.post(f"{receiver.url}/v1/completions", timeout=60,
                        headers=_instruction(holder, SECRET),
                        json={"prompt": fresh, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    result = answer.headers["x-kvroute-fetch-result"]
    assert result.startswith(f"blocks={BLOCKS};bytes={BLOCKS * 32 * 131072};"), result
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 32
    text = httpx.get(f"{receiver.url}/metrics").text
    assert metric(text, "kvroute_worker_kv_fetch_total", outcome="fetched") == 1
    assert metric(text, "kvroute_worker_kv_fetch_total", outcome="failed") == 1
    assert metric(text, "kvroute_worker_kv_fetch_blocks_total") == BLOCKS
    assert metric(httpx.get(f"{holder.url}/metrics").text, "kvroute_worker_kv_reads_total",
                  outcome="served") == 1
    # The fetched blocks are on the receiver's event stream: its snapshot names them.
    received = set(receiver.resident()) - before
    assert len(received) == BLOCKS and received <= set(holder.resident())


def test_a_torch_worker_fetches_a_prefix_and_decodes_the_same_tokens(
        tmp_path: Path, processes: list[Process]) -> None:
    require("torch")
    torch = {"engine": "torch", "torch_model": "tiny", "device": "cpu", "kv_memory_gb": 0.05}
    holder, receiver = _pair(tmp_path, processes, **torch)
    first = _complete(holder).json()["choices"][0]["text"]
    reference = _complete(holder).json()["choices"][0]["text"]  # over its cached prefix
    answer = _complete(receiver, _instruction(holder))
    assert answer.headers["x-kvroute-fetch-result"].startswith(f"blocks={BLOCKS};")
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * 32
    assert answer.json()["choices"][0]["text"] == reference == first
