"""The live dispatcher: runs real actions on local hardware under the same scheduling
core (state, encoder, masks, ``Scheduler``) as the simulator.

``from metasched.runtime import Dispatcher, DispatcherConfig`` is the entry point; see
``docs/apps/dispatch.md``. The names are imported on first use, so that a
process needing one light submodule (the sandbox server) does not load the dispatcher
and NumPy.
"""

from __future__ import annotations

from metasched.lazy import lazy_exports

_EXPORTS = {
    "Dispatcher": "metasched.runtime.dispatch.dispatcher",
    "DispatcherConfig": "metasched.runtime.dispatch.config",
    "LiveService": "metasched.runtime.gpu",
    "Request": "metasched.runtime.requests",
    "RequestLimits": "metasched.runtime.limits",
    "Result": "metasched.runtime.requests",
    "parse_request": "metasched.runtime.requests",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
