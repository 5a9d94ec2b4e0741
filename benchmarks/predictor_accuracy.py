"""Accuracy of the remaining-work predictor (metasched.core.predictor) against the static,
type-level estimate, on held-out seeds of the grouped profiles.

    python benchmarks/predictor_accuracy.py
    python benchmarks/predictor_accuracy.py --profiles swe_grouped --oracle

Trains each design on ``--train-trajectories`` (whole RL steps) sampled with seed
``--train-seed`` and tests on ``--test-trajectories`` of seed ``--test-seed``, replaying
both on an uncontended clock (every decision point: a trajectory queueing a turn's
action). Prints per profile and design: remaining-time mean |log error| (predictor,
static, ratio), the share of true remaining times inside [p10, p90], and the queued
action's duration mean |log error| (predictor, static, ratio). ``--trace`` adds a
recorded trace's trajectories as a test set. ``--oracle`` adds, per profile, three
references: the static estimate told the queued action's type (reward or not: the
median per turn index and type), a least-squares predictor that knows the siblings'
true totals, and the bound: boosted trees (as the ``boost`` design) given, beside every
feature, each trajectory's true latents (its prompt's difficulty, the prompt's turn
latent, its own persistence; read from the sampler), which is about what any predictor
could get. Real traces, out of sample by prompt: ``benchmarks/predictor_real.py``.
"""

from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

import metasched.sim.sampling as sampling
from metasched.compose import profile
from metasched.core.predictor import (
    DESIGNS,
    REWARD,
    Predictor,
    TrajRecord,
    fit_gbm,
    records_of,
    records_of_trace,
    replay,
)
from metasched.sim.sampling import sample_workload
from metasched.sim.trace import scan_trace

PROFILES = ("retool_grouped", "retool_grouped_c10", "swe_grouped")


def sample(name: str, trajectories: int, seed: int) -> list[TrajRecord]:
    """Training/test records of at least ``trajectories`` trajectories (whole RL steps)
    of profile ``name``, sampled with seed ``seed``."""
    w, _ = profile(name, [])
    steps = -(-trajectories // w.trajectories_per_step)
    return records_of(sample_workload(replace(w, steps=steps),
                                      np.random.default_rng(seed)).steps)


@contextmanager
def _latents_recorded(out: list[tuple[float, float, float, float]]):
    """While active, the grouped sampler appends each trajectory's latents ``(d, dt, u,
    v)`` to ``out``, in the order it draws them (the trajectories' order)."""
    sibling, draws = sampling._sample_sibling, sampling._Draws
    turn_latent: list[float] = []

    def _draws(*a, **k):
        d = draws(*a, **k)
        out.append((d.d, turn_latent[-1], d.u, d.v))
        return d

    def _sibling(task, rng, est_error, loads, d, dt, prompt):
        turn_latent.append(dt)
        return sibling(task, rng, est_error, loads, d, dt, prompt)

    sampling._sample_sibling, sampling._Draws = _sibling, _draws
    try:
        yield out
    finally:
        sampling._sample_sibling, sampling._Draws = sibling, draws


def sample_latents(name: str, trajectories: int, seed: int) -> tuple[list[TrajRecord], list]:
    """:func:`sample` with each trajectory's true latents (see ``_latents_recorded``)."""
    with _latents_recorded([]) as lat:
        recs = sample(name, trajectories, seed)
    if len(lat) != len(recs):
        raise SystemExit(f"{name}: latents recorded for {len(lat)} of {len(recs)} trajectories")
    return recs, lat


def _rows(p: Predictor, records: list[TrajRecord], latents: list) -> tuple[np.ndarray, ...]:
    """Per decision point: ``p``'s features with the trajectory's true latents, the log
    remaining time, the turn index and whether the queued action is the reward."""
    x, y, k, rw = [], [], [], []
    for d, f in replay(p, records):
        x.append(np.concatenate([f, latents[d.key]]))
        y.append(math.log(max(d.remaining_s, 1e-3)))
        k.append(min(d.turn, 64)), rw.append(d.name == REWARD)
    return np.array(x), np.array(y), np.array(k), np.array(rw)


def references(name: str, a: argparse.Namespace) -> dict[str, float]:
    """Mean |log error| of remaining time on the test seed for the static estimate told
    the action's type and for the known-latents bound (see the module docstring)."""
    train, lat_a = sample_latents(name, a.train_trajectories, a.train_seed)
    test, lat_b = sample_latents(name, a.test_trajectories, a.test_seed)
    p = Predictor.fit(train, "shrinkage")
    xa, ya, ka, ra = _rows(p, train, lat_a)
    xb, yb, kb, rb = _rows(p, test, lat_b)
    typed = np.empty(len(yb))
    for k in np.unique(kb):
        for r in (False, True):
            m, mb = (ka == k) & (ra == r), (kb == k) & (rb == r)
            if mb.any():
                typed[mb] = np.median(ya[m] if m.sum() >= 30 else ya[ra == r])
    bound = fit_gbm(xa, ya, []).predict(xb)
    return {"typed_static": float(np.abs(typed - yb).mean()),
            "latents": float(np.abs(bound - yb).mean())}


def trace_records(path: str) -> list[TrajRecord]:
    """The trajectories of a recorded trace (``records_of_trace``)."""
    return records_of_trace(scan_trace(path))


def evaluate(p: Predictor, records: list[TrajRecord]) -> dict[str, float]:
    """Replay ``records`` through ``p`` and measure it against the static estimates."""
    rem_p, rem_s, cover, act_p, act_s = [], [], [], [], []
    for d, _ in replay(p, records):
        q = p.remaining(d.key)
        rem_p.append(abs(math.log(q.p50 / d.remaining_s)))
        rem_s.append(abs(math.log(p.static_remaining(d.task, d.turn) / d.remaining_s)))
        cover.append(q.p10 <= d.remaining_s <= q.p90)
        if d.action_s > 0 and d.name in p.mu:
            act_p.append(abs(math.log(p.duration(d.key, d.name) / d.action_s)))
            act_s.append(abs(math.log(p.static_duration(d.name) / d.action_s)))
    rp, rs = np.array(rem_p), np.array(rem_s)
    diff = rp - rs
    return {"n": len(rp), "rem": rp.mean(), "rem_static": rs.mean(), "rem_ratio":
            rp.mean() / rs.mean(), "rem_diff_se": diff.std() / math.sqrt(len(diff)),
            "cover": float(np.mean(cover)), "act": float(np.mean(act_p)),
            "act_static": float(np.mean(act_s)),
            "act_ratio": float(np.mean(act_p) / np.mean(act_s))}


def _oracle_rows(p: Predictor, records: list[TrajRecord]) -> tuple[np.ndarray, ...]:
    """Per decision point: features that know every sibling's true total (the future),
    the log remaining time and the turn bucket."""
    tot: dict[object, list[tuple[float, float]]] = {}
    for i, r in enumerate(records):
        tot.setdefault(r.group, []).append((i, math.log(sum(g + d for _, g, d in r.turns[1:])
                                                        + r.turns[0][2])))
    lt = {i: math.log(len(r.turns) + 1.0) for i, r in enumerate(records)}
    x, y, k = [], [], []
    for d, f in replay(p, records):
        sib = [(j, v) for j, v in tot[records[d.key].group] if j != d.key]
        x.append([1.0, f[0], f[1], f[6], f[7], np.mean([v for _, v in sib]),
                  np.mean([lt[j] for j, _ in sib])])
        y.append(math.log(d.remaining_s))
        k.append(min(d.turn, 8))
    return np.array(x), np.array(y), np.array(k)


def prompt_oracle(train: list[TrajRecord], test: list[TrajRecord]) -> float:
    """Mean |log error| of remaining time for a least-squares predictor (per turn bucket,
    median-corrected) that knows the siblings' true totals and turn counts (the future)
    beside the trajectory's own history: about what knowing the prompt's latent buys."""
    p = Predictor.fit(train, "shrinkage")
    xa, ya, ka = _oracle_rows(p, train)
    xb, yb, kb = _oracle_rows(p, test)
    err = []
    for b in np.unique(kb):
        c = np.linalg.lstsq(xa[ka == b], ya[ka == b], rcond=None)[0]
        off = np.median(ya[ka == b] - xa[ka == b] @ c)
        err += list(np.abs(yb[kb == b] - xb[kb == b] @ c - off))
    return float(np.mean(err))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="*", default=list(PROFILES))
    ap.add_argument("--designs", nargs="*", default=list(DESIGNS))
    ap.add_argument("--train-trajectories", type=int, default=3456)
    ap.add_argument("--test-trajectories", type=int, default=1728)
    ap.add_argument("--train-seed", type=int, default=0)
    ap.add_argument("--test-seed", type=int, default=1)
    ap.add_argument("--trace", help="a recorded trace to test on as well (trained on the "
                    "first profile's training seed)")
    ap.add_argument("--oracle", action="store_true",
                    help="also the bound of a predictor that knows the siblings' totals")
    a = ap.parse_args()
    print("| profile | design | decisions | remaining: pred / static (ratio) | p10-p90 cover "
          "| action: pred / static (ratio) |\n|---|---|---|---|---|---|")
    for name in a.profiles:
        train = sample(name, a.train_trajectories, a.train_seed)
        test = sample(name, a.test_trajectories, a.test_seed)
        for design in a.designs:
            f = evaluate(Predictor.fit(train, design), test)
            print(f"| {name} | {design} | {f['n']:,} | {f['rem']:.3f} / {f['rem_static']:.3f} "
                  f"({f['rem_ratio']:.2f}, diff se {f['rem_diff_se']:.3f}) | "
                  f"{f['cover']:.1%} | {f['act']:.3f} / {f['act_static']:.3f} "
                  f"({f['act_ratio']:.2f}) |")
        if a.oracle:
            st = f["rem_static"]
            o = prompt_oracle(train, test)
            r = references(name, a)
            for label, v in (("static told the action's type", r["typed_static"]),
                             ("siblings' true totals (least squares)", o),
                             ("true latents (bound)", r["latents"])):
                print(f"| {name} | {label} | | {v:.3f} / {st:.3f} ({v / st:.2f}) | | |")
    if a.trace:
        train = sample(a.profiles[0], a.train_trajectories, a.train_seed)
        for design in a.designs:
            f = evaluate(Predictor.fit(train, design), trace_records(a.trace))
            print(f"| {a.trace} | {design} | {f['n']:,} | {f['rem']:.3f} / "
                  f"{f['rem_static']:.3f} ({f['rem_ratio']:.2f}) | {f['cover']:.1%} | "
                  f"{f['act']:.3f} / {f['act_static']:.3f} ({f['act_ratio']:.2f}) |")


if __name__ == "__main__":
    main()
