"""``metasched-loop``: close the loop from a live trace to a policy decision.

Three stages, each in the run directory:

1. **calibrate** the trace (``metasched-calibrate``) into ``profile/`` (a Hydra config
   directory with ``workload/NAME.yaml`` and ``cluster/NAME.yaml``);
2. **train** on the calibrated profile, warm-started from ``checkpoint`` (``metasched-train
   init=<checkpoint>``: its weights and VecNormalize statistics, its observation and
   network settings; a new run of ``budget`` PPO timesteps, no cloning) into ``train/``;
   the new checkpoint is the run's ``best/`` (lowest validation mean ACT, the warm start
   included), copied to ``checkpoint/``;
3. **evaluate** the new checkpoint, the one it started from and the heuristics on held-out
   seeds of the calibrated profile (``metasched-eval``'s paired ratios with 95% CIs) into
   ``eval/``;

then recommends switching or keeping (:data:`RULE`) and writes ``loop.json``.

Examples::

    metasched-serve trace=live.jsonl ...                  # or metasched-dispatch trace=...
    metasched-loop trace=live.jsonl            # the shipped per-action policy, default budget
    metasched-loop trace=live.jsonl checkpoint=outputs/loop/<run>/checkpoint budget=50000
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from metasched.cli.app import make_main
from metasched.cli.output import json_safe
from metasched.cli.settings import int_setting
from metasched.core.schema import Text, parse
from metasched.errors import ConfigError, one_of
from metasched.sim.seeds import EVAL_SEED_OFFSET

# The names the two policies carry in the evaluation.
SHIPPED, RETRAINED = "current", "retrained"
STAGES = 3
RULE = ("switch only if the 95% CI of mean ACT retrained ÷ current lies below 1 and the "
        "mean step time is not worse (its ratio's CI reaches down to 1 or below); "
        "otherwise keep the current policy")


def loop_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validated loop settings from a composed config (one-line errors)."""
    from metasched.agents import BASELINES
    from metasched.agents.checkpoint import MODEL, load_metadata, resolve_scheduler
    from metasched.sim.simulator import ESTIMATES

    trace = cfg.get("trace")
    if not isinstance(trace, str) or not trace:
        raise ConfigError("trace", "required: the trace to calibrate (metasched-loop "
                          "trace=live.jsonl)")
    if not Path(trace).is_file():
        raise ConfigError("trace", f"{trace}: no such file")
    name = parse(str | None, cfg.get("name"), "name")
    base = parse(str | None, cfg.get("base"), "base")
    ckpt = parse(Text, cfg.get("checkpoint"), "checkpoint")
    path = Path(resolve_scheduler(ckpt))
    try:
        meta = load_metadata(path)
    except ConfigError as e:
        raise ConfigError("checkpoint", e.problem) from None
    if not (path / MODEL).is_file():
        raise ConfigError("checkpoint", f"{ckpt} has no {MODEL}: a warm start needs the "
                          "SB3 model")
    overrides = parse(list[str], cfg.get("train_overrides") or [], "train_overrides")
    ev = cfg.get("evaluation") or {}
    heuristics = parse(Annotated[list[Literal[BASELINES]], Field(min_length=1)],
                       ev.get("heuristics"), "evaluation.heuristics")
    if len(set(heuristics)) != len(heuristics):
        raise ConfigError("evaluation.heuristics", f"lists a heuristic twice ({heuristics})")
    estimates = one_of(ev.get("estimates", "given"), ESTIMATES, "evaluation.estimates")
    try:
        n_seeds = int_setting(ev, "n_seeds", 2)  # a paired CI needs two seeds
        offset = int_setting(ev, "seed_offset", EVAL_SEED_OFFSET)  # held out
        workers = int_setting(ev, "workers", 1)
    except ConfigError as e:
        raise ConfigError(f"evaluation.{e.field}", e.problem) from None
    return {"trace": trace, "name": name, "base": base, "checkpoint": str(path),
            "checkpoint_name": ckpt, "metadata": meta,
            "budget": int_setting(cfg, "budget", 1), "seed": int_setting(cfg, "seed", 0),
            "train_overrides": list(overrides), "heuristics": list(heuristics),
            "seeds": list(range(offset, offset + n_seeds)), "workers": workers,
            "estimates": estimates}


def warm_start_overrides(s: dict[str, Any], profile_dir: Path, name: str,
                         obs_keys: list[str]) -> list[str]:
    """``metasched-train`` overrides of the loop's training: the calibrated profile, the
    warm start (and the observation, network and normalisation it needs; ``obs_keys``:
    the ``obs`` settings ``metasched-train`` has), the budget, then the user's
    ``train_overrides``."""
    from metasched.agents.checkpoint import normalization

    meta = s["metadata"]
    trained = (meta.get("config") or {}).get("ppo") or {}
    norm = normalization(meta)
    out = [f"hydra.searchpath=[file://{profile_dir.resolve()}]", f"workload={name}",
           f"init={s['checkpoint']}", "ppo.bc.decisions=0",
           f"ppo.total_timesteps={s['budget']}", f"seed={s['seed']}",
           f"ppo.normalize_obs={str(bool(norm['obs'])).lower()}",
           f"ppo.normalize_reward={str(bool(norm['reward'])).lower()}"]
    if "hidden" in trained:
        out.append(f"ppo.hidden={int(trained['hidden'])}")
    obs = meta["obs_config"]
    for k in obs_keys:  # the observation it was trained on
        v = getattr(obs, k)
        out.append(f"obs.{k}={'null' if v is None else v}")
    return out + s["train_overrides"]


def recommend(vs_current: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Switch or keep, by :data:`RULE`, from the paired comparison of the retrained
    policy with the current one (``{"mean_act_s": {...}, "mean_step_s": {...}}``, each
    as :func:`~metasched.evaluation.statistics.paired_comparison` gives it)."""
    act, step = vs_current["mean_act_s"], vs_current["mean_step_s"]
    act_hi = act["ratio_ci95"][1]
    step_lo = step["ratio_ci95"][0]
    better = math.isfinite(act_hi) and act_hi < 1.0
    step_ok = not (math.isfinite(step_lo) and step_lo > 1.0)
    decision = "switch" if better and step_ok else "keep"
    lo, hi = act["ratio_ci95"]
    if decision == "switch":
        why = f"mean ACT retrained ÷ current {act['ratio']:.3f} (95% CI {lo:.3f}–{hi:.3f}) < 1"
    elif not better:
        why = (f"mean ACT retrained ÷ current {act['ratio']:.3f} (95% CI {lo:.3f}–{hi:.3f}) "
               "does not lie below 1")
    else:
        why = (f"mean step time retrained ÷ current {step['ratio']:.3f} (95% CI "
               f"{step_lo:.3f}–{step['ratio_ci95'][1]:.3f}) is worse")
    return {"decision": decision, "rule": RULE, "why": why}


def _stage(i: int, what: str) -> float:
    print(f"[{i}/{STAGES}] {what}", flush=True)
    return time.perf_counter()


def _done(t0: float) -> float:
    took = time.perf_counter() - t0
    print(f"      done in {took:.0f} s", flush=True)
    return took


def run_loop(cfg: dict[str, Any], out_dir: str | Path, progress: bool = True
             ) -> dict[str, Any]:
    """Calibrate, train warm-started, evaluate and recommend as configured into
    ``out_dir``; returns what ``loop.json`` holds."""
    from metasched.cli.calibrate_app import _default_name, run_calibrate
    from metasched.cli.output import write_report
    from metasched.cli.train_app import run_train
    from metasched.compose import compose, load_profile
    from metasched.evaluation.report import results_table
    from metasched.evaluation.runs import evaluate
    from metasched.evaluation.statistics import paired_comparison

    t_all = time.perf_counter()
    s = loop_settings(cfg)
    out = Path(out_dir)
    name = s["name"] or _default_name(s["trace"])
    profile_dir = out / "profile"
    timings: dict[str, float] = {}

    t0 = _stage(1, f"calibrate {s['trace']} -> {profile_dir}")
    cal = run_calibrate({"trace": s["trace"], "name": name, "out": str(profile_dir),
                         "base": s["base"], "plot": True, "quiet": True})
    print(f"      {cal['actions']:,} actions, {len(cal['types'])} action types, "
          f"{cal['steps']} steps of {cal['trajectories_per_step']} trajectories; fit report: "
          f"{profile_dir / 'fit_report.md'}")
    timings["calibrate_s"] = _done(t0)

    t0 = _stage(2, f"train on {name}, warm-started from {s['checkpoint_name']}, "
                   f"{s['budget']:,} timesteps -> {out / 'train'}")
    obs_keys = list(compose("train")["obs"])
    train_cfg = compose("train", warm_start_overrides(s, profile_dir, name, obs_keys))
    summary = run_train(train_cfg, out / "train", progress=progress)
    new = out / "checkpoint"
    if new.exists():
        shutil.rmtree(new)
    shutil.copytree(out / "train" / "best", new)
    best = summary["best_validation"]
    print(f"      new checkpoint: {new} (validation mean ACT {best['mean_act_s']:.4g} s at "
          f"{best['timesteps']:,} timesteps; the warm start: "
          f"{summary['history'][0]['mean_act_s']:.4g} s)")
    timings["train_s"] = _done(t0)

    t0 = _stage(3, f"evaluate on {len(s['seeds'])} held-out seeds of {name} -> {out / 'eval'}")
    eval_cfg = compose("eval", [f"hydra.searchpath=[file://{profile_dir.resolve()}]",
                                f"workload={name}"])
    workload, cluster = load_profile(eval_cfg)
    names = [*s["heuristics"], SHIPPED, RETRAINED]
    params = {h: dict((eval_cfg.get("scheduler_params") or {}).get(h) or {})
              for h in s["heuristics"]}
    doc, _ = evaluate(workload, cluster, names, s["seeds"], params=params,
                      workers=s["workers"], max_wait_s=eval_cfg.get("max_wait_s"),
                      paths={SHIPPED: s["checkpoint"], RETRAINED: str(new.resolve())},
                      estimates=s["estimates"], progress=progress)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    write_report(out / "eval", doc, results_table(doc))
    per_seed = {n: doc["schedulers"][n]["per_seed"] for n in (SHIPPED, RETRAINED)}
    vs_current = {m: paired_comparison(per_seed[RETRAINED][m], per_seed[SHIPPED][m])
                  for m in ("mean_act_s", "mean_step_s")}
    timings["evaluate_s"] = _done(t0)

    rec = recommend(vs_current)
    timings["total_s"] = time.perf_counter() - t_all
    result = {
        "trace": s["trace"], "profile": str(profile_dir), "workload": name,
        "checkpoint": s["checkpoint"], "new_checkpoint": str(new), "budget": s["budget"],
        "seeds": s["seeds"], "best_heuristic": doc["best_heuristic"],
        "mean_act_s": {n: doc["schedulers"][n]["mean_act_s"] for n in names},
        "mean_step_s": {n: doc["schedulers"][n]["mean_step_s"] for n in names},
        "retrained_vs_current": vs_current,
        "retrained_vs_best_heuristic": doc["schedulers"][RETRAINED].get("paired"),
        "current_vs_best_heuristic": doc["schedulers"][SHIPPED].get("paired"),
        "training": {"timesteps": summary["timesteps"], "best_validation": best,
                     "warm_start_validation": summary["history"][0]},
        "recommendation": rec, "timings": timings}
    (out / "loop.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")
    act = vs_current["mean_act_s"]
    step = vs_current["mean_step_s"]
    bh = result["retrained_vs_best_heuristic"]
    print(f"\nretrained ÷ current ({s['checkpoint_name']}), same {len(s['seeds'])} seeds: "
          f"mean ACT {act['ratio']:.3f} (95% CI {act['ratio_ci95'][0]:.3f}–"
          f"{act['ratio_ci95'][1]:.3f}), mean step {step['ratio']:.3f} (95% CI "
          f"{step['ratio_ci95'][0]:.3f}–{step['ratio_ci95'][1]:.3f})")
    if bh is not None:
        a = bh["mean_act_s"]
        print(f"retrained ÷ best heuristic ({doc['best_heuristic']}): mean ACT "
              f"{a['ratio']:.3f} (95% CI {a['ratio_ci95'][0]:.3f}–{a['ratio_ci95'][1]:.3f})")
    print(f"recommendation: {rec['decision'].upper()}: {rec['why']}\nrule: {RULE}")
    print(f"loop took {timings['total_s'] / 60:.1f} min; summary: {out / 'loop.json'}; "
          f"new checkpoint: {new}")
    return result


main = make_main("loop", run_loop)


if __name__ == "__main__":
    main()
