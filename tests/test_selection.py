"""A tier leaves unimported only the folders and modules its ``-m`` expression cannot select
anything in, judged by the markers their path gives (:mod:`tests.support.selection`)."""

from __future__ import annotations

import pytest

from tests.support.selection import may_select

#: What the path says of e2e/, an engine module in it, another module in it, and tests/.
E2E = {"process": True}
ENGINE_MODULE = {"process": True, "engine": True}
E2E_MODULE = {"process": True, "engine": False}
TESTS = {"engine": False}


@pytest.mark.parametrize(("expression", "selectable"), [
    ("not process", [False, False, False, True]),  # make check
    ("not engine", [True, False, True, True]),  # make test, while the engines install
    ("engine", [True, True, False, False]),  # make test, then
    ("process and not engine", [True, False, True, True]),
    ("slow", [True, True, True, True]),  # a marker the path does not settle
    ("not slow and not process", [False, False, False, True]),
    ("engine or slow", [True, True, True, True]),
    ("process(reason=1)", [True, True, True, True]),  # asked with arguments: unsettled
    ("", [False, False, False, False]),  # an empty expression holds for nothing
])
def test_a_folder_is_left_out_only_where_no_test_of_it_can_match(
        expression: str, selectable: list[bool]) -> None:
    assert [may_select(expression, known) for known in (E2E, ENGINE_MODULE, E2E_MODULE, TESTS)
            ] == selectable


def test_an_invalid_expression_is_left_to_pytest_to_refuse() -> None:
    with pytest.raises(SyntaxError):
        may_select("not (process", {})
