"""The book of which worker made each stored response: bounded, least recently used out."""

from __future__ import annotations

import pytest

from router.http.response_homes import ResponseHomes, response_id


def test_the_least_recently_used_id_goes_first() -> None:
    homes = ResponseHomes(capacity=2)
    homes.made("resp_a", 1)
    homes.made("resp_b", 2)
    assert homes.home("resp_a") == 1  # a is now the most recent
    homes.made("resp_c", 3)
    assert (homes.home("resp_a"), homes.home("resp_b"), homes.home("resp_c")) == (1, None, 3)
    assert len(homes) == 2
    homes.made("resp_a", 4)  # made again elsewhere: the later worker holds it
    assert homes.home("resp_a") == 4


@pytest.mark.parametrize(("head", "found"), [
    (b'{"id":"resp_1","object":"response"', "resp_1"),
    (b'event: response.created\ndata: {"type":"response.created","response":{"id": "resp_2"',
     "resp_2"),
    (b'data: {"item_id":"msg_1","x":1}', None),
    (b'{"object":"response","id":"resp_', None),  # cut before the id ends
])
def test_the_id_is_the_first_id_member(head: bytes, found: str | None) -> None:
    assert response_id(head) == found


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ResponseHomes(0)
