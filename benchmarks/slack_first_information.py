"""What ``slack_first_predicted`` lacks against ``slack_first_oracle``: the step's horizon
or each trajectory's own remaining work; and two other uses of the same predictor.

``slack_first`` reads remaining work twice: summed and maximised over the live
trajectories for the step's horizon, and per queued action for its class and order
(:mod:`metasched.agents.slack_first`). Four variants on the same training seeds:

- ``predicted``: both from the learned predictor (``slack_first_predicted``);
- ``true horizon``: the horizon from the true remaining work, the actions' remaining
  work from the predictor;
- ``true per action``: the horizon from the predictor, the actions' remaining work true;
- ``true``: both true (``slack_first_oracle``'s information, with the predicted rule's
  margin and quantile settings).

Two other designs on the predictor alone (``--variants``):

- ``rekey``: every queued action's remaining work read again at each refresh (the
  siblings' news reaches actions already queued; ``slack_first``'s ``rekey=True``),
  at margins 0.5 and 0.35 (``rekey m0.35``);
- ``probable``: a trajectory is critical by probability, not by a quantile: each
  trajectory's remaining time drawn 128 times from the log-normal through its
  predicted p10/p50/p90, the horizon drawn with them (the most remaining path, or the
  CPU work over the cores), and a trajectory critical when its draw is within the
  margin of the horizon's in at least ``tau`` of the draws (``probable t0.05``,
  ``probable t0.2``; queued actions re-read as with ``rekey``).

``--train-mult K`` fits the predictor on K times the trajectories and decisions of an
evaluation's fit (:mod:`metasched.evaluation.predictors`): whether more training data
moves the predicted variant.

    python benchmarks/slack_first_information.py [--profile retool_grouped_c10]
        [--seeds 100,101,102,103] [--train-mult 1] [--workers 2]
        [--variants "predicted,true horizon,true per action,true"]

Prints mean step and mean ACT over the seeds per variant (training seeds by default:
the predictor is fitted on training seed 0, evaluation seeds start at 1,000,000).
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ProcessPoolExecutor
from functools import partial

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


class Probable(SlackFirstPredictedScheduler):
    """Critical by probability over draws of every trajectory's remaining time."""

    def __init__(self, tau: float, draws: int = 128) -> None:
        super().__init__(rekey=True)
        self.tau = tau
        self.draws = draws
        self._critical_ids: set[int] = set()

    def _refresh(self, state) -> None:
        trajs = list(state.trajectories.values())
        p = self._stats_for.predictor
        mu, sd, work = np.zeros(len(trajs)), np.zeros(len(trajs)), 0.0
        for i, traj in enumerate(trajs):
            q = p.remaining_of(traj)
            lo, mid, hi = (math.log(max(x, 1e-6)) for x in (q.p10, q.p50, q.p90))
            mu[i], sd[i] = mid, max((hi - lo) / (2 * 1.2816), 1e-3)  # p10..p90: +-1.28 sd
            work += self.traj_work(traj)[1]
        # draws seeded by the clock: the same state, the same split
        z = np.random.default_rng(int(state.t * 1000)).standard_normal((len(trajs), self.draws))
        r = np.exp(mu[:, None] + sd[:, None] * z)
        cores = sum(state.cpu.cores)
        h = np.maximum(r.max(axis=0, initial=0.0), work / cores if cores else 0.0)
        share = (r >= (1.0 - self.margin) * h).mean(axis=1)
        self._critical_ids = {t.id for t, c in zip(trajs, share, strict=True) if c >= self.tau}
        self._requeue(state)

    def _critical(self, a) -> bool:
        return a.traj is not None and a.traj.id in self._critical_ids


VARIANTS = {"predicted": SlackFirstPredictedScheduler, "true horizon": TrueHorizon,
            "true per action": TruePerAction, "true": TrueBoth,
            "rekey": partial(SlackFirstPredictedScheduler, rekey=True),
            "rekey m0.35": partial(SlackFirstPredictedScheduler, rekey=True, margin=0.35),
            "probable t0.05": partial(Probable, 0.05),
            "probable t0.2": partial(Probable, 0.2)}
INFORMATION = "predicted,true horizon,true per action,true"


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
    ap.add_argument("--variants", default=INFORMATION,
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    jobs = [(n, args.profile, s, args.train_mult) for n in names for s in seeds]
    with ProcessPoolExecutor(args.workers) as ex:
        out = list(ex.map(run, jobs))
    print(f"| {args.profile}, seeds {args.seeds}, predictor x{args.train_mult:g} "
          "| mean step s | mean ACT s |\n|---|---|---|")
    for n in names:
        step = np.mean([o[1] for o in out if o[0] == n])
        act = np.mean([o[2] for o in out if o[0] == n])
        print(f"| {n} | {step:.1f} | {act:.2f} |")


if __name__ == "__main__":
    main()
