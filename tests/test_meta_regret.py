"""The meta-policy regret benchmark (benchmarks/meta_regret.py): a checkpoint takes a
rule's figures only where its run is that rule's run, and bad arguments are one line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from helpers import shrunk

from metasched.agents.meta_options import FEATURES, OPTIONS, option
from metasched.agents.meta_policy import MetaNetwork, MetaScheduler, ValueEstimates
from metasched.sim.simulator import Simulator

ROOT = Path(__file__).resolve().parents[1]
F = len(FEATURES)
K = len(OPTIONS)


def _bench() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("meta_regret",
                                                  ROOT / "benchmarks" / "meta_regret.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _meta(pick: str, fallback_log: float | None) -> MetaScheduler:
    """A meta-policy that picks ``pick`` everywhere, with the gate's fallback estimate at
    ``fallback_log`` (None: no estimates, so no gate)."""
    b2 = np.zeros(K)
    b2[[o.name for o in OPTIONS].index(pick)] = 1.0
    net = MetaNetwork(np.zeros((F, 4)), np.zeros(4), np.zeros((4, K)), b2, np.zeros(F),
                      np.ones(F))
    vals = None
    if fallback_log is not None:
        coef = np.zeros((K, F + 1))
        coef[:, 0] = fallback_log
        vals = ValueEstimates(coef, np.full(K, 0.01), np.zeros(F), np.ones(F))
    return MetaScheduler(net, list(OPTIONS), "rate_greedy", "step", vals)


@pytest.mark.parametrize("fallback_log, reused", [(None, True), (20.0, True), (0.0, False)])
def test_a_checkpoint_reuses_a_rule_only_where_its_run_is_that_rules(fallback_log, reused):
    bench = _bench()
    w, c = shrunk("retool_grouped", load=0.1, steps=2)
    rule = Simulator(w, c, 3, max_wait_s=300.0).run(option("fifo").build())
    row = {"steps": rule.step_s.tolist()}
    meta = _meta("fifo", fallback_log)
    x = bench.first_features(w, c, 3)
    got = bench.reused_rule(meta, x, {o.name for o in OPTIONS}, row)
    assert got == ("fifo" if reused else None)
    run = Simulator(w, c, 3, max_wait_s=300.0).run(meta)
    # Reused: the gate never acted and the run is the rule's. Not reused: the gate handed
    # over (a fallback estimate of e^0 = 1 s a step is below any step).
    assert meta.gated is not reused
    if reused:
        assert run.step_s.tolist() == rule.step_s.tolist()
        assert np.array_equal(run.end, rule.end)


def test_the_first_decisions_features_are_every_schedulers():
    bench = _bench()
    w, c = shrunk("retool_grouped", load=0.1, steps=2)
    meta = _meta("critical_path", None)
    Simulator(w, c, 5, max_wait_s=300.0).run(meta)
    assert np.array_equal(bench.first_features(w, c, 5), meta._features)


@pytest.mark.parametrize("args, says", [(["--points", "nowhere"], "--points: unknown nowhere"),
                                        (["--real", "elsewhere"], "--real: unknown elsewhere"),
                                        (["--cap", "act"], "--cap: 'act' is not")])
def test_bad_arguments_are_one_line(args, says, capsys):
    assert _bench().main(args) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
