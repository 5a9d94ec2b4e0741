"""The live dispatcher: runs real actions on local hardware under the same scheduling
core (state, encoder, masks, ``Scheduler``) as the simulator.

``from metasched.runtime import Dispatcher, DispatcherConfig`` is the entry point; see
the README's "Live dispatcher" section.
"""

from metasched.runtime.dispatcher import Dispatcher, DispatcherConfig
from metasched.runtime.gpu import LiveService
from metasched.runtime.requests import Request, Result, parse_request

__all__ = ["Dispatcher", "DispatcherConfig", "LiveService", "Request", "Result",
           "parse_request"]
