"""The command line's help shows the defaults the settings classes hold, and no others."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.cli import build_parser
from kvroute.epp import DEFAULT_GRPC_PORT
from kvroute.help_defaults import shown
from router.events.transport import DEFAULT_MAX_MESSAGE_BYTES
from router.settings import RouterSettings
from workers.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
ROUTER = {f.name: f.default for f in dataclasses.fields(RouterSettings)}
WORKER = {f.name: f.default for f in dataclasses.fields(WorkerSettings)}
#: Each subcommand whose flags take their defaults from settings, and those defaults.
SOURCES = {
    ("router",): ROUTER,
    ("epp",): {**ROUTER, "grpc_port": DEFAULT_GRPC_PORT},
    ("worker",): WORKER,
    ("events", "tail"): {"max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES},
    ("up",): {"port": ROUTER["port"]},
}


def subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (choices,) = [a.choices for a in parser._actions
                      if isinstance(a, argparse._SubParsersAction)]
        parser = choices[name]
    return parser


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("path", sorted(SOURCES))
def test_every_shown_default_is_the_settings_default(path: tuple[str, ...]) -> None:
    parser = subparser(*path)
    text = flat(parser.format_help())
    checked = 0
    for action in parser._actions:
        if action.help is None or "%(default)s" not in action.help:
            continue
        if action.default is not None:  # the command's own option (kvroute up's): one source
            assert action.dest not in SOURCES[path], f"--{action.dest} repeats a setting"
            continue
        assert action.dest in SOURCES[path], f"--{action.dest} has no settings field"
        value = SOURCES[path][action.dest]
        # The flag's words up to its default (after any other value the help names).
        before = action.help.split("%(default)s")[0].split(")s")[-1]
        assert flat(f"{before}{shown(action.dest, value)}") in text, action.dest
        checked += 1
    assert checked >= {"router": 20, "epp": 20, "worker": 20}.get(path[0], 1)


@pytest.mark.parametrize("path", sorted(SOURCES))
def test_no_flag_spells_a_default_number_out(path: tuple[str, ...]) -> None:
    parser = subparser(*path)
    literal = re.compile(r"\(default:? \d")
    assert [a.dest for a in parser._actions if a.help and literal.search(a.help)] == []
    assert "None" not in parser.format_help()


def test_shown_values() -> None:
    assert [shown("max_body_bytes", 64 * 1024 * 1024), shown("max_body_bytes", 1000),
            shown("max_header_bytes", 64 * 1024),
            shown("health_interval", 1.0), shown("first_byte_factor", 2.5),
            shown("sessions", True), shown("sessions", False), shown("topic", ""),
            shown("port", 8000)] == ["64 MiB", "1000", "64 KiB", "1", "2.5", "on", "off", "empty",
                                     "8000"]


def test_a_changed_settings_default_changes_the_help(monkeypatch: pytest.MonkeyPatch) -> None:
    # The help reads the settings when it is printed, not a copy taken when it was written.
    import router.settings

    changed = dataclasses.make_dataclass(
        "RouterSettings", [("port", int, dataclasses.field(default=8123))])
    monkeypatch.setattr(router.settings, "RouterSettings", changed)
    assert "port (default 8123)" in flat(subparser("router").format_help())


def test_the_routing_flags_in_the_help_show_the_cores_defaults() -> None:
    from router.routing.core import CoreSettings

    text = flat(subparser("router").format_help())
    assert f"(default {CoreSettings().policy})" in text
    assert "learned from observed first tokens" in text and "--overlap-weight" not in text


@pytest.mark.process
def test_building_the_parser_loads_neither_router_nor_worker() -> None:
    # The defaults are read when help is printed; `kvroute events tail` starts without them.
    code = ("import sys, kvroute.cli as c; c.build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'router', 'workers', "
            "'bench'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
