"""The package's import contracts, checked as it installs (``make lint`` runs this).

In a checkout ``agents/`` and ``envs/`` sit beside ``metasched/`` and install inside it
(setuptools' ``package-dir``), so import-linter run on the checkout finds no
``metasched.envs``. This copies the package as it installs into a temporary directory
and, in a fresh interpreter with that copy first on its path:

- checks the import-linter contracts of ``pyproject.toml`` (``[tool.importlinter]``);
- checks that no modules of the package import each other in a circle (imports inside
  functions and under ``TYPE_CHECKING`` count: a circle of either still ties the
  modules together).

    python tools/import_contracts.py [--contracts-only | --circles-only]

Exits 0 when everything holds, 1 when something is broken (the report says what).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"

# import-linter's API in the fresh interpreter: it prints its report, and says by its exit
# status whether every contract is kept (a configuration it cannot use raises).
LINT = """
import sys
from importlinter import api  # noqa: F401  (sets import-linter's adapters up)
from importlinter.application import use_cases
kept = use_cases.lint_imports(sys.argv[1], cache_dir=None, no_logo=True, is_debug_mode=True)
sys.exit(0 if kept else 1)
"""

# The module graph (grimp, import-linter's), then one circle per strongly connected
# group of modules, printed "a -> b -> ... -> a"; exit status 1 if there is any.
CIRCLES = """
import sys
import grimp
g = grimp.build_graph("metasched", cache_dir=None)
edges = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
index, low, stack, on, groups = {}, {}, [], set(), []
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v); on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = set()
        while True:
            w = stack.pop(); on.discard(w); group.add(w)
            if w == v:
                break
        if len(group) > 1:
            groups.append(group)
for v in sorted(edges):
    if v not in index:
        visit(v)
for group in sorted(groups, key=lambda s: (-len(s), min(s))):
    start = min(group)
    path = g.find_shortest_chain(start, min(w for w in edges[start] if w in group))
    back = g.find_shortest_chain(path[-1], start)
    print(f"circle of {len(group)} modules: {' -> '.join([*path, *back[1:]])}")
    print("  " + ", ".join(sorted(group)))
print(f"import circles: {len(groups)}")
sys.exit(1 if groups else 0)
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


def _run(code: str, tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def lint(tree: Path) -> tuple[dict[str, bool], str]:
    """The contracts checked on the package under ``tree``: whether each is kept (by
    name), and the report."""
    p = _run(LINT, tree, str(CONFIG))
    if p.returncode not in (0, 1):
        raise RuntimeError(p.stdout + p.stderr)
    kept = {}
    for line in p.stdout.splitlines():
        name, _, status = line.strip().rpartition(" ")
        if status in ("KEPT", "BROKEN"):
            kept[name] = status == "KEPT"
    if (p.returncode == 0) != all(kept.values()):
        raise RuntimeError(p.stdout)
    return kept, p.stdout


def circles(tree: Path) -> tuple[int, str]:
    """The import circles of the package under ``tree``: how many, and the report."""
    p = _run(CIRCLES, tree)
    if p.returncode not in (0, 1):
        raise RuntimeError(p.stdout + p.stderr)
    last = p.stdout.strip().splitlines()[-1]
    return int(last.rpartition(" ")[2]), p.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--contracts-only", action="store_true")
    only.add_argument("--circles-only", action="store_true")
    a = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tree = installed_layout(Path(tmp))
        if not a.circles_only:
            kept, text = lint(tree)
            print(text.strip())
            ok &= all(kept.values())
        if not a.contracts_only:
            n, text = circles(tree)
            print(text.strip())
            ok &= n == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
