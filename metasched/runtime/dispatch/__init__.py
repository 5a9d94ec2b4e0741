"""The live dispatcher, one concern per module:

- :mod:`.dispatcher`: :class:`Dispatcher`, the core's decision step
  (:class:`~metasched.core.decision.DecisionStep`) on the asyncio clock, and the wiring;
- :mod:`.loop`: :class:`~.loop.DispatchLoop`, the clock, the event loop and the
  scheduling pass's wake-ups;
- :mod:`.shared`: what every part is given (each part's module adds, in a protocol of
  its own, what else it asks of the dispatcher; no part reads another's private
  attributes);
- :mod:`.config`: :class:`DispatcherConfig` (:mod:`.deadline_config`: its deadlines);
- :mod:`.sharing`: deadlines and time-sharing (commands at their latest start, idle
  cores lent);
- :mod:`.jobs`: what is kept of an accepted request, and the table of those unfinished;
- :mod:`.admission`: accepting a request (checks, limits, duplicate ids, recovery);
- :mod:`.journal_writer`: grouped journal commits;
- :mod:`.sandbox_gate`: holding commands until their sandbox is ready;
- :mod:`.trajectories`: trajectory life and close;
- :mod:`.completion`: a finished action's bookkeeping and result;
- :mod:`.cancellation`: ending a request its caller no longer wants;
- :mod:`.kernels`: a persistent interpreter per trajectory (``/run_jupyter``);
- :mod:`.policy`: loading the scheduler, and the fallback;
- :mod:`.status`: stats, status, run results, finding a request;
- :mod:`.executors`: what runs a granted action, per kind and backend;
- :mod:`.local`: :class:`LocalBackend`, this machine as a backend (the Ray one is
  :class:`~metasched.runtime.ray_backend.RayBackend`).

Names are imported on first use (see :mod:`metasched.lazy`).
"""

from __future__ import annotations

from metasched.lazy import lazy_exports

_EXPORTS = {
    "ACTION_ENV": "metasched.runtime.dispatch.jobs",
    "COMMAND_SERVICE": "metasched.runtime.dispatch.jobs",
    "Dispatcher": "metasched.runtime.dispatch.dispatcher",
    "DispatcherConfig": "metasched.runtime.dispatch.config",
    "LocalBackend": "metasched.runtime.dispatch.local",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
