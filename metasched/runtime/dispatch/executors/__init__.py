"""The executors: what runs a granted action, one per kind. :mod:`.base` has those
every backend shares (GPU service batches, API calls with their quota-aware retries,
the reservation of cores for gpu commands); :mod:`.local` runs commands on this
machine's cores, :mod:`.nodes` on a backend's nodes. A backend names its executors
(``backend.executors(dispatcher)``)."""

from __future__ import annotations

from metasched.runtime.dispatch.executors.base import Executors

__all__ = ["Executors"]
