"""``kvroute epp``: the router's flags, its own port flag, and clear refusals of bad input."""

from __future__ import annotations

import socket

import pytest

from kvroute.cli import build_parser, main
from router.epp import endpoint_of, epp_server
from router.settings import RouterSettings


def test_epp_takes_the_routers_flags_and_a_grpc_port() -> None:
    args = build_parser().parse_args(
        ["epp", "--grpc-port", "9100", "--worker", "http://10.0.0.1:8000", "--discover",
         "dns:///w.ns.svc.cluster.local:8000", "--rates", "prefill=2e-6", "--seed", "3"])
    assert (args.grpc_port, args.workers, args.discover) == (
        9100, ["http://10.0.0.1:8000"], ["dns:///w.ns.svc.cluster.local:8000"])
    assert args.rates == "prefill=2e-6" and args.seed == 3


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["epp", "--grpc-port", "0"], {}, "--grpc-port 0 is not in 1..65535"),
    (["epp"], {"KVROUTE_EPP_GRPC_PORT": "nine"}, "KVROUTE_EPP_GRPC_PORT='nine' is not a port"),
    (["epp", "--discover", "kvroute-workers:8000"], {}, "dns:///NAME:PORT"),
    (["epp", "--worker", "10.0.0.1:8000"], {}, "is not an http(s) URL"),
    (["router", "--discover", "dns:///name"], {}, "dns:///NAME:PORT"),
])
def test_bad_input_is_refused_before_serving(argv: list[str], env: dict[str, str],
                                             message: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_endpoints_are_host_port_as_envoy_dials_them() -> None:
    assert endpoint_of("http://10.1.2.3:8000") == "10.1.2.3:8000"
    assert endpoint_of("http://10.1.2.3") == "10.1.2.3:80"
    assert endpoint_of("https://[fd00::5]:8443") == "[fd00::5]:8443"


async def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
            async with epp_server(RouterSettings(), port, host="127.0.0.1"):
                pass
