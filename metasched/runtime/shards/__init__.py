"""Dispatcher shards on Ray: each a whole dispatcher over its own nodes with its own
journal (:mod:`.actor`), trajectories placed on them by consistent hashing
(:mod:`.ring`), requests routed and a dead shard's journal adopted (:mod:`.router`),
the shards behind one dispatcher's interface for the HTTP service (:mod:`.front`);
the shared pools are leased from one service (:mod:`metasched.runtime.leases`).
:mod:`.standin` stands nodes in for measuring the control plane alone."""

from metasched.runtime.shards.front import ShardedDispatcher
from metasched.runtime.shards.ring import ShardRing
from metasched.runtime.shards.router import ShardRouter, shard_names, start_shards, stop_shards

__all__ = ["ShardRing", "ShardRouter", "ShardedDispatcher", "shard_names", "start_shards",
           "stop_shards"]
