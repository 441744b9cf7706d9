"""CURVE on the event plane, over real sockets on 127.0.0.1: an authorized router receives
the stream and its replays; a router with another key, or none, receives nothing."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from indexer.wire import BlockRemoved, KVEventBatch, pack_seq
from kvroute.keys import generate_keypair
from router.events.subscriber import Delivered, EventSubscriber
from router.events.transport import CurveClientKeys, EventTransport
from router.settings import SettingsError, load_settings
from tests.support.eventually import eventually
from workers.cache.publisher import CurveServerKeys, EventPublisher
from workers.settings import WorkerSettingsError, load_worker_settings

ANY_PORT = "tcp://127.0.0.1:*"


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0)], 0)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A worker keypair, an authorized router keypair and an intruder's keypair."""
    allowed = tmp_path / "authorized"
    worker_pub, worker_secret = generate_keypair(tmp_path / "worker", "worker")
    _, router_secret = generate_keypair(allowed, "router")
    _, intruder_secret = generate_keypair(tmp_path / "intruder", "intruder")
    return {"worker_pub": worker_pub, "worker_secret": worker_secret, "allowed": allowed,
            "router_secret": router_secret, "intruder_secret": intruder_secret}


def transport(secret: Path, server: Path) -> EventTransport:
    return EventTransport(curve=CurveClientKeys.load(secret, server))


async def test_only_an_authorized_router_receives_events(keys: dict[str, Path],
                                                         notice_log: Any) -> None:
    curve = CurveServerKeys.load(keys["worker_secret"], keys["allowed"])
    pub = EventPublisher(ANY_PORT, ANY_PORT, curve=curve)
    await pub.start()
    for i in range(5):  # before anyone listens: only an answered replay brings these
        await pub.publish(batch(i))
    good, intruder, plain = notice_log(), notice_log(), notice_log()
    subs = [
        EventSubscriber(pub.endpoint, good, replay_endpoint=pub.replay_endpoint, from_seq=0,
                        transport=transport(keys["router_secret"], keys["worker_pub"])),
        EventSubscriber(pub.endpoint, intruder, replay_endpoint=pub.replay_endpoint,
                        from_seq=0, probe_interval=None, replay_timeout=30.0,
                        transport=transport(keys["intruder_secret"], keys["worker_pub"])),
        EventSubscriber(pub.endpoint, plain, replay_endpoint=pub.replay_endpoint, from_seq=0,
                        probe_interval=None, replay_timeout=30.0),
    ]
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.SUB)  # a plain ZeroMQ client, as an eavesdropper would use
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(pub.endpoint)
    try:
        for sub in subs:
            await sub.start()
        blocks = itertools.count(5)

        async def publish_one() -> bool:  # until the authorized router has the live stream too
            if any(isinstance(n, Delivered) and not n.replayed for n in good.items):
                return True
            await pub.publish(batch(next(blocks)))
            return False

        await eventually(publish_one, "the live stream at the authorized router",
                         interval=0.05)
        last = pub.next_seq - 1
        await good.wait_for(lambda items: any(isinstance(n, Delivered) and n.seq == last
                                              for n in items), what="the last batch")
        raw_got = await raw.poll(0)
    finally:
        for sub in subs:
            await sub.stop()
        raw.close(linger=0)
        ctx.term()
        await pub.close()
    assert [n.seq for n in good.of(Delivered)] == list(range(last + 1))
    assert [n.seq for n in good.of(Delivered) if n.replayed][:5] == [0, 1, 2, 3, 4]
    assert intruder.items == [] and plain.items == []
    assert raw_got == 0
    assert pub.replays_served == 1, "only the authorized router's replay request came through"


async def test_the_replay_port_does_not_answer_a_plain_request(keys: dict[str, Path]) -> None:
    pub = EventPublisher(ANY_PORT, ANY_PORT,
                         curve=CurveServerKeys.load(keys["worker_secret"], keys["allowed"]))
    await pub.start()
    await pub.publish(batch(0))
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        await dealer.send_multipart([b"", pack_seq(0)])
        # the authorized path works on the same publisher, so its loop is serving
        sub_log: list[Any] = []
        sub = EventSubscriber(pub.endpoint, sub_log.append, replay_endpoint=pub.replay_endpoint,
                              from_seq=0, transport=transport(keys["router_secret"],
                                                              keys["worker_pub"]))
        await sub.start()
        async def publish_one() -> bool:
            if sub_log:
                return True
            await pub.publish(batch(1))
            await dealer.poll(20)
            return False

        await eventually(publish_one, "the authorized subscriber's first batch")
        await sub.stop()
        assert sub_log and isinstance(sub_log[0], Delivered)
        assert await dealer.poll(0) == 0, "the plain client got no reply"
    finally:
        dealer.close(linger=0)
        ctx.term()
        await pub.close()


def test_key_files_are_checked_at_start_up(keys: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no secret key"):
        CurveServerKeys.load(keys["worker_pub"], keys["allowed"])
    with pytest.raises(ValueError, match="client public keys"):
        CurveServerKeys.load(keys["worker_secret"], tmp_path / "missing")
    with pytest.raises(ValueError, match="CURVE key file"):
        CurveClientKeys.load(tmp_path / "missing.key_secret", keys["worker_pub"])
    with pytest.raises(WorkerSettingsError, match="go together"):
        load_worker_settings({"curve_secret_key": str(keys["worker_secret"])}, env={})
    with pytest.raises(SettingsError, match="go together"):
        load_settings({"curve_server_key": str(keys["worker_pub"])}, env={})
    with pytest.raises(SettingsError, match="CURVE key file"):
        load_settings({"curve_server_key": str(keys["worker_pub"]),
                       "curve_secret_key": str(tmp_path / "nope")}, env={})
    settings = load_settings({"curve_server_key": str(keys["worker_pub"]),
                              "curve_secret_key": str(keys["router_secret"])}, env={})
    curve = settings.event_transport().curve
    assert curve is not None and "secret" not in repr(curve).replace("secret=", "")
    worker = load_worker_settings({"curve_secret_key": str(keys["worker_secret"]),
                                   "curve_authorized_clients": str(keys["allowed"])}, env={})
    assert worker.curve_keys is not None
