"""The dispatcher's functional tests on both backends: this machine (``local``) and a Ray
cluster (``ray``: the dispatcher as a named actor, commands as node-pinned tasks run by
each node's daemon, GPU services in GPU actors), through the same interface (``submit`` /
``accept`` / ``enqueue`` / ``stats``), durability included (journal, a killed
dispatcher, dedup by id), and sandboxes (bwrap sandboxes and cgroup slots: no network,
no writes outside the workspace, cores and memory held, a trajectory's workspace kept).

Ray runs here as one local node bound to 127.0.0.1, started once for the module (Ray
takes seconds to start) with 2 CPUs and one logical GPU (a CPU stand-in serves it).
Without the ``ray`` extra the ``ray`` cases skip, saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest
from helpers import COMMAND_PY, cpu, dispatcher_config

from metasched.core.pools import EndpointSpec
from metasched.errors import ConfigError
from metasched.runtime.dispatch import ACTION_ENV, Dispatcher, DispatcherConfig
from metasched.runtime.gpu import linear_scorer
from metasched.runtime.journal import Journal
from metasched.runtime.sandbox.config import SandboxConfig

# Ray resolves 127.0.0.1 to the machine's outward address (and binds its servers to every
# interface) unless clusters are off; with them off, every server it starts listens on
# 127.0.0.1 only. Read when ray is imported, so it is set before.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

PY = COMMAND_PY  # commands run as other users in sandboxes (locally): one they can run
RAY_CPUS = 2
BACKENDS = ["local", pytest.param("ray", marks=pytest.mark.ray)]


def cfg(**kw) -> DispatcherConfig:
    # Commands unconfined (cgroup slots only) unless a test asks for sandboxes: these
    # tests write gate files where a sandboxed command could not (see confined()).
    kw.setdefault("sandbox", SandboxConfig(isolation="none"))
    kw.setdefault("gpu_standin", 1)  # local; on Ray the cluster's logical GPU is a stand-in
    return dispatcher_config(**kw)


def confined(**kw) -> DispatcherConfig:
    """Settings whose commands run in bwrap sandboxes (a test using them needs bwrap)."""
    return cfg(sandbox=SandboxConfig(isolation="bwrap"), **kw)


@pytest.fixture(scope="module")
def ray_cluster(ray_cluster):
    """The session's local Ray (conftest: 2 CPUs, one logical GPU, bound to 127.0.0.1);
    the shared dispatcher actor is stopped when the module ends."""
    assert int(ray_cluster.cluster_resources()["CPU"]) == RAY_CPUS
    try:
        yield ray_cluster
    finally:
        RaySide().release_shared()


class LocalSide:
    """The dispatcher in this process."""

    name = "local"

    @asynccontextmanager
    async def dispatcher(self, config, services=None):
        async with Dispatcher(config, services=services) as d:
            yield d

    def node_cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    async def crash(self, d: Dispatcher) -> None:
        """Stop as a crash would: nothing more runs or is recorded, commands are left."""
        d.flush()
        d.loop.closed = True
        d.journal.close()

    async def restarted(self, d, config):
        return Dispatcher(config)


class RaySide:
    """The dispatcher as a named actor, reached through a handle.

    A test that asks for the default settings (``cfg()`` or ``confined()``: no journal,
    no services) shares one actor with the others that do (started when first needed, as
    a cluster's dispatcher serves many workers; each test connects its own handle): a
    dispatcher actor takes seconds to start. Tests of their own settings, journals and
    restarts get their own (the shared one is stopped first: each takes the cluster's
    GPU).
    """

    name = "ray"
    shared: str | None = None  # the shared actor's name, once started
    shared_config: DispatcherConfig | None = None  # its settings

    def __init__(self) -> None:
        from metasched.runtime.ray_backend import connect, start_dispatcher, stop_dispatcher

        self.start, self.stop, self.connect = start_dispatcher, stop_dispatcher, connect

    def release_shared(self) -> None:
        """Stop the shared actor: a dispatcher takes every GPU of the cluster, so another
        cannot start beside it."""
        if RaySide.shared is not None:
            self.stop(RaySide.shared, drain=False)
            RaySide.shared = RaySide.shared_config = None

    def shared_name(self, config: DispatcherConfig) -> str:
        """The shared actor's name, with ``config`` (started by the first test that
        needs it; one of other settings is stopped first)."""
        if RaySide.shared_config != config:
            self.release_shared()
        if RaySide.shared is None:
            name = f"test-shared-{uuid.uuid4().hex[:8]}"
            self.start(config, name=name)
            RaySide.shared, RaySide.shared_config = name, config
        return RaySide.shared

    @asynccontextmanager
    async def dispatcher(self, config, services=None):
        if config in (cfg(), confined()) and not services:
            handle = self.connect(await asyncio.to_thread(self.shared_name, config))
            try:
                yield handle
            finally:
                await handle.aclose()
            return
        await asyncio.to_thread(self.release_shared)
        name = f"test-{uuid.uuid4().hex[:8]}"
        handle = await asyncio.to_thread(self.start, config, name=name, services=services)
        try:
            yield handle
        finally:
            await handle.aclose()
            await asyncio.to_thread(self.stop, name, drain=False)

    def node_cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))[:RAY_CPUS]

    async def crash(self, handle) -> None:
        """kill -9 of the actor's process; Ray restarts it (the handle reconnects)."""
        pid = (await handle.astats())["actor_pid"]
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=BACKENDS)
def side(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        return RaySide()
    return LocalSide()


async def stats_of(d) -> dict:
    """A dispatcher's stats: read in place, or asked of the actor."""
    return await d.astats() if hasattr(d, "astats") else d.stats()


# ---------------------------------------------------------------------- actions


async def test_cpu_action_runs_pinned_to_its_grant(side):
    code = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"

    async with side.dispatcher(cfg()) as d:
        r = await d.submit(cpu(PY, "-c", code, id="a", max_cores=2,
                               parallel_fraction=0.95))
    assert r.status == "done" and r.id == "a" and r.exit_code == 0, r.reason
    cores, omp = r.stdout.rsplit(" ", 1)
    assert json.loads(cores) == sorted(r.allocation["cores"])
    assert int(omp) == len(r.allocation["cores"]) >= 1
    assert set(r.allocation["cores"]) <= set(side.node_cores())
    assert r.queued_at <= r.started_at <= r.finished_at


@pytest.mark.parametrize("req, reason", [
    (cpu(PY, "-c", "import sys; sys.exit(3)"), "exit code 3"),
    (cpu(PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"),
     "killed by SIGSEGV"),
    (cpu(PY, "-c", "import time; time.sleep(30)", timeout_s=0.5), "timeout after 0.5 s"),
    (cpu("/nonexistent/program"), "cannot start"),
])
async def test_faults_are_reported_and_the_next_action_runs(side, req, reason):
    async with side.dispatcher(cfg()) as d:
        before = await stats_of(d)
        bad = await d.submit(req)
        good = await d.submit(cpu(PY, "-c", "print(1)"))
        stats = await stats_of(d)
    assert bad.status == "failed" and reason in bad.reason, bad.reason
    assert good.ok and good.stdout.strip() == "1"
    assert stats["failed"] - before["failed"] == 1 and stats["running"] == 0


@pytest.mark.parametrize("req, reason", [
    ({"kind": "tpu", "timeout_s": 1}, "kind: must be one of"),
    (cpu("/bin/true", min_cores=64, max_cores=64), "64 cores asked, this dispatcher has"),
    (cpu("/bin/true", timeout_s=-1), "timeout_s: must be > 0"),
    ({"kind": "gpu", "service": "nope", "timeout_s": 1}, "unknown service 'nope'"),
    ({"kind": "api", "endpoint": "nope", "timeout_s": 1, "http": {"url": "http://127.0.0.1:9"}},
     "unknown endpoint 'nope'"),
])
async def test_bad_input_is_rejected_alone(side, req, reason):
    async with side.dispatcher(cfg()) as d:
        bad, good = await asyncio.gather(d.submit(req), d.submit(cpu("/bin/true")))
    assert bad.status == "rejected" and "\n" not in bad.reason
    assert reason in bad.reason, bad.reason
    assert good.ok


async def test_gpu_service_batches_on_its_device_and_scores_correctly(side):
    pytest.importorskip("torch", reason="the example scorer is a torch module")
    svc = linear_scorer(4, seed=1)
    payloads = [[1.0, 2.0], [0.5, 0.0, 1.0], [3.0], [0.0, 0.0, 0.0, 1.0]]

    async with side.dispatcher(cfg(), services={"scorer": svc}) as d:
        results = await asyncio.gather(*(d.submit({"kind": "gpu", "service": "scorer",
                                                   "payload": p, "timeout_s": 60})
                                         for p in payloads))
    want = svc.infer(svc.load(), payloads)
    assert [r.status for r in results] == ["done"] * 4, [r.reason for r in results]
    assert [r.value for r in results] == pytest.approx(want, abs=1e-6)
    assert all(r.allocation["device"] == 0 for r in results)


async def test_gpu_command_sees_only_its_device(side):
    code = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"

    async with side.dispatcher(cfg()) as d:
        r = await d.submit({"kind": "gpu", "argv": [PY, "-c", code], "timeout_s": 30})
    assert r.ok and r.stdout.strip() == "''", r  # a stand-in: no GPU visible


class _Counting(BaseHTTPRequestHandler):
    """Counts requests; answers 429 to the first two."""

    calls = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's naming
        with type(self).lock:
            type(self).calls += 1
            n = type(self).calls
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"n": n}).encode()
        self.send_response(429 if n <= 2 else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


async def test_api_call_is_retried_within_the_dispatchers_quota(side):
    """The dispatcher makes API calls itself (its ApiPool holds the quota for every
    caller of the cluster): 429s retried, each attempt charged."""
    from metasched.runtime.api_calls import RetryPolicy

    _Counting.calls = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/q"
    ep = {"e": EndpointSpec(rpm=6000, max_concurrency=2, window_s=1.0)}

    try:
        async with side.dispatcher(cfg(endpoints=ep, retry=RetryPolicy(4, 0.01, 0.05))) as d:
            r = await d.submit({"kind": "api", "endpoint": "e", "timeout_s": 20,
                                "http": {"url": url, "json": {"q": 1}}})
    finally:
        server.shutdown()
    assert r.ok and r.value == {"n": 3} and r.attempts == 3, r


async def test_an_id_runs_once_and_another_request_under_it_is_rejected(side, visible_dir):
    """While an id is known (accepted and unfinished; with a journal, ever), the same
    request under it gets its result and another request is rejected."""
    log = visible_dir / "runs"
    req = cpu("/bin/sh", "-c", f"echo x >> {log}; sleep 0.3", id="same")

    async with side.dispatcher(cfg()) as d:
        first, again, other = await asyncio.gather(d.submit(req), d.submit(dict(req)),
                                                   d.submit(dict(req, argv=["/bin/true"])))
    assert first.ok and again.ok and first.started_at == again.started_at
    assert log.read_text() == "x\n"  # ran once
    assert other.status == "rejected" and "accepted before with a different request" in \
        other.reason


async def test_enqueue_returns_once_durable_and_results_follow(side, tmp_path):
    db = tmp_path / "j.db"

    async with side.dispatcher(cfg(journal=db)) as d:
        fut = await d.enqueue(cpu("/bin/sleep", "0.2", id="e1"))
        with Journal(db, lock=False) as j:
            status = j.status("e1")
        bad = await d.enqueue({"kind": "tpu", "timeout_s": 1})
        bad, r = bad.result(), await fut
    assert status in ("queued", "running") and bad.status == "rejected" and r.ok


async def test_finished_ids_are_answered_from_the_journal_after_a_restart(side, tmp_path,
                                                                   visible_dir):
    db, log = tmp_path / "j.db", visible_dir / "runs"
    req = cpu("/bin/sh", "-c", f"echo x >> {log}", id="done-once")

    async def first():
        async with side.dispatcher(cfg(journal=db)) as d:
            return await d.submit(req)

    async def second():
        async with side.dispatcher(cfg(journal=db)) as d:
            return await d.submit(req), await d.submit(dict(req, argv=["/bin/true"]))
    a = await first()
    b, other = await second()
    assert a.ok and b.ok and b.finished_at == a.finished_at and log.read_text() == "x\n"
    assert other.status == "rejected"


@pytest.mark.ray
async def test_ray_results_come_on_a_direct_connection_and_survive_its_loss(ray_cluster):
    """A handle reads its results on its own connection to the dispatcher actor; when
    that connection is cut, it connects again, sends what was unanswered again under
    the same ids, and every result comes."""
    side = RaySide()
    async with side.dispatcher(cfg()) as handle:
        assert (await handle.submit(cpu("/bin/true"))).ok
        assert handle.results_via == "direct"
        futures = [handle.accept(cpu("/bin/sleep", "0.05", id=f"cut-{i}")) for i in range(20)]
        await asyncio.sleep(0.1)
        handle._direct.transport.abort()  # the connection is cut (as by the network)
        results = await asyncio.wait_for(asyncio.gather(*futures), 60)
        assert [r.id for r in results] == [f"cut-{i}" for i in range(20)]
        assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
        assert handle.results_via == "direct" and handle._direct is not None


# On Ray the same kill is checked, with commands handed ahead besides, by
# test_ray_a_killed_dispatcher_with_commands_handed_ahead_loses_nothing (the journal's
# answers after a restart by test_finished_ids_...): this Ray case is the slow one.
@pytest.mark.parametrize("side", ["local", pytest.param("ray", marks=pytest.mark.slow)],
                         indirect=True)
async def test_a_killed_dispatcher_loses_nothing_and_kills_what_it_left(side, tmp_path,
                                                                     visible_dir):
    """A command running when its dispatcher dies is killed by the next one on the same
    journal and run again (its id once more); what was queued runs; a finished id is
    answered from the journal, not run again."""
    db, gate, log = tmp_path / "j.db", visible_dir / "gate", visible_dir / "runs"
    wait = cpu("/bin/sh", "-c", f'echo $$ >> {log}; while [ ! -e {gate} ]; do sleep 0.05; done',
               id="long", timeout_s=120)
    quick = cpu("/bin/true", id="quick")

    def first_pids() -> list[int]:
        return [int(p) for p in log.read_text().split()] if log.exists() else []

    config = cfg(journal=db)
    async with side.dispatcher(config) as d:
        done = await d.submit(quick)
        long = d.accept(wait)
        for _ in range(400):  # until the command runs
            if first_pids():
                break
            await asyncio.sleep(0.025)
        (orphan,) = first_pids()
        await side.crash(d)
        if side.name == "local":  # a new dispatcher, and the workers resubmit
            d = await side.restarted(d, config)
            await d.start()
            long = d.accept(wait)
            again = d.accept(quick)
        else:  # Ray restarts the actor; the handle resubmits what was unanswered
            again = d.accept(quick)
        for _ in range(400):  # the orphan is killed, the command runs again
            if len(first_pids()) == 2 and not _alive(orphan):
                break
            await asyncio.sleep(0.025)
        gate.write_text("")
        out = await asyncio.wait_for(asyncio.gather(long, again), 60)
        if side.name == "local":
            await d.close()
        long, again = out
    assert not _alive(orphan)
    assert len(first_pids()) == 2  # the killed run, then the one that finished
    assert long.ok and long.attempts == 2, long
    assert again.ok and again.finished_at == done.finished_at  # from the journal
    with Journal(db) as j:
        assert j.counts() == {"queued": 0, "running": 0, "finished": 2}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------------- Ray only


async def test_ray_cluster_view_is_what_ray_reports(ray_cluster):
    from metasched.runtime.ray_backend import cluster_view

    nodes = await cluster_view()
    assert [n.name for n in nodes] == [n["NodeID"] for n in ray_cluster.nodes()]
    assert [len(n.cores) for n in nodes] == [RAY_CPUS]
    assert nodes[0].mem_gb == pytest.approx(psutil.virtual_memory().total / 1e9)
    with pytest.raises(ConfigError, match="cores_per_node: 3 exceeds"):
        await cluster_view(cores_per_node=3)


@pytest.mark.subprocess
def test_ray_dispatcher_is_found_by_name_from_another_process(ray_cluster, tmp_path):
    """A worker in another process (a Ray driver of its own) connects by name, submits
    through the sync handle, and its command runs as a task of the cluster."""
    name = RaySide().shared_name(cfg())
    worker = f"""
import json, os, ray
from metasched.runtime.ray_backend import connect
ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
with connect({name!r}).sync() as d:
    rs = d.map([{{"kind": "cpu", "argv": ["/bin/echo", str(i)], "timeout_s": 30}}
                for i in range(20)])
    print(json.dumps([[r.status, r.stdout.strip(), r.allocation["node"]] for r in rs]))
"""
    import subprocess

    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    node = ray_cluster.nodes()[0]["NodeID"]
    assert rows == [["done", str(i), node] for i in range(20)]


def test_ray_connect_to_a_missing_dispatcher_is_one_line(ray_cluster):
    from metasched.runtime.ray_backend import connect

    with pytest.raises(ConfigError, match="no dispatcher 'nobody' runs on this Ray cluster"):
        connect("nobody")


async def test_ray_commands_hold_their_cores_in_rays_accounting(ray_cluster):
    """While a 2-core command runs, Ray counts the node's 2 CPUs as taken."""
    async with RaySide().dispatcher(cfg()) as d:
        fut = d.accept(cpu("/bin/sleep", "1.5", min_cores=2, max_cores=2))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if ray_cluster.available_resources().get("CPU", 0.0) == 0:
                break
        during = ray_cluster.available_resources().get("CPU", 0.0)
        r = await fut
    assert r.ok and len(r.allocation["cores"]) == 2 and during == 0.0


def test_ray_agent_submission_holds_the_dispatchers_cores_while_it_runs(ray_cluster):
    """submit="daemon": commands are calls to the node's daemon (no task each), and the
    daemon holds the dispatcher's cores in Ray's accounting until the dispatcher stops."""
    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher

    RaySide().release_shared()
    name = f"test-{uuid.uuid4().hex[:8]}"
    handle = start_dispatcher(cfg(), name=name, submit="daemon")
    try:
        with handle.sync() as d:
            r = d.submit(cpu(PY, "-c", "import os; print(len(os.sched_getaffinity(0)))",
                             min_cores=2, max_cores=2))
        during = ray_cluster.available_resources().get("CPU", 0.0)
    finally:
        stop_dispatcher(name)
    for _ in range(100):
        if ray_cluster.available_resources().get("CPU", 0.0) == RAY_CPUS:
            break
        time.sleep(0.05)
    assert r.ok and r.stdout.strip() == "2", r
    assert during == 0.0
    assert ray_cluster.available_resources().get("CPU", 0.0) == RAY_CPUS


def test_ray_unknown_submission_mode_is_one_line(ray_cluster):
    from metasched.runtime.ray_backend import start_dispatcher

    RaySide().release_shared()
    with pytest.raises(ConfigError, match="submit: must be one of task, daemon, stream"):
        start_dispatcher(cfg(), name=f"test-{uuid.uuid4().hex[:8]}", submit="carrier")


async def test_ray_command_of_a_stopped_dispatcher_is_killed_with_its_task(ray_cluster,
                                                                         visible_dir):
    """Closing without draining cancels the running task; its command's group dies."""
    log = visible_dir / "pid"

    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher

    await asyncio.to_thread(RaySide().release_shared)
    name = f"test-{uuid.uuid4().hex[:8]}"
    handle = await asyncio.to_thread(start_dispatcher, cfg(), name=name)
    handle.accept(cpu("/bin/sh", "-c", f"echo $$ > {log}; exec sleep 60"))
    for _ in range(200):
        if log.exists() and log.read_text().strip():
            break
        await asyncio.sleep(0.025)
    pid = int(log.read_text())
    await asyncio.to_thread(stop_dispatcher, name, drain=False)
    await handle.aclose()
    for _ in range(200):
        if not _alive(pid):
            break
        await asyncio.sleep(0.025)
    pid = pid
    assert not _alive(pid)


def test_base_install_does_not_import_ray():
    code = ("import sys, metasched.runtime, metasched.runtime.dispatch.dispatcher, "
            "metasched.runtime.ray_backend; print('ray' in sys.modules)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_commands_carry_their_action_id(side):
    """How a next dispatcher finds what a dead one left: every command's environment
    names its action."""
    async with side.dispatcher(cfg()) as d:
        r = await d.submit(cpu(PY, "-c", f"import os; print(os.environ['{ACTION_ENV}'])",
                               id="who"))
    assert r.ok and r.stdout.strip() == "who"


# ---------------------------------------------------------------------- sandboxes


@pytest.fixture
def boxed(side):
    """``side``, for a test of commands in bwrap sandboxes (marked ``isolation``: skipped
    where bwrap cannot run, it needs root and bubblewrap)."""
    return side


@pytest.mark.isolation
async def test_a_sandboxed_command_runs_unprivileged_without_network(boxed):
    """No network unless asked (a server on the host's 127.0.0.1 is out of reach), a
    user id of the sandbox range, the workspace as its working directory."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    code = ("import os, socket\n"
            "s = socket.socket(); s.settimeout(2)\n"
            "try:\n"
            f"    s.connect(('127.0.0.1', {port})); print('reached')\n"
            "except OSError:\n"
            "    print('unreachable')\n"
            "print(os.getuid(), os.getcwd())")

    try:
        async with boxed.dispatcher(confined()) as d:
            r = await d.submit(cpu(PY, "-c", code))
    finally:
        listener.close()
    assert r.ok, r.reason
    reach, ident = r.stdout.strip().splitlines()
    uid, cwd = ident.split()
    assert reach == "unreachable"
    assert int(uid) >= SandboxConfig().uid_range[0] and cwd == "/workspace"


@pytest.mark.isolation
async def test_a_sandboxed_command_writes_only_in_its_workspace(boxed, visible_dir):
    """The system and the host's directories are read-only in the sandbox (a directory
    it can see, world-writable on the host, included); its workspace is writable."""
    visible_dir.chmod(0o777)
    code = ("import os\n"
            "for path in ['/etc/metasched-probe', '" + str(visible_dir / "x") + "']:\n"
            "    try:\n"
            "        open(path, 'w').write('x'); print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
            "open('/workspace/ok', 'w').write('y'); print(open('/workspace/ok').read())")

    async with boxed.dispatcher(confined()) as d:
        r = await d.submit(cpu(PY, "-c", code))
    assert r.ok, r.reason
    lines = r.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines[:2]] == ["refused", "refused"], lines
    assert lines[2] == "y"
    assert not (visible_dir / "x").exists() and not os.path.exists("/etc/metasched-probe")


@pytest.mark.isolation
async def test_a_sandboxed_command_is_held_to_its_cores_and_memory(boxed):
    """Its cgroup's cpuset is its grant (asking for every core does not widen it), and
    its memory limit holds (an allocation past it is killed, and said so)."""
    widen = ("import os\n"
             "try:\n"
             "    os.sched_setaffinity(0, range(os.cpu_count()))\n"
             "except OSError:\n"
             "    pass\n"
             "print(sorted(os.sched_getaffinity(0)))")
    hog = "b = bytearray(512 << 20); b[::4096] = b'x' * len(b[::4096]); print('kept')"

    async with boxed.dispatcher(confined()) as d:
        pinned, hogged = await asyncio.gather(
                      d.submit(cpu(PY, "-c", widen, min_cores=1, max_cores=1)),
                      d.submit(cpu(PY, "-c", hog, mem_limit_mb=128)))
    assert pinned.ok, pinned.reason
    assert json.loads(pinned.stdout) == pinned.allocation["cores"]
    assert len(pinned.allocation["cores"]) == 1
    assert hogged.status == "failed" and "memory limit exceeded" in hogged.reason, hogged


@pytest.mark.isolation
async def test_a_trajectorys_workspace_persists_across_its_actions_only(boxed):
    """A trajectory's actions share its sandbox's workspace (on its node: the same one
    for each of them); another trajectory's is out of sight."""
    t1, t2 = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    write = "open('note', 'w').write('kept')"
    read = ("import os\n"
            "print(open('note').read() if os.path.exists('note') else 'absent')")

    async with boxed.dispatcher(confined()) as d:
        first = await d.submit(cpu(PY, "-c", write, trajectory=t1))
        again = await d.submit(cpu(PY, "-c", read, trajectory=t1, turn=1))
        other = await d.submit(cpu(PY, "-c", read, trajectory=t2))
    assert first.ok and again.ok and other.ok, (first.reason, again.reason, other.reason)
    assert again.stdout.strip() == "kept" and other.stdout.strip() == "absent"
    if boxed.name == "ray":
        assert first.allocation["node"] == again.allocation["node"]


# ---------------------------------------------------------------------- handing ahead


def test_the_local_backend_has_no_node_queue_to_hand_ahead_to():
    with pytest.raises(ConfigError, match="ahead_per_core: the local backend"):
        Dispatcher(cfg(ahead_per_core=1))


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of ``spans`` (start, end) that overlap at any instant."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in edges:  # at a tie an end sorts first: touching spans do not overlap
        now += step
        most = max(most, now)
    return most


async def _peak_queued(d, until: asyncio.Future) -> int:
    """The most commands the node held ahead, by the dispatcher's stats, until ``until``."""
    peak = 0
    while not until.done():
        peak = max(peak, *(await d.astats())["ahead_at_node"])
        await asyncio.sleep(0.02)
    return peak


@pytest.mark.isolation
@pytest.mark.parametrize("submit", [  # the default way, and task's, in the default suite
    "stream", "task", pytest.param("daemon", marks=pytest.mark.slow)])  # (~15 s each)
async def test_ray_commands_handed_ahead_run_once_each_in_their_sandbox_within_the_cores(
        ray_cluster, submit):
    """With commands handed to the node ahead of its free cores, every command runs, once,
    in its trajectory's sandbox (its workspace's log gets each of its turns once), and no
    more run at once than the node's granted cores (spans timed by the commands)."""
    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher

    trajs, turns = 3, 6
    code = ("import os, sys, time\n"
            "t0 = time.time()\n"
            "open('log', 'a').write(sys.argv[1] + '\\n')\n"
            "time.sleep(0.1)\n"
            "print(t0, time.time(), os.getcwd())")
    read = "print(' '.join(sorted(open('log').read().split())))"

    await asyncio.to_thread(RaySide().release_shared)
    name = f"test-{uuid.uuid4().hex[:8]}"
    handle = await asyncio.to_thread(start_dispatcher, confined(ahead_per_core=2),
                                     name=name, submit=submit)
    try:
        futs = [handle.accept(cpu(PY, "-c", code, str(i), trajectory=f"p{t}", turn=i))
                for i in range(turns) for t in range(trajs)]
        everything = asyncio.ensure_future(asyncio.gather(*futs))
        peak = await _peak_queued(handle, everything)
        results = await everything
        logs = await asyncio.gather(*(handle.submit(cpu(PY, "-c", read, trajectory=f"p{t}",
                                                        turn=turns)) for t in range(trajs)))
        stats = await handle.astats()
    finally:
        await handle.aclose()
        await asyncio.to_thread(stop_dispatcher, name, drain=False)
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert peak >= 1 and stats["ahead_per_core"] == 2  # commands did wait at the node
    spans = [tuple(map(float, r.stdout.split()[:2])) for r in results]
    assert _most_at_once(spans) <= RAY_CPUS
    assert {r.stdout.split()[2] for r in results} == {"/workspace"}
    assert all(len(r.allocation["cores"]) == 1 for r in results)
    expected = " ".join(sorted(str(i) for i in range(turns)))
    assert [lg.stdout.strip() for lg in logs] == [expected] * trajs
    assert len({r.allocation["node"] for r in results}) == 1


async def test_ray_a_drain_with_commands_handed_ahead_finishes_them_all(ray_cluster, visible_dir):
    """stop_dispatcher(drain=True) while the node holds commands ahead: each runs, once."""
    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher

    log = visible_dir / "runs"
    n = 8

    await asyncio.to_thread(RaySide().release_shared)
    name = f"test-{uuid.uuid4().hex[:8]}"
    handle = await asyncio.to_thread(start_dispatcher, cfg(ahead_per_core=2), name=name)
    try:
        for i in range(n):
            handle.accept(cpu("/bin/sh", "-c", f"echo {i} >> {log}; sleep 0.2"))
        for _ in range(200):
            if (await handle.astats())["ahead_at_node"] == [2 * RAY_CPUS]:
                break
            await asyncio.sleep(0.02)
        queued = (await handle.astats())["ahead_at_node"]
    finally:
        await handle.aclose()
        stats = await asyncio.to_thread(stop_dispatcher, name, drain=True)
    assert queued == [2 * RAY_CPUS]
    assert (stats["done"], stats["failed"], stats["ahead_at_node"]) == (n, 0, [0])
    assert sorted(log.read_text().split()) == sorted(str(i) for i in range(n))


async def test_ray_a_killed_dispatcher_with_commands_handed_ahead_loses_nothing(
        ray_cluster, tmp_path, visible_dir):
    """kill -9 of the actor while 2 commands run and 4 wait at the node: the restarted
    one kills the 2, re-queues all 6 from the journal, and each then runs to its end."""
    from metasched.runtime.ray_backend import start_dispatcher, stop_dispatcher

    db, gate, log = tmp_path / "j.db", visible_dir / "gate", visible_dir / "runs"
    n = 3 * RAY_CPUS
    wait = f'echo $$ >> {log}; while [ ! -e {gate} ]; do sleep 0.05; done'

    def pids() -> list[int]:
        return [int(p) for p in log.read_text().split()] if log.exists() else []

    await asyncio.to_thread(RaySide().release_shared)
    name = f"test-{uuid.uuid4().hex[:8]}"
    handle = await asyncio.to_thread(start_dispatcher, cfg(journal=db, ahead_per_core=2),
                                     name=name)
    try:
        futs = [handle.accept(cpu("/bin/sh", "-c", wait, id=f"w{i}", timeout_s=120))
                for i in range(n)]
        for _ in range(400):
            if len(pids()) == RAY_CPUS and (await handle.astats())["ahead_at_node"] == [
                    n - RAY_CPUS]:
                break
            await asyncio.sleep(0.025)
        first = pids()
        queued = (await handle.astats())["ahead_at_node"]
        await RaySide().crash(handle)
        for _ in range(400):  # the orphans killed, the first two of the six run again
            if len(pids()) == 2 * RAY_CPUS and not any(_alive(p) for p in first):
                break
            await asyncio.sleep(0.025)
        gate.write_text("")
        results = await asyncio.wait_for(asyncio.gather(*futs), 60)
    finally:
        await handle.aclose()
        await asyncio.to_thread(stop_dispatcher, name, drain=False)
    assert len(first) == RAY_CPUS and queued == [n - RAY_CPUS]
    assert not any(_alive(p) for p in first)
    assert all(r.ok for r in results), [r.reason for r in results if not r.ok]
    assert sorted(r.id for r in results) == sorted(f"w{i}" for i in range(n))
    assert len(pids()) == RAY_CPUS + n  # the two killed runs, then one run of each
    with Journal(db) as j:
        assert j.counts() == {"queued": 0, "running": 0, "finished": n}


@pytest.mark.isolation
async def test_a_gpu_command_is_confined_as_cpu_commands_are(boxed, visible_dir):
    """A gpu request with an argv runs in its trajectory's sandbox (on its GPU's node):
    it sees the workspace its trajectory's cpu command wrote, cannot reach a server on
    the host's 127.0.0.1 nor write outside its workspace, runs as the sandbox's user, and
    sees its device alone (on the stand-in: none)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    visible_dir.chmod(0o777)
    traj = f"t-{uuid.uuid4().hex[:8]}"
    probe = ("import os, socket\n"
             "print(open('note').read() if os.path.exists('note') else 'absent')\n"
             "s = socket.socket(); s.settimeout(2)\n"
             "try:\n"
             f"    s.connect(('127.0.0.1', {port})); print('reached')\n"
             "except OSError:\n"
             "    print('unreachable')\n"
             "for path in ['/etc/metasched-probe', '" + str(visible_dir / "x") + "']:\n"
             "    try:\n"
             "        open(path, 'w').write('x'); print('wrote')\n"
             "    except OSError:\n"
             "        print('refused')\n"
             "print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')),"
             " repr(os.environ.get('NVIDIA_VISIBLE_DEVICES')))\n"
             "print(os.getuid(), os.getcwd())")

    try:
        async with boxed.dispatcher(confined()) as d:
            wrote = await d.submit(cpu(PY, "-c", "open('note', 'w').write('kept')",
                                       trajectory=traj))
            gpu = await d.submit({"kind": "gpu", "argv": [PY, "-c", probe], "timeout_s": 30,
                                  "trajectory": traj, "turn": 1})
    finally:
        listener.close()
    assert wrote.ok and gpu.ok, (wrote.reason, gpu.reason, gpu.stderr)
    note, reach, etc, host_dir, devices, ident = gpu.stdout.strip().splitlines()
    uid, cwd = ident.split()
    assert (note, reach, etc, host_dir) == ("kept", "unreachable", "refused", "refused")
    assert devices == "'' ''"
    assert int(uid) >= SandboxConfig().uid_range[0] and cwd == "/workspace"
    assert not (visible_dir / "x").exists()
    assert gpu.allocation["device"] == 0
    if boxed.name == "ray":
        assert gpu.allocation["node"] == wrote.allocation["node"]
