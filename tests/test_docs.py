"""The docs: the README stays short and its links into docs/ resolve; the docs site
(mkdocs.yml, docs/) builds with ``mkdocs build --strict`` (every page in the nav, every
link and anchor found, the HTTP API page from the service's OpenAPI schema, the Python API
reference from the docstrings)."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250
# [text](target) links, outside code spans; images and external links are not docs links.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _readme_doc_links() -> list[str]:
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if t.startswith("docs/")]


def _slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc extension makes it (its ``slugify``)."""
    text = unicodedata.normalize("NFKD", re.sub(r"[`*]", "", heading))
    text = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a docs page, as mkdocs' toc extension makes them."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M)
    return {_slug(h) for h in headings}


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def test_readme_links_into_docs() -> None:
    links = _readme_doc_links()
    assert len(links) >= 10, links  # the four ways in and the docs map link into docs/
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}: no such file"
        if anchor:
            assert anchor in _anchors(target), f"README links to {link}: no such heading"


@pytest.mark.parametrize("link", _readme_doc_links())
def test_readme_doc_link_is_in_the_nav(link: str) -> None:
    """Every docs page the README points at is one the site shows (mkdocs.yml's nav)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    page = link.partition("#")[0].removeprefix("docs/")
    assert re.search(rf":\s*{re.escape(page)}\s*$", nav, flags=re.M), \
        f"{page} is not in mkdocs.yml's nav"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install "
                        "'metasched[docs]'): the docs site is not built")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The HTTP API page is the service's OpenAPI schema, written by the build (docs/hooks.py)
    # from the application and rendered: every route of the service, the same schema.
    from metasched.serve.app import create_app

    schema = json.loads((ROOT / "docs" / "api" / "openapi.json").read_text())
    assert schema == json.loads(json.dumps(create_app(lambda: None, owns=False).openapi()))
    http = re.sub(r"<[^>]+>", "", (site / "api" / "http" / "index.html").read_text())
    assert len(schema["paths"]) >= 9, schema["paths"]
    for route in schema["paths"]:
        assert route in http, f"the HTTP API page lacks {route}"
    # ... and every route the application answers, the schema's and the others (E2B's).
    from metasched.serve.route_table import routes

    text = " ".join(html.unescape(http).split())
    for r in routes(create_app(lambda: None, owns=False)):
        assert f"{', '.join(r.methods) or 'any'} {r.path} " in text, \
            f"the HTTP API page lacks {r.path}"

    python = (site / "api" / "python" / "index.html").read_text()
    for name in ("Client", "Dispatcher", "start_dispatcher", "ActionSchedulingEnv",
                 "make_scheduler"):
        assert name in python, f"the Python API page lacks {name}"


def test_the_route_table_holds_every_route_of_the_app() -> None:
    """The table the HTTP API page shows walks the included routers and the mounts: every
    path of the schema, E2B's (left out of it) and the mounted /e2b application."""
    from starlette.routing import Mount

    from metasched.serve.app import create_app
    from metasched.serve.route_table import routes

    app = create_app(lambda: None, owns=False)
    found = {re.sub(r":path}", "}", r.path) for r in routes(app)}
    assert set(app.openapi()["paths"]) <= found
    mounts = [r.path for r in app.routes if isinstance(r, Mount)]
    assert mounts and all(f"{m}/…" in found for m in mounts)
    assert {"/e2b/sandboxes", "/e2b/files", "/e2b/health"} <= found
    assert all(r.summary for r in routes(app))


REPEATED = re.compile(r"(\b[A-Z][^.:!?`]{20,}[.:!?]) \1")


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT).as_posix() for p in
                                        [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]))
def test_no_sentence_is_said_twice_in_a_row(page: str) -> None:
    text = " ".join((ROOT / page).read_text().split())
    m = REPEATED.search(text)
    assert m is None, f"{page} repeats {m[1]!r}"
