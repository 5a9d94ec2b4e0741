"""mkdocs hook: writes ``docs/api/openapi.json``, the HTTP service's OpenAPI schema, from
the application itself before every build, and puts the table of every route the
application answers (those the schema leaves out included) into the HTTP API page, so
the page cannot drift from the code. No dispatcher is started: the schema is the
application's routes and models."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Where the HTTP API page takes the table of routes.
ROUTES_MARK = "<!-- routes -->"


def _app() -> Any:
    """``metasched-serve``'s application, with default settings."""
    from metasched.serve.app import create_app

    # A dispatcher factory that is never called: it runs only in the app's lifespan.
    return create_app(lambda: None, owns=False)  # type: ignore[arg-type]


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI schema of ``metasched-serve``'s application, with default settings."""
    return _app().openapi()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The HTTP API page with the table of every route in place of its mark."""
    if ROUTES_MARK not in markdown:
        return markdown
    from metasched.serve.route_table import routes_markdown

    return markdown.replace(ROUTES_MARK, routes_markdown(_app()))


def on_config(config: Any) -> Any:
    """Regenerate the schema before the pages are read (rewritten only when it changed)."""
    root = Path(config.config_file_path).parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    out = Path(config.docs_dir) / "api" / "openapi.json"
    text = json.dumps(openapi_schema(), indent=2) + "\n"
    if not out.exists() or out.read_text() != text:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return config
