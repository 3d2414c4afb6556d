"""Placement-policy parameters from a service option, and the decision metrics."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from services.global_scheduler import metrics
from services.global_scheduler.policy import configured_policy_params, make_policy, parse_policy_params
from splitserve.config import CoordinatorConfig, SchedulerConfig, load_config

keys = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)
values = st.text(string.ascii_letters + string.digits + "._/:-", max_size=20)


@given(st.dictionaries(keys, values, max_size=5))
def test_key_value_pairs_and_json_give_the_same_params(params):
    pairs = ",".join(f"{k}={v}" for k, v in params.items())
    assert parse_policy_params(pairs) == params
    assert parse_policy_params(json.dumps(params)) == params


def test_json_values_become_strings_as_set_policy_receives_them():
    assert parse_policy_params('{"max_probes": 6, "tolerance": 0.05}') == {"max_probes": "6", "tolerance": "0.05"}
    assert parse_policy_params("  ") == {}


@pytest.mark.parametrize("text, message", [
    ("max_probes", "key=value"),
    ("=3", "key=value"),
    ("{not json", "not a JSON object"),
    ("[1, 2]", "key=value"),
    ('{"a": 1', "not a JSON object"),
])
def test_bad_params_name_the_field(text, message):
    with pytest.raises(ValueError, match=f"policy_params: .*{message}"):
        parse_policy_params(text)


def test_split_ratio_option_applies_to_split_only_and_params_win():
    assert configured_policy_params("split", 0.3, "") == {"split_ratio": 0.3}
    assert configured_policy_params("split", 0.3, "split_ratio=0.7") == {"split_ratio": "0.7"}
    assert configured_policy_params("dynaserve", 0.3, "max_probes=4") == {"max_probes": "4"}


def test_service_configs_take_policy_params_from_the_environment():
    env = {"SPLITSERVE_SCHEDULER_POLICY": "dynaserve",
           "SPLITSERVE_SCHEDULER_POLICY_PARAMS": "perf_model=A100/qwen2.5-14b,max_probes=4",
           "SPLITSERVE_COORDINATOR_POLICY_PARAMS": '{"max_probes": 3}'}
    scheduler = load_config(SchedulerConfig, environ=env)
    policy = make_policy(scheduler.policy, **configured_policy_params(
        scheduler.policy, scheduler.split_ratio, scheduler.policy_params))
    assert policy.max_probes == 4 and "A100" in policy.perf_model.label
    coordinator = load_config(CoordinatorConfig, environ=env)
    assert parse_policy_params(coordinator.policy_params) == {"max_probes": "3"}


def _sample_count(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_decisions_reach_the_histograms_and_plain_placements_add_nothing():
    before_phi = _sample_count("splitserve_scheduler_decision_phi_count", policy="unit-test")
    before_t2 = _sample_count("splitserve_scheduler_decision_predicted_seconds_count",
                              policy="unit-test", prediction="t2")
    metrics.observe_decision("unit-test", {"phi": 0.4, "probes": 3.0, "t1_s": 0.2, "t2_s": 0.25,
                                           "predicted_ttft_s": 0.05})
    metrics.observe_decision("unit-test", {})
    assert _sample_count("splitserve_scheduler_decision_phi_count", policy="unit-test") == before_phi + 1
    assert _sample_count("splitserve_scheduler_decision_predicted_seconds_count",
                         policy="unit-test", prediction="t2") == before_t2 + 1
    assert _sample_count("splitserve_scheduler_decision_probes_bucket", policy="unit-test", le="3.0") >= 1
