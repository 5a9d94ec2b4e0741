"""Reading JSON request bodies safely: :func:`decode_json` (UTF-8, at most
:data:`MAX_JSON_DEPTH` levels of nesting, no lone surrogates in any string) and
:class:`JSONRoute`, the route class that makes FastAPI read every body it parses as JSON
with it.

Python's ``json`` accepts ``"\\ud800"`` (a lone UTF-16 surrogate, which is not Unicode
text: it cannot be encoded, written to a journal or passed on a command line) and
recurses once per level of nesting (``[[[[...`` deep enough exhausts the interpreter's
stack). A body with either is answered ``422`` with one line, ``{"detail": "body:
..."}``, as any other body that is not a request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from metasched.errors import ConfigError

__all__ = ["MAX_JSON_DEPTH", "JSONRoute", "decode_json"]

MAX_JSON_DEPTH = 64  # levels of arrays and objects in one body (a request has 3 or 4)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _where(path: list[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path) or ""


def _check(doc: Any, max_depth: int) -> None:
    """Raise ConfigError if ``doc`` nests deeper than ``max_depth`` or holds a string
    (a key or a value) with a lone surrogate. Iterative: as deep as the parser went."""
    stack: list[tuple[Any, int, list[Any]]] = [(doc, 1, [])]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if (m := _SURROGATE.search(node)) is not None:
                raise ConfigError(f"body{_where(path)}", f"holds a lone surrogate "
                                  f"(\\u{ord(m.group()):04x} at {m.start()}), which is not "
                                  f"Unicode text")
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise ConfigError("body", f"nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            for k, v in node.items():
                if _SURROGATE.search(k) is not None:
                    raise ConfigError(f"body{_where(path)}", f"a key holds a lone surrogate "
                                      f"({k[:40]!r}), which is not Unicode text")
                stack.append((v, depth + 1, [*path, k]))
        else:
            stack.extend((v, depth + 1, [*path, i]) for i, v in enumerate(node))


def decode_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON document in ``raw``.

    Raises:
        ConfigError: ``raw`` is not UTF-8 or not JSON, nests deeper than ``max_depth``
            levels, or holds a lone surrogate (named ``body``, or the field's path).
    """
    try:
        text = raw.decode("utf-8")  # not json.loads(bytes): it would guess UTF-16 or -32
    except UnicodeDecodeError as e:
        raise ConfigError("body", f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                          f"{e.start})") from None
    try:
        doc = json.loads(text)
    except RecursionError:  # deeper than the interpreter's stack allows
        raise ConfigError("body", f"nested deeper than {max_depth} levels") from None
    except ValueError as e:
        raise ConfigError("body", f"not valid JSON ({e})") from None
    _check(doc, max_depth)
    return doc


class _JSONRequest(Request):
    """A request whose ``json()`` is :func:`decode_json`'s (a bad body: a 422 line)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = decode_json(await self.body())
            except ConfigError as e:
                raise HTTPException(422, str(e)) from None
        return self._json


class JSONRoute(APIRoute):
    """An API route that reads JSON bodies with :func:`decode_json` (FastAPI passes an
    ``HTTPException`` raised while it reads the body on as it is)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return route
