"""``kvroute --help`` and each subcommand's: plain text, and the long flag lists in groups."""

from __future__ import annotations

import argparse
import re

import pytest

from kvroute.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found |= {f"{name} {k}": v for k, v in _subparsers(sub).items()}
    return found


PARSERS = {"": build_parser(), **_subparsers(build_parser())}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_is_plain_text(command: str) -> None:
    text = PARSERS[command].format_help()
    assert "`" not in text, f"kvroute {command} --help: reStructuredText markup"


@pytest.mark.parametrize("command", ["router", "worker", "epp"])
def test_the_long_flag_lists_are_grouped(command: str) -> None:
    text = PARSERS[command].format_help()
    headings = re.findall(r"^(\S[^\n]*):$", text, re.M)
    assert len(headings) >= 6, headings
    options = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    flags = re.findall(r"^  (-[-\w]+)", options, re.M)
    own = {"epp": ["-h", "--grpc-port", "--metrics-port"]}.get(command, ["-h"])
    assert flags == own, f"ungrouped flags: {flags}"
