"""The lease service's state, without Ray: which leases of which shared pool are held
by whom, until when, and which calls each pool's quota window still counts.

A shared pool is an API endpoint's quota (requests, and tokens, per sliding window; at
most so many calls in flight) or a GPU service's slots (at most so many held at once).
A **lease** lets its holder start one call (or hold one slot) on a pool: the holder
sends the call while the lease is unexpired and renews it while the call runs. The
book never grants a lease that could make a window hold more calls than the quota:

- a lease granted at ``g`` and released at ``r`` (the book's clock, when the release
  reached it) stands for one call that reached the upstream within ``[g, r]``;
- a lease never released (its holder died) stands for one that reached it by its
  expiry (its holder renews it while its call runs, and sends only under an unexpired
  lease), so it counts until ``expiry + window``;
- a lease still held counts now, whenever its call comes.

A new lease at ``now`` would put its call after every counted one; the window that
holds the most of them with it is the one starting just after ``now - window``: the
book grants only while fewer than the quota's calls end after that. A window counted
this way holds at most the quota's calls whatever the calls' delays, since every
arrival lies in its lease's interval. Done calls' ends, the release times, are the
book's own clock: no holder's clock is trusted.

Every change is one line appended to a file (written before the answer leaves), so
a restarted service reads back what it had granted and what its windows still
count: the quota holds across restarts. Holders re-present leases the service no
longer knows (:meth:`LeaseBook.renew`), which count again from then on.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metasched.core.pools import EndpointSpec
from metasched.errors import ConfigError

__all__ = ["Grant", "Lease", "LeaseBook", "PoolLimit"]


@dataclass(frozen=True)
class PoolLimit:
    """What one shared pool allows.

    Attributes:
        calls: calls started in any ``window_s`` seconds (None: no rate limit).
        tokens: tokens in any ``window_s`` seconds (None: no token limit).
        window_s: the sliding window both are counted over.
        max_held: leases held at once (an endpoint's concurrency, a GPU service's
            slots; None: no limit).
    """

    calls: int | None = None
    tokens: float | None = None
    window_s: float = 60.0
    max_held: int | None = None

    @classmethod
    def endpoint(cls, spec: EndpointSpec) -> PoolLimit:
        """An API endpoint's quota, as the dispatcher's settings give it."""
        tokens = None if spec.tpm is None else spec.tok_capacity
        return cls(int(spec.req_capacity), tokens, spec.window_s, spec.max_concurrency)

    @classmethod
    def service(cls, slots: int) -> PoolLimit:
        """A GPU service's ``slots`` (batches in flight at once, over every shard)."""
        if slots < 1:
            raise ConfigError("slots", f"must be >= 1 (got {slots})")
        return cls(max_held=slots)


@dataclass
class Lease:
    """One granted lease (see the module docstring); times are the book's clock."""

    id: str
    pool: str
    holder: str
    tokens: float
    granted: float
    expires: float
    released: float | None = None
    ask: str = ""  # the asking call's key: a retried call gets the same leases


    def to_row(self) -> dict[str, Any]:
        return {"id": self.id, "pool": self.pool, "holder": self.holder,
                "tokens": self.tokens, "granted": self.granted, "expires": self.expires,
                "released": self.released, "ask": self.ask}


class _PoolState:
    """One pool's leases that count: those held (with a heap of their expiries, stale
    entries skipped) and those ended within a window (a heap of their ends), so every
    call costs O(log n) in the leases a window holds."""

    __slots__ = ("held", "expiring", "ended", "tokens")

    def __init__(self) -> None:
        self.held: dict[str, Lease] = {}
        self.expiring: list[tuple[float, str]] = []
        self.ended: list[tuple[float, str, Lease]] = []
        self.tokens = 0.0  # of every lease that counts

    def add(self, lease: Lease) -> None:
        self.tokens += lease.tokens
        if lease.released is None:
            self.held[lease.id] = lease
            heapq.heappush(self.expiring, (lease.expires, lease.id))
        else:
            heapq.heappush(self.ended, (lease.released, lease.id, lease))

    def extend(self, lease: Lease, expires: float) -> None:
        lease.expires = expires
        heapq.heappush(self.expiring, (expires, lease.id))

    def end(self, lease: Lease, at: float) -> None:
        del self.held[lease.id]
        lease.released = at
        heapq.heappush(self.ended, (at, lease.id, lease))

    def prune(self, now: float, window_s: float) -> list[Lease]:
        """Lapse the held leases past their expiry (their holder is gone: see the module
        docstring); return those ended before the window, no longer counted."""
        while self.expiring and self.expiring[0][0] <= now:
            at, lid = heapq.heappop(self.expiring)
            lease = self.held.get(lid)
            if lease is not None and lease.expires == at:
                self.end(lease, at)
        gone = []
        while self.ended and self.ended[0][0] <= now - window_s:
            lease = heapq.heappop(self.ended)[2]
            self.tokens -= lease.tokens
            gone.append(lease)
        return gone


@dataclass(frozen=True)
class Grant:
    """What :meth:`LeaseBook.acquire` answers: the leases granted (perhaps none), and
    when asking again could grant more (None: not before a lease is released)."""

    leases: list[Lease] = field(default_factory=list)
    retry_at: float | None = None


class LeaseBook:
    """The leases of the shared pools (see the module docstring).

    Args:
        pools: each pool's limit, by name.
        ttl_s: how long a lease lasts unless renewed.
        path: the file every change is appended to (None: none; a restart forgets).
        clock: the book's clock (wall seconds, as the file's times are).
    """

    def __init__(self, pools: dict[str, PoolLimit], *, ttl_s: float = 5.0,
                 path: str | Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not ttl_s > 0:
            raise ConfigError("ttl_s", f"must be > 0 (got {ttl_s})")
        self.pools = dict(pools)
        self.ttl_s = ttl_s
        self.clock = clock
        self.path = Path(path) if path is not None else None
        # Per pool, every lease that still counts (held, or ended within a window).
        self._state = {p: _PoolState() for p in self.pools}
        self._by_id: dict[str, Lease] = {}
        self._asks: dict[str, dict[str, Lease]] = {}
        self._seq = 0
        self._fd: int | None = None
        self.restored = 0
        self.grants = 0
        self._lines = 0  # lines in the file (compacted when most no longer count)
        if self.path is not None:
            self._read()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    # ------------------------------------------------------------------ file

    def _read(self) -> None:
        if not self.path.exists():
            return
        rows: dict[str, dict[str, Any]] = {}
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write: its answer never left
            if row.get("pool") in self.pools:
                rows[row["id"]] = row  # a later line of the same lease wins
        for row in rows.values():
            lease = Lease(**row)
            self._put(lease)
            self._seq = max(self._seq, int(lease.id.rsplit("-", 1)[-1], 16) + 1)
        self.restored = len(self._by_id)
        for pool in self.pools:
            self._prune(pool, self.clock())
        self._compact()

    def _write(self, leases: Iterable[Lease]) -> None:
        if self._fd is not None:
            data = "".join(json.dumps(lease.to_row()) + "\n" for lease in leases)
            if data:
                os.write(self._fd, data.encode())  # one write: lines are never interleaved
                self._lines += data.count("\n")

    def _compact(self) -> None:
        """Rewrite the file with the leases that still count (atomically)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(lease.to_row()) + "\n"
                               for lease in self._by_id.values()))
        os.replace(tmp, self.path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lines = len(self._by_id)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ------------------------------------------------------------------ state

    def _put(self, lease: Lease) -> None:
        self._state[lease.pool].add(lease)
        self._by_id[lease.id] = lease
        if lease.ask:
            self._asks.setdefault(lease.ask, {})[lease.id] = lease

    def _prune(self, pool: str, now: float) -> None:
        """Lapse ``pool``'s leases past their expiry; forget those no window counts."""
        for lease in self._state[pool].prune(now, self.pools[pool].window_s):
            del self._by_id[lease.id]
            self._asks.pop(lease.ask, None)

    def _room(self, pool: str) -> tuple[int, float | None]:
        """How many leases of ``pool`` could be granted now (ignoring tokens), and
        when more could be (None: once one is released)."""
        lim, st = self.pools[pool], self._state[pool]
        room = math.inf
        retry: float | None = None
        if lim.max_held is not None:
            room = lim.max_held - len(st.held)
        if lim.calls is not None:
            room = min(room, lim.calls - len(st.held) - len(st.ended))
            if room <= 0 and st.ended:
                retry = st.ended[0][0] + lim.window_s  # when the oldest ended call leaves
        return max(0, int(room) if math.isfinite(room) else 1 << 30), retry

    def _tokens_free(self, pool: str) -> float:
        lim, st = self.pools[pool], self._state[pool]
        return math.inf if lim.tokens is None else lim.tokens - st.tokens

    # ------------------------------------------------------------------ calls

    def acquire(self, holder: str, pool: str, n: int = 1, tokens: float = 0.0,
                ask: str = "") -> Grant:
        """Up to ``n`` leases of ``pool`` for ``holder`` (each for a call of ``tokens``
        tokens), as many as its limits allow now. ``ask``: the call's key; asked again
        (a retry after the service restarted mid-call), the same leases come back, so a
        lost answer wastes no quota.

        Raises:
            ConfigError: no such pool, or a call of more tokens than a window allows.
        """
        if pool not in self.pools:
            raise ConfigError("pool", f"no shared pool {pool!r} (known: {sorted(self.pools)})")
        lim = self.pools[pool]
        if lim.tokens is not None and tokens > lim.tokens:
            raise ConfigError("tokens", f"{tokens:g} asked; {pool} allows {lim.tokens:g} "
                              f"in any {lim.window_s:g} s")
        if ask and ask in self._asks:
            return Grant([x for x in self._asks[ask].values() if x.released is None])
        now = self.clock()
        self._prune(pool, now)
        room, retry = self._room(pool)
        out = []
        free = self._tokens_free(pool)
        for _ in range(min(n, room)):
            if tokens > free:
                retry = now + 0.1 if retry is None else retry
                break
            free -= tokens
            lease = Lease(f"{pool}-{self._seq:x}", pool, holder, tokens, now,
                          now + self.ttl_s, ask=ask)
            self._seq += 1
            self._put(lease)
            out.append(lease)
        self.grants += len(out)
        self._write(out)
        if self.path is not None and self._lines > 4 * len(self._by_id) + 4096:
            self._compact()
        return Grant(out, None if out else retry)

    def release(self, ids: Iterable[str]) -> int:
        """End leases ``ids`` (their calls are done); how many were held."""
        now = self.clock()
        done = []
        for lid in ids:
            lease = self._by_id.get(lid)
            if lease is not None and lease.released is None:
                self._state[lease.pool].end(lease, now)
                done.append(lease)
        self._write(done)
        return len(done)

    def renew(self, holder: str, leases: Iterable[tuple[str, str, float]]) -> int:
        """Extend ``holder``'s leases (``(id, pool, tokens)`` each) by the TTL from now.
        One the book does not know (granted by a service that lost its file) is taken
        back as held from now: it counts against its pool again. Returns how many
        were re-presented so."""
        now = self.clock()
        changed, again = [], 0
        for lid, pool, tokens in leases:
            lease = self._by_id.get(lid)
            if lease is None:
                if pool not in self.pools:
                    continue
                lease = Lease(lid, pool, holder, tokens, now, now + self.ttl_s)
                self._put(lease)
                again += 1
            elif lease.released is not None:
                continue  # lapsed: counted as ended by its expiry already
            self._state[lease.pool].extend(lease, now + self.ttl_s)
            changed.append(lease)
        self._write(changed)
        return again

    def load(self) -> dict[str, dict[str, float]]:
        """Per pool: leases held now, and calls its window counts."""
        now = self.clock()
        out = {}
        for pool, st in self._state.items():
            self._prune(pool, now)
            out[pool] = {"held": len(st.held), "in_window": len(st.held) + len(st.ended)}
        return out
