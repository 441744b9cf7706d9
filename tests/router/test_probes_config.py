"""Probes of the router's configuration (:func:`router.settings.load_settings`): config-file
keys unknown or of the wrong type, values out of range, environment values that do not
parse. Each probe must either load settings that hold what was meant or stop with one
:class:`~router.settings.SettingsError` naming the setting; none may load a value other than
the one written (a port of ``true`` taken as 1, a block size of 1.9 taken as 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.settings import SettingsError, load_settings

#: (config file text, the setting it must be refused for)
REFUSED: dict[str, tuple[str, str]] = {
    "an unknown key": ('prot = 8000\n', "prot"),
    "a port of true": ("port = true\n", "port"),
    "a block size of 1.9": ("block_size = 1.9\n", "block_size"),
    "a port out of range": ("port = 70000\n", "port"),
    "a negative block size": ("block_size = -32\n", "block_size"),
    "a list for a string": ('tokenizer = ["a", "b"]\n', "tokenizer"),
    "a table for a string": ('[router.policy]\nx = 1\n', "policy"),
    "a string for a number": ('health_interval = "fast"\n', "health_interval"),
    "a NaN": ("flow_ttft_bound = nan\n", "flow_ttft_bound"),
    "an infinity": ("first_byte_timeout = inf\n", "first_byte_timeout"),
    "an unknown policy": ('policy = "fastest"\n', "policy"),
    "an unknown log format": ('log_format = "xml"\n', "log_format"),
    "a number for a bool": ("learn_rates = 2\n", "learn_rates"),
    "a bad trusted_clients": ('trusted_clients = "10.0.0.0/40"\n', "trusted_clients"),
    "a bad tenant weight": ('tenant_weights = "alice=heavy"\n', "tenant_weights"),
    "a zero max_body_bytes": ("max_body_bytes = 0\n", "max_body_bytes"),
    "a bool for a float": ("connect_timeout = true\n", "connect_timeout"),
    "workers a number": ("workers = 5\n", "workers"),
}


@pytest.mark.parametrize(("text", "setting"), REFUSED.values(), ids=REFUSED.keys())
def test_a_bad_config_file_value_is_refused_naming_it(tmp_path: Path, text: str,
                                                      setting: str) -> None:
    path = tmp_path / "router.toml"
    path.write_text(text)
    with pytest.raises(SettingsError) as refused:
        load_settings({}, env={}, config_file=str(path))
    assert setting in str(refused.value)


ENV: dict[str, tuple[dict[str, str], str]] = {
    "a port that is not a number": ({"KVROUTE_PORT": "eighty"}, "port"),
    "a bool that is not one": ({"KVROUTE_SESSIONS": "maybe"}, "sessions"),
    "a float with a unit": ({"KVROUTE_HEALTH_INTERVAL": "1s"}, "health_interval"),
    "an int written as a float": ({"KVROUTE_MAX_CONNECTIONS": "10.5"}, "max_connections"),
}


@pytest.mark.parametrize(("env", "setting"), ENV.values(), ids=ENV.keys())
def test_a_bad_environment_value_is_refused_naming_it(env: dict[str, str], setting: str
                                                      ) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings({}, env=env)
    assert setting in str(refused.value)


TAKEN: dict[str, tuple[str, dict[str, Any]]] = {
    "an int for a float": ("health_interval = 2\n", {"health_interval": 2.0}),
    "a [router] table": ("[router]\nport = 9001\n", {"port": 9001}),
    "a bool as a word": ('sessions = "off"\n', {"sessions": False}),
    "a whole float for an int": ("block_size = 64.0\n", {"block_size": 64}),
}


@pytest.mark.parametrize(("text", "expected"), TAKEN.values(), ids=TAKEN.keys())
def test_a_good_config_file_value_is_taken(tmp_path: Path, text: str,
                                           expected: dict[str, Any]) -> None:
    path = tmp_path / "router.toml"
    path.write_text(text)
    settings = load_settings({}, env={}, config_file=str(path))
    for name, value in expected.items():
        assert getattr(settings, name) == value
        assert type(getattr(settings, name)) is type(value)


def test_a_config_file_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text("[1, 2]")
    with pytest.raises(SettingsError, match="table"):
        load_settings({}, env={}, config_file=str(path))


def test_a_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="config file"):
        load_settings({}, env={}, config_file=str(tmp_path / "absent.toml"))
