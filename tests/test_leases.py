"""The lease book: no window ever holds more calls than the quota, whatever the
grants, releases, lapses and restarts; a retried ask gets its leases back; a lease the
book lost is counted again when re-presented."""

from __future__ import annotations

import random

import pytest

from metasched.core.pools import EndpointSpec
from metasched.errors import ConfigError
from metasched.runtime.leases import LeaseBook, PoolLimit
from metasched.serve.rate_limited import max_in_window


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _drive(book: LeaseBook, clock: Clock, rng: random.Random, steps: int,
           held: list, calls: list[float], holders: int = 4) -> None:
    """Random asks, calls (at a random time within their lease) and releases; a call's
    arrival is recorded as the upstream would see it."""
    for _ in range(steps):
        clock.t += rng.expovariate(20.0)
        op = rng.random()
        if op < 0.5:
            g = book.acquire(f"h{rng.randrange(holders)}", "api", n=rng.randint(1, 3))
            for lease in g.leases:
                held.append((lease, clock.t))
        elif held:
            lease, granted = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.1:
                continue  # its holder died before calling: it lapses
            # The call reached the upstream between the grant and now, before the
            # lease's expiry (sent only under an unexpired lease).
            calls.append(rng.uniform(granted, min(clock.t, lease.expires)))
            if clock.t < lease.expires:
                book.release([lease.id])


@pytest.mark.parametrize("seed", range(5))
def test_no_window_holds_more_calls_than_the_quota(seed: int) -> None:
    clock = Clock()
    book = LeaseBook({"api": PoolLimit(calls=20, window_s=3.0)}, ttl_s=1.0, clock=clock)
    rng = random.Random(seed)
    calls: list[float] = []
    _drive(book, clock, rng, 3000, [], calls)
    assert len(calls) > 200  # the quota was used, not merely never exceeded
    assert max_in_window(calls, 3.0) <= 20


def test_the_quota_holds_across_a_restart_from_the_file(tmp_path) -> None:
    clock = Clock()
    limit = {"api": PoolLimit(calls=10, window_s=5.0)}
    book = LeaseBook(limit, ttl_s=2.0, path=tmp_path / "leases.jsonl", clock=clock)
    granted = book.acquire("a", "api", n=10).leases
    assert len(granted) == 10
    book.release([x.id for x in granted[:6]])
    book.close()  # the process dies; a new one reads the file back
    clock.t += 1.0
    again = LeaseBook(limit, ttl_s=2.0, path=tmp_path / "leases.jsonl", clock=clock)
    assert again.restored == 10
    assert again.acquire("b", "api").leases == []  # the window still counts all ten
    clock.t += 5.0  # the six released ones left the window; four lapse at their expiry
    assert len(again.acquire("b", "api", n=20).leases) == 6
    clock.t += 1.5  # past the lapsed ones' expiry + window
    assert len(again.acquire("b", "api", n=20).leases) == 4


def test_a_retried_ask_gets_the_same_leases_back(tmp_path) -> None:
    clock = Clock()
    book = LeaseBook({"api": PoolLimit(calls=3)}, path=tmp_path / "l.jsonl", clock=clock)
    first = book.acquire("a", "api", n=2, ask="k1").leases
    book.close()
    again = LeaseBook({"api": PoolLimit(calls=3)}, path=tmp_path / "l.jsonl", clock=clock)
    assert [x.id for x in again.acquire("a", "api", n=2, ask="k1").leases] == \
        [x.id for x in first]
    assert len(again.acquire("a", "api", n=5, ask="k2").leases) == 1  # 3 in all


def test_a_lease_the_book_lost_counts_again_when_renewed() -> None:
    clock = Clock()
    book = LeaseBook({"api": PoolLimit(calls=2, window_s=10.0)}, clock=clock)
    assert book.renew("a", [("api-7", "api", 0.0), ("api-8", "api", 0.0)]) == 2
    assert book.acquire("b", "api").leases == []


def test_held_leases_are_bounded_by_max_held_and_tokens() -> None:
    clock = Clock()
    book = LeaseBook({"gpu": PoolLimit.service(2),
                      "llm": PoolLimit.endpoint(EndpointSpec(rpm=600, max_concurrency=50,
                                                             tpm=1000))}, clock=clock)
    got = book.acquire("a", "gpu", n=5).leases
    assert len(got) == 2 and book.acquire("b", "gpu").retry_at is None
    book.release([got[0].id])
    assert len(book.acquire("b", "gpu").leases) == 1
    assert len(book.acquire("a", "llm", n=10, tokens=300).leases) == 3  # 1000 tokens
    with pytest.raises(ConfigError, match="tokens"):
        book.acquire("a", "llm", tokens=2000)
    with pytest.raises(ConfigError, match="no shared pool"):
        book.acquire("a", "nope")


def test_a_full_window_says_when_to_ask_again() -> None:
    clock = Clock()
    book = LeaseBook({"api": PoolLimit(calls=1, window_s=60.0)}, clock=clock)
    (lease,) = book.acquire("a", "api").leases
    clock.t += 1.0
    book.release([lease.id])
    g = book.acquire("a", "api")
    assert g.leases == [] and g.retry_at == pytest.approx(clock.t + 60.0)
