"""Lazily loaded package exports (:mod:`metasched.lazy`): a name's module is imported on
first use only, and the packages that use the helper export what they list."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from metasched.lazy import lazy_exports


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throwaway package ``lazypkg`` exporting ``Thing`` and ``make`` from
    ``lazypkg.heavy`` through :func:`lazy_exports`."""
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "__init__.py").write_text(textwrap.dedent("""
        from metasched.lazy import lazy_exports

        LIGHT = 1
        __getattr__, __dir__ = lazy_exports(
            __name__, {"Thing": "lazypkg.heavy", "make": "lazypkg.heavy"})
    """))
    (root / "heavy.py").write_text("class Thing:\n    pass\n\ndef make():\n    return Thing()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("lazypkg")
    for name in ("lazypkg", "lazypkg.heavy"):
        sys.modules.pop(name, None)


def test_module_loads_on_first_use_only(package):
    assert "lazypkg.heavy" not in sys.modules
    thing = package.Thing
    assert "lazypkg.heavy" in sys.modules
    assert thing is sys.modules["lazypkg.heavy"].Thing
    assert isinstance(package.make(), thing)


def test_loaded_name_is_kept_in_the_package(package):
    assert "Thing" not in vars(package)
    thing = package.Thing
    assert vars(package)["Thing"] is thing


def test_unknown_name_raises_attribute_error(package):
    with pytest.raises(AttributeError, match=r"module 'lazypkg' has no attribute 'Nothing'"):
        _ = package.Nothing
    assert not hasattr(package, "Nothing")
    assert "lazypkg.heavy" not in sys.modules


def test_dir_lists_exports_and_module_names(package):
    names = dir(package)
    assert {"Thing", "make", "LIGHT"} <= set(names)
    assert names == sorted(names)
    assert "lazypkg.heavy" not in sys.modules


def test_exports_mapping_is_copied():
    exports = {"x": "math"}
    getattr_, dir_ = lazy_exports(__name__, exports)
    exports["pi"] = "math"
    with pytest.raises(AttributeError):
        getattr_("pi")
    assert "pi" not in dir_()


@pytest.mark.parametrize("package_name", ["metasched.runtime", "metasched.runtime.ray_backend"])
def test_packages_export_what_they_list(package_name):
    if package_name.endswith("ray_backend"):
        pytest.importorskip("ray", reason="needs the ray extra (pip install 'metasched[ray]')")
    package = importlib.import_module(package_name)
    assert set(package.__all__) <= set(dir(package))
    for name in package.__all__:
        value = getattr(package, name)
        assert getattr(importlib.import_module(value.__module__), name) is value


def test_importing_runtime_loads_no_numpy():
    """The sandbox server imports ``metasched.runtime``'s light submodules only."""
    code = "import sys, metasched.runtime; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
