"""``metasched-train-meta``: train a meta-policy over the rules (see
:mod:`metasched.agents.meta_policy`) toward the objective the user names.

Examples::

    metasched-train-meta                                   # objective step, every point
    metasched-train-meta objective=act table=outputs/train-meta/<run>/table.json
    metasched-train-meta +caps.act=1.10 out=checkpoints/step_act110

The run directory holds ``table.json`` (every option on every training instance: reused
by ``table=`` to train for another objective without running them again), the
checkpoint (``checkpoint/`` or ``out=``) and ``train_summary.json`` (wall and CPU time,
the PPO curve, the choices on the training instances).
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from metasched.cli.app import make_main
from metasched.cli.output import json_safe
from metasched.errors import ConfigError, one_of


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def meta_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validated settings of a meta-policy training from a composed config."""
    from metasched.agents.meta_options import OPTIONS, option
    from metasched.agents.meta_policy import OBJECTIVES
    from metasched.agents.meta_ppo import PPOSettings
    from metasched.evaluation.meta_table import FIGURES

    objective = cfg.get("objective")
    one_of(objective, OBJECTIVES, "objective")
    caps = cfg.get("caps") or {}
    for k, v in caps.items():
        one_of(k, [o for o in OBJECTIVES if o != objective], "caps", what="the other objectives")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 1.0:
            raise ConfigError(f"caps.{k}", f"must be a factor >= 1 (got {v!r})")
    names = cfg.get("options")
    try:
        opts = list(OPTIONS) if names is None else [option(n) for n in names]
    except ValueError as e:
        raise ConfigError("options", str(e)) from None
    if len(opts) < 2:
        raise ConfigError("options", "needs two options or more")
    points = cfg.get("points") or {}
    if not points:
        raise ConfigError("points", "needs one point or more")
    per_point = cfg.get("per_point")
    if isinstance(per_point, bool) or not isinstance(per_point, int) or per_point < 1:
        raise ConfigError("per_point", f"must be a whole number >= 1 (got {per_point!r})")
    try:
        ppo = PPOSettings(**(cfg.get("ppo") or {}))
    except TypeError as e:
        raise ConfigError("ppo", str(e)) from None
    return {"objective": objective, "caps": {k: float(v) for k, v in caps.items()},
            "figure": FIGURES[objective], "options": opts,
            "points": {p: (v[0], list(v[1])) for p, v in points.items()},
            "per_point": per_point, "ppo": ppo, "seed": int(cfg.get("seed", 0)),
            "jitter": cfg.get("jitter") or {}, "workers": int(cfg.get("workers", 1)),
            "max_wait_s": cfg.get("max_wait_s"), "table": cfg.get("table"),
            "steps": cfg.get("steps"),
            "out": cfg.get("out")}


def _load_table(path: str, options: list[str]):
    from metasched.evaluation.meta_table import MetaTable

    try:
        table = MetaTable.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError("table", f"{path} is unreadable ({e})") from None
    missing = [o for o in options if o not in table.options]
    if missing:
        raise ConfigError("table", f"{path} has no runs of {', '.join(missing)}")
    keep = [table.options.index(o) for o in options]
    table.figures = {k: v[:, keep] for k, v in table.figures.items()}
    table.options = options
    return table


def run_meta_train(cfg: dict[str, Any], out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Build (or reuse) the table, fit the choice by PPO, write the checkpoint."""
    from metasched.agents.meta_policy import ValueEstimates, save_meta_checkpoint
    from metasched.agents.meta_ppo import returns, train_choice
    from metasched.evaluation.meta_table import FIGURES, build_table

    s = meta_settings(cfg)
    names = [o.name for o in s["options"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, cpu0 = time.perf_counter(), _cpu_s()
    built_with = {k: s[k] for k in ("seed", "points", "per_point", "jitter", "steps",
                                    "max_wait_s")}
    if s["table"]:
        table = _load_table(s["table"], names)
        built_with = json.loads(Path(s["table"]).read_text()).get("built_with", {})
        print(f"table: {s['table']} ({len(table.points)} instances)", flush=True)
    else:
        print(f"running {len(names)} options on {len(s['points']) * s['per_point']} training "
              f"instances ({len(s['points'])} points x {s['per_point']})", flush=True)
        table = build_table(s["points"], s["options"], s["per_point"], s["seed"], s["jitter"],
                            max_wait_s=s["max_wait_s"], workers=s["workers"], steps=s["steps"],
                            progress=progress)
        (out_dir / "table.json").write_text(json.dumps({**table.to_dict(),
                                                        "built_with": built_with}) + "\n")
    table_s, table_cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    capped = {k: (table.figure(k), cap) for k, cap in s["caps"].items()}
    ret = returns(table.figure(s["objective"]), capped, s["ppo"].cap_penalty)
    network, info = train_choice(table.features, ret, s["ppo"], s["seed"], progress=progress)
    fallback = names[info["fallback"]]
    values = ValueEstimates.fit(table.features, np.log(table.figure(s["objective"])),
                                network.mean, network.std)
    ckpt = Path(s["out"]) if s["out"] else out_dir / "checkpoint"
    chosen = network.logits(table.features).argmax(axis=1)
    regret = np.exp(-ret[np.arange(len(chosen)), chosen])
    summary = {
        "objective": s["objective"], "caps": s["caps"], "fallback": fallback,
        "instances": len(table.points), "options": names,
        "table_wall_s": table_s, "table_cpu_s": table_cpu,
        "wall_s": time.perf_counter() - t0, "cpu_s": _cpu_s() - cpu0,
        "training_regret": {"mean": float(regret.mean()), "max": float(regret.max())},
        "choices": {p: sorted({names[c] for c, q in zip(chosen, table.points, strict=True)
                               if q == p}) for p in s["points"]},
        "curve": info["curve"][:: max(1, len(info["curve"]) // 50)],
    }
    save_meta_checkpoint(ckpt, network, s["options"], fallback, s["objective"], s["caps"],
                         values, {"training": {
                             "ppo_seed": s["seed"], "instances": built_with,
                             "training_seeds": sorted(set(table.seeds)),
                             "figure": FIGURES[s["objective"]], "ppo": vars(s["ppo"]),
                             "wall_s": summary["wall_s"], "cpu_s": summary["cpu_s"],
                             "table": s["table"] or str(out_dir / "table.json")}})
    (out_dir / "train_summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    print(f"checkpoint: {ckpt} (objective {s['objective']}, fallback {fallback}); training "
          f"instances: mean regret {regret.mean():.4f}x, worst {regret.max():.4f}x; "
          f"{summary['wall_s']:.0f} s wall, {summary['cpu_s']:.0f} CPU s", flush=True)
    return summary


main = make_main("train-meta", run_meta_train)


if __name__ == "__main__":
    main()
