"""Every route an application answers, in and out of its OpenAPI schema (E2B's API keeps
out of it; a mounted application has routes of its own): what the HTTP API page lists,
written from the application itself so the page cannot drift from the code."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

__all__ = ["Route", "routes", "routes_markdown"]

# FastAPI's own pages: the schema and its Swagger UI.
_DOCS_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect")


@dataclass(frozen=True)
class Route:
    """One route: its methods (empty for a mounted application), path and what it does."""

    methods: tuple[str, ...]
    path: str
    summary: str
    in_schema: bool


def _summary(endpoint: Any, fallback: str) -> str:
    doc = inspect.getdoc(endpoint) or ""
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(first.split()) or fallback


def _walk(items: list[Any], prefix: str = "") -> list[Route]:
    from starlette.routing import Mount

    out = []
    for r in items:
        original = getattr(r, "original_router", None)  # a router included in the app
        if original is not None:
            context = getattr(r, "include_context", None)
            out += _walk(original.routes, prefix + getattr(context, "prefix", ""))
        elif isinstance(r, Mount):
            sub = getattr(r.app, "routes", None)
            out += _walk(sub, prefix + r.path) if sub is not None else [
                Route((), f"{prefix}{r.path}/…", _summary(r.app, "a mounted application "
                      "(its routes are its own)"), False)]
        elif hasattr(r, "path") and f"{prefix}{r.path}" not in _DOCS_PATHS:
            methods = tuple(sorted(set(getattr(r, "methods", None) or ()) - {"HEAD"}))
            name = str(getattr(r, "name", "") or "").replace("_", " ")
            out.append(Route(methods, prefix + r.path, getattr(r, "summary", None)
                             or _summary(r.endpoint, name[:1].upper() + name[1:]),
                             bool(getattr(r, "include_in_schema", False))))
    return out


def routes(app: Any) -> list[Route]:
    """Every route of ``app`` (FastAPI's own documentation pages left out), in the order
    the application matches them; one entry for the methods of a path that do the same."""
    merged: dict[tuple[str, str], Route] = {}
    for r in _walk(app.routes):
        seen = merged.get((r.path, r.summary))
        merged[r.path, r.summary] = r if seen is None else Route(
            tuple(sorted({*seen.methods, *r.methods})), r.path, r.summary,
            seen.in_schema or r.in_schema)
    return list(merged.values())


def routes_markdown(app: Any) -> str:
    """A markdown table of :func:`routes`: method, path, what it does, whether the
    schema below details it."""
    lines = ["| method | path | what it does | in the schema |", "|---|---|---|---|"]
    for r in routes(app):
        summary = r.summary.replace("|", "\\|")
        lines.append(f"| {', '.join(r.methods) or 'any'} | `{r.path}` | {summary} | "
                     f"{'yes' if r.in_schema else 'no'} |")
    return "\n".join(lines) + "\n"
