"""GPU devices of the live dispatcher: what a device is (:class:`LiveDevice`), the
environment a command on one sees, NVML shared by its users, device discovery (with CPU
stand-ins when there is no GPU) and the device node of a GPU.

Nothing here needs a GPU: without NVML, :func:`discover_devices` says why there is no GPU
and, when asked, returns CPU stand-in devices that behave like GPUs for the host (tests,
dry runs).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("metasched.runtime.gpu")  # the package's one logger

GIB = float(1 << 30)


@dataclass(frozen=True)
class LiveDevice:
    """One device the dispatcher can place services on.

    Attributes:
        index: position in the dispatcher's GPU pool (``GpuPool.devices[index]``).
        name: the GPU's model name ("NVIDIA H200"), or "cpu-standin-<i>".
        mem_gb: total memory, GiB (what GPU vendors call GB: an "80 GB" card has ~79.6).
        torch_device: where this process puts tensors for it: "cuda:<k>", k its position
            among the GPUs CUDA shows this process, or "cpu" for a stand-in.
        nvml_index: its NVML index (every GPU on the machine, PCI bus order), or None
            for a stand-in.
        visible_id: the CUDA_VISIBLE_DEVICES value that shows a child process this GPU
            alone (its UUID); "" for a stand-in (no GPU visible).
    """

    index: int
    name: str
    mem_gb: float
    torch_device: str
    nvml_index: int | None
    visible_id: str

    @property
    def standin(self) -> bool:
        return self.nvml_index is None


def command_env(device: LiveDevice) -> dict[str, str]:
    """Environment additions for a command action that runs on ``device``: it sees that
    GPU alone (as its ``cuda:0``); for a stand-in, no GPU at all. ``NVIDIA_VISIBLE_DEVICES``
    says the same to a container runtime the command starts."""
    return {"CUDA_VISIBLE_DEVICES": device.visible_id,
            "NVIDIA_VISIBLE_DEVICES": device.visible_id}


# ---------------------------------------------------------------- NVML, shared by users

_nvml_lock = threading.Lock()
_nvml_users = 0


def _nvml_acquire() -> Any:
    """Initialise NVML for one more user (the first user's call runs ``nvmlInit``);
    returns the ``pynvml`` module. Raises ImportError or ``pynvml.NVMLError``."""
    global _nvml_users
    import pynvml

    with _nvml_lock:
        if _nvml_users == 0:
            pynvml.nvmlInit()
        _nvml_users += 1
    return pynvml


def _nvml_release() -> None:
    """One user is done with NVML (the last one's call runs ``nvmlShutdown``)."""
    global _nvml_users
    with _nvml_lock:
        if _nvml_users <= 0:
            return
        _nvml_users -= 1
        if _nvml_users == 0:
            import pynvml

            try:
                pynvml.nvmlShutdown()
            except Exception as e:  # shutting down: nothing left to do
                log.debug("nvmlShutdown failed: %s", e)


def _err(e: BaseException) -> str:
    """``ExcType: message`` on one line (at most ~200 characters)."""
    msg = " ".join(str(e).split())
    if len(msg) > 200:
        msg = msg[:197] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _visible(env: str | None, uuids: list[str]) -> tuple[list[int], str]:
    """NVML indices CUDA_VISIBLE_DEVICES shows, in CUDA's order, and a reason when it
    shows none. Parsed as CUDA (and torch) do: unset means every GPU; a list of indices
    (each read like ``strtoul``: "1gpu" is 1) or of unique UUID prefixes ("GPU-..."),
    whichever the first entry is; the first invalid entry ends the list; a repeated GPU
    shows none at all. MIG instances are not supported."""
    if env is None:
        return list(range(len(uuids))), ""
    n = len(uuids)
    none = f"no GPU: CUDA_VISIBLE_DEVICES={env!r}"
    if env.startswith("MIG-"):
        return [], f"{none} names MIG instances (not supported)"
    shown: list[int] = []
    for raw in env.split(","):
        entry = raw.strip()
        if env.startswith("GPU-"):
            match = [i for i, u in enumerate(uuids) if u.startswith(entry)]
            if not entry.startswith("GPU-") or len(match) != 1:
                break
            i = match[0]
        else:
            digits = re.match(r"[+-]?\d+", entry)
            i = int(digits.group()) if digits else -1
            if not 0 <= i < n:
                break
        if i in shown:
            return [], f"{none} repeats GPU {i} (CUDA then shows none)"
        shown.append(i)
    if not shown:
        return [], f"{none} shows none of the {n} GPUs"
    return shown, ""


def _standins(n: int, mem_gb: float) -> list[LiveDevice]:
    return [LiveDevice(i, f"cpu-standin-{i}", float(mem_gb), "cpu", None, "") for i in range(n)]


def discover_devices(*, standin: int = 0, standin_mem_gb: float = 16.0
                     ) -> tuple[list[LiveDevice], str]:
    """The GPUs this process may use, found with NVML, and why there are none.

    Returns ``(devices, "")`` when NVML finds GPUs (only those CUDA_VISIBLE_DEVICES shows,
    when it is set, in its order). Otherwise ``([], reason)`` with a one-line reason
    starting "no GPU:", e.g. "no GPU: NVML unavailable (NVMLError_LibraryNotFound: NVML
    Shared Library Not Found)"; when ``standin`` > 0 was asked for, ``standin`` CPU
    stand-in devices of ``standin_mem_gb`` each instead of ``[]``, the reason saying so.
    The reason is empty exactly when real GPUs were found. Never raises for a missing GPU.

    ``torch_device`` numbers GPUs as CUDA does in this process (position in
    CUDA_VISIBLE_DEVICES, else NVML's PCI order; on a machine mixing GPU models set
    CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA's default order agrees).
    """
    devices, reason = _discover_nvml()
    if devices:
        return devices, ""
    if standin > 0:
        word = "device" if standin == 1 else "devices"
        return _standins(standin, standin_mem_gb), f"{reason}; using {standin} CPU stand-in {word}"
    return [], reason


def _discover_nvml() -> tuple[list[LiveDevice], str]:
    try:
        nv = _nvml_acquire()
    except ImportError as e:
        return [], f"no GPU: NVML unavailable (pynvml not importable: {_err(e)})"
    except Exception as e:  # any NVML failure means no usable GPU
        return [], f"no GPU: NVML unavailable ({_err(e)})"
    try:
        try:
            n = int(nv.nvmlDeviceGetCount())
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            uuids = [_text(nv.nvmlDeviceGetUUID(h)) for h in handles]
        except Exception as e:
            return [], f"no GPU: NVML could not list devices ({_err(e)})"
        if n == 0:
            return [], "no GPU: NVML found no devices"
        shown, why = _visible(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
        devices: list[LiveDevice] = []
        last = ""
        for k, i in enumerate(shown):
            try:
                name = _text(nv.nvmlDeviceGetName(handles[i]))
                mem = nv.nvmlDeviceGetMemoryInfo(handles[i]).total / GIB
            except Exception as e:  # a broken GPU is left out, others used
                last = f"GPU {i} ({uuids[i]}): {_err(e)}"
                log.warning("left out %s", last)
                continue
            devices.append(LiveDevice(len(devices), name, mem, f"cuda:{k}", i, uuids[i]))
        if not devices and not why:
            why = f"no GPU: NVML could not read any device ({last})"
        return devices, why
    finally:
        _nvml_release()


_minors: dict[int, int] = {}  # NVML index -> minor number (fixed while the driver runs)


def device_minor(nvml_index: int | None) -> int | None:
    """The minor number of the GPU of NVML index ``nvml_index`` (its device node is
    ``/dev/nvidia<minor>``), from NVML's ``nvmlDeviceGetMinorNumber``; None for a
    stand-in (``nvml_index`` None: no device node). The one place an NVML index becomes
    a device node: a gpu command's sandbox binds that node alone.

    Raises:
        OSError: NVML cannot say (the command must not guess: a wrong node is another
            command's GPU).
    """
    if nvml_index is None:
        return None
    minor = _minors.get(nvml_index)
    if minor is not None:
        return minor
    try:
        nv = _nvml_acquire()
    except Exception as e:  # noqa: BLE001 - ImportError or any NVMLError
        raise OSError(0, f"GPU {nvml_index}'s device node: NVML unavailable ({_err(e)})"
                      ) from None
    try:
        minor = int(nv.nvmlDeviceGetMinorNumber(nv.nvmlDeviceGetHandleByIndex(nvml_index)))
    except Exception as e:  # noqa: BLE001
        raise OSError(0, f"GPU {nvml_index}'s device node: NVML cannot tell its minor "
                      f"number ({_err(e)})") from None
    finally:
        _nvml_release()
    _minors[nvml_index] = minor
    return minor
