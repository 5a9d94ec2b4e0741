"""The GPU side of the live dispatcher: device discovery (NVML), utilisation sampling,
and a host of GPU services whose real residency follows the scheduler's model.

The scheduling core keeps a *model* of which services are resident on which device
(:class:`metasched.core.pools.GpuPool`; ``ClusterState.start`` makes a granted batch's service
resident, evicting least recently used ones). :meth:`ServiceHost.run_batch` makes the
hardware match that model (moves evicted modules back to host memory, restores the
requested one) and runs the batch in a worker thread, so the event loop never blocks.

Nothing here needs a GPU: without NVML, :func:`discover_devices` says why there is no GPU
and, when asked, returns CPU stand-in devices that behave like GPUs for the host (tests,
dry runs). torch is imported only when a torch service is loaded or placed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from metasched.core.pools import ServiceSpec
from metasched.runtime.outcome import Outcome

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- sampling

class GpuSampler:
    """Utilisation (0..1) and memory used (GiB) of each device, read from NVML.

    A stand-in reports utilisation 0.0 and the host-side size of the modules ``host``
    has resident on it (0 without a host). A GPU that NVML fails to read reports
    ``(nan, nan)`` for that sample. Holds NVML initialised from construction to
    :meth:`close` (shared with other users: the last one to close shuts it down);
    usable as a context manager.
    """

    def __init__(self, devices: list[LiveDevice], host: ServiceHost | None = None) -> None:
        self.devices = list(devices)
        self.host = host
        self._nv: Any = None
        self._handles: dict[int, Any] = {}
        if any(not d.standin for d in self.devices):
            self._nv = _nvml_acquire()
            try:
                for d in self.devices:
                    if not d.standin:
                        self._handles[d.index] = self._nv.nvmlDeviceGetHandleByIndex(
                            d.nvml_index)
            except BaseException:
                self.close()
                raise

    def sample(self) -> list[tuple[float, float]]:
        """``(utilisation, mem_used_gb)`` per device, in ``devices`` order."""
        if self._nv is None and self._handles:
            raise RuntimeError("GpuSampler is closed")
        out = []
        for d in self.devices:
            if d.standin:
                used = self.host.mem_used_gb(d) if self.host is not None else 0.0
                out.append((0.0, used))
                continue
            h = self._handles[d.index]
            try:
                util = self._nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
                used = self._nv.nvmlDeviceGetMemoryInfo(h).used / GIB
            except Exception as e:  # one bad read must not stop a monitor
                log.debug("NVML read of device %d failed: %s", d.index, e)
                util = used = float("nan")
            out.append((float(util), float(used)))
        return out

    def close(self) -> None:
        """Release NVML (once; later calls do nothing)."""
        if self._nv is not None:
            self._nv = None
            _nvml_release()

    def __enter__(self) -> GpuSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- services

@dataclass
class LiveService:
    """A GPU service the dispatcher can run.

    Attributes:
        spec: the scheduler's view of it (memory, restore time, batching).
        load: builds it in host memory (e.g. returns a ``torch.nn.Module`` on the CPU).
            Called once per copy ever needed (one per device it is resident on at once);
            eviction keeps the copy in host memory, so restoring it does not call
            ``load`` again.
        infer: ``(resident object, payloads) -> one result per payload``; runs in a
            worker thread, under ``torch.inference_mode()`` and with the current CUDA
            device set to the batch's device when torch is in use.
    """

    spec: ServiceSpec
    load: Callable[[], Any]
    infer: Callable[[Any, list[Any]], list[Any]]


def _torch() -> Any:
    """torch if this process has imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def _move(obj: Any, where: str) -> Any:
    """``obj.to(where)`` if it has ``.to`` (a module moves in place and returns itself)."""
    to = getattr(obj, "to", None)
    return to(where) if callable(to) else obj


def _size_gb(obj: Any) -> float | None:
    """GiB held by a torch module's parameters and buffers (None if not a module)."""
    params = getattr(obj, "parameters", None)
    buffers = getattr(obj, "buffers", None)
    if not (callable(params) and callable(buffers)):
        return None
    try:
        n = sum(t.numel() * t.element_size() for t in (*params(), *buffers()))
    except Exception:  # not a torch module after all
        return None
    return n / GIB


def _sync(device: LiveDevice) -> None:
    torch = _torch()
    if torch is not None and device.torch_device.startswith("cuda"):
        torch.cuda.synchronize(device.torch_device)


class ServiceHost:
    """Live GPU services, made resident on devices as the scheduler's model says.

    Each service's copies live either in host memory (free) or on one device. Eviction
    moves a copy back to host memory (``.to("cpu")``) and keeps it, so a later restore
    costs a host-to-device copy, not a ``load``. Objects without ``.to`` (plain
    callables) are shared by every device.
    """

    def __init__(self, devices: list[LiveDevice]) -> None:
        for i, d in enumerate(devices):
            if d.index != i:
                raise ValueError(f"devices[{i}] has index {d.index}; expected {i}")
        self.devices = list(devices)
        self._services: dict[str, LiveService] = {}
        self._lock = threading.Lock()  # guards the bookkeeping below (never held long)
        self._free: dict[str, list[Any]] = {}  # service -> copies in host memory
        self._placed: list[dict[str, Any]] = [{} for _ in devices]  # device -> svc -> obj
        self._sizes: dict[str, float] = {}  # service -> GiB of one copy (torch modules)
        self._busy: dict[int, str] = {}  # device -> service of the batch running there
        self.loads: dict[str, int] = {}  # service -> load() calls
        self.restores = 0
        self.evictions = 0

    def register(self, name: str, service: LiveService) -> None:
        """Add ``service`` under ``name`` (ValueError if the name is taken)."""
        if name in self._services:
            raise ValueError(f"service {name!r} is already registered")
        if not isinstance(service, LiveService):
            raise TypeError(f"service {name!r}: expected a LiveService, got "
                            f"{type(service).__name__}")
        self._services[name] = service
        self._free[name] = []
        self.loads[name] = 0

    @property
    def specs(self) -> dict[str, ServiceSpec]:
        """Name -> spec of every registered service (to build the ``GpuPool``)."""
        return {n: s.spec for n, s in self._services.items()}

    def resident(self, device: LiveDevice) -> set[str]:
        """Services this host really has on ``device`` now."""
        with self._lock:
            return set(self._placed[device.index])

    def module(self, service: str, device: LiveDevice) -> Any:
        """The object of ``service`` resident on ``device`` (KeyError if not resident)."""
        with self._lock:
            return self._placed[device.index][service]

    def busy(self, device: LiveDevice) -> bool:
        """A batch (or its residency change) is running on ``device``."""
        return device.index in self._busy

    def mem_used_gb(self, device: LiveDevice) -> float:
        """GiB of the services resident on ``device``: measured size of a torch module,
        else the spec's ``mem_gb``."""
        with self._lock:
            names = list(self._placed[device.index])
        return sum(self._sizes.get(n, self._services[n].spec.mem_gb) for n in names)

    async def run_batch(self, service: str, device: LiveDevice, resident_now: Collection[str],
                        payloads: list[Any]) -> Outcome:
        """Make ``device`` hold exactly the services of ``resident_now`` that this host
        has placed there (evicting the others), make ``service`` resident, and run
        ``payloads`` through it.

        ``resident_now`` is the model's residency after ``ClusterState.start``
        (``state.gpu.devices[i].resident``). A service error (load, placement, infer,
        wrong number of results) comes back as a failed Outcome, never raised. Returns
        ``Outcome(ok=True, value=[result per payload], detail={"restore_s", "batch",
        "device", ...})``. Raises RuntimeError if ``device`` is already running a batch
        (the scheduler runs one at a time per device). If the awaiting task is
        cancelled, the work in the thread still finishes, and the device stays busy
        until it does.
        """
        svc = self._services.get(service)
        if svc is None:
            names = ", ".join(sorted(self._services)) or "none"
            return Outcome(ok=False, reason=f"unknown service {service!r} (registered: {names})")
        i = device.index
        if not (0 <= i < len(self.devices) and self.devices[i] == device):
            raise ValueError(f"device {device!r} is not one of this host's devices")
        if i in self._busy:
            raise RuntimeError(f"device {i} is already running a batch of {self._busy[i]!r}; "
                               f"one batch runs on a device at a time")
        keep = set(resident_now)
        with self._lock:
            placed = self._placed[i]
            evicted = {s: placed.pop(s) for s in list(placed) if s not in keep and s != service}
            have = placed.get(service)
            copy = None if have is not None else self._take_copy(service)
        self._busy[i] = service
        job = asyncio.ensure_future(asyncio.to_thread(
            self._work, svc, service, device, evicted, have, copy, list(payloads)))
        job.add_done_callback(lambda _: self._busy.pop(i, None))
        return await asyncio.shield(job)

    def _take_copy(self, service: str) -> Any:
        """A host-memory copy of ``service`` to place (None: ``load`` one), or a shared
        object (no ``.to``) already placed on another device. Under ``_lock``."""
        free = self._free[service]
        if free:
            return free.pop()
        for placed in self._placed:
            obj = placed.get(service)
            if obj is not None and not callable(getattr(obj, "to", None)):
                return obj
        return None

    def _work(self, svc: LiveService, service: str, device: LiveDevice,
              evicted: dict[str, Any], have: Any, copy: Any, payloads: list[Any]) -> Outcome:
        """In a worker thread: evict, restore, infer."""
        detail: dict[str, Any] = {"batch": len(payloads), "device": device.index,
                                  "evicted": sorted(evicted), "restored": have is None,
                                  "loaded": False, "restore_s": 0.0, "evict_s": 0.0}
        on_cuda = device.torch_device.startswith("cuda")
        # Evict: back to host memory, kept there for the next restore.
        if evicted:
            t0 = time.perf_counter()
            back = {}
            for s, obj in evicted.items():
                try:
                    back[s] = _move(obj, "cpu")
                except Exception as e:  # drop the copy rather than fail
                    log.warning("evicting %s from device %d failed (%s); copy dropped",
                                s, device.index, _err(e))
            torch = _torch()
            if on_cuda and torch is not None:
                torch.cuda.empty_cache()
            detail["evict_s"] = time.perf_counter() - t0
            with self._lock:
                for s, obj in back.items():
                    self._free[s].append(obj)
                self.evictions += len(evicted)
        # Restore: load once, then place on the device.
        obj = have
        if obj is None:
            t0 = time.perf_counter()
            try:
                if copy is None:
                    with self._lock:
                        self.loads[service] += 1
                    copy = svc.load()
                    detail["loaded"] = True
                    size = _size_gb(copy)
                    if size is not None:
                        with self._lock:
                            self._sizes[service] = size
                obj = _move(copy, device.torch_device)
                _sync(device)
            except Exception as e:  # a service's error is an Outcome
                self._restore_failed(service, device, copy)
                return Outcome(ok=False, reason=f"service {service} failed to restore on "
                               f"device {device.index}: {_err(e)}", detail=detail)
            detail["restore_s"] = time.perf_counter() - t0
            with self._lock:
                self._placed[device.index][service] = obj
                self.restores += 1
        if not payloads:
            return Outcome(ok=True, value=[], detail=detail)
        # Infer.
        t0 = time.perf_counter()
        try:
            results = self._infer(svc, obj, device, payloads)
            _sync(device)
            results = list(results)
        except Exception as e:  # a service's error is an Outcome
            torch = _torch()
            if on_cuda and torch is not None:
                torch.cuda.empty_cache()
            return Outcome(ok=False, reason=f"service {service} failed: {_err(e)}", detail=detail)
        detail["infer_s"] = time.perf_counter() - t0
        if len(results) != len(payloads):
            return Outcome(ok=False, reason=f"service {service} failed: returned "
                           f"{len(results)} results for {len(payloads)} payloads", detail=detail)
        return Outcome(ok=True, value=results, detail=detail)

    @staticmethod
    def _infer(svc: LiveService, obj: Any, device: LiveDevice, payloads: list[Any]) -> Any:
        torch = _torch()
        if torch is None:
            return svc.infer(obj, payloads)
        with torch.inference_mode():
            if device.torch_device.startswith("cuda"):
                with torch.cuda.device(device.torch_device):
                    return svc.infer(obj, payloads)
            return svc.infer(obj, payloads)

    def _restore_failed(self, service: str, device: LiveDevice, copy: Any) -> None:
        """Keep a loaded copy in host memory after a failed placement (best effort)."""
        if copy is not None:
            try:
                back = _move(copy, "cpu")
            except Exception:
                back = None
            if back is not None:
                with self._lock:
                    self._free[service].append(back)
        torch = _torch()
        if device.torch_device.startswith("cuda") and torch is not None:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- example service

def linear_scorer(dim: int = 64, seed: int = 0) -> LiveService:
    """A tiny reward-model stand-in: ``torch.nn.Linear(dim, 1)`` with weights drawn from
    ``seed``. Payloads are lists of at most ``dim`` floats (shorter ones zero-padded);
    results are floats. Every ``load`` builds the same weights."""

    def load() -> Any:
        import torch

        g = torch.Generator().manual_seed(seed)
        lin = torch.nn.Linear(dim, 1)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(1, dim, generator=g) / dim ** 0.5)
            lin.bias.copy_(torch.randn(1, generator=g) * 0.1)
        return lin.eval()

    def infer(model: Any, payloads: list[Any]) -> list[float]:
        import torch

        rows = []
        for k, p in enumerate(payloads):
            row = [float(v) for v in p]
            if len(row) > dim:
                raise ValueError(f"payload {k} has {len(row)} values; at most {dim}")
            rows.append(row + [0.0] * (dim - len(row)))
        w = model.weight
        x = torch.tensor(rows, dtype=w.dtype).to(w.device)
        return model(x).squeeze(-1).tolist()

    spec = ServiceSpec(mem_gb=0.001, restore_s=0.05, max_batch=8, batch_marginal=0.05)
    return LiveService(spec=spec, load=load, infer=infer)


__all__ = [
    "GpuSampler", "LiveDevice", "LiveService", "ServiceHost", "command_env",
    "discover_devices", "linear_scorer",
]
