"""Dispatcher shards on Ray: trajectories placed by their hash and every action run; a
shard killed under load loses nothing; one API quota shared by two shards through the
lease service is never exceeded, and holds across the lease service's kill; a GPU
service's slots shared so too; ``metasched-serve``'s ``shards`` setting refused in one
line where it cannot work."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(script: str, *args: str, timeout: float = 600) -> dict:
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--json"],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_two_shards_run_each_trajectory_where_it_hashes(ray_cluster, tmp_path):
    """Each action goes to the shard its trajectory hashes to (every turn of a
    trajectory to the same one), and every one is run once and answered."""
    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.shards import ShardRing, start_shards, stop_shards

    prefix = f"test-{uuid.uuid4().hex[:6]}"
    router = start_shards(2, DispatcherConfig(scheduler="elastic_greedy"),
                          journal_dir=str(tmp_path), standin={"nodes": 1, "cores": 8},
                          prefix=prefix)
    try:
        reqs = [{"kind": "cpu", "argv": ["true"], "trajectory": f"t{i % 20}", "turn": i // 20,
                 "id": f"a{i}", "max_cores": 1} for i in range(200)]

        async def run():
            results = await asyncio.gather(*(router.accept(r) for r in reqs))
            stats = await router.astats()
            await router.aclose()
            return results, stats

        results, stats = asyncio.run(run())
    finally:
        stop_shards(router.names, drain=False, leases=False)
    assert Counter(r.status for r in results) == {"done": 200}
    assert all(r.attempts == 1 for r in results)
    ring = ShardRing(router.names)
    expected = Counter(ring.hashed(r["trajectory"]) for r in reqs)
    assert len(expected) == 2  # both shards had work
    got = {name: s["dispatchers"][name]["done"] for name, s in stats.items()}
    assert got == dict(expected)


@pytest.mark.ray
@pytest.mark.subprocess
@pytest.mark.slow
def test_a_shard_killed_under_load_loses_nothing():
    """kill -9 of one of two shards while 64 trajectories run actions on them: every
    action submitted is answered done (0 lost), its trajectories are answered again
    within 5 s by the shard that adopted its journal, and only actions running at the
    kill ran again (at least once)."""
    doc = _bench("shard_faults.py", "--seconds", "8", "--kill-at", "3")
    assert doc["lost"] == 0 and doc["submitted"] > 500
    assert doc["statuses"] == {"done": doc["submitted"]}
    assert doc["victim_trajectories"] > 0
    assert doc["victim_trajectories_served_again"] == doc["victim_trajectories"]
    assert doc["served_again_s"]["max"] <= 5.0
    assert len(doc["adopter_dispatchers"]) == 2  # its own and the dead one's journal
    # At most the actions running at the kill (one per trajectory of the dead shard).
    assert doc["ran_more_than_once"] <= doc["victim_trajectories"]


@pytest.mark.ray
@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("kill, block", [(None, 1), (3.0, 4)])
def test_a_quota_shared_by_two_shards_holds_in_every_window(kill, block):
    """60 calls in any 6 s window, shared by 2 shards with 4 callers each for a little
    over two windows: the counting upstream never sees more than 60 in a window (nor
    answers 429), and at least 95% of what the windows admit is used; with the lease
    service killed 3 s in (and leases asked 4 at a time), the same, and the service
    answers again within 5 s."""
    args = ["--rpm", "600", "--window-s", "6", "--seconds", "13", "--lease-block", str(block)]
    if kill is not None:
        args += ["--kill-leases-at", str(kill)]
    doc = _bench("shared_quota.py", *args)
    assert doc["quota"] == 60
    assert doc["busiest_window"] <= 60
    assert doc["upstream_429"] == 0
    assert doc["quota_used"] >= 0.95, doc
    assert len(doc["done_per_shard"]) == 2
    if kill is not None:
        assert doc["lease_service_restart"]["back_within_s"] <= 5.0


@pytest.mark.parametrize("leased", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_gpu_service_shared_by_two_shards_never_runs_more_than_its_slots(
        ray_cluster, tmp_path, leased):
    """One GPU service with 2 slots shared by 2 shards of 2 stand-in GPUs each: never
    more than 2 of its requests run at once over both (each shard alone would run 2);
    without the shared pool (the control, with the slow tests), more do."""
    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.leases.book import PoolLimit
    from metasched.runtime.shards import ShardRing, start_shards, stop_shards

    prefix = f"test-{uuid.uuid4().hex[:6]}"
    standin = {"nodes": 1, "cores": 4, "gpus": 2, "seconds": 0.3,
               "services": {"rm": {"mem_gb": 1.0, "restore_s": 0.0, "max_batch": 1}}}
    router = start_shards(2, DispatcherConfig(scheduler="elastic_greedy"),
                          journal_dir=str(tmp_path), standin=standin, prefix=prefix,
                          pools={"rm": PoolLimit.service(2)} if leased else None)
    reqs = [{"kind": "gpu", "service": "rm", "payload": i, "trajectory": f"t{i}",
             "id": f"g{i}"} for i in range(16)]
    try:
        async def run():
            results = await asyncio.gather(*(router.accept(r) for r in reqs))
            await router.aclose()
            return results

        results = asyncio.run(run())
    finally:
        stop_shards(router.names, drain=False, leases=leased)
    assert [r.status for r in results] == ["done"] * len(reqs), results[0]
    assert len({ShardRing(router.names).hashed(r["trajectory"]) for r in reqs}) == 2
    edges = sorted([(r.started_at, 1) for r in results] + [(r.finished_at, -1) for r in results])
    running = most = 0
    for _, step in edges:  # (an end sorts before a start at the same instant)
        running += step
        most = max(most, running)
    assert most <= 2 if leased else most > 2, most


@pytest.mark.slow
def test_a_shard_on_the_clusters_nodes_runs_commands_there(ray_cluster, tmp_path):
    """Without stand-ins a shard schedules over the Ray nodes that hash to it (here the
    one node) and runs commands there; more shards than nodes is a one-line error."""
    from metasched.errors import ConfigError
    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.sandbox.config import SandboxConfig
    from metasched.runtime.shards import start_shards, stop_shards

    cfg = DispatcherConfig(scheduler="elastic_greedy", sandbox=SandboxConfig(isolation="none"))
    prefix = f"test-{uuid.uuid4().hex[:6]}"
    router = start_shards(1, cfg, journal_dir=str(tmp_path), prefix=prefix)
    try:
        async def run():
            out = await asyncio.gather(*(router.submit(
                {"kind": "cpu", "argv": ["sh", "-c", "echo $((6*7))"], "trajectory": "t",
                 "turn": i, "id": f"c{i}"}) for i in range(3)))
            await router.aclose()
            return out

        results = asyncio.run(run())
    finally:
        stop_shards(router.names, drain=False, leases=False)
    assert [(r.status, r.stdout.strip()) for r in results] == [("done", "42")] * 3
    with pytest.raises(ConfigError, match="fewer nodes than shards"):
        start_shards(2, cfg, journal_dir=str(tmp_path), prefix=f"{prefix}-two")
    stop_shards([f"{prefix}-two-0", f"{prefix}-two-1"], drain=False, leases=False)


def test_the_http_front_doors_route_each_trajectory_to_its_shard(ray_cluster, tmp_path):
    """The HTTP service in front of two shards: each action posted to ``/v1/actions``
    runs on the shard its trajectory hashes to, and ``/v1/status`` shows both."""
    import httpx

    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.shards import ShardedDispatcher, ShardRing, start_shards, stop_shards
    from metasched.serve import BackgroundServer, ServeConfig, create_app

    prefix = f"test-{uuid.uuid4().hex[:6]}"
    router = start_shards(2, DispatcherConfig(scheduler="elastic_greedy"),
                          journal_dir=str(tmp_path), standin={"nodes": 1, "cores": 8},
                          prefix=prefix)
    names = router.names
    trajectories = [f"sb-{i}" for i in range(12)]
    try:
        app = create_app(lambda: ShardedDispatcher(names), ServeConfig(languages=[]))
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            got = [c.post("/v1/actions", params={"wait": 30}, json={
                "kind": "cpu", "argv": ["true"], "trajectory": t, "max_cores": 1}).json()
                for t in trajectories]
            status = c.get("/v1/status").json()
        stats = asyncio.run(_shard_stats(names))
    finally:
        stop_shards(names, drain=False, leases=False)
    assert [r["status"] for r in got] == ["done"] * len(trajectories)
    assert sorted(status["shards"]) == sorted(names)
    expected = Counter(ShardRing(names).hashed(t) for t in trajectories)
    assert {n: s["dispatchers"][n]["done"] for n, s in stats.items()} == dict(expected)


async def _shard_stats(names: list[str]) -> dict:
    from metasched.runtime.shards import ShardRouter

    return await ShardRouter(names).astats()


def test_a_router_started_after_a_shard_died_sends_its_trajectories_to_the_adopter(
        ray_cluster, tmp_path):
    """A shard dies (killed, no restart) with actions in its journal; a router made
    afterwards sends that shard's trajectories to the shard that adopts its journal
    (finished ids answered from it), and new ones to the live shard."""
    import ray

    from metasched.runtime.dispatch import DispatcherConfig
    from metasched.runtime.leases.service import NAMESPACE
    from metasched.runtime.shards import ShardRouter, start_shards, stop_shards

    prefix = f"test-{uuid.uuid4().hex[:6]}"
    first = start_shards(2, DispatcherConfig(scheduler="elastic_greedy"),
                         journal_dir=str(tmp_path), standin={"nodes": 1, "cores": 8},
                         prefix=prefix)
    names = first.names
    reqs = [{"kind": "cpu", "argv": ["true"], "trajectory": f"t{i}", "id": f"a{i}",
             "max_cores": 1} for i in range(16)]
    try:
        async def before():
            out = await asyncio.gather(*(first.accept(r) for r in reqs))
            await first.aclose()
            return out

        answered = {r.id: r for r in asyncio.run(before())}
        ray.kill(ray.get_actor(names[0], namespace=NAMESPACE), no_restart=True)

        async def after():
            router = ShardRouter(names)
            again = await asyncio.gather(*(router.accept(r) for r in reqs))
            fresh = await asyncio.gather(*(router.accept(
                {**r, "id": f"b{i}", "trajectory": f"new{i}"}) for i, r in enumerate(reqs)))
            stats = await router.astats()
            await router.aclose()
            return again, fresh, stats

        again, fresh, stats = asyncio.run(after())
    finally:
        stop_shards(names, drain=False, leases=False)
    # Answered from the dead shard's journal or the live one's: none run again.
    assert [(r.id, r.status, r.attempts) for r in again] == \
        [(r["id"], "done", answered[r["id"]].attempts) for r in reqs]
    assert all(r.attempts == 1 for r in again)
    assert [r.status for r in fresh] == ["done"] * len(reqs)
    assert list(stats) == [names[1]]
    assert sorted(stats[names[1]]["dispatchers"]) == sorted(names)


@pytest.mark.parametrize("cfg, problem", [
    ({"shards": 2}, "need backend=ray"),
    ({"shards": 0, "backend": "ray"}, "whole number >= 1"),
    ({"shards": "two", "backend": "ray"}, "whole number >= 1"),
    ({"shards": 2, "backend": "ray", "services": {"rm": "m:f"}}, "GPU services"),
])
def test_a_bad_shards_setting_is_refused_in_one_line(cfg, problem):
    pytest.importorskip("ray")
    from metasched.cli.backend_settings import ray_settings, shard_count
    from metasched.errors import ConfigError

    with pytest.raises(ConfigError, match=problem) as e:
        shard_count(cfg, ray_settings(cfg))
    assert str(e.value).startswith("shards: ") and "\n" not in str(e.value)


@pytest.mark.slow
def test_serves_shards_need_as_many_nodes_as_shards(ray_cluster, tmp_path):
    """``metasched-serve backend=ray shards=2`` on a one-node cluster: one line."""
    from metasched.cli.backend_settings import open_shards, ray_settings
    from metasched.errors import ConfigError
    from metasched.runtime.dispatch import DispatcherConfig

    settings = ray_settings({"backend": "ray", "ray": {"name": f"t{uuid.uuid4().hex[:6]}"}})
    with pytest.raises(ConfigError, match="fewer nodes than shards") as e:
        open_shards(2, settings, DispatcherConfig(scheduler="elastic_greedy"), tmp_path)
    assert str(e.value).startswith("shards: ")
