"""The routing policies as values: each name gives one policy, read for what it prices."""

from __future__ import annotations

import pytest

from router.routing.core import CoreSettings
from router.routing.policy import BASELINES, POLICIES, policy_named
from router.settings import SettingsError, load_settings


def test_every_name_gives_its_policy_and_an_unknown_one_is_refused() -> None:
    assert POLICIES == ("kv", "dynamo", "round_robin", "random")
    assert BASELINES == ("round_robin", "random")
    for name in POLICIES:
        assert policy_named(name).name == name
    with pytest.raises(ValueError, match="'lru' is not one of kv, dynamo, round_robin"):
        policy_named("lru")


def test_only_kv_predicts_learns_follows_sessions_and_prices_fetch() -> None:
    kv, dynamo = policy_named("kv"), policy_named("dynamo")
    assert kv.predicts_ttft and kv.learns_rates and kv.follows_sessions
    assert kv.prices_fetch and kv.takes_slo and kv.tracks_prefill and not kv.cache_blind
    assert dynamo.block_rates and not dynamo.predicts_ttft and not dynamo.learns_rates
    for name in BASELINES:
        p = policy_named(name)
        assert p.cache_blind and not (p.prices_fetch or p.follows_sessions or p.block_rates)
    assert policy_named("round_robin").in_turn and not policy_named("random").in_turn


def test_settings_choose_the_policy_once_with_the_same_errors() -> None:
    assert CoreSettings(policy="dynamo").rule is policy_named("dynamo")
    assert not CoreSettings(policy="dynamo").learns
    settings = load_settings({"policy": "random"}, env={})
    assert settings.rule is policy_named("random")
    assert settings.core_settings().sessions is False  # sessions follow kv only
    with pytest.raises(SettingsError, match="policy 'lru' is not one of"):
        load_settings({"policy": "lru"}, env={})
    with pytest.raises(SettingsError, match="ttft_slo applies to the kv policy, not 'dynamo'"):
        load_settings({"policy": "dynamo", "ttft_slo": 0.5}, env={})
    with pytest.raises(ValueError, match="ttft_slo applies to the kv policy"):
        CoreSettings(policy="random", ttft_slo=0.5)
