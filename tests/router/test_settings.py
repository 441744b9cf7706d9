"""Router and worker settings: precedence, config files, and what each bad value gets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.settings import RouterSettings, SettingsError, load_settings
from workers.settings import WorkerSettingsError, load_worker_settings


def test_flag_beats_environment_beats_file(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text('[router]\nport = 9001\nblock_size = 16\nworkers = ["http://a:1"]\n')
    env = {"KVROUTE_PORT": "9002", "KVROUTE_WORKERS": "http://b:2, http://c:3/"}
    s = load_settings({"port": 9003}, env=env, config_file=str(config))
    assert (s.port, s.block_size, s.workers) == (9003, 16, ("http://b:2", "http://c:3"))


def test_rates_are_learned_unless_set_by_hand() -> None:
    from router.routing.rates import Rates

    core = load_settings({}, env={}).core_settings()
    assert core.rates is None and core.learns
    hand = load_settings({"rates": "prefill=4e-6,context=1e-9"}, env={}).core_settings()
    assert hand.rates == Rates(prefill_s=4e-6, context_s=1e-9) and not hand.learns
    assert not load_settings({"learn_rates": "off"}, env={}).core_settings().learns


def test_sessions_are_on_by_default() -> None:
    assert load_settings({}, env={}).core_settings().sessions
    off = load_settings({"sessions": "off"}, env={})
    assert not off.sessions and not off.core_settings().sessions
    assert load_settings({}, env={"KVROUTE_SESSIONS": "on"}).sessions


def test_the_routing_defaults_are_the_cores() -> None:
    from router.routing.core import CoreSettings

    # One source: the settings hold no routing defaults of their own.
    assert RouterSettings().core_settings() == CoreSettings()


def test_dynamo_is_one_flag_away() -> None:
    from router.routing.rates import DYNAMO_RATES

    core = load_settings({"policy": "dynamo"}, env={}).core_settings()
    assert (core.policy, core.sessions, core.learns) == ("dynamo", False, False)
    assert core.base_rates("vllm") == DYNAMO_RATES


def test_json_config_files_work_too(tmp_path: Path) -> None:
    config = tmp_path / "router.json"
    config.write_text('{"predict_ttl": 2.5, "sessions": false}')
    s = load_settings({}, env={}, config_file=str(config))
    assert (s.predict_ttl, s.sessions) == (2.5, False)


def test_a_ttft_objective_reaches_the_core_and_none_unsets_it(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text("[router]\nttft_slo = 2.4\n")
    s = load_settings({}, env={}, config_file=str(config))
    assert s.ttft_slo == 2.4 and s.core_settings().ttft_slo == 2.4
    assert load_settings({}, env={"KVROUTE_TTFT_SLO": "none"}, config_file=str(config)
                         ).core_settings().ttft_slo is None
    assert load_settings({}, env={}).ttft_slo is None  # none stated by default


@pytest.mark.parametrize("flags, env, fragment", [
    ({"port": 0}, {}, "port 0"),
    ({}, {"KVROUTE_PORT": "eighty"}, "port from environment"),
    ({"workers": ("ftp://x",)}, {}, "not an http(s) URL"),
    ({"block_size": -4}, {}, "block_size"),
    ({"sessions": "sometimes"}, {}, "sessions from flag: 'sometimes' is not a valid bool"),
    ({}, {"KVROUTE_POLICY": "least_cost"}, "policy 'least_cost' is not one of kv"),
    ({"rates": "prefill=fast"}, {}, "rates: 'fast' is not a number"),
    ({"rates": "context=1e-9"}, {}, "prefill=SECONDS_PER_TOKEN is required"),
    ({}, {"KVROUTE_RATES": "speed=1"}, "'speed=1' is not NAME=SECONDS"),
    ({"rates": "prefill=-1"}, {}, "rate prefill_s must be a finite number >= 0"),
    ({"rates": "prefill=1e-6,onboard=1e-5"}, {}, "onboard_s must not exceed prefill_s"),
    ({"learn_rates": "sometimes"}, {}, "learn_rates from flag: 'sometimes'"),
    ({"predict_ttl": "0"}, {}, "ttls must be positive"),
    ({"ttft_slo": "0"}, {}, "ttft_slo must be positive"),
    ({"ttft_slo": "-2.4"}, {}, "ttft_slo must be positive"),
    ({"ttft_slo": "soon"}, {}, "ttft_slo from flag: 'soon' is not a valid float | None"),
    ({}, {"KVROUTE_TTFT_SLO": "nan"}, "ttft_slo must be a finite number"),
    ({"ttft_slo": "2", "policy": "dynamo"}, {}, "ttft_slo applies to the kv policy"),
])
def test_bad_router_settings_are_refused_with_the_reason(flags: dict, env: dict,
                                                         fragment: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(fragment)):
        load_settings(flags, env=env)


@pytest.mark.parametrize("content, name, fragment", [
    ("port = ", "r.toml", "not valid"),
    ("{]", "r.json", "not valid"),
    ("[router]\nbogus = 1\n", "r.toml", "unknown settings"),
    ("[router]\ntemperature = 0.1\n", "r.toml", r"unknown settings \['temperature'\]"),
    ("[1, 2]", "r.json", "table of settings"),
])
def test_bad_config_files_are_refused(tmp_path: Path, content: str, name: str,
                                      fragment: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SettingsError, match=fragment):
        load_settings({}, env={}, config_file=str(path))


def test_a_missing_config_file_is_named() -> None:
    with pytest.raises(SettingsError, match=r"config file /nope\.toml"):
        load_settings({}, env={}, config_file="/nope.toml")


def test_defaults_bind_loopback() -> None:
    assert RouterSettings().host == "127.0.0.1"
    assert load_worker_settings({}, env={}).host == "127.0.0.1"
    assert load_worker_settings({}, env={}).events_host == "127.0.0.1"


@pytest.mark.parametrize("flags, env, fragment", [
    ({"num_blocks": 0}, {}, "num_blocks must be positive"),
    ({}, {"KVROUTE_WORKER_SPEEDUP": "fast"}, "speedup from environment"),
    ({}, {"KVROUTE_WORKER_IMAGES": "maybe"}, "images from environment"),
    ({"engine": "tpu"}, {}, "engine must be"),
    ({}, {"KVROUTE_WORKER_TIMING": "fast"}, "timing must be 'calibrated' or 'paged'"),
    ({"max_num_batched_tokens": 8}, {}, "at least block_size"),
])
def test_bad_worker_settings_are_refused(flags: dict, env: dict, fragment: str) -> None:
    with pytest.raises(WorkerSettingsError, match=fragment):
        load_worker_settings(flags, env=env)


def test_worker_environment_switches_parse() -> None:
    env = {"KVROUTE_WORKER_IMAGES": "off", "KVROUTE_WORKER_EVENTS_PORT": "none",
           "KVROUTE_WORKER_LORAS": "a, b"}
    s = load_worker_settings({}, env=env)
    assert (s.images, s.events_port, s.loras) == (False, None, ("a", "b"))
    assert s.image_routing_version is None


def test_torch_engine_model_names_the_weights_unless_torch_model_does() -> None:
    s = load_worker_settings({"engine": "torch", "model": "llama-1b"}, env={})
    assert (s.torch_model, s.model) == ("llama-1b", "llama-1b")
    s = load_worker_settings({"engine": "torch", "model": "served", "torch_model": "tiny"}, env={})
    assert (s.torch_model, s.model) == ("tiny", "served")
    s = load_worker_settings({"model": "llama-1b"}, env={})  # the sim engine: a name only
    assert (s.engine, s.torch_model) == ("sim", "tiny")


@pytest.mark.process
@pytest.mark.parametrize("args, fragment", [
    (["router", "--port", "x"], "invalid int value"),
    (["router", "--temperature", "0.5"], "unrecognized arguments: --temperature"),
    (["router", "--sessions", "maybe"], "invalid choice"),
    (["router", "--rates", "prefill=0,onboard=1"], "onboard_s must not exceed prefill_s"),
    (["worker", "--engine", "tpu"], "invalid choice"),
    (["worker", "--num-blocks", "0"], "num_blocks must be positive"),
    (["events", "tail", "--connect", "tcp://127.0.0.1:1", "--count", "0"], "must be >= 1"),
])
def test_bad_cli_flags_exit_2_with_the_reason(args: list[str], fragment: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvroute.cli", *args], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert fragment in result.stderr


async def test_the_router_prices_with_its_configured_rates(tmp_path: Path) -> None:
    import httpx

    from router.routing.rates import DEFAULT_RATES
    from router.service import RouterService

    config = tmp_path / "r.toml"
    config.write_text('[router]\nrates = "prefill=5e-6,decode=1e-8"\nblock_size = 16\n')
    settings = load_settings({}, env={}, config_file=str(config))
    async with httpx.AsyncClient() as http:
        core = RouterService(settings, http).core
    core.worker_joined(0, engine="vllm")
    assert core.rates(0).prefill_s == 5e-6 * 16 and core.rates(0).decode_s == 1e-8 * 16
    async with httpx.AsyncClient() as http:
        default = RouterService(RouterSettings(), http).core
    default.worker_joined(0, engine="vllm")
    assert default.rates(0) == DEFAULT_RATES["vllm"].per_block(32)


@pytest.mark.parametrize("timing", ["calibrated", "paged", "measured"])
def test_a_sim_worker_prices_its_iterations_with_the_timing_named(timing: str) -> None:
    from workers.engine.timing import TIMING_MODELS
    from workers.runtime import WorkerRuntime

    settings = load_worker_settings({"timing": timing}, env={"KVROUTE_WORKER_EVENTS_PORT": "none"})
    assert settings.events_port is None  # no publisher: nothing to bind or close
    assert WorkerRuntime(settings).executor.timing is TIMING_MODELS[timing]


def test_flow_control_flags_become_its_settings() -> None:
    settings = load_settings({"flow_control": "off", "flow_ttft_bound": "2.5",
                              "flow_deadlines": "0=1.5, 3=20", "tenant_weights": "gold=3"},
                             env={"KVROUTE_FLOW_MAX_QUEUE": "7"})
    flow = settings.flow_settings()
    assert not flow.enabled and flow.ttft_bound_s == 2.5 and flow.max_queue == 7
    assert flow.deadlines == {0: 1.5, 3: 20.0}
    assert flow.weight("gold") == 3.0 and flow.weight("anyone") == 1.0


def test_objective_priorities_are_read_as_the_inference_objective_orders_them() -> None:
    # GIE's spec.priority: higher is more urgent; flow control's: lower is.
    settings = load_settings({"objective_priorities": "critical=10, batch=-2, std=0"}, env={})
    assert settings.objectives() == {"critical": -10, "batch": 2, "std": 0}


@pytest.mark.parametrize(("flags", "message"), [
    ({"tenant_weights": "gold"}, "tenant_weights: 'gold' is not KEY=NUMBER"),
    ({"tenant_weights": "gold=0"}, "weight of 'gold' must be"),
    ({"flow_deadlines": "high=1"}, "priority 'high' is not an integer"),
    ({"flow_ttft_bound": "0"}, "ttft_bound_s must be"),
    ({"flow_max_queue": "-1"}, "max_queue must be"),
    ({"objective_priorities": "critical=1.5"}, "the priority of 'critical' must be an integer"),
    ({"objective_priorities": "critical"}, "'critical' is not KEY=NUMBER"),
])
def test_bad_flow_control_settings_are_refused_with_a_clear_message(
        flags: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings(flags, env={})
