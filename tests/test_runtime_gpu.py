"""The live dispatcher's GPU side: discovery and sampling (with NVML absent, and with a
fake pynvml), and a ServiceHost whose residency follows a real GpuPool's model."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pynvml
import pytest

from metasched.core.pools import GpuPool, ServiceSpec
from metasched.runtime import gpu
from metasched.runtime.gpu import (
    GIB,
    GpuSampler,
    LiveDevice,
    LiveService,
    ServiceHost,
    command_env,
    discover_devices,
    linear_scorer,
)

# ---------------------------------------------------------------- NVML fakes


@pytest.fixture(autouse=True)
def nvml_released():
    """Every test leaves NVML with no users (samplers closed, discovery balanced)."""
    yield
    assert gpu.devices._nvml_users == 0


def _no_nvml(monkeypatch) -> None:
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", fail)


class FakeNvml:
    """Four GPUs; counts init/shutdown; ``broken`` indices fail memory queries."""

    def __init__(self, monkeypatch, broken: tuple[int, ...] = ()) -> None:
        self.gpus = [
            ("NVIDIA H100 80GB HBM3", "GPU-aaaa0000-0000", 80 * GIB, 10 * GIB, 37),
            ("NVIDIA H100 80GB HBM3", "GPU-bbbb1111-1111", 80 * GIB, 0.5 * GIB, 0),
            (b"NVIDIA H200", "GPU-cccc2222-2222", 140 * GIB, 70 * GIB, 100),
            ("NVIDIA H200", "GPU-cccc3333-3333", 140 * GIB, 1 * GIB, 5),
        ]
        self.broken = set(broken)
        self.inits = self.shutdowns = 0
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount",
                     "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName", "nvmlDeviceGetUUID",
                     "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"):
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        assert self.inits > self.shutdowns, "NVML used while shut down"
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetName(self, h):
        return self.gpus[h[1]][0]

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h[1]][1]

    def nvmlDeviceGetMemoryInfo(self, h):
        if h[1] in self.broken:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        _, _, total, used, _ = self.gpus[h[1]]
        return SimpleNamespace(total=int(total), used=int(used), free=int(total - used))

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.gpus[h[1]][4], memory=0)


# ---------------------------------------------------------------- discovery


def test_discover_without_nvml_says_why(monkeypatch):
    _no_nvml(monkeypatch)
    devices, why = discover_devices()
    assert devices == []
    assert why.startswith("no GPU: NVML unavailable") and "NVMLError_LibraryNotFound" in why
    assert "\n" not in why


def test_discover_without_pynvml_module(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    devices, why = discover_devices()
    assert devices == [] and "NVML unavailable" in why and "pynvml" in why


def test_standins_only_when_asked(monkeypatch):
    _no_nvml(monkeypatch)
    devices, why = discover_devices(standin=2, standin_mem_gb=8.0)
    assert [d.index for d in devices] == [0, 1]
    assert [d.name for d in devices] == ["cpu-standin-0", "cpu-standin-1"]
    assert all(d.mem_gb == 8.0 and d.torch_device == "cpu" and d.nvml_index is None
               and d.visible_id == "" and d.standin for d in devices)
    assert "NVML" in why and "2 CPU stand-in devices" in why
    assert command_env(devices[1]) == {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": ""}


def test_discover_maps_nvml_devices(monkeypatch):
    nv = FakeNvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices, why = discover_devices(standin=3)  # real GPUs win over stand-ins
    assert why == ""
    assert [(d.index, d.nvml_index, d.torch_device) for d in devices] == [
        (0, 0, "cuda:0"), (1, 1, "cuda:1"), (2, 2, "cuda:2"), (3, 3, "cuda:3")]
    assert devices[0].name == "NVIDIA H100 80GB HBM3" and devices[2].name == "NVIDIA H200"
    assert devices[0].mem_gb == pytest.approx(80.0) and devices[3].mem_gb == pytest.approx(140)
    assert devices[2].visible_id == "GPU-cccc2222-2222"
    assert command_env(devices[2]) == {"CUDA_VISIBLE_DEVICES": "GPU-cccc2222-2222",
                                       "NVIDIA_VISIBLE_DEVICES": "GPU-cccc2222-2222"}
    assert (nv.inits, nv.shutdowns) == (1, 1)


@pytest.mark.parametrize("env, nvml", [
    ("2,0", [2, 0]),
    (" 3, 1gpu", [3, 1]),  # read like strtoul
    ("GPU-cccc3333,GPU-aaaa", [3, 0]),  # unique UUID prefixes
    ("GPU-bbbb1111-1111,2", [1]),  # a list of UUIDs ends at the first non-UUID
    ("GPU-cccc,GPU-aaaa", []),  # ambiguous prefix: invalid, so none
    ("1,7,2", [1]),  # the first invalid entry ends the list
    ("1,GPU-aaaa,2", [1]),
    ("3,-1,0", [3]),
])
def test_discover_follows_cuda_visible_devices(monkeypatch, env, nvml):
    FakeNvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    devices, why = discover_devices()
    assert why == ("" if nvml else f"no GPU: CUDA_VISIBLE_DEVICES={env!r} shows none of the "
                   "4 GPUs")
    assert [d.nvml_index for d in devices] == nvml
    assert [d.index for d in devices] == list(range(len(nvml)))
    assert [d.torch_device for d in devices] == [f"cuda:{k}" for k in range(len(nvml))]


def test_discover_cuda_visible_devices_shows_none(monkeypatch):
    FakeNvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    devices, why = discover_devices()
    assert devices == [] and why.startswith("no GPU: CUDA_VISIBLE_DEVICES=''")
    devices, why = discover_devices(standin=1)
    assert [d.name for d in devices] == ["cpu-standin-0"] and "1 CPU stand-in device" in why
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,2")
    assert discover_devices() == ([], "no GPU: CUDA_VISIBLE_DEVICES='2,0,2' repeats GPU 2 "
                                  "(CUDA then shows none)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    assert discover_devices()[1].endswith("names MIG instances (not supported)")


def test_discover_leaves_out_a_broken_gpu(monkeypatch):
    FakeNvml(monkeypatch, broken=(1,))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices, why = discover_devices()
    assert why == ""
    # indices stay dense; torch numbering still counts the broken GPU
    assert [(d.index, d.nvml_index, d.torch_device) for d in devices] == [
        (0, 0, "cuda:0"), (1, 2, "cuda:2"), (2, 3, "cuda:3")]


def test_sampler_reads_nvml_and_shares_init(monkeypatch):
    nv = FakeNvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    devices, _ = discover_devices()
    assert (nv.inits, nv.shutdowns) == (1, 1)
    a = GpuSampler(devices)
    b = GpuSampler(devices[:1])
    assert nv.inits == 2  # one real init for both samplers
    assert a.sample() == [(1.0, pytest.approx(70.0)), (0.37, pytest.approx(10.0))]
    a.close()
    a.close()
    assert nv.shutdowns == 1  # b still holds NVML
    assert b.sample() == [(1.0, pytest.approx(70.0))]
    with b:
        pass
    assert (nv.inits, nv.shutdowns) == (2, 2)
    nv.broken.add(2)  # a GPU lost mid-run: nan for it, no exception
    with GpuSampler(devices) as c:
        (u0, m0), (u1, m1) = c.sample()
    assert u0 != u0 and m0 != m0 and (u1, m1) == (0.37, pytest.approx(10.0))
    assert nv.inits == nv.shutdowns == 3


def test_sampler_on_standins_needs_no_nvml(monkeypatch):
    _no_nvml(monkeypatch)
    devices, _ = discover_devices(standin=2)
    with GpuSampler(devices) as s:
        assert s.sample() == [(0.0, 0.0), (0.0, 0.0)]


# ---------------------------------------------------------------- service host


class FakeModule:
    """Records where it is (like a module's parameters)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device = "cpu"
        self.moves: list[str] = []

    def to(self, where: str) -> FakeModule:
        self.device = where
        self.moves.append(where)
        return self


def fake_service(name: str, mem_gb: float, loads: dict[str, int], *, restore_s=1.0,
                 infer=None) -> LiveService:
    def load():
        loads[name] = loads.get(name, 0) + 1
        return FakeModule(name)

    def echo(m, payloads):
        assert m.device != "cpu" or m.name == "cpu-ok"
        return [(m.name, p) for p in payloads]

    return LiveService(ServiceSpec(mem_gb=mem_gb, restore_s=restore_s, max_batch=4),
                       load, infer or echo)


def fake_devices(n: int) -> list[LiveDevice]:
    # The host only needs a distinct torch device per GPU; FakeModule never touches torch.
    return [LiveDevice(i, f"fake-{i}", 10.0, f"fake:{i}", i, f"GPU-{i}") for i in range(n)]


async def test_host_mirrors_gpu_pool_residency():
    loads: dict[str, int] = {}
    host = ServiceHost(fake_devices(1))
    for name, mem in (("a", 6.0), ("b", 6.0), ("c", 3.0)):  # a and b never fit together
        host.register(name, fake_service(name, mem, loads))
    pool = GpuPool(n_devices=1, mem_gb=10.0, services=host.specs)
    dev = host.devices[0]

    expect = [  # service, resident after, restored, evicted
        ("a", {"a"}, True, []),
        ("c", {"a", "c"}, True, []),
        ("a", {"a", "c"}, False, []),
        ("b", {"b"}, True, ["a", "c"]),  # evicts c (LRU) then a
        ("a", {"a"}, True, ["b"]),  # restored from host memory: no second load
        ("a", {"a"}, False, []),
    ]
    for t, (svc, resident, restored, evicted) in enumerate(expect):
        paid = pool.make_resident(svc, 0, float(t))
        assert set(pool.devices[0].resident) == resident
        out = await host.run_batch(svc, dev, pool.devices[0].resident, [t, "x"])
        assert out.ok, out.reason
        assert out.value == [(svc, t), (svc, "x")]
        assert out.detail["restored"] is restored is (paid > 0)
        assert out.detail["evicted"] == evicted
        assert out.detail["batch"] == 2 and out.detail["device"] == 0
        assert (out.detail["restore_s"] > 0) is restored
        assert host.resident(dev) == resident
        for s in resident:
            assert host.module(s, dev).device == "fake:0"
    assert loads == {"a": 1, "b": 1, "c": 1}  # load() once per service, ever
    assert (host.restores, host.evictions) == (pool.restores, pool.evictions) == (4, 3)
    # evicted copies went back to host memory, and were restored from there
    a = host.module("a", dev)
    assert a.moves == ["fake:0", "cpu", "fake:0"]
    assert host._free["b"][0].device == "cpu" and host._free["c"][0].device == "cpu"
    assert host.mem_used_gb(dev) == 6.0  # spec size (not a torch module)


async def test_host_places_a_copy_per_device():
    loads: dict[str, int] = {}
    host = ServiceHost(fake_devices(2))
    host.register("a", fake_service("a", 4.0, loads))

    def load_double():  # a plain callable: no .to, so every device shares it
        loads["shared"] = loads.get("shared", 0) + 1
        return lambda p: p * 2

    host.register("shared", LiveService(ServiceSpec(1.0, 0.1), load_double,
                                        lambda f, ps: [f(p) for p in ps]))
    d0, d1 = host.devices

    for d in (d0, d1, d0):
        out = await host.run_batch("a", d, {"a"}, [1])
        assert out.ok and out.value == [("a", 1)]
        out = await host.run_batch("shared", d, {"a", "shared"}, [1, 2])
        assert out.ok and out.value == [2, 4]
    assert host.module("a", d0) is not host.module("a", d1)
    assert host.module("a", d0).device == "fake:0" and host.module("a", d1).device == "fake:1"
    assert host.module("shared", d0) is host.module("shared", d1)  # no .to: one object
    assert loads == {"a": 2, "shared": 1}


async def test_infer_error_is_a_failed_outcome():
    def boom(m, payloads):
        raise ValueError("bad input\nsecond line")

    host = ServiceHost(fake_devices(1))
    host.register("a", fake_service("a", 1.0, {}, infer=boom))
    out = await host.run_batch("a", host.devices[0], {"a"}, [1, 2])
    assert not out.ok
    assert out.reason == "service a failed: ValueError: bad input second line"
    assert host.resident(host.devices[0]) == {"a"}  # restored all the same
    assert not host.busy(host.devices[0])


async def test_wrong_result_count_fails():
    host = ServiceHost(fake_devices(1))
    host.register("a", fake_service("a", 1.0, {}, infer=lambda m, ps: ps[:1]))
    out = await host.run_batch("a", host.devices[0], {"a"}, [1, 2, 3])
    assert not out.ok and out.reason == "service a failed: returned 1 results for 3 payloads"
    host.register("b", fake_service("b", 1.0, {}, infer=lambda m, ps: 42))
    out = await host.run_batch("b", host.devices[0], {"a", "b"}, [1])
    assert not out.ok and out.reason.startswith("service b failed: TypeError:")


async def test_load_error_is_a_failed_outcome():
    def load():
        raise OSError("weights not found")

    host = ServiceHost(fake_devices(1))
    host.register("a", LiveService(ServiceSpec(1.0, 1.0), load, lambda m, ps: ps))
    out = await host.run_batch("a", host.devices[0], {"a"}, [1])
    assert not out.ok
    assert out.reason == "service a failed to restore on device 0: OSError: weights not found"
    assert host.resident(host.devices[0]) == set()


async def test_unknown_service_and_duplicates():
    host = ServiceHost(fake_devices(1))
    out = await host.run_batch("x", host.devices[0], set(), [1])
    assert out == type(out)(ok=False, reason="unknown service 'x' (registered: none)")
    host.register("b", fake_service("b", 1.0, {}))
    host.register("a", fake_service("a", 1.0, {}))
    out = await host.run_batch("x", host.devices[0], {"x"}, [1])
    assert not out.ok and out.reason == "unknown service 'x' (registered: a, b)"
    with pytest.raises(ValueError, match="already registered"):
        host.register("a", fake_service("a", 1.0, {}))
    assert set(host.specs) == {"a", "b"} and host.specs["a"].max_batch == 4
    with pytest.raises(ValueError, match="has index 1; expected 0"):
        ServiceHost([fake_devices(2)[1]])


async def test_batches_run_off_the_loop_one_per_device():
    gate = threading.Event()
    seen: dict[str, int] = {}

    def slow(m, payloads):
        seen["thread"] = threading.get_ident()
        assert gate.wait(5.0)
        return payloads

    host = ServiceHost(fake_devices(2))
    host.register("a", fake_service("a", 1.0, {}, infer=slow))
    host.register("b", fake_service("b", 1.0, {}))
    d0, d1 = host.devices

    first = asyncio.create_task(host.run_batch("a", d0, {"a"}, [1]))
    await asyncio.sleep(0.05)  # the loop runs while infer blocks its thread
    assert host.busy(d0) and not host.busy(d1)
    with pytest.raises(RuntimeError, match="already running"):
        await host.run_batch("b", d0, {"a", "b"}, [1])
    other = await host.run_batch("b", d1, {"b"}, [7])  # another device is free
    assert other.ok and other.value == [("b", 7)]
    first.cancel()  # the action timed out: the thread still runs, the device stays busy
    await asyncio.sleep(0.05)
    assert first.cancelled() and host.busy(d0)
    gate.set()
    for _ in range(200):
        if not host.busy(d0):
            break
        await asyncio.sleep(0.01)
    assert not host.busy(d0)
    again = await host.run_batch("a", d0, {"a"}, [2])
    assert again.ok and again.value == [2] and not again.detail["restored"]
    assert seen["thread"] != threading.get_ident()


# ---------------------------------------------------------------- torch example service


async def test_linear_scorer_on_standin(monkeypatch):
    torch = pytest.importorskip("torch", reason="the example scorer is a torch module")

    _no_nvml(monkeypatch)
    devices, _ = discover_devices(standin=1)
    host = ServiceHost(devices)
    host.register("rm", linear_scorer(dim=8, seed=3))
    dev = devices[0]
    payloads = [[1.0] * 8, [0.5, -2.0], [], list(range(8))]
    out = await host.run_batch("rm", dev, {"rm"}, payloads)
    assert out.ok, out.reason
    ref = linear_scorer(dim=8, seed=3).load()  # same seed, same weights
    w, b = ref.weight.detach()[0].tolist(), float(ref.bias.detach())
    for got, p in zip(out.value, payloads, strict=True):
        assert isinstance(got, float)
        direct = sum(wi * xi for wi, xi in zip(w, p, strict=False)) + b  # zero-padded
        assert got == pytest.approx(direct, abs=1e-5)
    module = host.module("rm", dev)
    assert isinstance(module, torch.nn.Linear)
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    assert linear_scorer(dim=8, seed=4).load().weight.tolist() != ref.weight.tolist()
    with GpuSampler(devices, host) as s:
        ((util, used),) = s.sample()
    assert util == 0.0 and used == pytest.approx((8 + 1) * 4 / GIB)
    # too long a payload fails the batch, not the caller
    bad = await host.run_batch("rm", dev, {"rm"}, [[0.0] * 9])
    assert not bad.ok and bad.reason == "service rm failed: ValueError: payload 0 has 9 values; " \
        "at most 8"


async def test_infer_runs_under_inference_mode():
    torch = pytest.importorskip("torch")

    modes = []

    def infer(m, payloads):
        modes.append(torch.is_inference_mode_enabled())
        return payloads

    host = ServiceHost(fake_devices(1))
    host.register("a", fake_service("a", 1.0, {}, infer=infer))
    assert (await host.run_batch("a", host.devices[0], {"a"}, [1])).ok
    assert modes == [True] and not torch.is_inference_mode_enabled()
