"""Which shard owns a trajectory: rendezvous (highest-random-weight) hashing, the
consistent hashing that needs no ring of virtual nodes, with a sticky table.

Each key goes to the live shard whose ``blake2b(shard, key)`` is highest. A shard that
joins takes about ``1/N`` of the keys not seen yet, a shard that leaves gives up only
its own: no other key moves. Keys already placed stay where they are (a trajectory
keeps its sandbox and its journal): the table remembers them until they are closed,
and a dead shard's keys go to the shard that adopted its journal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["ShardRing"]


def _weight(shard: str, key: str) -> int:
    h = hashlib.blake2b(f"{shard}\0{key}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


class ShardRing:
    """The placement of keys on shards (see the module docstring).

    Args:
        shards: the live shards' names.
    """

    def __init__(self, shards: Iterable[str]) -> None:
        self.live: list[str] = list(dict.fromkeys(shards))
        if not self.live:
            raise ValueError("shards: at least one")
        self.placed: dict[str, str] = {}  # key -> the shard (by name) it was placed on
        self.adopted: dict[str, str] = {}  # dead shard -> the live one serving its keys

    def hashed(self, key: str, among: Iterable[str] | None = None) -> str:
        """The shard ``key`` hashes to among ``among`` (default: the live shards)."""
        return max(self.live if among is None else among, key=lambda s: _weight(s, key))

    def owner(self, key: str) -> str:
        """The shard whose journal holds ``key`` (placing a new key by its hash)."""
        shard = self.placed.get(key)
        if shard is None:
            shard = self.placed[key] = self.hashed(key)
        return shard

    def serving(self, shard: str) -> str:
        """The live shard that serves ``shard``'s keys (itself, or its adopter)."""
        while shard in self.adopted:
            shard = self.adopted[shard]
        return shard

    def join(self, shard: str) -> None:
        """A new shard: it takes new keys from now on (placed ones stay)."""
        if shard not in self.live:
            self.live.append(shard)

    def leave(self, shard: str) -> str:
        """``shard`` is dead: the live shard that adopts it (its own hash among the
        rest, so every router picks the same one)."""
        if shard in self.adopted:
            return self.serving(shard)
        rest = [s for s in self.live if s != shard]
        if not rest:
            raise ValueError(f"shards: {shard} was the last one")
        self.live = rest
        self.adopted[shard] = self.hashed(shard, rest)
        return self.adopted[shard]

    def forget(self, key: str) -> None:
        """``key`` (a trajectory) is closed: it is placed afresh if it comes again."""
        self.placed.pop(key, None)
