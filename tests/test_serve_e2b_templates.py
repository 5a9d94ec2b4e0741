"""E2B templates with packages (metasched.serve.e2b.templates): read from YAML, each
built once into a cached layer that its sandboxes mount; with the real SDKs."""

from __future__ import annotations

import asyncio
import time

import pytest

from metasched.errors import ConfigError
from metasched.serve.e2b.templates import E2BTemplate, build_layers, layer_of, load_templates


def test_templates_load_from_a_file_or_a_directory(tmp_path):
    (tmp_path / "a.yaml").write_text("one:\n  packages: {pip: [six]}\n  network: true\n")
    (tmp_path / "b.yml").write_text("two: {}\n")
    both = load_templates(tmp_path)
    assert sorted(both) == ["one", "two"]
    assert both["one"].packages.pip == ["six"] and both["one"].network
    assert load_templates(tmp_path / "a.yaml")["one"] == both["one"]
    assert load_templates("configs/examples/e2b_templates.yaml")["swe-python"].network


@pytest.mark.parametrize("text,expected", [
    ("one: {packages: {pip: 3}}", "e2b_templates.one.packages.pip"),
    ("one: {pakages: {pip: [six]}}", "pakages"),
    ("- one", "must map template names to templates"),
    ("one: [", "e2b_templates"),
])
def test_a_bad_template_is_one_line(tmp_path, text, expected):
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_templates(tmp_path / "t.yaml")
    assert expected in str(info.value) and "\n" not in str(info.value).strip()


def test_a_layer_is_built_once_and_found_again(tmp_path, monkeypatch):
    import metasched.serve.e2b.templates as templates

    runs = []
    real = templates.subprocess.run
    monkeypatch.setattr(templates.subprocess, "run",
                        lambda argv, **kw: runs.append(argv) or real(argv, **kw))
    files = tmp_path / "files"
    files.mkdir()
    # A package from a local directory: installed as from a registry, no network.
    pkg = tmp_path / "pkg"
    (pkg / "tinypkg").mkdir(parents=True)
    (pkg / "tinypkg" / "__init__.py").write_text("VALUE = 7\n")
    (pkg / "pyproject.toml").write_text(
        '[project]\nname = "tinypkg"\nversion = "1.0"\n'
        '[build-system]\nrequires = []\nbuild-backend = "setuptools.build_meta"\n')
    t = {"tiny": E2BTemplate(files=str(files), packages={"pip": [
        "--no-build-isolation", "--no-index", str(pkg)]})}
    first = build_layers(t, str(tmp_path / "cache"))
    layer = layer_of("tiny", t["tiny"], str(tmp_path / "cache"))
    assert first == {"system_paths": [str(layer)], "templates": {"tiny": str(files)}}
    assert (layer / "tinypkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert len(runs) == 1
    assert build_layers(t, str(tmp_path / "cache")) == first  # the same template: cached
    assert len(runs) == 1
    changed = {"tiny": E2BTemplate(files=str(files), packages=t["tiny"].packages,
                                   env={"A": "1"})}
    assert build_layers(changed, str(tmp_path / "cache")) != first  # another digest
    assert len(runs) == 2


def test_packages_that_cannot_install_say_why_in_one_line(tmp_path):
    t = {"bad": E2BTemplate(packages={"pip": ["./no-such-directory-here"]})}
    with pytest.raises(ConfigError, match="bad: its packages could not be installed"):
        build_layers(t, str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").iterdir())  # nothing half-built left


@pytest.mark.slow  # installs one small package from the registry
async def test_a_package_template_is_built_once_and_importable_in_16_sandboxes():
    ci = pytest.importorskip("e2b_code_interpreter")
    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.sandbox.config import SandboxConfig
    from metasched.serve import ServeConfig
    from tests.serve_helpers import serving
    from tests.test_serve_e2b import opts

    templates = {"tab": E2BTemplate(packages={"pip": ["tabulate==0.9.0"]})}
    cache = None  # the default: sandboxes see no path under the host's /tmp
    layers = build_layers(templates, cache)
    layer = layer_of("tab", templates["tab"], cache)
    assert (layer / "tabulate").exists()
    t0 = time.monotonic()
    assert build_layers(templates, cache) == layers
    assert time.monotonic() - t0 < 1.0  # found, not installed again
    with serving(DispatcherConfig(scheduler="elastic_greedy",
                                  sandbox=SandboxConfig(**layers)),
                 ServeConfig(languages=[], e2b_templates=templates, e2b_cache=cache)) as srv:

        async def one() -> str:
            sb = await ci.AsyncSandbox.create("tab", **opts(srv, request_timeout=600))
            try:
                ex = await sb.run_code("import tabulate\ntabulate.__file__", timeout=600)
                r = await sb.commands.run("python3 -c 'import tabulate'", timeout=600)
                assert r.exit_code == 0
                return ex.text
            finally:
                await sb.kill()

        paths = await asyncio.gather(*(one() for _ in range(16)))
        assert set(paths) == {f"{layer}/tabulate/__init__.py"}
        sb = await ci.AsyncSandbox.create(**opts(srv))  # without the template: not there
        try:
            assert (await sb.run_code("import tabulate")).error.name == "ModuleNotFoundError"
        finally:
            await sb.kill()
