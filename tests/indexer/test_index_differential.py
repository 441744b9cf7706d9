"""Differential test: random event streams into both cores; every answer must agree.

A seeded generator plays several workers caching prompts that share prefixes (system prompts,
scoped tenants, images), with stores in chain order and with unknown parents, removals in
random order and on random tiers, clears, restarts (new engine hashes, with or without a
clear), departures, direct stores and block-size mismatches. After every step both indexes
answer the same random queries; every few steps their whole per-worker state is compared.
"""

from __future__ import annotations

import random
import types
from dataclasses import dataclass, field

import pytest

from indexer.events import Cleared, MmItem, Removed, Stored
from indexer.hashing import block_hashes, scope_seed

BS = 4
U64 = 2**64 - 1
MEDIUMS = (None, "GPU", "CPU", "CPU", "DISK")


@dataclass
class Prompt:
    tokens: list[int | str]
    mm: list[list[tuple[str, int]]]
    lora: str | None
    salt: str | None
    local: list[int] = field(default_factory=list)


def make_prompts(rng: random.Random) -> list[Prompt]:
    systems = [[rng.randrange(50) for _ in range(BS * rng.randint(1, 6))] for _ in range(4)]
    prompts = []
    for _ in range(40):
        toks: list[int | str] = list(rng.choice(systems))
        toks += [rng.randrange(50) for _ in range(BS * rng.randint(1, 8))]
        mm: list[list[tuple[str, int]]] = [[] for _ in range(len(toks) // BS)]
        if rng.random() < 0.2 and len(toks) > BS + 5:  # an image of 5 positions, after block 0
            digest = rng.choice(["aa", "bb"]) * 32
            start = rng.randrange(BS, len(toks) - 5)
            for k in range(5):
                toks[start + k] = digest
            for b in range(start // BS, (start + 4) // BS + 1):
                mm[b].append((digest, max(0, b * BS - start)))
        lora = rng.choice([None, None, "sql"])
        salt = rng.choice([None, None, None, "t1"])
        p = Prompt(toks, mm, lora, salt)
        p.local = block_hashes(toks, BS, seed=scope_seed(lora, salt), mm=mm)
        prompts.append(p)
    return prompts


class Player:
    """Generates one worker's events; remembers what it has sent to pick removals."""

    def __init__(self, rng: random.Random, wid: int) -> None:
        self.rng = rng
        self.wid = wid
        self.mask = rng.getrandbits(64)
        self.sent: list[int] = []

    def engine(self, p: Prompt, i: int) -> int:
        if self.rng.random() < 0.01:
            return self.rng.randrange(8)  # a colliding engine hash: remaps a block
        return p.local[i] ^ self.mask

    def store(self, p: Prompt) -> Stored:
        rng = self.rng
        n = len(p.local)
        start = rng.choice([0, 0, rng.randrange(n)])
        count = rng.randint(1, n - start)
        parent = None
        if start > 0:
            parent = self.engine(p, start - 1) if rng.random() < 0.9 else rng.getrandbits(64)
        hashes = [self.engine(p, i) for i in range(start, start + count)]
        self.sent += hashes
        images = any(p.mm[i] for i in range(start, start + count))
        toks = p.tokens[start * BS:(start + count) * BS]
        return Stored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
            block_size=BS if rng.random() > 0.01 else 2 * BS, medium=rng.choice(MEDIUMS),
            lora_name=p.lora if start == 0 else None,
            cache_salt=p.salt if start == 0 else None,
            mm_keys=[[MmItem(d, o, "u-" + d[:2]) for d, o in p.mm[i]]
                     for i in range(start, start + count)] if images else None,
            trtllm_image_routing={"version": 1} if images and rng.random() < 0.5 else None,
        )

    def remove(self) -> Removed:
        picks = self.rng.sample(self.sent, min(len(self.sent), self.rng.randint(1, 6)))
        if self.rng.random() < 0.1:
            picks.append(self.rng.getrandbits(64))
        return Removed(block_hashes=picks, medium=self.rng.choice(MEDIUMS))

    def restart(self) -> None:
        self.mask = self.rng.getrandbits(64)
        self.sent.clear()


def step(rng: random.Random, players: dict[int, Player], prompts: list[Prompt],
         indexes: tuple) -> None:
    wid = rng.choice(list(players))
    player = players[wid]
    roll = rng.random()
    if roll < 0.5:
        ops = [("apply", (wid, player.store(rng.choice(prompts))))]
    elif roll < 0.8:
        ops = [("apply", (wid, player.remove()))]
    elif roll < 0.83:
        ops = [("apply", (wid, Cleared()))]
    elif roll < 0.86:  # restart: new engine hashes; the stream may or may not say so
        player.restart()
        ops = [("clear", (wid,))] if rng.random() < 0.5 else []
    elif roll < 0.88:
        player.restart()
        ops = [("remove_worker", (wid,))]
    elif roll < 0.94:
        p = rng.choice(prompts)
        hashes = p.local[: rng.randint(1, len(p.local))]
        verb = rng.choice(["store_hashes", "remove_hashes"])
        ops = [(verb, (wid, hashes, rng.choice([0, 1])))]
    else:
        batch = [player.store(rng.choice(prompts)) for _ in range(3)] + [player.remove()]
        ops = [("apply_batch", (wid, batch))]
    for verb, args in ops:
        for index in indexes:
            getattr(index, verb)(*args)


def query(rng: random.Random, prompts: list[Prompt]) -> list[int]:
    p = rng.choice(prompts)
    q = p.local[: rng.randint(0, len(p.local))]
    if rng.random() < 0.3:
        q = [*q, rng.getrandbits(64)]
    return q


def assert_same_state(ref, nat, workers: list[int]) -> None:
    assert ref.num_blocks() == nat.num_blocks()
    assert ref.stats() == nat.stats()
    assert ref.workers() == nat.workers()
    for w in workers:
        assert ref.worker_blocks(w) == nat.worker_blocks(w), w
        assert ref.engine_hashes(w) == nat.engine_hashes(w), w


def run(both: tuple[types.SimpleNamespace, types.SimpleNamespace], seed: int, workers: int,
        steps: int) -> None:
    rng = random.Random(seed)
    prompts = make_prompts(rng)
    ids = rng.sample(range(2**31), workers)
    players = {w: Player(rng, w) for w in ids}
    ref, nat = both[0].PrefixIndex(BS), both[1].PrefixIndex(BS)
    for i in range(steps):
        step(rng, players, prompts, (ref, nat))
        for _ in range(3):
            q = query(rng, prompts)
            assert ref.match(q) == nat.match(q), (seed, i, q)
        if i % 50 == 49:
            assert_same_state(ref, nat, ids)
    assert_same_state(ref, nat, ids)
    # The streams exercised every rule at least once.
    stats = ref.stats()
    assert stats["stored_blocks"] and stats["removed_blocks"] and stats["unknown_removal"]


@pytest.mark.parametrize("seed", range(24))
def test_few_workers(both, seed: int) -> None:
    run(both, seed, workers=rng_workers(seed), steps=400)


def rng_workers(seed: int) -> int:
    return 2 + seed % 7


@pytest.mark.parametrize("seed", range(3))
def test_a_thousand_workers(both, seed: int) -> None:
    run(both, 1000 + seed, workers=1024, steps=1500)


def test_a_thousand_workers_on_one_prompt(both) -> None:
    rng = random.Random(7)
    prompts = make_prompts(rng)[:2]
    ids = list(range(1024))
    players = {w: Player(rng, w) for w in ids}
    ref, nat = both[0].PrefixIndex(BS), both[1].PrefixIndex(BS)
    for i in range(3000):
        step(rng, players, prompts, (ref, nat))
        q = query(rng, prompts)
        assert ref.match(q) == nat.match(q), i
    assert_same_state(ref, nat, ids)
    assert max(len(ref.match(p.local)) for p in prompts) > 100
