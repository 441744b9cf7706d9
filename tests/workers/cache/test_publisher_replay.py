"""The publisher's replay to a consumer busy elsewhere: the ROUTER queues a whole replay
rather than dropping past its default high-water mark (``workers.cache.publisher``, note 7)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from indexer.wire import REPLAY_END_SEQ, pack_seq, unpack_seq
from tests.support.eventually import eventually
from workers.cache.publisher import EventPublisher

#: More batches than a ROUTER's default send pipe holds (1,000), each large enough that the
#: TCP buffers cannot take the rest either.
BATCHES, PAYLOAD = 3000, b"x" * 20_000


async def _publisher() -> EventPublisher:
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_batches=BATCHES)
    await pub.start()
    for _ in range(BATCHES):
        await pub.publish_payload(PAYLOAD)
    return pub


def _dealer(ctx: zmq.asyncio.Context, pub: EventPublisher) -> zmq.asyncio.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 10)  # the consumer's side holds little
    dealer.setsockopt(zmq.LINGER, 0)
    assert pub.replay_endpoint is not None
    dealer.connect(pub.replay_endpoint)
    return dealer


async def _read_replay(dealer: zmq.asyncio.Socket) -> list[int]:
    """Every seq of one replay, up to its end marker (bounded: a lost marker fails)."""
    seqs = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), 20)
        if frames[-2] == REPLAY_END_SEQ:
            return seqs
        seqs.append(unpack_seq(frames[-2]))


async def test_a_replay_past_the_routers_default_pipe_reaches_a_busy_consumer_whole() -> None:
    # The consumer asks, then is busy elsewhere while the publisher sends: a dropping ROUTER
    # lost everything past the first thousand batches, end marker included.
    pub = await _publisher()
    ctx = zmq.asyncio.Context()
    dealer = _dealer(ctx, pub)
    try:
        await dealer.send_multipart([b"", pack_seq(0)])
        await eventually(lambda: pub.replays_served, "the replay request")
        await asyncio.sleep(0.3)  # busy elsewhere; whatever it takes, nothing is lost
        assert await _read_replay(dealer) == list(range(BATCHES))
    finally:
        dealer.close()
        ctx.term()
        await pub.close()
