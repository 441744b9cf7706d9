"""Flag help that shows the defaults the settings classes hold, read when help is printed.

A flag's help says ``(default %(default)s)``; the flag itself keeps ``default=None`` (not given),
so the settings' precedence (flag > environment > config file > default) still decides. The
shown value is the settings field of the flag's ``dest``: one source of defaults, so a help text
cannot drift from what the router or worker would use. The settings are imported only when
help is formatted, so building the parser loads neither the router nor the worker. A help text
may name another default as ``%(NAME)s`` when the source lists ``NAME`` (a rule constant the
flag's text explains).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["field_defaults", "formatter_showing", "shown"]

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_MIB = 1024 * 1024


def field_defaults(settings: type) -> dict[str, Any]:
    """Each field of the dataclass ``settings`` and its default (fields without one left out)."""
    return {f.name: f.default for f in dataclasses.fields(settings)
            if f.default is not dataclasses.MISSING}


def shown(name: str, value: Any) -> str:
    """How help shows the default ``value`` of setting ``name``: byte sizes in MiB or KiB
    where whole, numbers without a trailing ``.0``, booleans as ``on``/``off``, an empty
    string as ``empty``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and name.endswith("_bytes") and value and value % _MIB == 0:
        return f"{value // _MIB} MiB"
    if isinstance(value, int) and name.endswith("_bytes") and value and value % 1024 == 0:
        return f"{value // 1024} KiB"
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return "empty"
    return str(value)


def formatter_showing(defaults: Callable[[], Mapping[str, Any]]) -> type[argparse.HelpFormatter]:
    """A help formatter that fills ``%(default)s`` (and ``%(NAME)s`` for a name in ``defaults()``)
    from ``defaults()``, called when help is first formatted.

    Args:
        defaults: returns each setting's default by name (a flag's ``dest``).
    """
    cache: dict[str, Any] = {}

    def values() -> Mapping[str, Any]:
        if not cache:
            cache.update(defaults())
        return cache

    class SettingsDefaultsFormatter(argparse.HelpFormatter):
        def _get_help_string(self, action: argparse.Action) -> str | None:
            text = action.help
            if text is None or "%(" not in text:
                return text

            def fill(match: re.Match[str]) -> str:
                key = match.group(1)
                name = action.dest if key == "default" and action.default is None else key
                if name not in values():
                    return match.group(0)  # left to argparse (%(default)s of an own default)
                return shown(name, values()[name]).replace("%", "%%")

            return _PLACEHOLDER.sub(fill, text)

    return SettingsDefaultsFormatter
