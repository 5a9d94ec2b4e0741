"""Old names of renamed settings and counters keep working, with one deprecation line
(metasched/core/renamed.py; docs/concepts/glossary.md)."""

from __future__ import annotations

import logging

import pytest

from metasched.compose import compose
from metasched.core import renamed


@pytest.mark.parametrize("given, expected", [
    (["agent.total_timesteps=10"], ["ppo.total_timesteps=10"]),
    (["+agent.bc.extra=1"], ["+ppo.bc.extra=1"]),
    (["agent=maskable_ppo"], ["ppo=maskable_ppo"]),
    (["agents.x=1", "workload=coding"], ["agents.x=1", "workload=coding"]),
])
def test_old_override_keys_are_renamed(given, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="metasched"):
        assert renamed.overrides(given) == expected
    assert (given != expected) == any("deprecated" in m for m in caplog.messages)


@pytest.mark.parametrize("cfg, path, expected", [
    ({"estimates": "profile"}, "estimates", "given"),
    ({"estimates": "request"}, "estimates", "given"),
    ({"estimates": "online"}, "estimates", "online"),
    ({"env": {"estimates": "profile"}}, "env.estimates", "given"),
    ({"evaluation": {"estimates": "profile"}}, "evaluation.estimates", "given"),
    ({"ray": {"submit": "agent"}}, "ray.submit", "daemon"),
    ({"ray": None}, "ray", None),
])
def test_old_setting_values_are_renamed(cfg, path, expected):
    out = renamed.settings(cfg)
    for part in path.split("."):
        out = out[part]
    assert out == expected


def test_an_old_estimates_value_composes_to_the_new_one():
    assert compose("eval", ["workload=rm_math", "estimates=profile"])["estimates"] == "given"
    assert compose("eval", ["workload=rm_math"])["estimates"] == "given"


def test_renamed_counters_name_their_new_names_once():
    out = renamed.metrics({"ahead_at_node": [1, 0], "sandboxes": None, "done": 3})
    assert out == {"ahead_at_node": [1, 0], "sandboxes": None, "done": 3,
                   "renamed": {"confinement": "sandboxes", "queued_at_node": "ahead_at_node"}}


def test_a_checkpoint_saved_with_the_old_group_reads_as_the_new_one():
    assert renamed.stored({"agent": {"hidden": 64}, "seed": 0}) == {
        "ppo": {"hidden": 64}, "seed": 0}
