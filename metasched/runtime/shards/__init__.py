"""Dispatcher shards on Ray: each a whole dispatcher over its own nodes with its own
journal (:mod:`.actor`), trajectories placed on them by consistent hashing
(:mod:`.ring`), requests routed and a dead shard's journal adopted (:mod:`.router`),
the shards behind one dispatcher's interface for the HTTP service (:mod:`.front`);
the shared pools are leased from one service (:mod:`metasched.runtime.leases`).
:mod:`.standin` stands nodes in for measuring the control plane alone.

Importing this package does not import Ray; its names are loaded on first use.
"""

from __future__ import annotations

from metasched.lazy import lazy_exports

_EXPORTS = {
    "ShardRing": "metasched.runtime.shards.ring",
    "ShardRouter": "metasched.runtime.shards.router",
    "ShardedDispatcher": "metasched.runtime.shards.front",
    "shard_names": "metasched.runtime.shards.router",
    "start_shards": "metasched.runtime.shards.router",
    "stop_shards": "metasched.runtime.shards.router",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
