"""What one-step look-ahead over ``rate_greedy`` buys: the achievable gain of a policy
that improves on the best heuristic decision by decision (``agents/lookahead.py``).

For each grid point and training seed: ``rate_greedy``, then the look-ahead teacher
(privileged: the true future; estimates only: futures re-drawn from the estimates) on
the same instance. Prints mean ACT and mean step of each, paired ÷ ``rate_greedy``.
Training seeds only (below the evaluation range): nothing here is tuned to evaluation.

    python benchmarks/lookahead_headroom.py [--points rm_math-gpu1,mixed-x0.25,...]
        [--seeds 2] [--seed-offset 0] [--variants privileged,estimates]
        [--horizon-s 60] [--futures 2] [--kinds gpu] [--alternatives 3]
        [--out outputs/lookahead]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from metasched.agents import make_scheduler
from metasched.agents.lookahead import LookaheadTeacher
from metasched.errors import ConfigError
from metasched.sim.seeds import EVAL_SEED_OFFSET
from metasched.sim.simulator import Simulator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grid import POINTS, point_settings  # noqa: E402

VARIANTS = ("privileged", "estimates")


_MAKESPAN: dict[tuple[str, int], float] = {}


def reference_makespan(point: str, seed: int) -> float:
    """Simulated seconds of ``rate_greedy``'s run (the progress bar's length)."""
    return _MAKESPAN.get((point, seed), 1.0)


def measure(point: str, seed: int, variant: str, horizon_s: float, futures: int,
            kinds: tuple[str, ...], alternatives: int, holds_s: tuple[float, ...],
            look_every: int = 1) -> dict:
    """One run of ``variant`` (``rate_greedy`` or a teacher) at ``point`` on ``seed``."""
    workload, cluster, s = point_settings(point, ["rate_greedy"], 1, seed)
    params = s["params"].get("rate_greedy", {})
    sim = Simulator(workload, cluster, seed, timeline_dt=s["timeline_dt"],
                    max_wait_s=s["max_wait_s"])
    t0 = time.perf_counter()
    stats = None
    if variant == "rate_greedy":
        r = sim.run(make_scheduler("rate_greedy", **params))
    else:
        teacher = LookaheadTeacher(horizon_s=horizon_s, privileged=variant == "privileged",
                                   n_futures=futures, kinds=kinds,
                                   n_alternatives=alternatives, holds_s=holds_s,
                                   look_every=look_every, seed=seed,
                                   params=params)
        ref_t = reference_makespan(point, seed)
        with tqdm(total=round(ref_t), desc=f"{point} seed {seed} {variant}", unit="sim s",
                  file=sys.stderr, leave=False) as bar:
            r = teacher.run(sim, progress=lambda t: bar.update(min(round(t), bar.total) - bar.n))
        st = teacher.stats
        stats = {"decisions": st.decisions, "looked": st.looked, "changed": st.changed,
                 "rollouts": st.rollouts, "chosen": st.by_label}
    if variant == "rate_greedy":
        _MAKESPAN[(point, seed)] = sim.state.t
    return {"point": point, "seed": seed, "variant": variant,
            "mean_act_s": float(r.act.mean()), "mean_step_s": float(r.step_s.mean()),
            "wall_s": time.perf_counter() - t0, "stats": stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="rm_math-gpu1,mixed-x0.25,retool-c10,search-q0.25")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--horizon-s", type=float, default=60.0)
    ap.add_argument("--futures", type=int, default=2, help="forks per candidate (estimates)")
    ap.add_argument("--kinds", default="gpu", help="pools given alternatives: gpu,cpu,api")
    ap.add_argument("--alternatives", type=int, default=3)
    ap.add_argument("--holds-s", default="", help="GPU holds to try, seconds (e.g. 2,8,32)")
    ap.add_argument("--look-every", type=int, default=1,
                    help="look ahead at every N-th decision with alternatives only")
    ap.add_argument("--out", default="outputs/lookahead")
    args = ap.parse_args(argv)
    points = [p for p in args.points.split(",") if p]
    variants = [v for v in args.variants.split(",") if v]
    kinds = tuple(k for k in args.kinds.split(",") if k)
    try:
        try:
            holds = tuple(float(h) for h in args.holds_s.split(",") if h)
        except ValueError:
            raise ConfigError("holds-s", f"must be numbers (got {args.holds_s!r})") from None
        if any(not h > 0 for h in holds):
            raise ConfigError("holds-s", f"must be > 0 (got {args.holds_s!r})")
        if not points or any(p not in POINTS for p in points):
            raise ConfigError("points", f"unknown point in {points} (known: {', '.join(POINTS)})")
        if not variants or any(v not in VARIANTS for v in variants):
            raise ConfigError("variants", f"must be among {', '.join(VARIANTS)} (got {variants})")
        if args.look_every < 1:
            raise ConfigError("look-every", f"must be >= 1 (got {args.look_every})")
        if args.seeds < 1:
            raise ConfigError("seeds", f"must be >= 1 (got {args.seeds})")
        if args.seed_offset + args.seeds > EVAL_SEED_OFFSET:
            raise ConfigError("seed-offset", "training seeds only: seeds must stay below "
                              f"{EVAL_SEED_OFFSET}")
        if any(k not in ("cpu", "gpu", "api") for k in kinds):
            raise ConfigError("kinds", f"must be among cpu, gpu, api (got {list(kinds)})")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seeds = range(args.seed_offset, args.seed_offset + args.seeds)
    jobs = [(p, s, v) for p in points for s in seeds for v in ("rate_greedy", *variants)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p, s, v in tqdm(jobs, desc="runs", file=sys.stderr):
        rows.append(measure(p, s, v, args.horizon_s, args.futures, kinds, args.alternatives,
                            holds, args.look_every))
        # every run kept as it finishes: a long measurement stopped early loses nothing
        (out / "lookahead.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"seeds {seeds.start}..{seeds.stop - 1}, horizon {args.horizon_s:g} s, kinds "
             f"{','.join(kinds)}, {args.alternatives} alternatives, GPU holds "
             f"{args.holds_s or 'none'} s, {args.futures} futures "
             f"(estimates only), looking at every {args.look_every}. decision with "
             "alternatives; ratios paired by seed ÷ rate_greedy", "",
             "| point | variant | mean ACT ÷ rate_greedy (per seed) | mean step ÷ rate_greedy "
             "| decisions changed | wall s per run |", "|---|---|---|---|---|---|"]
    for p in points:
        ref = {r["seed"]: r for r in rows if r["point"] == p and r["variant"] == "rate_greedy"}
        for v in variants:
            rs = [r for r in rows if r["point"] == p and r["variant"] == v]
            act = [r["mean_act_s"] / ref[r["seed"]]["mean_act_s"] for r in rs]
            step = [r["mean_step_s"] / ref[r["seed"]]["mean_step_s"] for r in rs]
            ch = sum(r["stats"]["changed"] for r in rs) / max(1, sum(
                r["stats"]["decisions"] for r in rs))
            lines.append(f"| {p} | {v} | {np.mean(act):.3f} ({', '.join(f'{a:.3f}' for a in act)}) "
                         f"| {np.mean(step):.3f} | {ch:.1%} "
                         f"| {np.mean([r['wall_s'] for r in rs]):.0f} |")
    table = "\n".join(lines) + "\n"
    (out / "lookahead.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
