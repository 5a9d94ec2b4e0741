"""The child's environment: inherited or given, plus the thread-count variables.

Built as bytes, the form ``execve`` takes, so that nothing is encoded again per spawn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["THREAD_ENV_VARS", "child_env"]

# Set to the number of granted cores: the thread pools of OpenMP, BLAS libraries, numexpr,
# torch, Rayon, Go, Julia and TensorFlow would otherwise size themselves to the whole
# machine (they read the cpu count, not the affinity mask) and oversubscribe the cores.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "NUMEXPR_MAX_THREADS",
    "TORCH_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "BLIS_NUM_THREADS",
    "RAYON_NUM_THREADS",
    "GOMAXPROCS",
    "JULIA_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
)

_THREAD_ENV_VARS_B = tuple(name.encode() for name in THREAD_ENV_VARS)


def child_env(env: Mapping[str, str] | None, extra_env: Mapping[str, str] | None,
              n_cores: int) -> dict[bytes, bytes]:
    """The child's environment: ``env`` (or ours), PATH if missing, extras, thread vars.

    Built as bytes, the form ``execve`` takes: ``Popen`` would encode every key and
    value on every spawn, which cost more than the rest of this package's Python work.

    Raises:
        ValueError: a given variable name contains "=".
    """
    if env is None:
        # Read now, not cached: the caller's os.environ may have changed since the last
        # call. os.environb is the bytes view of it: nothing is decoded or encoded.
        out = dict(os.environb)
    else:
        out = _encode_env(env)
        # Without PATH, execvpe falls back to a confstr default that may not match this
        # machine, and the child's own subprocesses could not find anything.
        if b"PATH" not in out and b"PATH" in os.environb:
            out[b"PATH"] = os.environb[b"PATH"]
    if extra_env:
        out.update(_encode_env(extra_env))
    n = str(n_cores).encode()
    for name in _THREAD_ENV_VARS_B:
        out[name] = n
    return out


def _encode_env(env: Mapping[str, str]) -> dict[bytes, bytes]:
    out = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    if any(b"=" in k for k in out):
        raise ValueError("illegal environment variable name")
    return out
