"""Leases of the shared pools (API quotas, GPU service slots) for every dispatcher
shard: :mod:`.book` (the state, and why no quota is exceeded) and :mod:`.service` (the
Ray actor, and the client a shard asks it through)."""

from metasched.runtime.leases.book import Grant, Lease, LeaseBook, PoolLimit

__all__ = ["Grant", "Lease", "LeaseBook", "PoolLimit"]
