"""Per-decision latency of the learned scheduler, on one thread.

Records observations along an env rollout (timing the encoder on the way), then times
(a) SB3 ``model.predict(obs, action_masks=..., deterministic=True)``, (b)
``NumpyPolicy.act(obs)`` and (c) ``ObservationEncoder.observe(state)``; prints
p50/p90/p99 in microseconds.

    python benchmarks/decision_latency.py [--samples 2000] [--profile mixed]
        [--checkpoint DIR]      # a trained checkpoint (default: an untrained policy)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from metasched.agents.numpy_policy import NumpyPolicy
from metasched.compose import profile
from metasched.envs.scheduling import ActionSchedulingEnv


def record(env: ActionSchedulingEnv, n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    """``n`` observations from a rollout with random legal actions, and the time of
    ``observe`` on each state behind them, microseconds (``observe`` only reads the
    state, so timing it in place leaves the rollout unchanged)."""
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    observations, us = [], np.empty(n)
    clock = time.perf_counter_ns
    while len(observations) < n:
        t0 = clock()
        env.encoder.observe(env.sim.state)
        us[len(observations)] = (clock() - t0) / 1e3
        observations.append(obs)
        obs, _, term, trunc, _ = env.step(int(rng.choice(np.flatnonzero(obs["action_mask"]))))
        if term or trunc:
            obs, _ = env.reset()
    return observations, us


def timed(fn, items, warmup: int = 50) -> np.ndarray:
    """Microseconds of ``fn(item)`` for each item (after ``warmup`` untimed calls)."""
    for it in items[:warmup]:
        fn(it)
    out = np.empty(len(items))
    clock = time.perf_counter_ns
    for i, it in enumerate(items):
        t0 = clock()
        fn(it)
        out[i] = (clock() - t0) / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000, help="decisions to time")
    ap.add_argument("--profile", default="mixed", help="workload profile (default: mixed)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory to time")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from sb3_contrib import MaskablePPO

    from metasched.agents.checkpoint import MODEL, load_metadata
    from metasched.agents.policy import SlotPolicy

    w, c = profile(args.profile)
    if args.checkpoint:
        env = ActionSchedulingEnv(w, c, obs_config=load_metadata(args.checkpoint)["obs_config"])
        model = MaskablePPO.load(f"{args.checkpoint}/{MODEL}", device="cpu")
    else:
        env = ActionSchedulingEnv(w, c)
        model = MaskablePPO(SlotPolicy, env, seed=args.seed, device="cpu")
    npol = NumpyPolicy.from_sb3(model.policy)
    observations, observe_us = record(env, args.samples, args.seed)

    rows = {
        "sb3 predict": timed(lambda o: model.predict(
            o, action_masks=o["action_mask"].astype(bool), deterministic=True), observations),
        "numpy act": timed(npol.act, observations),
        "encoder observe": observe_us,
    }
    what = f"checkpoint {args.checkpoint}" if args.checkpoint else "untrained policy"
    print(f"{args.profile}: {args.samples} decisions, {what}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'':16s} {'p50 us':>9s} {'p90 us':>9s} {'p99 us':>9s}")
    for name, us in rows.items():
        p50, p90, p99 = np.percentile(us, [50, 90, 99])
        print(f"{name:16s} {p50:9.1f} {p90:9.1f} {p99:9.1f}")


if __name__ == "__main__":
    main()
