"""A gpu command's device nodes: its sandbox binds its GPU's ``/dev/nvidia<minor>``
and the driver's control nodes, no other GPU's; a cpu command of the same trajectory
sees none of them; both share the trajectory's workspace; the GPU's sandbox ends with
the trajectory's.

No GPU here: the ``/dev`` the nodes are found in is a temporary directory holding real
character devices (``/dev/null``'s and ``/dev/zero``'s numbers under NVIDIA's names),
bound by real bwrap sandboxes.
"""

from __future__ import annotations

import asyncio
import os
import stat

import psutil
import pytest
from sandbox_helpers import run_in

from metasched.runtime.gpu import device_minor
from metasched.runtime.sandbox.config import SandboxConfig
from metasched.runtime.sandbox.devices import gpu_nodes
from metasched.runtime.sandbox.manager import Sandboxes

NULL, ZERO = os.stat("/dev/null").st_rdev, os.stat("/dev/zero").st_rdev


def make_dev(root, nodes: dict[str, int]):
    """Character devices ``name -> rdev`` under ``root``, readable and writable by all
    (as the driver's are)."""
    root.mkdir(exist_ok=True)
    for name, rdev in nodes.items():
        os.mknod(root / name, 0o666 | stat.S_IFCHR, rdev)
        os.chmod(root / name, 0o666)
    return root


@pytest.fixture
def dev(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making device nodes needs root")
    return make_dev(tmp_path / "dev", {"nvidiactl": NULL, "nvidia0": ZERO, "nvidia1": NULL})


@pytest.mark.parametrize(("nodes", "minor", "found"), [
    ({"nvidiactl": NULL, "nvidia0": ZERO, "nvidia1": NULL}, 0, ["nvidiactl", "nvidia0"]),
    ({"nvidiactl": NULL, "nvidia0": ZERO, "nvidia1": NULL}, 1, ["nvidiactl", "nvidia1"]),
    ({"nvidiactl": NULL, "nvidia-uvm": NULL, "nvidia-uvm-tools": NULL,
      "nvidia-modeset": NULL, "nvidia3": ZERO}, 3,
     ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia3"]),
    ({"nvidiactl": NULL, "nvidia0": ZERO}, 1, []),  # no such GPU: nothing to bind
    ({}, 0, []),  # no NVIDIA driver (this machine's /dev)
])
def test_gpu_nodes_are_the_control_nodes_and_the_gpus_own(tmp_path, nodes, minor, found):
    if os.geteuid() != 0:
        pytest.skip("making device nodes needs root")
    root = make_dev(tmp_path / "dev", nodes)
    (root / "nvidia7").write_text("a regular file is not a device")
    assert gpu_nodes(minor, str(root)) == found
    assert gpu_nodes(7, str(root)) == []


def test_device_minor_of_a_standin_is_none_and_nvml_failure_is_an_error():
    assert device_minor(None) is None
    with pytest.raises(OSError, match="GPU 0's device node: NVML"):
        device_minor(0)  # no NVIDIA driver here: NVML cannot say, and nothing is guessed


@pytest.fixture
def sandbox_dev_root(dev) -> str:
    """``sandboxes`` with the fake device nodes of ``dev``."""
    return str(dev)


# What a command sees of the NVIDIA nodes: each opened for reading and writing, as CUDA
# opens them ("refused": there but not openable, e.g. on a nodev mount).
PROBE = ("for n in nvidiactl nvidia0 nvidia1; do "
         "if [ ! -e /dev/$n ]; then echo \"$n absent\"; "
         "elif ( exec 3<>/dev/$n ) 2>/dev/null; then echo \"$n open\"; "
         "else echo \"$n refused\"; fi; done")


def bwraps(sandboxes: Sandboxes) -> int:
    """bwrap processes the sandbox server holds (one per open sandbox)."""
    server = psutil.Process(sandboxes.server.pid)
    return sum(1 for p in server.children() if p.name() == "bwrap")


def slot_dirs(sandboxes: Sandboxes) -> list[str]:
    return sorted(e.name for d in sandboxes.tree.directories() for e in os.scandir(d)
                  if e.is_dir()) if sandboxes.tree is not None else []


async def test_a_gpu_command_sees_its_gpu_alone_and_its_trajectorys_workspace(sandboxes, dev):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    await sb.ready
    wrote = await run_in(sandboxes, sb, ["sh", "-c", "echo from-cpu > note; echo t > /tmp/t"])
    g0 = sandboxes.gpu_sandbox(sb, 0)
    assert sandboxes.gpu_sandbox(sb, 0) is g0 and g0 is not sb  # one per (sandbox, GPU)
    g1 = sandboxes.gpu_sandbox(sb, 1)
    gpu = await run_in(sandboxes, g0, ["sh", "-c", PROBE + "; cat note /tmp/t; "
                                   "echo from-gpu > back; id -u; pwd"])
    other = await run_in(sandboxes, g1, ["sh", "-c", PROBE])
    cpu = await run_in(sandboxes, sb, ["sh", "-c", PROBE + "; cat back; id -u"])
    open_boxes, used, slots = bwraps(sandboxes), set(sandboxes.uids._used), slot_dirs(sandboxes)
    sandboxes.close_trajectory("t1")
    await asyncio.sleep(0.3)  # the sandboxes' processes exit
    left = bwraps(sandboxes)
    assert wrote.code == 0 and gpu.code == 0 and cpu.code == 0, (gpu.stderr, cpu.stderr)
    assert gpu.stdout.split("\n")[:3] == ["nvidiactl open", "nvidia0 open", "nvidia1 absent"]
    assert gpu.stdout.split("\n")[3:7] == ["from-cpu", "t", str(sb.uid), "/workspace"]
    assert other.stdout.split("\n")[:3] == ["nvidiactl open", "nvidia0 absent",
                                            "nvidia1 open"]
    assert cpu.stdout.split("\n")[:5] == ["nvidiactl absent", "nvidia0 absent",
                                          "nvidia1 absent", "from-gpu", str(sb.uid)]
    assert open_boxes == 3 and left == 0  # the trajectory's and its two GPUs'
    assert sb.closed and g0.closed and g1.closed and not sb.gpus
    assert used == {sb.uid} and not sandboxes.uids._used  # the GPUs' run as the trajectory
    assert bool(slots) == (sandboxes.tree is not None)  # the commands' cgroup slots...
    assert slot_dirs(sandboxes) == []  # ...removed with their sandboxes


async def test_without_a_device_node_a_gpu_command_runs_in_its_own_sandbox(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    await sb.ready
    standin, missing = sandboxes.gpu_sandbox(sb, None), sandboxes.gpu_sandbox(sb, 5)
    assert standin is sb and missing is sb and not sb.gpus


async def test_trajectory_less_gpu_commands_get_private_workspaces_and_their_gpu(sandboxes):
    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.shared(network=False)
    await sb.ready
    g = sandboxes.gpu_sandbox(sb, 1)
    a = await run_in(sandboxes, g, ["sh", "-c", PROBE + "; echo a > mine; id -u"])
    b = await run_in(sandboxes, g, ["sh", "-c", "ls -A /workspace; id -u"])
    assert a.code == 0 and b.code == 0, (a.stderr, b.stderr)
    assert a.stdout.split("\n")[:3] == ["nvidiactl open", "nvidia0 absent", "nvidia1 open"]
    assert "mine" not in b.stdout
    assert a.stdout.split()[-1] != b.stdout.split()[-1]  # a user id each


@pytest.mark.isolation
async def test_the_dispatcher_runs_a_trajectorys_gpu_command_with_its_gpu_alone(dev, monkeypatch):
    """Through the dispatcher: a gpu request granted device 0 (NVML index 0, minor 0)
    sees ``/dev/nvidia0`` and the control node, not ``/dev/nvidia1``; the cpu commands
    of its trajectory see none of them; all share the workspace; when the trajectory
    closes, its GPU's sandbox goes with it (no bwrap, cgroup slot or run-directory entry
    left). NVML is the one thing not here: the device says it is NVML's GPU 0, whose
    minor number (what NVML would say) is 0."""
    from metasched.runtime.dispatch import Dispatcher, DispatcherConfig
    from metasched.runtime.dispatch import local as local_mod
    from metasched.runtime.gpu import GpuSampler, LiveDevice
    from metasched.runtime.gpu import devices as gpu_mod
    from metasched.runtime.sandbox import devices as devices_mod

    device = LiveDevice(0, "test GPU", 16.0, "cpu", 0, "GPU-00000000-test")
    monkeypatch.setattr(devices_mod, "DEV_ROOT", str(dev))
    monkeypatch.setattr(local_mod, "discover_devices", lambda **_: ([device], ""))
    monkeypatch.setattr(gpu_mod, "_minors", {0: 0})
    monkeypatch.setattr(local_mod, "GpuSampler", lambda devices, host: GpuSampler(
        [LiveDevice(d.index, d.name, d.mem_gb, d.torch_device, None, "") for d in devices],
        host))
    config = DispatcherConfig(scheduler="elastic_greedy",
                              sandbox=SandboxConfig(isolation="bwrap"))

    def cmd(kind, script, turn):
        return {"kind": kind, "argv": ["sh", "-c", script], "timeout_s": 30,
                "trajectory": "t1", "turn": turn}

    async with Dispatcher(config) as d:
        before = sorted(os.listdir(d.backend.run_dir.path)), bwraps(d.sandboxes)
        first = await d.submit(cmd("cpu", PROBE + "; echo from-cpu > note", 0))
        gpu = await d.submit(cmd("gpu", PROBE + "; cat note; echo $CUDA_VISIBLE_DEVICES;"
                                 " echo from-gpu > back", 1))
        last = await d.submit(cmd("cpu", PROBE + "; cat back", 2))
        during = bwraps(d.sandboxes)
        d.close_trajectory("t1")
        await asyncio.sleep(0.3)  # the sandboxes' processes exit
        after = sorted(os.listdir(d.backend.run_dir.path)), bwraps(d.sandboxes)
        slots = slot_dirs(d.sandboxes)
    assert first.ok and gpu.ok and last.ok, (first.reason, gpu.reason, gpu.stderr)
    assert gpu.allocation["device"] == 0
    assert gpu.stdout.split("\n")[:5] == ["nvidiactl open", "nvidia0 open", "nvidia1 absent",
                                          "from-cpu", "GPU-00000000-test"]
    none = ["nvidiactl absent", "nvidia0 absent", "nvidia1 absent"]
    assert first.stdout.split("\n")[:3] == none
    assert last.stdout.split("\n")[:4] == [*none, "from-gpu"]
    assert during == before[1] + 2  # the trajectory's sandbox and its GPU's
    assert after == before and slots == []


@pytest.mark.isolation
async def test_a_ray_node_agent_runs_a_gpu_command_with_its_gpu_alone(dev, monkeypatch,
                                                                     tmp_path):
    """The node daemon's launch path (what a Ray node runs for a granted command, called
    here in this process: Ray's transport is not what is checked): a gpu command's spec
    names its GPU's NVML index, and the daemon runs it in its trajectory's sandbox for
    that GPU; the trajectory's cpu command sees no GPU node; both share the workspace;
    closing the trajectory ends both sandboxes."""
    pytest.importorskip("ray")
    import pickle

    from metasched.runtime.backend import CommandSpec
    from metasched.runtime.gpu import devices as gpu_mod
    from metasched.runtime.ray_backend.node_daemon import BoxSpec, NodeDaemon, pack
    from metasched.runtime.sandbox import devices as devices_mod

    monkeypatch.setattr(devices_mod, "DEV_ROOT", str(dev))
    monkeypatch.setattr(gpu_mod, "_minors", {3: 1})  # NVML's GPU 3 is /dev/nvidia1
    box = BoxSpec("t1", network=False, size_mb=64)

    def spec(script, gpu=None):
        return CommandSpec(("sh", "-c", script), 30.0, {"PATH": "/usr/bin:/bin"}, gpu=gpu)

    daemon = NodeDaemon(SandboxConfig(isolation="bwrap"), [], str(tmp_path))
    try:
        cpu = pickle.loads(await daemon.run(pack(spec(PROBE + "; echo c > note"), [0], box)))
        gpu = pickle.loads(await daemon.run(pack(spec(PROBE + "; cat note", gpu=3), [0],
                                                box)))
        during = bwraps(daemon.sandboxes)
        daemon.close_trajectory("t1")
        await asyncio.sleep(0.3)
        after = bwraps(daemon.sandboxes)
    finally:
        daemon.close()
    assert cpu.ok and gpu.ok, (cpu.reason, gpu.reason)
    assert cpu.stdout.split("\n")[:3] == ["nvidiactl absent", "nvidia0 absent",
                                          "nvidia1 absent"]
    assert gpu.stdout.split("\n")[:4] == ["nvidiactl open", "nvidia0 absent", "nvidia1 open",
                                          "c"]
    assert during - after == 2


async def test_a_gpu_command_sees_the_pci_devices_and_a_cpu_command_does_not(sandboxes):
    if not os.path.isdir("/sys/bus/pci/devices") or not os.listdir("/sys/bus/pci/devices"):
        pytest.skip("no PCI device in /sys here")
    first = sorted(os.listdir("/sys/bus/pci/devices"))[0]
    probe = ["sh", "-c", f"cat /sys/bus/pci/devices/{first}/vendor || echo none; "
             "test -e /sys/class/net && echo net || echo no-net"]

    sandboxes.attach(asyncio.get_running_loop())
    sb = sandboxes.open("t1", size_mb=64, template=None, network=False)
    await sb.ready
    gpu = await run_in(sandboxes, sandboxes.gpu_sandbox(sb, 0), probe)
    cpu = await run_in(sandboxes, sb, probe)
    sandboxes.close_trajectory("t1")
    vendor = open(f"/sys/bus/pci/devices/{first}/vendor").read().strip()
    assert gpu.stdout.split() == [vendor, "no-net"], gpu.stderr
    assert cpu.stdout.split() == ["none", "no-net"]
