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
with the same template finds it there). Every sandbox sees that layer read-only at the
same path (the dispatcher's ``sandbox.system_paths``) and finds it through
``PYTHONPATH`` (its programs on ``PATH``): nothing is installed, copied or changed per
sandbox. A template's ``files`` are its workspace template (``sandbox.templates``),
mounted copy-on-write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field

from metasched.core.schema import Strict, Text, parse
from metasched.errors import ConfigError

__all__ = ["E2BTemplate", "Packages", "build_layers", "layer_of", "load_templates",
           "template_env"]

log = logging.getLogger("metasched.serve")

DEFAULT_CACHE = "~/.cache/metasched/e2b-templates"
INSTALL_TIMEOUT_S = 1800.0
LAYOUT = 2  # how a layer is laid out: in its digest, so that a new layout builds anew


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
        doc = {**self.model_dump(), "python": sys.version_info[:2], "layout": LAYOUT}
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


def layer_of(name: str, t: E2BTemplate, cache: str | None = None) -> Path:
    """Where ``t``'s packages are (or are to be) installed."""
    return Path(cache or DEFAULT_CACHE).expanduser().absolute() / f"{name}-{t.digest()}"


def _build(name: str, t: E2BTemplate, layer: Path) -> None:
    """Install ``t``'s packages into ``layer`` (made whole, or not at all)."""
    work = Path(tempfile.mkdtemp(prefix=f".{layer.name}-", dir=layer.parent))
    try:
        for argv in _installer(t, work):
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
                 ) -> dict[str, dict[str, list[str] | dict[str, str]]]:
    """Each template's packages installed where they are not cached yet; what the
    dispatcher needs for them: ``system_paths`` (the layers, bound read-only into every
    sandbox) and ``templates`` (name -> ``files``, the workspace templates).

    Raises:
        ConfigError: a template whose files are missing or whose packages could not be
            installed (one line).
    """
    paths: list[str] = []
    files: dict[str, str] = {}
    for name, t in templates.items():
        if t.files:
            src = Path(t.files).expanduser()
            if not src.exists():
                raise ConfigError(f"e2b_templates.{name}.files", f"{t.files}: not found")
            files[name] = str(src)
        if t.packages.pip or t.packages.uv:
            layer = layer_of(name, t, cache)
            layer.parent.mkdir(parents=True, exist_ok=True)
            if not layer.is_dir():
                _build(name, t, layer)
            paths.append(str(layer))
    return {"system_paths": paths, "templates": files}


def template_env(name: str, t: E2BTemplate | None, cache: str | None = None
                 ) -> dict[str, str]:
    """The environment template ``name`` gives its commands (``PYTHONPATH`` and
    ``PATH`` for its packages, then its ``env``)."""
    if t is None:
        return {}
    env: dict[str, str] = {}
    if t.packages.pip or t.packages.uv:
        layer = layer_of(name, t, cache)
        env["PYTHONPATH"] = str(layer)
        env["PATH"] = f"{layer}/bin:/usr/local/bin:/usr/bin:/bin"
    return {**env, **t.env}
