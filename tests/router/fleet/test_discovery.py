"""Workers found by DNS: added and removed as a name's addresses come and go."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from indexer.index import PrefixIndex
from router.fleet.discovery import Discovery, DnsTarget, parse_target, system_resolver
from router.fleet.facts import FleetFacts
from router.fleet.registry import Registry
from router.settings import RouterSettings, SettingsError, load_settings

NAME = "kvroute-workers.inference.svc.cluster.local"


class StubResolver:
    """Answers from a table the test edits; an ``OSError`` value is raised."""

    def __init__(self, **answers: Any) -> None:
        self.answers: dict[str, Any] = {k.replace("_", "-"): v for k, v in answers.items()}
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers.get(host, [])
        if isinstance(answer, OSError):
            raise answer
        return list(answer)


def _unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def registry(**kw: Any) -> Registry:
    """A real registry whose workers never answer (no sockets: a refusing transport)."""
    settings = RouterSettings(**kw)
    return Registry(settings.fleet_settings(), PrefixIndex(settings.block_size), FleetFacts(),
                    "bytes-v1", httpx.AsyncClient(transport=httpx.MockTransport(_unreachable)))


def urls(reg: Registry) -> list[str]:
    return [e.url for e in reg.entries()]


def test_targets_are_parsed_and_bad_ones_refused() -> None:
    assert parse_target(f"dns:///{NAME}:8000") == DnsTarget(NAME, 8000)
    assert str(DnsTarget(NAME, 8000)) == f"dns:///{NAME}:8000"
    for bad in (f"dns://8.8.8.8/{NAME}:8000", f"dns:///{NAME}", f"http://{NAME}:8000",
                "dns:///:8000", f"dns:///{NAME}:0", f"dns:///{NAME}:port"):
        with pytest.raises(ValueError, match="dns:///NAME:PORT"):
            parse_target(bad)


def test_settings_read_discovery_from_flags_environment_and_file(tmp_path: Any) -> None:
    s = load_settings({}, env={"KVROUTE_DISCOVER": f"dns:///{NAME}:8000, dns:///b:9"})
    assert s.discover == (f"dns:///{NAME}:8000", "dns:///b:9")
    config = tmp_path / "router.toml"
    config.write_text(f'[router]\ndiscover = ["dns:///{NAME}:8000"]\ndiscover_interval = 2\n')
    s = load_settings({}, env={}, config_file=str(config))
    assert s.discover == (f"dns:///{NAME}:8000",) and s.discover_interval == 2.0
    with pytest.raises(SettingsError, match="discover"):
        load_settings({"discover": ["dns:///nope"]}, env={})
    with pytest.raises(SettingsError, match="discover_interval"):
        load_settings({"discover_interval": 0}, env={})


async def test_addresses_that_come_and_go_are_added_and_removed() -> None:
    reg = registry(workers=("http://127.0.0.1:9",))
    for url in reg._settings.workers:
        await reg.add(url, must_answer=False)
    resolve = StubResolver(**{NAME: ["10.0.0.1", "10.0.0.2"]})
    discovery = Discovery([f"dns:///{NAME}:8000"], 5.0, reg, resolve)
    await discovery.refresh()
    assert urls(reg) == ["http://127.0.0.1:9", "http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # Unreachable addresses stay registered, unhealthy, and are retried by the health poll.
    assert reg.candidates() == []
    resolve.answers[NAME] = ["10.0.0.2", "10.0.0.3"]
    await discovery.refresh()
    assert urls(reg) == ["http://127.0.0.1:9", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    # A failed look-up changes nothing; "no such name" (an empty answer) empties the name's
    # workers and leaves the configured one.
    resolve.answers[NAME] = OSError("temporary failure in name resolution")
    await discovery.refresh()
    assert discovery.urls == {"http://10.0.0.2:8000", "http://10.0.0.3:8000"}
    assert len(reg.entries()) == 3
    resolve.answers[NAME] = []
    await discovery.refresh()
    assert urls(reg) == ["http://127.0.0.1:9"]
    assert resolve.asked == [(NAME, 8000)] * 4


async def test_an_address_under_two_names_or_also_configured_is_one_worker() -> None:
    reg = registry()
    await reg.add("http://10.0.0.1:8000", must_answer=False)  # also given with --worker
    resolve = StubResolver(a=["10.0.0.1", "10.0.0.2", "fd00::5"], b=["10.0.0.2"])
    discovery = Discovery(["dns:///a:8000", "dns:///b:8000"], 5.0, reg, resolve)
    await discovery.refresh()
    assert urls(reg) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000",
                         "http://[fd00::5]:8000"]
    resolve.answers["a"] = []
    await discovery.refresh()
    # 10.0.0.2 is still b's; the configured 10.0.0.1 was never discovery's to remove.
    assert urls(reg) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


async def test_the_registry_runs_discovery_from_its_settings() -> None:
    reg = registry(discover=("dns:///localhost:9",), discover_interval=60, health_interval=60)
    await reg.start()
    try:
        assert reg.discovery is not None
        assert "http://127.0.0.1:9" in urls(reg)
    finally:
        await reg.stop()


async def test_the_system_resolver_answers_and_says_no_such_name_as_empty() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 80)
    assert await system_resolver("no-such-name.invalid", 80) == []
    with pytest.raises(OSError, match="not a valid DNS name"):
        await system_resolver("bad..name", 80)


def test_a_dns_target_gives_its_workers_a_role_and_ranks_and_bad_ones_are_refused() -> None:
    target = parse_target(f"dns:///{NAME}:8000?role=prefill&dp_size=2")
    assert target == DnsTarget(NAME, 8000, "prefill", 2)
    assert parse_target(str(target)) == target
    assert str(DnsTarget(NAME, 8000, "decode")) == f"dns:///{NAME}:8000?role=decode"
    for bad, why in (("?role=prefil", "role 'prefil'"), ("?dp_size=0", "dp_size '0'"),
                     ("?dp_size=two", "dp_size 'two'"), ("?rank=1", "options are role"),
                     ("?role=prefill&role=decode", "each once")):
        with pytest.raises(ValueError, match=why):
            parse_target(f"dns:///{NAME}:8000{bad}")
    with pytest.raises(SettingsError) as error:
        load_settings({"discover": [f"dns:///{NAME}:8000?role=both&x=1"]}, env={})
    assert "\n" not in str(error.value) and "role and dp_size" in str(error.value)


async def test_discovered_workers_take_the_targets_role_and_ranks() -> None:
    reg = registry()
    resolve = StubResolver(prefill=["10.0.0.1"], decode=["10.0.0.2", "10.0.0.3"])
    discovery = Discovery(["dns:///prefill:8000?role=prefill&dp_size=2",
                           "dns:///decode:8000?role=decode"], 5.0, reg, resolve)
    await discovery.refresh()
    assert {(e.url, e.role, e.dp_size) for e in reg.entries()} == {
        ("http://10.0.0.1:8000", "prefill", 2), ("http://10.0.0.2:8000", "decode", 1),
        ("http://10.0.0.3:8000", "decode", 1)}
