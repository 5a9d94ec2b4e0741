"""A host of GPU services whose real residency follows the scheduler's model.

The scheduling core keeps a *model* of which services are resident on which device
(:class:`metasched.core.pools.GpuPool`; ``ClusterState.start`` makes a granted batch's service
resident, evicting least recently used ones). :meth:`ServiceHost.run_batch` makes the
hardware match that model (moves evicted modules back to host memory, restores the
requested one) and runs the batch in a worker thread, so the event loop never blocks.
torch is imported only when a torch service is loaded or placed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from metasched.core.pools import ServiceSpec
from metasched.runtime.gpu.devices import GIB, LiveDevice, _err
from metasched.runtime.outcome import Outcome

log = logging.getLogger("metasched.runtime.gpu")  # the package's one logger


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


class GpuHost(Protocol):
    """The GPU services of a backend's devices (:class:`ServiceHost` has this
    interface on one machine)."""

    @property
    def specs(self) -> dict[str, ServiceSpec]: ...

    async def run_batch(self, service: str, device: LiveDevice, resident_now: Collection[str],
                        payloads: list[Any]) -> Outcome: ...


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
