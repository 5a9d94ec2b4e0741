"""metasched: a learned, action-level meta-scheduler for the external resources of agentic RL.

The core (this package) holds the action model, the resource pools, the scheduling
state shared by the simulator and the live dispatcher, and the ``Scheduler`` interface.
Heuristic and learned schedulers live in :mod:`metasched.agents`; Gymnasium
environments in :mod:`metasched.envs`.
"""

from metasched.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__"]
