"""The package's import layers: the import-linter contracts of pyproject.toml
(``[tool.importlinter]``) hold, and break on an upward import (lazy ones inside
functions included), so the check cannot pass by seeing nothing.

The contracts are checked on the package as it installs, ``agents/`` and ``envs/`` inside
``metasched/`` (setuptools' ``package-dir``), in a copy under the test's temporary
directory; each check runs in a fresh interpreter with that copy first on its path (this
one has ``metasched`` imported from the checkout already).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"
LAYERS = "metasched in layers"
RUNTIME = "runtime in layers: sandbox below process"
ENV = "the Gymnasium env is not built on training"
CONTRACTS = (LAYERS, RUNTIME, ENV)

# import-linter's API in the fresh interpreter: it prints its report, and says by its exit
# status whether every contract is kept (a configuration it cannot use raises).
LINT = """
import sys
from importlinter import api  # noqa: F401  (sets import-linter's adapters up)
from importlinter.application import use_cases
kept = use_cases.lint_imports(sys.argv[1], cache_dir=None, no_logo=True, is_debug_mode=True)
sys.exit(0 if kept else 1)
"""


def installed_layout(dest: Path) -> Path:
    """A copy of the package as it installs, under ``dest``; returns ``dest``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")

    def top(folder: str, names: list[str]) -> set[str]:
        # metasched/agents and metasched/envs, where a checkout links them, come below
        extra = {"agents", "envs"} if Path(folder) == ROOT / "metasched" else set()
        return set(skip(folder, names)) | (extra & set(names))

    shutil.copytree(ROOT / "metasched", dest / "metasched", ignore=top)
    for sub in ("agents", "envs"):
        shutil.copytree(ROOT / sub, dest / "metasched" / sub, ignore=skip)
    return dest


def lint(tree: Path) -> tuple[dict[str, bool], str]:
    """The contracts checked on the package under ``tree``: whether each is kept (by
    name), and the report."""
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-c", LINT, str(CONFIG)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    kept = {}
    for line in p.stdout.splitlines():
        name, _, status = line.strip().rpartition(" ")
        if status in ("KEPT", "BROKEN"):
            kept[name] = status == "KEPT"
    assert (p.returncode == 0) == all(kept.values()), p.stdout
    return kept, p.stdout


def test_the_package_keeps_its_layers(tmp_path):
    kept, text = lint(installed_layout(tmp_path))
    assert kept == dict.fromkeys(CONTRACTS, True), text


# (file in the installed layout, code added to its end, the contract it breaks, the
# import the report names)
UPWARD = [
    ("metasched/core/observation.py", "from metasched.agents import make_scheduler\n",
     LAYERS, "metasched.core.observation -> metasched.agents"),
    ("metasched/sim/simulator.py",
     "def _later():\n    from metasched.evaluation import runs\n",
     LAYERS, "metasched.sim.simulator -> metasched.evaluation.runs"),
    ("metasched/evaluation/runs.py", "from metasched.runtime import machine\n",
     LAYERS, "metasched.evaluation.runs -> metasched.runtime.machine"),
    ("metasched/runtime/dispatch/dispatcher.py", "from metasched.serve import app\n",
     LAYERS, "metasched.runtime.dispatch.dispatcher -> metasched.serve.app"),
    ("metasched/runtime/sandbox/manager.py",
     "def _later():\n    from metasched.runtime.process import start_process\n",
     RUNTIME, "metasched.runtime.sandbox.manager -> metasched.runtime.process"),
    ("metasched/envs/scheduling.py", "from metasched.agents.training import train\n",
     ENV, "metasched.envs.scheduling -> metasched.agents.training"),
]


@pytest.mark.parametrize("path,code,contract,names", UPWARD,
                         ids=[case[3].split(" -> ")[0] for case in UPWARD])
def test_an_upward_import_breaks_a_contract(tmp_path, path, code, contract, names):
    tree = installed_layout(tmp_path)
    with open(tree / path, "a") as f:
        f.write("\n\n" + code)
    kept, text = lint(tree)
    want = dict.fromkeys(CONTRACTS, True)
    want[contract] = False
    assert kept == want, text
    assert f"{names} (l." in text, text
