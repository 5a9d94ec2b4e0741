"""The Ray backend of the live dispatcher (``pip install 'metasched[ray]'``).

The dispatcher runs as a named, detached Ray actor (:mod:`.actor`), so that rollout
workers in any process or on any node submit to one dispatcher through a handle
(:mod:`.client`: :func:`start_dispatcher`, :func:`connect`). It schedules over the
cluster Ray describes (:mod:`.cluster`: nodes, cores, GPUs), runs each granted command
in its trajectory's sandbox on its node through that node's daemon (:mod:`.node_daemon`),
reached by a Ray task pinned to the node with ``num_cpus`` equal to its granted cores
(or by a call to the daemon), each GPU's services in an actor holding that GPU
(:mod:`.gpu_hosts`), and API calls itself, so that one ``ApiPool`` holds every
endpoint's quota for the whole cluster.

Importing this package does not import Ray; its names are loaded on first use.
"""

from __future__ import annotations

from metasched.lazy import lazy_exports

_EXPORTS = {
    "DispatcherHandle": "metasched.runtime.ray_backend.client",
    "SyncDispatcherHandle": "metasched.runtime.ray_backend.client",
    "connect": "metasched.runtime.ray_backend.client",
    "start_dispatcher": "metasched.runtime.ray_backend.client",
    "stop_dispatcher": "metasched.runtime.ray_backend.client",
    "RayBackend": "metasched.runtime.ray_backend.cluster",
    "cluster_view": "metasched.runtime.ray_backend.cluster",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
