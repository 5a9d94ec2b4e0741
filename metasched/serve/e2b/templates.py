"""E2B templates with packages, written by the operator in YAML (``e2b_templates``: a
file, or a directory of ``*.yaml`` files, each mapping template names to
:class:`E2BTemplate`)::

    swe-python:                       # Sandbox.create("swe-python")
      files: /srv/templates/swe       # optional: the workspace's files (dir or tar)
      packages:
        pip: ["pytest==8.3.4", "requests>=2.31"]   # or uv: [...]
      index_url: null                 # a registry the operator allows (null: pip's own)
      network: false                  # egress for its commands (sandbox.egress's rules)
      env: {PIP_NO_INPUT: "1"}

Each template's packages are installed once, when the service starts, into a layer
cached on this host (``<e2b_cache>/<name>-<digest of the template>``; a later start
with the same template finds it there): the layer is the template's workspace
directory, its files copied in and the packages installed under ``.packages``. It is
given to the dispatcher as a workspace template (``sandbox.templates``), which each
sandbox of it mounts copy-on-write: nothing is installed or copied per sandbox. Its
commands and kernels find the packages through ``PYTHONPATH`` (and their programs on
``PATH``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from metasched.core.schema import Strict, Text, parse
from metasched.errors import ConfigError

__all__ = ["PACKAGES_DIR", "E2BTemplate", "Packages", "build_layers", "load_templates",
           "template_env"]

log = logging.getLogger("metasched.serve")

PACKAGES_DIR = ".packages"  # in the layer: the workspace's
HOME = "/home/user"
DEFAULT_CACHE = "~/.cache/metasched/e2b-templates"
INSTALL_TIMEOUT_S = 1800.0


class Packages(Strict):
    """What a template installs: pip requirement strings, by installer."""

    pip: list[Text] = []
    uv: list[Text] = []


class E2BTemplate(Strict):
    """One E2B template (see the module docstring).

    Attributes:
        files: a directory or tar archive on this host: the workspace's files (None:
            an empty workspace).
        packages: pip requirements, installed with ``pip`` or ``uv``.
        index_url: the package index to install from (None: pip's configuration).
        network: whether its commands may reach the network (where ``sandbox.egress``
            allows).
        env: environment variables of its commands (a sandbox's own ``envs`` over them).
    """

    files: Text | None = None
    packages: Packages = Field(default_factory=Packages)
    index_url: Text | None = None
    network: bool = False
    env: dict[Annotated[str, BeforeValidator(str)], Annotated[str, BeforeValidator(str)]] = {}

    def digest(self) -> str:
        """What identifies its layer: the template, and the Python it is built for."""
        doc = {**self.model_dump(), "python": sys.version_info[:2]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def load_templates(path: str | os.PathLike[str] | None) -> dict[str, E2BTemplate]:
    """The templates of a YAML file, or of every ``*.yaml`` / ``*.yml`` file of a
    directory (None: none).

    Raises:
        ConfigError: a file that cannot be read, or a template that is not valid (one
            line naming it).
    """
    import yaml

    if path is None:
        return {}
    p = Path(path).expanduser()
    files = sorted([*p.glob("*.yaml"), *p.glob("*.yml")]) if p.is_dir() else [p]
    out: dict[str, E2BTemplate] = {}
    for f in files:
        try:
            doc = yaml.safe_load(f.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError("e2b_templates", f"{f}: {e}") from None
        if not isinstance(doc, dict):
            raise ConfigError("e2b_templates", f"{f}: must map template names to templates")
        for name, spec in doc.items():
            name = str(name)
            if name in out:
                raise ConfigError("e2b_templates", f"{f}: template {name!r} given twice")
            out[name] = parse(E2BTemplate, spec or {}, f"e2b_templates.{name}")
    return out


def _installer(t: E2BTemplate, target: Path) -> list[list[str]]:
    """The commands that install ``t``'s packages into ``target``."""
    index = ["--index-url", t.index_url] if t.index_url else []
    out = []
    if t.packages.pip:
        out.append([sys.executable, "-m", "pip", "install", "--quiet", "--no-input",
                    "--disable-pip-version-check", "--target", str(target), *index,
                    *t.packages.pip])
    if t.packages.uv:
        uv = shutil.which("uv")
        if uv is None:
            raise ConfigError("e2b_templates", "packages.uv: uv is not installed here "
                              "(pip install uv, or list the packages under pip)")
        out.append([uv, "pip", "install", "--quiet", "--python", sys.executable,
                    "--target", str(target), *index, *t.packages.uv])
    return out


def _build(name: str, t: E2BTemplate, layer: Path) -> None:
    """Make ``layer``: ``t``'s files, its packages under :data:`PACKAGES_DIR`."""
    work = Path(tempfile.mkdtemp(prefix=f".{layer.name}-", dir=layer.parent))
    try:
        if t.files:
            src = Path(t.files).expanduser()
            if src.is_dir():
                shutil.copytree(src, work, symlinks=True, dirs_exist_ok=True)
            else:
                with tarfile.open(src) as tar:
                    tar.extractall(work, filter="data")
        for argv in _installer(t, work / PACKAGES_DIR):
            log.info("template %s: installing %s (once: cached at %s)", name,
                     " ".join(t.packages.pip + t.packages.uv), layer)
            r = subprocess.run(argv, capture_output=True, text=True,
                               timeout=INSTALL_TIMEOUT_S)
            if r.returncode != 0:
                why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
                raise ConfigError("e2b_templates", f"{name}: its packages could not be "
                                  f"installed: {why}")
        os.chmod(work, 0o755)
        os.rename(work, layer)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def build_layers(templates: dict[str, E2BTemplate], cache: str | None = None
                 ) -> dict[str, str]:
    """Each template's layer (built where it is not cached yet): name -> its directory,
    the workspace template the dispatcher mounts (``sandbox.templates``).

    Raises:
        ConfigError: a template whose files are missing or whose packages could not be
            installed (one line).
    """
    root = Path(cache or DEFAULT_CACHE).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in templates.items():
        if t.files and not Path(t.files).expanduser().exists():
            raise ConfigError(f"e2b_templates.{name}.files", f"{t.files}: not found")
        layer = root / f"{name}-{t.digest()}"
        if not layer.is_dir():
            _build(name, t, layer)
        out[name] = str(layer)
    return out


def template_env(t: E2BTemplate | None) -> dict[str, Any]:
    """The environment a template gives its commands (``PYTHONPATH`` and ``PATH`` for
    its packages, then its ``env``)."""
    if t is None:
        return {}
    env: dict[str, Any] = {}
    if t.packages.pip or t.packages.uv:
        env["PYTHONPATH"] = f"{HOME}/{PACKAGES_DIR}"
        env["PATH"] = f"{HOME}/{PACKAGES_DIR}/bin:/usr/local/bin:/usr/bin:/bin"
    return {**env, **t.env}
