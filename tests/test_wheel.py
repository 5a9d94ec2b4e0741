"""The built wheel works anywhere: installed into a fresh virtual environment outside the
repository, from a temporary directory, with the base dependencies only, then with the
``train`` extra.

This is what a user of ``pip install metasched`` gets: the Hydra configs and the shipped
checkpoint must come from the installed package, never from a source checkout. pip's
cache is reused, so after the first run this costs the install of cached wheels; the
install of the ``train`` extra (torch) is the slow check, ``-m slow``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from helpers import needs_train

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_JOBS = ROOT / "configs" / "examples" / "jobs.jsonl"


def _run(cmd: list[str], cwd: Path, timeout: float = 900, extra_env: dict[str, str] | None = None,
         **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "METASCHED_CONFIG_DIR", "VIRTUAL_ENV")}
    env.update(extra_env or {})
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def _ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"{p.args} exited {p.returncode}\n{p.stdout[-3000:]}\n" \
                              f"{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the source: setuptools' build/ folder in the tree could hold files of
    modules since removed, and a wheel would carry them."""
    src = tmp_path_factory.mktemp("src") / "metasched"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "outputs", "multirun", "*.egg-info", "__pycache__",
        ".pytest_cache", ".ruff_cache", ".hypothesis"))
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, source) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist),
              str(source)], cwd=dist))
    (whl,) = dist.glob("metasched-*.whl")
    return whl


def test_make_install_builds_without_a_warning(source, tmp_path):
    """``make install``'s editable install, as the Makefile runs it (its environment, a
    current pip and setuptools), prints nothing: setuptools warned of the licence table
    and of package data outside the declared packages (~300 lines)."""
    make = (ROOT / "Makefile").read_text()
    quiet = re.search(r'^QUIET_BUILD := (\w+)="([^"]*)"$', make, re.M)
    assert quiet is not None, "the Makefile's QUIET_BUILD"
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # the pip running is this one's
    p = _ok(_run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
                  "install", "--quiet", "--no-deps", "-e", str(source)], cwd=tmp_path,
                 extra_env={quiet[1]: quiet[2]}))
    assert (p.stdout + p.stderr).strip() == ""


@pytest.fixture(scope="module")
def base_env(tmp_path_factory, wheel) -> Path:
    """A fresh venv (outside the repository) with the wheel and its base dependencies."""
    env_dir = tmp_path_factory.mktemp("venv") / "base"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    _ok(_run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--quiet",
              str(wheel)], cwd=env_dir))
    return env_dir


def _installed(env_dir: Path) -> set[str]:
    out = _ok(_run([str(env_dir / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                   cwd=env_dir)).stdout
    return {d["name"].lower().replace("_", "-") for d in json.loads(out)}


def test_wheel_holds_the_configs_and_the_shipped_checkpoint(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for must in ("metasched/configs/eval.yaml", "metasched/configs/train.yaml",
                 "metasched/configs/workload/rm_math.yaml",
                 "metasched/configs/cluster/rm_math.yaml", "metasched/configs/examples/jobs.jsonl",
                 "metasched/configs/calibrate.yaml",
                 "metasched/configs/hydra/help/metasched.yaml",  # every app's --help
                 "metasched/checkpoints/default/meta_policy.npz",
                 "metasched/checkpoints/default/metadata.json",
                 "metasched/checkpoints/meta_act/meta_policy.npz",
                 "metasched/checkpoints/per_action/policy.npz",
                 "metasched/envs/scheduling.py", "metasched/agents/elastic.py"):
        assert must in names, must
    assert not any(n.startswith(("envs/", "agents/", "configs/", "checkpoints/")) for n in names)
    # Every package of the source tree is in the wheel (pyproject lists them one by one).
    installed_as = {"metasched": "metasched", "envs": "metasched/envs",
                    "agents": "metasched/agents", "configs": "metasched/configs",
                    "checkpoints": "metasched/checkpoints"}
    for top, prefix in installed_as.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.relative_to(ROOT / top).as_posix()
            assert f"{prefix}/{rel}" in names, f"{top}/{rel}: package missing from pyproject"


def test_base_install_evaluates_and_dispatches_from_anywhere(base_env, tmp_path):
    installed = _installed(base_env)
    for heavy in ("torch", "stable-baselines3", "sb3-contrib", "tensorboard", "ray"):
        assert heavy not in installed, f"{heavy} is not a base dependency"
    bin_ = base_env / "bin"

    # A heuristic and the shipped policy (the wheel's checkpoint): every other scheduler
    # comes from the same installed package.
    p = _ok(_run([str(bin_ / "metasched-eval"), "workload=rm_math", "n_seeds=2",
                  "schedulers=[elastic_greedy,checkpoints/default]", "hydra.run.dir=eval"],
                 cwd=tmp_path))
    doc = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert doc["seeds"] == [1_000_000, 1_000_001]
    learned = doc["schedulers"]["checkpoints/default"]  # the shipped policy, from the wheel
    assert learned["actions"] > 0 and learned["mean_act_s"] > 0
    assert (tmp_path / "eval" / "act_cdf.png").stat().st_size > 0
    assert "checkpoints/default" in p.stdout

    p = _ok(_run([str(bin_ / "metasched-dispatch"), f"jobs={EXAMPLE_JOBS}", "progress=false",
                  "hydra.run.dir=dispatch"], cwd=tmp_path))
    results = [json.loads(x) for x in
               (tmp_path / "dispatch" / "results.jsonl").read_text().splitlines()]
    statuses = [r["status"] for r in results]
    assert statuses.count("done") == 9 and statuses.count("failed") == 2
    assert statuses.count("rejected") == 1

    p = _run([str(bin_ / "metasched-train")], cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: metasched-train: needs the train extra (missing: torch, stable_baselines3, "
        "sb3_contrib, tensorboard): pip install 'metasched[train]'"]


def test_wheel_declares_the_train_extra_that_metasched_train_needs(wheel):
    """The wheel's ``train`` extra names a distribution for every module metasched-train
    requires, and admits the torch that constraints.txt pins (what the slow check below
    installs)."""
    import zipfile

    from packaging.requirements import Requirement

    from metasched.cli.train_app import TRAIN_MODULES

    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    assert "Provides-Extra: train" in lines
    train = {}
    for line in lines:
        if line.startswith("Requires-Dist: "):
            req = Requirement(line.removeprefix("Requires-Dist: "))
            if req.marker is not None and req.marker.evaluate({"extra": "train"}) \
                    and not req.marker.evaluate({"extra": ""}):
                train[req.name.lower().replace("-", "_")] = req
    assert set(TRAIN_MODULES) <= set(train), f"train extra lacks {set(TRAIN_MODULES) - set(train)}"
    pins = dict(ln.split("==") for ln in (ROOT / "constraints.txt").read_text().split()
                if "==" in ln)
    for name, version in pins.items():
        if name in train:
            assert train[name].specifier.contains(version), (name, version, str(train[name]))


@pytest.mark.slow  # installs torch into a fresh venv: ~2 min
@needs_train  # this interpreter has torch: the constraints' torch is installable for it
def test_train_extra_trains_a_tiny_policy(base_env, wheel, tmp_path):
    # The local CPU build of torch, as `make install` takes it (constraints.txt).
    _ok(_run([str(base_env / "bin" / "python"), "-m", "pip", "install", "--quiet", "-c",
              str(ROOT / "constraints.txt"), f"{wheel}[train]"], cwd=tmp_path))
    assert {"torch", "stable-baselines3", "sb3-contrib", "tensorboard"} <= _installed(base_env)
    _ok(_run([str(base_env / "bin" / "metasched-train"), "workload=rm_math",
              "workload.trajectories_per_step=8", "ppo.total_timesteps=256",
              "ppo.n_steps=128", "ppo.batch_size=64", "ppo.n_envs=1",
              "ppo.vec_env=dummy", "ppo.bc.decisions=200", "ppo.bc.epochs=1",
              "eval.freq=128", "eval.seeds=1", "checkpoint_freq=128",
              "env.curriculum.enabled=false", "hydra.run.dir=train"], cwd=tmp_path))
    best = tmp_path / "train" / "best"
    assert (best / "policy.npz").is_file() and (best / "metadata.json").is_file()
    p = _ok(_run([str(base_env / "bin" / "metasched-eval"), "workload=rm_math", "n_seeds=1",
                  f"schedulers=[elastic_greedy,{best}]", "plots=false", "hydra.run.dir=ev"],
                 cwd=tmp_path))
    doc = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert doc["schedulers"][str(best)]["actions"] > 0, p.stdout


def test_every_package_under_metasched_is_declared():
    """pyproject's package list is explicit (agents/, envs/, configs/ and checkpoints/
    install under metasched): a new subpackage must be named there, or the wheel lacks it."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                   ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "metasched").rglob("__init__.py")}
    assert found - declared == set(), "add these to [tool.setuptools] packages"
    # Each folder of package data too (setuptools takes data only from a declared
    # package's own folder): a new config group's folder must be named there.
    data = {".".join(("metasched", *d.relative_to(ROOT).parts))
            for top in ("configs", "checkpoints") for d in (ROOT / top).rglob("*")
            if d.is_dir() and any(f.is_file() for f in d.iterdir())
            and d.name != "__pycache__"}
    assert data - declared == set(), "add these to [tool.setuptools] packages"
