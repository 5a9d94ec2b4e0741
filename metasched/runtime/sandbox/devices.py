"""The device nodes a gpu command's sandbox binds: the NVIDIA driver's control nodes
that exist, and the node of its granted GPU alone.

CUDA opens ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` (and ``-tools``) and
``/dev/nvidia<minor>`` of each GPU it uses (``/dev/nvidia-modeset`` where the driver has
it). A sandbox's ``/dev`` is bwrap's minimal one, without any of these; binding only the
granted GPU's node is what keeps a command from opening another GPU, whatever its
``CUDA_VISIBLE_DEVICES`` says. The GPU's minor number comes from NVML
(:func:`metasched.runtime.gpu.device_minor`).
"""

from __future__ import annotations

import glob
import os
import stat

__all__ = ["CONTROL_NODES", "DEV_ROOT", "GPU_SYS_PATHS", "gpu_nodes", "gpu_sys_paths"]

DEV_ROOT = "/dev"
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# What of /sys a gpu command's sandbox also sees, read-only (glob patterns): the PCI
# devices (the driver and NVML read a GPU's PCI attributes and NUMA node) and the
# NVIDIA modules' parameters. Other sandboxes see no PCI device.
GPU_SYS_PATHS = ("/sys/bus/pci", "/sys/devices/pci*", "/sys/module/nvidia*")


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def gpu_nodes(minor: int, dev_root: str | None = None) -> list[str]:
    """The names (relative to ``dev_root``, default :data:`DEV_ROOT`) of the character
    devices a command on GPU ``minor`` needs: ``nvidia<minor>`` and the control nodes
    that exist. Empty where ``nvidia<minor>`` is not there (no NVIDIA GPU of that
    number: nothing to bind)."""
    root = dev_root if dev_root is not None else DEV_ROOT
    own = f"nvidia{int(minor)}"
    if not _is_char_device(os.path.join(root, own)):
        return []
    return [*(n for n in CONTROL_NODES if _is_char_device(os.path.join(root, n))), own]


def gpu_sys_paths() -> list[str]:
    """The host paths of :data:`GPU_SYS_PATHS` that exist here."""
    return sorted({p for pattern in GPU_SYS_PATHS for p in glob.glob(pattern)})
