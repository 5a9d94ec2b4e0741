"""CPU executor: runs one sandbox action as a subprocess pinned to its granted cores.

:func:`run_process` starts ``argv`` (never through a shell) in a fresh temporary working
directory and a new session (so it leads its own process group), pinned to exactly the
granted CPU ids, with the usual thread-count variables set to the number of cores and
optional address-space and CPU-time rlimits. It keeps the last ``tail_bytes`` of stdout
and stderr, kills the whole group after ``timeout_s`` or on cancellation, and reports an
:class:`~metasched.runtime.outcome.Outcome`; failures to start come back as an Outcome
too, never as an exception (only misuse of the API raises). No zombie, temporary
directory or file descriptor outlives a call, whichever way it ends.

Where each part lives (each module's docstring says why it is done that way):

- :mod:`.run`: :func:`run_process`, :func:`start_process` and :class:`Process`, which
  tie the parts below together and kill what is left of the group at the end;
- :mod:`.spawn`: starting the child pinned to its cores (the affinity dance around the
  spawn);
- :mod:`.environment`: the child's environment and :data:`THREAD_ENV_VARS`;
- :mod:`.limits`: rlimits, the ``prlimit(1)`` launcher that sets them before the
  command's first instruction, and the executable lookup it needs;
- :mod:`.child`: the running child: its pipes and output tails, exit watching on a
  pidfd, killing and reaping (:func:`kill_group`);
- :mod:`.sandboxed`: the child the sandbox server started, behind the same interface;
- :mod:`.fd_watch`: the per-event-loop epoll set that watches every child's pipes and
  pidfds as one reader;
- :mod:`.memory_watch`: the watchdog on a group's resident memory;
- :mod:`.failures`: naming how a command ended;
- :mod:`.workdir`: the scratch directories.

Sandboxes (bwrap's, with their cgroup slots) is :mod:`metasched.runtime.sandbox`'s, a layer
below this one (it never imports this package); ``run.py`` starts a command there when it
is given one, and :mod:`metasched.runtime.launch` ties the two together for a node.

Only the names below are the package's API; the modules are its internals.
"""

from metasched.runtime.process.child import kill_group
from metasched.runtime.process.environment import THREAD_ENV_VARS
from metasched.runtime.process.run import Process, run_process, start_process

__all__ = ["THREAD_ENV_VARS", "Process", "kill_group", "run_process", "start_process"]
