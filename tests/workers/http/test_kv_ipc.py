"""Peer KV fetch over the CUDA IPC path, between two torch CPU worker apps in one process.

A fake backend stands in for :class:`workers.torch.kv_ipc.CudaIpc`: its "handle" names the
holder's CPU pool in a table of this process, so the receiver's "mapped pool" is the holder's
own tensor, and its copy is the same ``index_select`` / ``index_copy_``. Everything above
the backend is the product's: the open and read endpoints, the pins and their release, the
receiver's mapping per holder, and each fallback to the byte path."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import pytest

from tests.support.lazy import LazyModule, require
from tests.workers.http.test_kv_fetch_torch import FULL, PROMPT, SOURCE, _cached, _worker
from tests.workers.http.test_kv_fetch_torch import _complete as _plain_complete
from tests.workers.http.test_kv_pull import _metric
from tests.workers.http.test_kv_pull import _settings as _plain_settings
from tests.workers.http.test_kv_read import keys as block_keys
from workers.http.kv_ipc import (
    OPEN_PATH,
    RELEASE_PATH,
    RETRY_S,
    DeviceIdentity,
    IpcPeers,
    IpcRead,
    MappedPool,
    PinLeaseEnded,
    ipc_writer,
    parse_read_answer,
)
from workers.torch.kv_wire import TransferError

require("torch")  # test_kv_fetch_torch above skips as well where torch is missing
torch = LazyModule("torch")  # imported by the first test that reads it

#: The IPC path needs the shared secret (the pool's handle reads and writes every block).
SECRET = "ipc-test-secret-of-32-bytes-long"
_POOLS: dict[str, Any] = {}
OVER_IPC = 'kvroute_worker_kv_fetch_transfers_total{transfer="cuda_ipc"}'
OVER_HTTP = 'kvroute_worker_kv_fetch_transfers_total{transfer="http"}'


class FakeIpc:
    """:class:`workers.http.kv_ipc.IpcBackend` over CPU tensors of one process."""

    def __init__(self, kv: Any, gpu: str = "GPU-0", fail_open: bool = False,
                 on_copy: Callable[[], None] | None = None) -> None:
        self.kv, self.gpu, self.fail_open, self.on_copy = kv, gpu, fail_open, on_copy
        self.opened = self.exported = self.synced = self.copied = 0

    def identity(self) -> tuple[str, str]:
        return "host-a", self.gpu

    def export(self) -> dict[str, Any]:
        self.exported += 1
        token = uuid.uuid4().hex
        _POOLS[token] = self.kv.device_blocks
        return {"token": token}

    def open(self, handle: Mapping[str, Any], blocks: int) -> Any:
        self.opened += 1
        if self.fail_open:
            raise TransferError("the holder's CUDA IPC handle did not open here")
        pool = _POOLS[handle["token"]]
        assert pool.shape[0] == blocks
        return pool

    def sync(self) -> None:
        self.synced += 1

    def copy(self, pool: Any, src: Sequence[int], dst: Sequence[int]) -> None:
        self.copied += len(src)
        self.kv.device_blocks.index_copy_(0, torch.tensor(list(dst)),
                                          pool.index_select(0, torch.tensor(list(src))))
        if self.on_copy is not None:
            self.on_copy()


def _settings(**kw: Any) -> Any:
    return _plain_settings(kv_transfer_secret=SECRET, **kw)


async def _complete(client: httpx.AsyncClient, text: str, fetch: int | None = None
                    ) -> httpx.Response:
    """A completion; with ``fetch``, the router's instruction and token."""
    if fetch is None:
        return await _plain_complete(client, text)
    answer = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 8},
                               headers={"x-kvroute-fetch-source": SOURCE,
                                        "x-kvroute-fetch-blocks": str(fetch),
                                        "x-kvroute-transfer-token": SECRET})
    assert answer.status_code == 200, answer.text
    return answer


def _state(client: Any) -> Any:
    return client.app._state


def _give(client: Any, **kw: Any) -> FakeIpc:
    """Give a worker app a fake backend, on both its sides."""
    state = _state(client)
    fake = FakeIpc(state.runtime.engine.executor.kv, **kw)
    state.block_reads.ipc.backend = fake
    state.fetcher.ipc.backend = fake
    return fake


async def _reference() -> str:
    async with _worker(_plain_settings()) as alone:
        await _complete(alone, PROMPT)
        return str((await _complete(alone, PROMPT)).json()["choices"][0]["text"])


async def _metrics(client: Any) -> str:
    return str((await client.get("/metrics")).text)


async def test_a_peer_on_the_same_device_copies_the_blocks_and_releases_the_pin() -> None:
    reference = await _reference()
    async with _worker(_settings()) as holder:
        held = _give(holder)
        await _complete(holder, PROMPT)
        info = (await holder.get("/model_info")).json()["kv_fetch"]
        assert info["transfer"] == "http"  # what a router that knows only HTTP reads
        assert info["transfers"] == ["http", "cuda_ipc"]
        assert info["cuda_ipc"] == {"host": "host-a", "gpu": "GPU-0"}
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            mine = _give(d)
            answer = await _complete(d, PROMPT, fetch=FULL)
            block_bytes = d.app._state.runtime.engine.executor.kv.layout().block_bytes  # type: ignore[attr-defined]
            assert answer.headers["x-kvroute-fetch-result"].startswith(
                f"blocks={FULL};bytes={FULL * block_bytes};")
            assert _cached(answer) == FULL * 4
            assert answer.json()["choices"][0]["text"] == reference
            assert (held.exported, held.synced, mine.opened, mine.copied) == (1, 1, 1, FULL)
            # The holder's pin ended with the release, not with its lease.
            assert holder.app._state.runtime.cache.num_pins == 0  # type: ignore[attr-defined]
            text = await _metrics(d)
            assert _metric(text, OVER_IPC) == 1
            assert _metric(text, OVER_HTTP) == 0
            # A second fetch maps nothing again: the pool stays mapped for this holder.
            await d.post("/reset_prefix_cache")
            answer = await _complete(d, PROMPT, fetch=FULL)
            assert answer.headers["x-kvroute-fetch-result"].startswith(f"blocks={FULL};")
            assert (held.exported, mine.opened, mine.copied) == (1, 1, 2 * FULL)


@pytest.mark.parametrize("case", ["another_gpu", "holder_off_cuda", "open_fails"])
async def test_a_peer_that_cannot_use_ipc_reads_the_bytes_over_http(case: str) -> None:
    reference = await _reference()
    async with _worker(_settings()) as holder:
        if case != "holder_off_cuda":
            _give(holder, gpu="GPU-1" if case == "another_gpu" else "GPU-0")
        await _complete(holder, PROMPT)
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            mine = _give(d, fail_open=case == "open_fails")
            answer = await _complete(d, PROMPT, fetch=FULL)
            result = answer.headers["x-kvroute-fetch-result"]
            assert result.startswith(f"blocks={FULL};"), result
            assert answer.json()["choices"][0]["text"] == reference
            assert mine.copied == 0
            text = await _metrics(d)
            assert _metric(text, OVER_HTTP) == 1
            reason = "open_failed" if case == "open_fails" else "status_409"
            assert _metric(text, f'kvroute_worker_kv_ipc_fallbacks_total{{reason="{reason}"}}') == 1
            # For a while this holder is read over HTTP without asking again.
            opened = mine.opened
            await d.post("/reset_prefix_cache")
            await _complete(d, PROMPT, fetch=FULL)
            assert mine.opened == opened
            assert _metric(await _metrics(d), "kvroute_worker_kv_ipc_fallbacks_total") == 1


async def test_a_holder_that_restarted_is_read_over_http_once_then_mapped_again() -> None:
    async with _worker(_settings()) as holder:
        held = _give(holder)
        await _complete(holder, PROMPT)
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            mine = _give(d)
            await _complete(d, PROMPT, fetch=FULL)
            holder.app._state.block_reads.ipc.pool_id = "another-start"  # type: ignore[attr-defined]
            holder.app._state.block_reads.ipc._handle = None  # type: ignore[attr-defined]
            for expect_open in (1, 2):
                await d.post("/reset_prefix_cache")
                answer = await _complete(d, PROMPT, fetch=FULL)
                assert answer.headers["x-kvroute-fetch-result"].startswith(f"blocks={FULL};")
                assert mine.opened == expect_open
            assert (held.exported, mine.copied) == (2, 2 * FULL)
            text = await _metrics(d)
            assert _metric(text, 'kvroute_worker_kv_ipc_fallbacks_total{reason="new_pool"}') == 1
            assert _metric(text, OVER_IPC) == 2


async def test_a_copy_that_ends_past_half_the_lease_is_thrown_away() -> None:
    reference = await _reference()
    async with _worker(_settings()) as holder:
        _give(holder)
        await _complete(holder, PROMPT)
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            now = [100.0]
            fetcher = d.app._state.fetcher  # type: ignore[attr-defined]
            fetcher._clock = lambda: now[0]

            def slow() -> None:
                now[0] += 30.0  # half of the holder's 60 s lease

            _give(d, on_copy=slow)
            answer = await _complete(d, PROMPT, fetch=FULL)
            assert answer.headers["x-kvroute-fetch-result"] == "failed;reason=timeout"
            assert _cached(answer) == 0  # nothing was committed: the prompt was computed
            assert answer.json()["choices"][0]["text"] == reference
            assert holder.app._state.runtime.cache.num_pins == 0  # type: ignore[attr-defined]


async def test_the_ipc_endpoints_follow_the_transfer_rule_and_check_their_bodies() -> None:
    async with _worker(_plain_settings(host="10.1.2.3", admin_token="admin-token",
                                       kv_transfer_secret="s" * 16)) as holder:
        _give(holder)
        await _complete(holder, PROMPT)
        me = {"device": {"host": "host-a", "gpu": "GPU-0"}}
        good = {"authorization": f"Bearer {'s' * 16}"}
        assert (await holder.post(OPEN_PATH, json=me)).status_code == 401
        assert (await holder.post(RELEASE_PATH, json={"pin": "x"})).status_code == 401
        assert (await holder.post(OPEN_PATH, json={"device": "gpu"}, headers=good)
                ).status_code == 400
        opened = await holder.post(OPEN_PATH, json=me, headers=good)
        assert opened.status_code == 200 and opened.json()["blocks"] > 0
        keys = block_keys(holder, PROMPT)[:FULL]
        bad = await holder.post("/kv_transfer/read", headers=good,
                                json={"block_keys": keys, "transfer": "rdma"})
        assert bad.status_code == 400 and "transfer" in bad.text
        read = await holder.post("/kv_transfer/read", headers=good,
                                 json={"block_keys": keys, "transfer": "cuda_ipc"})
        answer = parse_read_answer(read.json(), len(keys))
        assert answer.pool_id == opened.json()["pool"] and len(answer.block_ids) == FULL
        assert holder.app._state.runtime.cache.num_pins == 1  # type: ignore[attr-defined]
        release = {"pin": answer.pin}
        assert (await holder.post(RELEASE_PATH, json=release, headers=good)).json() == {
            "released": True}
        assert (await holder.post(RELEASE_PATH, json=release, headers=good)).json() == {
            "released": False}
        assert holder.app._state.runtime.cache.num_pins == 0  # type: ignore[attr-defined]
    async with _worker(_plain_settings()) as plain:  # no backend: the KV is not on CUDA
        assert (await plain.post(OPEN_PATH, json=me)).status_code == 409
        read = await plain.post("/kv_transfer/read", json={"block_keys": [], "transfer":
                                                          "cuda_ipc"})
        assert read.status_code == 409 and "no_cuda_ipc" in read.text
        assert "transfers" not in (await plain.get("/model_info")).json()["kv_fetch"]


@pytest.mark.parametrize("secret", [None, SECRET])
async def test_only_a_worker_with_the_secret_serves_or_uses_the_ipc_path(
        secret: str | None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # As if the KV were on CUDA: the state asks workers.http.state._cuda_ipc for a backend.
    monkeypatch.setattr("workers.http.state._cuda_ipc", lambda kv: FakeIpc(kv))
    caplog.set_level("INFO", logger="workers.http.state")
    async with _worker(_plain_settings(kv_transfer_secret=secret)) as w:
        state = _state(w)
        served = state.block_reads.ipc.backend is not None
        used = state.fetcher.ipc.backend is not None
        info = (await w.get("/model_info")).json()["kv_fetch"]
    assert served == used == (secret is not None)
    assert ("transfers" in info) == (secret is not None)
    logged = "peer KV fetch over CUDA IPC is off" in caplog.text
    assert logged == (secret is None)
    if secret is None:
        assert "--kv-transfer-secret-file" in caplog.text


async def test_a_holder_that_went_away_is_unmapped() -> None:
    async with _worker(_settings()) as holder:
        _give(holder)
        await _complete(holder, PROMPT)
        async with _worker(_settings(), peer=holder.app) as d:  # type: ignore[attr-defined]
            _give(d)
            await _complete(d, PROMPT, fetch=FULL)
            fetcher = _state(d).fetcher
            assert fetcher.ipc.mapped(SOURCE) is not None

            def refuse(request: httpx.Request) -> httpx.Response:
                raise httpx.ConnectError("connection refused", request=request)

            await fetcher.http.aclose()
            fetcher.http = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
            await d.post("/reset_prefix_cache")
            answer = await _complete(d, PROMPT, fetch=FULL)
            assert answer.headers["x-kvroute-fetch-result"] == "failed;reason=unreachable"
            assert fetcher.ipc.mapped(SOURCE) is None


def test_a_read_answer_is_checked_before_a_block_is_copied() -> None:
    good = {"pool": "p", "pin": "q", "block_ids": [3, 1], "lease_s": 60.0}
    assert parse_read_answer(good, 2) == IpcRead("p", "q", (3, 1), 60.0)
    for bad in ({**good, "block_ids": [3, 1, 2]}, {**good, "block_ids": [-1]},
                {**good, "lease_s": True}, {**good, "pin": None}, [1]):
        with pytest.raises(TransferError):
            parse_read_answer(bad, 2)


def test_a_holder_that_failed_is_read_over_http_until_the_retry_time() -> None:
    now = [0.0]
    peers = IpcPeers(FakeIpc(None), clock=lambda: now[0])
    assert peers.identity == DeviceIdentity("host-a", "GPU-0")
    assert peers.usable("http://s")
    peers.keep("http://s", MappedPool("p", None, 4))
    peers.use_http("http://s")
    assert peers.mapped("http://s") is None and not peers.usable("http://s")
    now[0] = RETRY_S
    assert peers.usable("http://s") and not IpcPeers(None).usable("http://s")


def test_the_writer_copies_only_the_blocks_it_is_asked_for() -> None:
    copies: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    class Backend(FakeIpc):
        def copy(self, pool: Any, src: Sequence[int], dst: Sequence[int]) -> None:
            copies.append((tuple(src), tuple(dst)))

    read = IpcRead("p", "q", (7, 8, 9), 60.0)
    write = ipc_writer(Backend(None), MappedPool("p", None, 10), read, offset=2,
                       deadline=10.0, clock=lambda: 0.0)
    write(3, (40, 41))  # the receiver held the prompt's block 2 already
    assert copies == [((8, 9), (40, 41))]
    with pytest.raises(TransferError, match="not in the read"):
        write(1, (5,))
    late = ipc_writer(Backend(None), MappedPool("p", None, 10), read, offset=2,
                      deadline=10.0, clock=lambda: 10.0)
    with pytest.raises(PinLeaseEnded):
        late(2, (1,))
