"""The package's import layers: the import-linter contracts of pyproject.toml
(``[tool.importlinter]``) hold, and break on an upward import (lazy ones inside
functions included), so the check cannot pass by seeing nothing.

The contracts are checked on the package as it installs, ``agents/`` and ``envs/`` inside
``metasched/`` (setuptools' ``package-dir``), in a copy under the test's temporary
directory; each check runs in a fresh interpreter with that copy first on its path (this
one has ``metasched`` imported from the checkout already). ``tools/import_contracts.py``
does both (``make lint`` runs it). No modules import each other in a circle, and a
circle added is seen.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_contracts",
                                               ROOT / "tools" / "import_contracts.py")
contracts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contracts)
installed_layout, lint, circles = contracts.installed_layout, contracts.lint, contracts.circles

LAYERS = "metasched in layers"
RUNTIME = "runtime in layers: sandbox below process"
ENV = "the Gymnasium env is not built on training"
CONTRACTS = (LAYERS, RUNTIME, ENV)


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


def test_no_modules_import_each_other_in_a_circle(tmp_path):
    n, text = circles(installed_layout(tmp_path))
    assert n == 0, text


# (file, code added to its end, a module the circle then holds): lazy and TYPE_CHECKING
# imports count
CIRCLES = [
    ("metasched/runtime/dispatch/jobs.py",
     "def _later():\n    from metasched.runtime.dispatch.dispatcher import Dispatcher\n",
     "metasched.runtime.dispatch.dispatcher"),
    ("metasched/core/state.py",
     "from typing import TYPE_CHECKING\n"
     "if TYPE_CHECKING:\n    from metasched.core.guard import WaitGuard\n",
     "metasched.core.guard"),
]


@pytest.mark.parametrize("path,code,member", CIRCLES, ids=[c[0] for c in CIRCLES])
def test_a_circle_added_is_seen(tmp_path, path, code, member):
    tree = installed_layout(tmp_path)
    with open(tree / path, "a") as f:
        f.write("\n\n" + code)
    n, text = circles(tree)
    assert n == 1, text
    assert member in text, text
