"""Where a node's commands start, whichever dispatcher grants them: the node's
sandboxes (its run directory and :class:`~metasched.runtime.sandbox.manager.Sandboxes`,
made by :func:`open_sandboxes`) and the one call that starts a command in it
(:func:`launch`).

It stands above both :mod:`metasched.runtime.process` (how a command is started and
watched) and :mod:`metasched.runtime.sandbox` (where it is confined), which it ties
together. The dispatcher on one machine holds these in its own process; on a Ray cluster
each node's daemon (:mod:`metasched.runtime.ray_backend.node_daemon`) holds its node's, so
a command is confined the same way on either backend.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence

from metasched.errors import ConfigError
from metasched.runtime.outcome import Outcome
from metasched.runtime.process import Process, start_process
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.manager import Sandbox, Sandboxes
from metasched.runtime.sandbox.rundir import RunDirectory, remove_dead_runs
from metasched.runtime.sandbox.workspace import SANDBOX_ENV

__all__ = ["gpu_sandbox", "launch", "open_sandboxes"]

log = logging.getLogger("metasched.dispatch")


async def open_sandboxes(workdir: str | None, config: SandboxConfig, *,
                           hide: Sequence[str] = ()) -> tuple[RunDirectory, Sandboxes]:
    """Remove what dispatchers that are gone left in ``workdir`` (their run directories,
    with the scratch directories and cgroups they record: nothing else), make this
    one's, and start the sandboxes on the running loop. The log says in one line how
    commands are confined.

    Raises:
        ConfigError: the run directory or the first sandbox cannot be made, or the
            configured isolation cannot work here.
    """
    root = workdir if workdir is not None else tempfile.gettempdir()
    removed = remove_dead_runs(root)
    if removed:
        log.info("removed what %d dispatchers that are gone left in %s", len(removed), root)
    try:
        run_dir = RunDirectory(root)
    except OSError as e:
        raise ConfigError("workdir", f"cannot make a directory in {root} "
                          f"({e.strerror or e})") from None
    try:
        sandboxes = Sandboxes(config, hide=hide)
    except BaseException:
        run_dir.remove()
        raise
    run_dir.record(sandboxes.directories())
    for why in sandboxes.warnings:
        log.warning(why)
    log.info(sandboxes.describe())
    sandboxes.attach(asyncio.get_running_loop())
    if sandboxes.isolated:  # trajectory-less commands' sandbox, ready before they come
        try:
            sb = sandboxes.shared(config.network)
            await sb.ready
            if sb.throwaway:  # (gVisor: one per command; this one only checked it works)
                sandboxes.close_sandbox(sb)
        except OSError as e:
            sandboxes.close()
            run_dir.remove()
            raise ConfigError("sandbox", f"cannot make a sandbox: {e.strerror or e}") from None
    return run_dir, sandboxes


async def gpu_sandbox(sandboxes: Sandboxes, sandbox: Sandbox | None,
                      nvml_index: int | None) -> Sandbox | None:
    """Where a gpu command granted the GPU of NVML index ``nvml_index`` (on this node;
    None: a stand-in) runs, given the sandbox its request runs in: that sandbox's
    sandbox for this GPU (its workspace, plus this GPU's device nodes and no other's:
    :meth:`~metasched.runtime.sandbox.manager.Sandboxes.gpu_sandbox`), ready or failed
    (:func:`launch` then fails the command with the reason); ``sandbox`` itself where
    there is nothing to bind, or without isolation.

    Raises:
        OSError: the GPU's device node cannot be told (NVML fails).
    """
    if sandbox is None or not sandboxes.isolated or nvml_index is None:
        return sandbox
    from metasched.runtime.gpu import device_minor

    box = sandboxes.gpu_sandbox(sandbox, device_minor(nvml_index))
    if box is not None and box is not sandbox:
        try:
            await box.ready
        except OSError:
            pass  # launch fails the command with the reason
    return box


def launch(argv: Sequence[str], *, cores: list[int], timeout_s: float,
           env: Mapping[str, str], request_env: Mapping[str, str] | None = None,
           sandboxes: Sandboxes, sandbox: Sandbox | None,
           cwd_root: str, pids_max: int | None, mem_limit_mb: float | None = None,
           cpu_time_s: float | None = None, tail_bytes: int = 4096,
           extra_env: Mapping[str, str] | None = None,
           on_start: Callable[[int], None] | None = None) -> Process:
    """Start one command now, in ``sandbox`` (isolation on: the trajectory's, or the
    shared one) or on the host in a scratch directory under ``cwd_root``, in a cgroup
    slot when there are cgroups (see :func:`metasched.runtime.process.start_process`).
    ``env`` is the allow-listed environment, ``request_env`` what the request adds
    (over a sandboxed command's home, its workspace).

    A sandbox that could not be made fails the command with the reason."""
    if sandbox is not None and sandbox.ready.done() and sandbox.ready.exception() is not None:
        exc = sandbox.ready.exception()
        why = getattr(exc, "strerror", None) or str(exc)
        return Process.failed(Outcome(False, f"cannot start: {why}", detail={"cores": cores}))
    env = {**env, **(SANDBOX_ENV if sandbox is not None else {}), **(request_env or {})}
    return start_process(
        argv, cores=cores, timeout_s=timeout_s, env=env, mem_limit_mb=mem_limit_mb,
        cpu_time_s=cpu_time_s, pids_max=pids_max, tail_bytes=tail_bytes,
        extra_env=extra_env, cwd_root=cwd_root, sandboxes=sandboxes, sandbox=sandbox,
        on_start=on_start)
