"""Warm gVisor sandboxes: containers started ahead, so that a trajectory's first command
(or a trajectory-less one) does not wait for a container's start.

A part of :class:`~metasched.runtime.sandbox.manager.Sandboxes` (which holds the state it
uses). With ``sandbox.gvisor_warm: N`` (``isolation: gvisor`` only) it keeps ``N``
sandboxes started of each of the two common kinds: a trajectory's without network,
``workspace_mb`` large and without template, and a trajectory-less command's
(``scratch_mb``, without network). Each is a whole sandbox already (its own user id,
workspace and container); taking one gives it its owner and starts another. Other kinds
(network granted, another size, a template) are made when asked, as without it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from metasched.runtime.sandbox.handles import Sandbox
from metasched.runtime.sandbox.slots import _MB


class WarmPool:
    """The warm-sandbox part of :class:`~metasched.runtime.sandbox.manager.Sandboxes`."""

    config: Any
    gvisor: Any
    _loop: asyncio.AbstractEventLoop | None
    _warm: dict[int, list[Sandbox]]

    def _new(self, key: str, size_mb: float, template: Any, network: bool) -> Sandbox: ...

    def _warm_sizes(self) -> list[int]:
        return sorted({int(self.config.workspace_mb * _MB), int(self.config.scratch_mb * _MB)})

    def _warm_fill(self) -> None:
        """Start sandboxes until each kind has ``gvisor_warm`` (on the attached loop)."""
        if self.gvisor is None or self._loop is None or not self.config.gvisor_warm:
            return
        for size in self._warm_sizes():
            pool = self._warm.setdefault(size, [])
            while len(pool) < self.config.gvisor_warm:
                pool.append(self._new("", size / _MB, None, False))

    def _warm_take(self, size_mb: float, template: Any, network: bool) -> Sandbox | None:
        """A warm sandbox of this kind (ready, or being started), another started in its
        place; None where there is none."""
        if template is not None or network:
            return None
        pool = self._warm.get(int(size_mb * _MB), [])
        while pool:
            sb = pool.pop(0)
            if sb.closed or (sb.ready.done() and sb.ready.exception() is not None):
                continue  # it failed: the next one, or one made now
            if self._loop is not None:
                self._loop.call_soon(self._warm_fill)
            return sb
        return None
