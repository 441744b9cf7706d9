"""Whether a ``-m`` expression can select any test of a folder or module from the markers its
path alone gives it: the top-level ``conftest.py`` leaves unimported what it cannot (``-m "not
process"`` imports nothing under ``e2e/``, ``-m engine`` nothing but the engine modules), so a
tier does not pay for importing the other tier's modules only to deselect their tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from _pytest.mark.expression import Expression

__all__ = ["may_select"]

#: A marker as an expression asks about it: its name and the arguments it is asked with.
_Key = tuple[str, tuple[tuple[str, Any], ...]]


class _Unknown(Exception):
    """The expression asked about a marker the path does not settle."""

    def __init__(self, key: _Key) -> None:
        super().__init__(key)
        self.key = key


def may_select(expression: str, known: Mapping[str, bool]) -> bool:
    """Whether ``expression`` holds for some test whose markers agree with ``known``.

    Args:
        expression: a ``-m`` expression.
        known: markers the path settles: on every test there (True) or on none (False). Any
            other marker, and any marker asked with arguments (``name(key=value)``), may be on
            a test or not: both are tried.

    Raises:
        SyntaxError: ``expression`` is not a valid ``-m`` expression (pytest's own parse of
            it says so as a usage error).
    """
    compiled = Expression.compile(expression)

    def holds(assigned: dict[_Key, bool]) -> bool:
        def matcher(name: str, /, **kwargs: Any) -> bool:
            if not kwargs and name in known:
                return known[name]
            key = (name, tuple(sorted(kwargs.items())))
            if key not in assigned:
                raise _Unknown(key)
            return assigned[key]

        try:
            return compiled.evaluate(matcher)
        except _Unknown as unknown:
            return holds({**assigned, unknown.key: True}) or holds({**assigned,
                                                                     unknown.key: False})

    return holds({})
