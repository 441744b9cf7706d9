"""The worker's vLLM- and SGLang-compatible endpoints, through httpx against the real app:
the ids they give are the ones the worker prefills, in the shapes peer routers read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from openai_request.prompts import build_prompt
from openai_request.tokenizer import load_tokenizer
from tests.fixtures.tokenizer_files import write_tiny_tokenizer
from workers.http.api import create_app
from workers.settings import WorkerSettings


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    folder = write_tiny_tokenizer(tmp_path)
    settings = WorkerSettings(events_port=0, replay_port=0, speedup=1e6, tokenizer=str(folder),
                              loras=("sql-adapter",))
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://worker") as c:
        c.tokenizer_folder = str(folder)  # type: ignore[attr-defined]
        yield c


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello router"}]


def prefilled(body: dict[str, Any], folder: str) -> list[int]:
    """The ids the worker prefills for ``body`` (its own prompt path)."""
    kind = "chat" if "messages" in body else "completions"
    return build_prompt(body, kind, load_tokenizer(folder), mm_tokens_per_image=1,
                        max_image_bytes=1, fetch=None).token_ids


async def test_tokenize_gives_the_ids_the_worker_prefills(client: httpx.AsyncClient) -> None:
    folder = client.tokenizer_folder  # type: ignore[attr-defined]
    for body in ({"prompt": "hello world, hello router"}, {"messages": CHAT}):
        answer = (await client.post("/tokenize", json={"model": "kvroute-sim", **body})).json()
        assert answer["tokens"] == prefilled(body, folder)
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
        assert answer["token_strs"] is None


async def test_special_tokens_follow_vllm_defaults_and_overrides(client: httpx.AsyncClient
                                                                 ) -> None:
    bos = load_tokenizer(client.tokenizer_folder).bos_token_id  # type: ignore[attr-defined]

    async def ids(body: dict[str, Any]) -> list[int]:
        return (await client.post("/tokenize", json=body)).json()["tokens"]  # type: ignore

    with_bos = await ids({"prompt": "hello"})
    assert with_bos[0] == bos
    assert await ids({"prompt": "hello", "add_special_tokens": False}) == with_bos[1:]
    chat = await ids({"messages": CHAT})
    assert chat[0] == bos and chat[1] != bos  # the template's BOS only
    assert (await ids({"messages": CHAT, "add_special_tokens": True}))[:2] == [bos, bos]


async def test_detokenize_and_token_strs_round_trip(client: httpx.AsyncClient) -> None:
    body = {"prompt": "hello world", "add_special_tokens": False, "return_token_strs": True}
    answer = (await client.post("/tokenize", json=body)).json()
    assert "".join(answer["token_strs"]) == "hello world"
    back = await client.post("/detokenize", json={"tokens": answer["tokens"]})
    assert back.json() == {"prompt": "hello world"}


async def test_render_endpoints_answer_in_vllms_shapes(client: httpx.AsyncClient) -> None:
    folder = client.tokenizer_folder  # type: ignore[attr-defined]
    completions = await client.post("/v1/completions/render",
                                    json={"prompt": "hello router", "max_tokens": 3})
    [one] = completions.json()
    assert one["token_ids"] == prefilled({"prompt": "hello router"}, folder)
    assert one["request_id"].startswith("cmpl-") and one["model"] == "kvroute-sim"
    assert one["sampling_params"] == {"max_tokens": 3}
    chat = (await client.post("/v1/chat/completions/render", json={"messages": CHAT})).json()
    assert chat["token_ids"] == prefilled({"messages": CHAT}, folder)
    assert chat["request_id"].startswith("chatcmpl-")


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/tokenize", {"prompt": 3}, 400, "prompt must be a string, a list of token ids"),
    ("/tokenize", {}, 400, "give a prompt or messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "must be a boolean"),
    ("/tokenize", {"prompt": [1, 10**9]}, 400, "out of range"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "does not exist"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "cannot start"),
    ("/detokenize", {"tokens": ["a"]}, 400, "list of token ids"),
    ("/detokenize", {"tokens": [10**9]}, 400, "out of range"),
    ("/v1/completions/render", {"messages": CHAT}, 400, "prompt is required"),
    ("/v1/chat/completions/render", {"prompt": "x"}, 400, "messages is required"),
])
async def test_bad_bodies_get_the_reason(client: httpx.AsyncClient, path: str,
                                         body: dict[str, Any], status: int, fragment: str
                                         ) -> None:
    answer = await client.post(path, json=body)
    assert answer.status_code == status
    assert fragment in answer.json()["error"]["message"]


async def test_peers_learn_the_model_from_server_info_and_model_info(
        client: httpx.AsyncClient) -> None:
    folder = client.tokenizer_folder  # type: ignore[attr-defined]
    for path in ("/server_info", "/get_server_info"):
        info = await client.get(path)
        assert info.status_code == 200
        body = info.json()
        assert (body["model_path"], body["tokenizer_path"], body["page_size"]) == (
            "kvroute-sim", folder, 32)
        assert body["max_total_num_tokens"] > 0
    model_info = (await client.get("/model_info")).json()
    assert (model_info["model_path"], model_info["tokenizer_path"]) == ("kvroute-sim", folder)


async def test_the_worker_prefills_what_tokenize_says_special_tokens_included(
        client: httpx.AsyncClient) -> None:
    for extra in ({}, {"add_special_tokens": False}):
        body = {"prompt": "hello world, hello router", **extra}
        ids = (await client.post("/tokenize", json=body)).json()["tokens"]
        done = (await client.post("/v1/completions", json={**body, "max_tokens": 1})).json()
        assert done["usage"]["prompt_tokens"] == len(ids)
    bad = await client.post("/v1/completions", json={"prompt": "x", "add_special_tokens": 1})
    assert bad.status_code == 400
