"""Placing trajectories on shards: sticky, and a join or a leave moves only what it
must."""

from __future__ import annotations

import pytest

from metasched.runtime.shards import ShardRing


def test_keys_spread_over_the_shards_and_stay_put() -> None:
    ring = ShardRing(["a", "b", "c"])
    owners = [ring.owner(f"t{i}") for i in range(3000)]
    for s in "abc":
        assert 800 < owners.count(s) < 1200
    assert [ring.owner(f"t{i}") for i in range(3000)] == owners


def test_a_join_takes_only_new_keys_and_a_fair_share_of_them() -> None:
    ring = ShardRing(["a", "b"])
    placed = {f"t{i}": ring.owner(f"t{i}") for i in range(1000)}
    ring.join("c")
    assert all(ring.owner(k) == s for k, s in placed.items())  # sticky
    fresh = [ring.owner(f"new{i}") for i in range(3000)]
    assert 800 < fresh.count("c") < 1200
    # Unplaced keys that do not go to the new shard hash where they did before.
    before = ShardRing(["a", "b"])
    assert all(s == before.hashed(f"new{i}") for i, s in enumerate(fresh) if s != "c")


def test_a_leave_hands_the_dead_shards_keys_to_one_adopter() -> None:
    ring = ShardRing(["a", "b", "c"])
    placed = {f"t{i}": ring.owner(f"t{i}") for i in range(300)}
    adopter = ring.leave("b")
    assert adopter == ShardRing(["a", "c"]).hashed("b")  # every router agrees
    assert ring.leave("b") == adopter
    assert all(ring.owner(k) == s for k, s in placed.items())  # the journal's owner
    assert {ring.serving(s) for s in placed.values()} == {"a", "c"}
    assert all(ring.owner(f"new{i}") != "b" for i in range(300))


def test_the_last_shard_cannot_leave() -> None:
    ring = ShardRing(["a"])
    with pytest.raises(ValueError, match="last one"):
        ring.leave("a")
