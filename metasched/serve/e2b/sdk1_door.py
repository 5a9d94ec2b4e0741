"""A door for E2B's SDK 1.x (``e2b`` 1.x, ``e2b-code-interpreter`` 1.x: what rllm's
E2B tool calls), which has no sandbox-URL setting: off the E2B cloud it reaches only
its debug mode's fixed ports on ``localhost`` (``E2B_DEBUG=true``): the API on 3000,
envd on 49983, the code interpreter on 49999, none of them naming a sandbox in its URL.

With ``e2b_sdk1_ports`` the service also listens on ``127.0.0.1`` at those ports
(:func:`bind_door`), and :class:`SDK1Door` hands each request to the same ``/e2b``
routes a 2.x SDK reaches, naming the sandbox as they expect (``E2b-Sandbox-Id``):

- the API (3000): as it comes; a sandbox made through it is a *door sandbox*, given
  an envd access token (which SDK 1.x sends with its envd calls);
- envd (49983: commands, files, health): the door sandbox whose access token the call
  carries (none live with it: not found, so ``is_running()`` reads False); a call
  with none (a download URL) as the interpreter's;
- the interpreter (49999): SDK 1.x sends nothing with ``/execute`` and ``/contexts``
  that names a sandbox, so they go to the one live door sandbox; with none, or more
  than one, they are refused in one line.

SDK 1.x in debug mode never sends its kill (nor ``set_timeout``): a door sandbox ends
at its timeout, when idle, when killed through the API by id, or, with
``e2b_sdk1_replace``, when the next door sandbox is made. A service with tokens has no
door: the interpreter's calls carry no credential.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from metasched.errors import ConfigError
from metasched.serve.config import E2B_SDK1_PORTS as SDK1_PORTS

if TYPE_CHECKING:
    from metasched.serve.e2b.sandboxes import Sandbox, Sandboxes

__all__ = ["API_PORT", "DOOR", "ENVD_PORT", "INTERPRETER_PORT", "SDK1_PORTS", "SDK1Door",
           "bind_door"]

API_PORT, ENVD_PORT, INTERPRETER_PORT = SDK1_PORTS  # SDK 1.x's debug mode's
HOST = "127.0.0.1"
DOOR = "metasched.e2b_door"  # scope key: the request came through the door's API port
PREFIX = b"/e2b"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def bind_door(host: str = HOST) -> list[socket.socket]:
    """Sockets bound on ``host`` at SDK 1.x's ports (listened on by the server).

    Raises:
        ConfigError: a port is taken or cannot be bound (one line; none kept bound).
    """
    bound: list[socket.socket] = []
    for port, what in SDK1_PORTS.items():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            for other in bound:
                other.close()
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
            raise ConfigError("e2b_sdk1_ports", f"{host}:{port} (SDK 1.x's {what}) {why}: "
                              f"its ports are fixed; free it, or leave the door off") from None
        bound.append(sock)
    return bound


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class SDK1Door:
    """ASGI middleware: requests that came on SDK 1.x's ports, handed to the ``/e2b``
    routes with their sandbox named (see the module docstring); others pass as they are.

    Args:
        app: the application behind it.
        sandboxes: the service's E2B sandboxes.
    """

    def __init__(self, app: App, *, sandboxes: Sandboxes) -> None:
        self.app = app
        self.sandboxes = sandboxes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        port = (scope.get("server") or (None, None))[1] if scope["type"] == "http" else None
        if port not in SDK1_PORTS:
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"]
                   if k not in (b"e2b-sandbox-id", b"e2b-sandbox-port")]
        inner = {**scope, "path": PREFIX.decode() + scope["path"],
                 "raw_path": PREFIX + scope.get("raw_path", scope["path"].encode())}
        if port == API_PORT:
            inner[DOOR] = True
        else:
            try:
                sb = self._sandbox(scope, port)
            except _Refused as e:
                # The health check's "not running" is 502 (is_running() reads False).
                status = 502 if scope["path"] == "/health" else e.status
                await _answer(send, status, e.message, plain=port == INTERPRETER_PORT)
                return
            headers.append((b"e2b-sandbox-id", sb.id.encode() if sb is not None else b""))
            if sb is not None and sb.token is not None:
                # Where the SDK sends none (the interpreter's calls, a download URL, which
                # carries a signature instead), the routes still check it: here a token
                # names a sandbox, it is no credential (the door has no tokens).
                headers = [(k, v) for k, v in headers if k != b"x-access-token"]
                headers.append((b"x-access-token", sb.token.encode()))
        inner["headers"] = headers
        await self.app(inner, receive, send)

    def _sandbox(self, scope: Scope, port: int) -> Sandbox | None:
        """The door sandbox a call on ``port`` is for (None: none with its token).

        Raises:
            _Refused: no token, and not exactly one door sandbox live.
        """
        token = dict(scope["headers"]).get(b"x-access-token")
        if token:
            return self.sandboxes.by_access_token(token.decode(errors="replace"))
        live = self.sandboxes.door_sandboxes()
        if len(live) == 1:
            return live[0]
        if not live:
            raise _Refused(404, "no sandbox made through SDK 1.x's door is live (create "
                           "one: Sandbox() with E2B_DEBUG=true)")
        ids = ", ".join(sb.id for sb in live[:4]) + (", ..." if len(live) > 4 else "")
        raise _Refused(409, f"{len(live)} sandboxes made through SDK 1.x's door are live "
                       f"({ids}): SDK 1.x's code interpreter cannot name its sandbox; keep "
                       f"one live (in debug mode SDK 1.x sends no kill: DELETE "
                       f"http://{HOST}:{API_PORT}/sandboxes/<id> ends one; the service's "
                       f"e2b_sdk1_replace=true ends the older ones at each create), or use "
                       f"SDK 2.x with E2B_SANDBOX_URL")


async def _answer(send: Send, status: int, message: str, *, plain: bool) -> None:
    if plain:  # as the interpreter's routes answer
        body, kind = message.encode(), b"text/plain; charset=utf-8"
    else:  # as envd's: E2B's {code, message}
        body, kind = json.dumps({"code": status, "message": message}).encode(), \
            b"application/json"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
