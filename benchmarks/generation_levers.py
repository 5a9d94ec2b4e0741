"""The generation pool's levers at the grouped points, with generation contended:
the step under each lever against FIFO generation's (today's practice), paired by seed.

Each point is a grouped profile with its LLM turns served by a pool of Llama-3.1-8B
replicas (``configs/generation/``; ``metasched.sim.generation``) at a few replica
counts; the tool actions are scheduled by ``rate_greedy`` throughout. Levers:

- ``oracle``: longest true remaining work first (a bound: the truth);
- ``least_slack``: least slack on the true remaining work (orders as ``oracle`` does
  in synchronous steps);
- ``affinity``: FIFO, a trajectory kept on one replica (its prefix cache);
- ``oracle_affinity``: both;
- ``predicted``: longest predicted remaining first, the predictor fitted out of sample
  (``metasched.evaluation.predictors``: training seed 0's trajectories; scored here on
  evaluation seeds from 1,000,000) and updated online on the run's own clock;
- ``predicted_affinity``: both;
- ``oracle_preempt`` (and ``_affinity``): ``oracle`` whose waiting request preempts a
  running one of lower priority when the batch is full (vLLM V0's priority policy);
- ``partial``: partial rollouts under a staleness bound of one step (the simulator's
  asynchronous rollouts, ``max_offpolicyness: 1``: a batch is the first
  ``trajectories_per_step`` to finish, the rest go on into the next; the "step" is then
  the interval between two batches), FIFO generation;
- ``overprovision_1``, ``overprovision_2``: 1 or 2 responses per prompt group launched
  beyond its size, the first ``size`` to finish kept, the rest aborted (RollPacker's
  over-provisioning, ``metasched.sim.overprovision``), FIFO generation.

Prints, per point and replica count, FIFO's mean step, the step with the pool's
generation off (the profile's fixed gaps), and each lever's mean step ÷ FIFO's with
the range over seeds.

    python benchmarks/generation_levers.py [--points swe_grouped,retool_grouped,...]
        [--replicas swe_grouped=4,8 ...] [--levers oracle,affinity,...] [--seeds 3]
        [--out outputs/generation_levers.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from metasched.agents import make_scheduler
from metasched.compose import compose, load_profile
from metasched.evaluation.predictors import fitted_predictor
from metasched.sim.seeds import EVAL_SEED_OFFSET
from metasched.sim.simulator import Simulator

# point -> (profile, its generation config, replica counts measured by default)
POINTS = {"swe_grouped": ("swe_grouped", "swe_grouped", (4, 8)),
          "retool_grouped": ("retool_grouped", "retool_grouped", (2, 4)),
          "retool_grouped_c10": ("retool_grouped_c10", "retool_grouped", (2, 4))}
# lever -> (the pool's order, affinity, further overrides)
LEVERS = {"fifo": ("fifo", False, ()), "oracle": ("oracle", False, ()),
          "least_slack": ("least_slack", False, ()), "affinity": ("fifo", True, ()),
          "oracle_affinity": ("oracle", True, ()), "predicted": ("predicted", False, ()),
          "predicted_affinity": ("predicted", True, ()),
          "oracle_preempt": ("oracle", False, ("generation.priority_preemption=true",)),
          "oracle_preempt_affinity": ("oracle", True, ("generation.priority_preemption=true",)),
          "partial": ("fifo", False, ("+workload.max_offpolicyness=1",)),
          "overprovision_1": ("fifo", False, ("generation.overprovision=1",)),
          "overprovision_2": ("fifo", False, ("generation.overprovision=2",))}


def step_s(point: str, replicas: int | None, lever: str, seed: int) -> tuple[float, dict]:
    """The mean step of one run (``replicas`` None: the pool off) and the pool's summary."""
    prof, gen, _ = POINTS[point]
    overrides = [f"workload={prof}"]
    order, affinity, more = LEVERS[lever]
    if replicas is not None:
        overrides += [f"+generation={gen}", f"generation.replicas={replicas}",
                      f"generation.order={order}", f"generation.affinity={str(affinity).lower()}",
                      *more]
    workload, cluster = load_profile(compose("eval", overrides))
    predictor = fitted_predictor(workload) if order == "predicted" else None
    sim = Simulator(workload, cluster, seed, predictor=predictor)
    r = sim.run(make_scheduler("rate_greedy"))
    return float(np.mean(r.step_s)), (sim.llm.pool.summary() if sim.llm is not None else {})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--replicas", nargs="*", default=[],
                    help="POINT=N,M: the replica counts of a point (default: POINTS')")
    ap.add_argument("--levers", default=",".join(k for k in LEVERS if k != "fifo"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="outputs/generation_levers.json")
    a = ap.parse_args(argv)
    points = a.points.split(",")
    counts = {p: POINTS[p][2] for p in points}
    for spec in a.replicas:
        p, _, ns = spec.partition("=")
        counts[p] = tuple(int(n) for n in ns.split(","))
    levers = ["fifo", *(x for x in a.levers.split(",") if x != "fifo")]
    seeds = [EVAL_SEED_OFFSET + i for i in range(a.seeds)]
    jobs = [(p, None, "fifo", s) for p in points for s in seeds]
    jobs += [(p, n, lv, s) for p in points for n in counts[p] for lv in levers for s in seeds]
    runs: dict[tuple, tuple[float, dict]] = {}
    t0 = time.perf_counter()
    for job in tqdm(jobs, desc="runs", unit="run"):
        runs[job] = step_s(*job)
    doc = []
    for p in points:
        off = np.mean([runs[(p, None, "fifo", s)][0] for s in seeds])
        for n in counts[p]:
            fifo = np.array([runs[(p, n, "fifo", s)][0] for s in seeds])
            row = {"point": p, "replicas": n, "fifo_step_s": float(fifo.mean()),
                   "pool_off_step_s": float(off),
                   "fifo_pool": runs[(p, n, "fifo", seeds[0])][1], "levers": {}}
            print(f"{p} x{n}: FIFO step {fifo.mean():.1f} s (pool off {off:.1f} s; "
                  f"{fifo.mean() / off:.2f}x)")
            for lv in levers[1:]:
                x = np.array([runs[(p, n, lv, s)][0] for s in seeds])
                ratio = x / fifo
                row["levers"][lv] = {"step_s": float(x.mean()),
                                     "ratio": float(x.mean() / fifo.mean()),
                                     "ratio_min": float(ratio.min()),
                                     "ratio_max": float(ratio.max())}
                print(f"  {lv:<20} {x.mean():8.1f} s  {x.mean() / fifo.mean():.3f}x FIFO "
                      f"(seeds {ratio.min():.3f}-{ratio.max():.3f})")
            doc.append(row)
    print(f"{len(jobs)} runs in {time.perf_counter() - t0:.0f} s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": seeds, "rows": doc}, indent=1))


if __name__ == "__main__":
    main()
