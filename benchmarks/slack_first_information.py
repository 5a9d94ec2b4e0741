"""What ``slack_first_predicted`` lacks against ``slack_first_oracle``: the step's horizon
or each trajectory's own remaining work.

``slack_first`` reads remaining work twice: summed and maximised over the live
trajectories for the step's horizon, and per queued action for its class and order
(:mod:`metasched.agents.slack_first`). Four variants on the same training seeds:

- ``predicted``: both from the learned predictor (``slack_first_predicted``);
- ``true horizon``: the horizon from the true remaining work, the actions' remaining
  work from the predictor;
- ``true per action``: the horizon from the predictor, the actions' remaining work true;
- ``true``: both true (``slack_first_oracle``'s information, with the predicted rule's
  margin and quantile settings).

``--train-mult K`` fits the predictor on K times the trajectories and decisions of an
evaluation's fit (:mod:`metasched.evaluation.predictors`): whether more training data
moves the predicted variant.

    python benchmarks/slack_first_information.py [--profile retool_grouped_c10]
        [--seeds 100,101,102,103] [--train-mult 1] [--workers 2]

Prints mean step and mean ACT over the seeds per variant (training seeds by default:
the predictor is fitted on training seed 0, evaluation seeds start at 1,000,000).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

import numpy as np

import metasched.evaluation.predictors as predictors
from metasched.agents.slack_first import SlackFirstOracleScheduler, SlackFirstPredictedScheduler
from metasched.agents.step_order import OracleScheduler
from metasched.compose import profile
from metasched.sim.simulator import Simulator


class TrueHorizon(SlackFirstPredictedScheduler):
    """The horizon from the true remaining work; the actions' from the predictor."""

    def traj_work(self, traj):
        return SlackFirstOracleScheduler.traj_work(self, traj)


class TruePerAction(SlackFirstPredictedScheduler):
    """The horizon from the predictor; the actions' remaining work true."""

    def __init__(self) -> None:
        super().__init__()
        self._suffix: dict[int, list[float]] = {}

    def remaining_s(self, a):
        return OracleScheduler.remaining_s(self, a)


class TrueBoth(TruePerAction, TrueHorizon):
    """Both true."""


VARIANTS = {"predicted": SlackFirstPredictedScheduler, "true horizon": TrueHorizon,
            "true per action": TruePerAction, "true": TrueBoth}


def run(job: tuple[str, str, int, float]) -> tuple[str, float, float]:
    """(variant, mean step s, mean ACT s) of one seed."""
    name, workload, seed, mult = job
    predictors.TRAIN_TRAJECTORIES = int(3456 * mult)
    predictors.TRAIN_DECISIONS = int(80_000 * mult)
    w, c = profile(workload)
    sim = Simulator(w, c, seed, predictor=predictors.fitted_predictor(w), max_wait_s=300)
    r = sim.run(VARIANTS[name]())
    return name, float(np.mean(r.step_s)), float(np.mean(r.act))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="retool_grouped_c10")
    ap.add_argument("--seeds", default="100,101,102,103")
    ap.add_argument("--train-mult", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(n, args.profile, s, args.train_mult) for n in VARIANTS for s in seeds]
    with ProcessPoolExecutor(args.workers) as ex:
        out = list(ex.map(run, jobs))
    print(f"| {args.profile}, seeds {args.seeds}, predictor x{args.train_mult:g} "
          "| mean step s | mean ACT s |\n|---|---|---|")
    for n in VARIANTS:
        step = np.mean([o[1] for o in out if o[0] == n])
        act = np.mean([o[2] for o in out if o[0] == n])
        print(f"| {n} | {step:.1f} | {act:.2f} |")


if __name__ == "__main__":
    main()
