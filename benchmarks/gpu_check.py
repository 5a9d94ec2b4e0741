"""Device check for the live dispatcher's GPU side (``metasched.runtime.gpu``), to run on
a machine with a GPU, NVML and a CUDA build of torch. Prints each check and a summary
table; exits 1 if any check fails.

Checks, on the first visible GPU:

1. ``discover_devices`` finds at least one GPU with a name and memory, and torch (CUDA)
   numbers the devices the same way (count, name per ``torch_device``).
2. ``GpuSampler``: utilisation in [0, 1], memory used in [0, total]; used memory grows by
   the size of a 1 GiB allocation; utilisation rises under a matmul loop.
3. Eviction and restore: two services of S GiB each (real parameter tensors), a model
   ``GpuPool`` whose budget holds one of them, and a tiny one beside. Following the
   model, making the second resident evicts the first, and NVML's used memory drops
   by about S before the second is loaded; restoring the first takes it from host
   memory (no second ``load``), with its values intact; restore times are measured.
4. ``linear_scorer`` on the GPU gives the CPU's results within 1e-5.
5. ``command_env``: a child process given it sees exactly one GPU, this one (name and
   UUID); a stand-in's env shows it none.
6. A confined gpu command (a live ``Dispatcher`` with ``sandbox.isolation: bwrap``, a
   trajectory's gpu request with an argv) runs a CUDA op on its device: it sees one GPU
   (``torch.cuda.device_count() == 1``, ``torch.zeros(1).cuda()`` works), has
   ``/dev/nvidia<minor>`` of its GPU and no other GPU's node, and reads the file its
   trajectory's cpu command wrote; that cpu command sees no ``/dev/nvidia*`` at all.
   Needs root and bubblewrap, and a Python with CUDA torch that the sandbox's
   unprivileged users may run (every directory above it searchable by others); the
   failure says which of these is missing.

7. The OpenAI front door against a GPU vLLM (``--vllm-url``: a running server, started
   with ``--scheduling-policy priority --max-num-seqs M`` and passed ``--vllm-seqs M``;
   skipped without it): through a metasched-serve on 127.0.0.1, its p50 overhead over
   going direct (one-token answers, streamed and not, alternated) is at most 2 ms, and
   under contention (``4 M + 8`` lower trajectories first) a later, higher-priority
   trajectory's three turns end before all but ``4 M`` of them.

Without a GPU (no NVML, or none visible) it prints "SKIPPED: no GPU: ..." and exits 0.

    python benchmarks/gpu_check.py [--size-gb S]   # S: each big service (default: auto)
    python benchmarks/gpu_check.py --vllm-url http://127.0.0.1:8000 --vllm-model NAME \
        --vllm-seqs 4                              # and the front door on that vLLM
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import metasched  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metasched.core.pools import GpuPool, ServiceSpec
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

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    return bool(ok)


def summary() -> int:
    width = max(len(n) for n, _, _ in RESULTS)
    print("\n" + "-" * (width + 60))
    print(f"{'check':<{width}}  result  detail")
    print("-" * (width + 60))
    for name, ok, detail in RESULTS:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {detail}")
    print("-" * (width + 60))
    failed = sum(not ok for _, ok, _ in RESULTS)
    print(f"{len(RESULTS) - failed}/{len(RESULTS)} checks passed")
    return 1 if failed else 0


def big_service(fill: float, size_gb: float, spec: ServiceSpec, loads: dict, name: str,
                before_load: dict, sampler_box: list) -> LiveService:
    """A module holding ``size_gb`` GiB of float32 parameters, all equal to ``fill``."""
    import torch

    n = int(size_gb * GIB) // 4

    def load():
        if sampler_box:  # NVML's view just before this load (after any eviction)
            before_load[name] = sampler_box[0].sample()[0][1]
        loads[name] = loads.get(name, 0) + 1
        m = torch.nn.Module()
        m.big = torch.nn.Parameter(torch.empty(n).fill_(fill), requires_grad=False)
        return m

    def infer(m, payloads):
        lo, hi = float(m.big.min()), float(m.big.max())
        return [(lo, hi, m.big.device.type) for _ in payloads]

    return LiveService(spec, load, infer)


def busy_util(sampler: GpuSampler, device: str, seconds: float = 1.5) -> float:
    """Highest utilisation NVML reports while a matmul loop keeps ``device`` busy."""
    import torch

    stop = threading.Event()

    def spin():
        a = torch.randn(4096, 4096, device=device)
        while not stop.is_set():
            for _ in range(20):
                a = (a @ a).tanh_()
            torch.cuda.synchronize(device)

    t = threading.Thread(target=spin)
    t.start()
    peak, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)
        peak = max(peak, sampler.sample()[0][0])
    stop.set()
    t.join()
    return peak


# Run in the sandbox by a gpu command: the CUDA op, then which NVIDIA nodes it has.
CONFINED_GPU = (
    "import glob, torch\n"
    "print(torch.cuda.device_count(), torch.zeros(1).cuda().device)\n"
    "print(' '.join(sorted(glob.glob('/dev/nvidia*'))))\n"
    "print(open('note').read())")
CONFINED_CPU = "import glob; print(' '.join(sorted(glob.glob('/dev/nvidia*'))) or 'none')"


async def confined_gpu_command(devices: list[LiveDevice]) -> None:
    """Check 6: a gpu command in its sandbox runs a CUDA op on its device, and only it."""
    from metasched.errors import ConfigError
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.gpu import device_minor
    from metasched.runtime.sandbox.config import SandboxConfig
    from metasched.runtime.sandbox.uids import runnable_by_all

    name = "confined gpu command runs CUDA"
    if not runnable_by_all(sys.executable):
        check(name, False, f"the sandbox's users cannot run {sys.executable} (a directory "
              f"above it is closed to others); run from a Python every user may run")
        return
    minors = {d.nvml_index: device_minor(d.nvml_index) for d in devices}
    config = DispatcherConfig(scheduler="elastic_greedy",
                              sandbox=SandboxConfig(isolation="bwrap"))
    try:
        async with Dispatcher(config) as d:
            def req(kind: str, code: str, turn: int) -> dict:
                return {"kind": kind, "argv": [sys.executable, "-c", code], "turn": turn,
                        "timeout_s": 300, "trajectory": "gpu-check"}
            cpu = await d.submit(req("cpu", "open('note', 'w').write('from-cpu'); "
                                     + CONFINED_CPU, 0))
            gpu = await d.submit(req("gpu", CONFINED_GPU, 1))
    except ConfigError as e:
        check(name, False, f"cannot confine commands here: {e}")
        return
    if not gpu.ok:
        tail = (gpu.stderr or "").strip().splitlines()[-1:]
        said = f"; its stderr ends: {tail[0][-300:]}" if tail else ""
        check(name, False, f"the gpu command failed: {gpu.reason}{said}")
        return
    lines = (gpu.stdout.splitlines() + ["", "", ""])[:3]
    dev = devices[gpu.allocation["device"]]
    own = f"/dev/nvidia{minors[dev.nvml_index]}"
    others = {f"/dev/nvidia{m}" for i, m in minors.items() if i != dev.nvml_index}
    seen = set(lines[1].split())
    ok_cuda = lines[0] == "1 cuda:0"
    check(name, ok_cuda, f"device {dev.index} ({dev.name}): child printed {lines[0]!r} "
          f"(want '1 cuda:0')")
    check("confined gpu command sees its GPU alone", own in seen and not seen & others,
          f"/dev/nvidia* in its sandbox: {lines[1] or 'none'} (its own: {own})")
    check("confined gpu command shares the workspace", lines[2] == "from-cpu",
          f"read {lines[2]!r} from the file its trajectory's cpu command wrote")
    check("confined cpu command sees no GPU", cpu.ok and cpu.stdout.strip() == "none",
          f"{cpu.reason or 'ok'}; /dev/nvidia* in its sandbox: {cpu.stdout.strip()!r}")


def child_sees(env_add: dict[str, str]) -> tuple[int, str, str]:
    """(device count, name of device 0, uuid of device 0) seen by a child process."""
    code = ("import torch\nn = torch.cuda.device_count()\n"
            "p = torch.cuda.get_device_properties(0) if n else None\n"
            "print(n); print(p.name if p else ''); print(getattr(p, 'uuid', '') if p else '')")
    env = {**os.environ, **env_add}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"child exited {r.returncode}: {r.stderr.strip()[-300:]}")
    lines = (r.stdout.splitlines() + ["", "", ""])[:3]
    return int(lines[0]), lines[1], lines[2]


async def residency(host: ServiceHost, pool: GpuPool, dev: LiveDevice, sampler: GpuSampler,
                    size: float, loads: dict, before_load: dict) -> None:
    """Checks 3 and 4: batches granted in the order a scheduler might, each made resident
    in the model first (as ``ClusterState.start`` does), then run by the host."""
    import torch

    async def step(t: float, service: str, payloads: list) -> tuple:
        paid = pool.make_resident(service, 0, t)
        out = await host.run_batch(service, dev, pool.devices[0].resident, payloads)
        torch.cuda.synchronize(dev.torch_device)
        return paid, out, sampler.sample()[0][1]

    kind = torch.device(dev.torch_device).type  # "cuda"
    (_, base), = sampler.sample()
    paid, a1, used_a = await step(1.0, "big_a", [0, 1])
    check("restore big_a (first load)",
          a1.ok and paid > 0 and a1.detail["loaded"]
          and a1.value[0] == (1.0, 1.0, kind) and used_a - base >= 0.9 * size,
          f"{a1.reason or 'ok'}; restore {a1.detail.get('restore_s', 0):.2f} s, "
          f"used {base:.2f} -> {used_a:.2f} GiB")
    _, r1, _ = await step(2.0, "rm", [[0.0] * 64])
    check("tiny service beside big_a", r1.ok and not r1.detail["evicted"]
          and host.resident(dev) == {"big_a", "rm"},
          f"{r1.reason or 'ok'}; resident {sorted(host.resident(dev))}")
    _, b1, used_b = await step(3.0, "big_b", [0])
    after = before_load.get("big_b", float("nan"))
    drop = used_a - after
    check("evict big_a for big_b",
          b1.ok and b1.detail["evicted"] == ["big_a"] and drop >= 0.9 * size
          and b1.value[0] == (2.0, 2.0, kind)
          and host.resident(dev) == set(pool.devices[0].resident) == {"big_b", "rm"},
          f"{b1.reason or 'ok'}; NVML used {used_a:.2f} -> {after:.2f} GiB after eviction "
          f"(drop {drop:.2f}), {used_b:.2f} with big_b; evict {b1.detail.get('evict_s', 0):.2f} s")
    # big_a again: the model evicts rm (least recently used) and big_b
    paid, a2, _ = await step(4.0, "big_a", [0])
    restore_s = a2.detail.get("restore_s", 0.0)
    gbps = size / restore_s if a2.ok and restore_s else 0.0
    check("restore big_a from host memory",
          a2.ok and paid > 0 and not a2.detail["loaded"] and a2.detail["restored"]
          and loads == {"big_a": 1, "big_b": 1} and a2.value[0] == (1.0, 1.0, kind)
          and a2.detail["evicted"] == sorted(set(pool.services) - {"big_a"}),
          f"{a2.reason or 'ok'}; restore {restore_s:.2f} s ({gbps:.1f} GiB/s), "
          f"evicted {a2.detail.get('evicted')} in {a2.detail.get('evict_s', 0):.2f} s, "
          f"loads {loads}")

    # 4. linear_scorer GPU vs CPU (rm restored from host memory beside big_a)
    g = torch.Generator().manual_seed(1)
    payloads = [torch.randn(k, generator=g).tolist() for k in (64, 64, 10, 1, 64, 33, 0, 64)]
    _, out, _ = await step(5.0, "rm", payloads)
    svc = linear_scorer(dim=64, seed=0)
    with torch.inference_mode():
        ref = svc.infer(svc.load(), payloads)
    diff = max(abs(a - b) for a, b in zip(out.value, ref, strict=True)) if out.ok else 1.0
    on = {p.device.type for p in host.module("rm", dev).parameters()} if out.ok else set()
    check("linear_scorer GPU == CPU", out.ok and on == {kind} and diff <= 1e-5,
          f"{out.reason or 'ok'}; max |diff| {diff:.2e} over {len(payloads)} payloads")
    check("host matches model", host.resident(dev) == set(pool.devices[0].resident)
          and (host.restores, host.evictions) == (pool.restores, pool.evictions),
          f"resident {sorted(host.resident(dev))}, restores {host.restores}, "
          f"evictions {host.evictions}")


def door_on_vllm(url: str, model: str, seqs: int) -> None:
    """Check 7: the front door in front of the vLLM at ``url`` (see the docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import httpx
    from generation_door import contention, made_up_predictor, percentile, side_by_side

    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.serve import BackgroundServer, ServeConfig, create_app

    cfg = ServeConfig(languages=[], generation={"replicas": [url]})
    app = create_app(lambda: Dispatcher(DispatcherConfig(scheduler="elastic_greedy"),
                                        predictor=made_up_predictor()), cfg)
    with BackgroundServer(app) as srv, httpx.Client(timeout=120) as http:
        for stream in (True, False):
            direct, (door,), _ = side_by_side(http, url, [srv.url], model, 1, stream, 200,
                                              20)
            extra = percentile(door, 0.5) - percentile(direct, 0.5)
            check(f"door overhead ({'streamed' if stream else 'whole'})", extra <= 2.0,
                  f"p50 {percentile(direct, 0.5):.2f} ms direct, {percentile(door, 0.5):.2f} "
                  f"ms through the door: +{extra:.2f} ms (load {os.getloadavg()[0]:.1f})")
        low = 4 * seqs + 8
        lows, hi = asyncio.run(contention(srv.url, model, low))
        before = sum(x > hi[-1] for x in lows)
        check("door priority under contention", before >= low - 4 * seqs,
              f"{before} of {low} earlier lower turns still running when the higher "
              f"trajectory's 3 turns were done ({hi[-1]:.2f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.0,
                    help="each big service's size, GiB (default: min(8, 20%% of free GPU "
                         "memory, 15%% of available host memory))")
    ap.add_argument("--vllm-url", default=None,
                    help="a running vLLM (--scheduling-policy priority) to check the door on")
    ap.add_argument("--vllm-model", default=None, help="its model's name")
    ap.add_argument("--vllm-seqs", type=int, default=4, help="its --max-num-seqs")
    args = ap.parse_args()

    # 1. discovery --------------------------------------------------------------
    devices, why = discover_devices()
    if not devices:
        print(f"SKIPPED: {why} (the GPU checks need NVML and a GPU; nothing was checked)")
        return 0
    for d in devices:
        print(f"  device {d.index}: {d.name}, {d.mem_gb:.1f} GiB, {d.torch_device}, "
              f"nvml {d.nvml_index}, {d.visible_id}")
    check("discover_devices", all(d.name and d.mem_gb > 0 for d in devices),
          f"{len(devices)} GPU(s); first: {devices[0].name}, {devices[0].mem_gb:.1f} GiB")
    import torch

    if not torch.cuda.is_available():
        check("torch CUDA", False, f"torch {torch.__version__} has no CUDA; cannot go on")
        return summary()
    names = [torch.cuda.get_device_name(d.torch_device) for d in devices]
    check("torch numbering", torch.cuda.device_count() == len(devices)
          and names == [d.name for d in devices],
          f"torch sees {torch.cuda.device_count()}: {names}")
    dev = devices[0]

    # 2. sampling ---------------------------------------------------------------
    loads: dict[str, int] = {}
    before_load: dict[str, float] = {}
    sampler_box: list[GpuSampler] = []
    host = ServiceHost([dev])
    with GpuSampler([dev], host) as sampler:
        sampler_box.append(sampler)
        torch.zeros(1, device=dev.torch_device)  # CUDA context first: it takes memory too
        torch.cuda.synchronize(dev.torch_device)
        (util0, used0), = sampler.sample()
        check("sampler sane", 0.0 <= util0 <= 1.0 and 0.0 <= used0 <= dev.mem_gb,
              f"util {util0:.2f}, used {used0:.2f} of {dev.mem_gb:.1f} GiB")
        x = torch.empty(int(GIB) // 4, device=dev.torch_device).fill_(1.0)
        torch.cuda.synchronize(dev.torch_device)
        (_, used1), = sampler.sample()
        del x
        torch.cuda.empty_cache()
        check("sampler sees 1 GiB", 0.9 <= used1 - used0 <= 1.5,
              f"used {used0:.2f} -> {used1:.2f} GiB")
        peak = busy_util(sampler, dev.torch_device)
        torch.cuda.empty_cache()
        check("sampler sees load", 0.1 < peak <= 1.0, f"peak utilisation {peak:.2f} under matmul")

        # 3. eviction and restore ----------------------------------------------------
        free_gpu = dev.mem_gb - sampler.sample()[0][1]
        try:
            import psutil

            host_avail = psutil.virtual_memory().available / GIB
        except ImportError:
            host_avail = 32.0
        size = args.size_gb or round(min(8.0, 0.2 * free_gpu, 0.15 * host_avail), 2)
        print(f"  big services: {size:.2f} GiB each (GPU free {free_gpu:.1f} GiB, "
              f"host available {host_avail:.1f} GiB)")
        big_spec = ServiceSpec(mem_gb=size, restore_s=1.0, max_batch=4)
        host.register("big_a", big_service(1.0, size, big_spec, loads, "big_a", before_load,
                                           sampler_box))
        host.register("big_b", big_service(2.0, size, big_spec, loads, "big_b", before_load,
                                           sampler_box))
        host.register("rm", linear_scorer(dim=64, seed=0))
        # the model's budget holds one big service (and the tiny scorer), not two
        pool = GpuPool(n_devices=1, mem_gb=1.5 * size, services=host.specs)

        asyncio.run(residency(host, pool, dev, sampler, size, loads, before_load))
    del host, pool
    torch.cuda.empty_cache()

    # 5. command_env ------------------------------------------------------------------
    for d in devices if len(devices) <= 2 else [devices[0], devices[-1]]:
        env = command_env(d)
        try:
            n, name, uuid = child_sees(env)
            bare = d.visible_id.lower().removeprefix("gpu-")
            same = name == d.name and (not uuid or uuid.lower().removeprefix("gpu-") == bare)
            check(f"command_env device {d.index}",
                  env["CUDA_VISIBLE_DEVICES"] == d.visible_id and n == 1 and same,
                  f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: child sees {n} "
                  f"({name}, {uuid or 'uuid n/a'})")
        except Exception as e:
            check(f"command_env device {d.index}", False, f"{type(e).__name__}: {e}")
    standin = LiveDevice(0, "cpu-standin-0", 16.0, "cpu", None, "")
    try:
        n, _, _ = child_sees(command_env(standin))
        check("command_env stand-in", n == 0, f"CUDA_VISIBLE_DEVICES='': child sees {n}")
    except Exception as e:
        check("command_env stand-in", False, f"{type(e).__name__}: {e}")

    # 6. a confined gpu command -------------------------------------------------------
    try:
        asyncio.run(confined_gpu_command(devices))
    except Exception as e:  # a check's failure, said as one
        check("confined gpu command runs CUDA", False, f"{type(e).__name__}: {e}")

    # 7. the OpenAI front door on a GPU vLLM ------------------------------------------
    if args.vllm_url:
        try:
            door_on_vllm(args.vllm_url.rstrip("/"), args.vllm_model or "", args.vllm_seqs)
        except Exception as e:
            check("door on vLLM", False, f"{type(e).__name__}: {e}")
    else:
        print("  door on vLLM: not checked (no --vllm-url)")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
