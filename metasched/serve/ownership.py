"""Who may act on a trajectory, when authentication is on: the client whose token
opened it (its first action through this service), and no other. Another client's
action in it, its close and the results of its actions are refused with one line (403,
or 404 for a result: an id another client owns is not known to this one).

Each token is one client (``ServeConfig.token``, the client ``default``, and
``ServeConfig.tokens``, clients by name). Ownership is kept in the service's memory:
after a restart, the first client to act on a trajectory recovered from the journal
owns it, and the results of actions submitted before the restart are answered only
when the service has a single client. With authentication off every client is the same
principal: each may act on, close and read everything (see
``docs/apps/serve.md``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from metasched.core.schema import MAX_KEY
from metasched.errors import ConfigError, short

__all__ = ["Owners", "scoped_prompt", "with_scoped_prompt"]


def scoped_prompt(prompt: Any, client: str | None) -> Any:
    """``prompt`` in ``client``'s namespace (``client/prompt``, or a digest of both
    where that is longer than an id may be): another client naming the same prompt id
    joins another group, so it can neither read nor sway this client's siblings in the
    remaining-work predictor. Unchanged with authentication off (``client`` None) or
    without a prompt."""
    if prompt is None or client is None:
        return prompt
    text = str(prompt)
    scoped = f"{client}/{text}"
    if len(scoped) <= MAX_KEY:
        return scoped
    return "#" + hashlib.sha256(f"{client}\0{text}".encode()).hexdigest()


def with_scoped_prompt(fields: Mapping[str, Any], client: str | None) -> dict[str, Any]:
    """``fields`` (trajectory fields, or a request) with its ``prompt`` scoped."""
    out = dict(fields)
    if out.get("prompt") is not None:
        out["prompt"] = scoped_prompt(out["prompt"], client)
    return out


class _Bounded(OrderedDict):
    """A mapping that forgets its oldest entries beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: str, value: str) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class Owners:
    """The owner of each trajectory and action id (see the module docstring).

    Args:
        clients: the configured clients' names (empty: authentication off, no checks).
        limit: how many trajectories, and how many action ids, are remembered (the
            oldest are forgotten first: a forgotten trajectory is claimed again by the
            next client acting on it).
    """

    def __init__(self, clients: set[str], limit: int = 1_000_000) -> None:
        self.on = bool(clients)
        self.single = len(clients) == 1
        self.trajectories = _Bounded(limit)
        self.actions = _Bounded(limit)

    def claim(self, trajectory: str | None, client: str | None) -> None:
        """Record that ``client`` acts on ``trajectory`` (the first one owns it).

        Raises:
            ConfigError: it belongs to another client.
        """
        if not self.on or trajectory is None or client is None:
            return
        owner = self.trajectories.get(trajectory)
        if owner is not None and owner != client:
            raise ConfigError("trajectory", f"{short(trajectory)} belongs to another client")
        self.trajectories.put(trajectory, client)

    def check_close(self, trajectory: str, client: str | None) -> None:
        """Whether ``client`` may close ``trajectory`` (its owner is kept: a name closed
        while its last actions still run must not pass to another client).

        Raises:
            ConfigError: it belongs to another client.
        """
        if not self.on:
            return
        owner = self.trajectories.get(trajectory)
        if owner is not None and owner != client:
            raise ConfigError("trajectory", f"{short(trajectory)} belongs to another client")

    def submitted(self, rid: str, client: str | None) -> None:
        """Record that ``client`` submitted action ``rid``.

        Raises:
            ConfigError: another client submitted an action with this id.
        """
        if not self.on or client is None:
            return
        owner = self.actions.get(rid)
        if owner is not None and owner != client:
            raise ConfigError("id", f"{short(rid)} belongs to another client")
        self.actions.put(rid, client)

    def may_read(self, rid: str, client: str | None) -> bool:
        """Whether ``client`` may read action ``rid``'s state and result."""
        if not self.on:
            return True
        owner = self.actions.get(rid)
        return owner == client if owner is not None else self.single
