"""Pool mechanics with exact numbers: Amdahl, API quota windows, GPU residency and
batching, CPU sandbox placement."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest

from metasched.core.actions import ActionSpec, amdahl_run_s
from metasched.core.pools import ApiPool, CpuPool, Endpoint, EndpointSpec, GpuPool, ServiceSpec

# ------------------------------------------------------------------ Amdahl


@pytest.mark.parametrize(
    "p, cores, speedup",
    [
        (0.0, 1, 1.0),
        (0.0, 16, 1.0),  # serial work does not speed up
        (1.0, 8, 8.0),  # perfectly parallel work scales linearly
        (0.8, 4, 2.5),  # 1 / (0.2 + 0.2)
        (0.5, 2, 4.0 / 3.0),  # 1 / (0.5 + 0.25)
        (0.9, 16, 1.0 / (0.1 + 0.9 / 16)),
        (0.9, 1, 1.0),
    ],
)
def test_amdahl_speedup_and_run_time(p, cores, speedup):
    spec = ActionSpec("cpu", "x", true_s=10.0, est_s=12.0, timeout_s=100.0, min_cores=1,
                      max_cores=16, parallel_fraction=p)
    assert spec.speedup(cores) == pytest.approx(speedup, rel=1e-12)
    # Run time on k cores is the one-core time divided by the speedup.
    assert amdahl_run_s(10.0, p, cores) == pytest.approx(10.0 / speedup, rel=1e-12)
    assert spec.est_run_s(cores) == pytest.approx(12.0 / speedup, rel=1e-12)


def test_amdahl_run_time_exact_values():
    assert amdahl_run_s(10.0, 0.8, 4) == pytest.approx(4.0)  # 10 * (0.2 + 0.8 / 4)
    assert amdahl_run_s(30.0, 0.9, 16) == pytest.approx(30.0 * (0.1 + 0.9 / 16))
    assert amdahl_run_s(3.0, 0.0, 64) == pytest.approx(3.0)


def test_amdahl_speedup_is_monotone_and_bounded():
    spec = ActionSpec("cpu", "x", 1.0, 1.0, 10.0, 1, 64, parallel_fraction=0.75)
    ups = [spec.speedup(k) for k in range(1, 65)]
    assert all(b > a for a, b in pairwise(ups))
    assert ups[-1] < 1.0 / (1.0 - 0.75)  # Amdahl's ceiling 1 / (1 - p)


@pytest.mark.parametrize("kind", ["gpu", "api"])
def test_est_run_s_ignores_cores_for_non_cpu(kind):
    spec = ActionSpec(kind, "x", 2.0, 3.0, 10.0, parallel_fraction=0.9)
    assert spec.est_run_s(1) == 3.0
    assert spec.est_run_s(8) == 3.0


# ------------------------------------------------------------------ API endpoints


@pytest.mark.parametrize(
    "rpm, tpm, window_s, req_cap, tok_cap",
    [
        (120, None, 3.0, 6.0, math.inf),  # 2 req/s x 3 s
        (600, 60000, 1.0, 10.0, 1000.0),
        (6, None, 60.0, 6.0, math.inf),  # the per-minute quota itself
        (500, 600000, 10.0, 83.0, 100000.0),  # 83.3 requests: whole ones only
        (6, None, 1.0, 1.0, math.inf),  # 0.1 req/s x 1 s, but a window admits >= 1
        (6 * 60 / 60.25, None, 60.25, 6.0, math.inf),  # derated: the allowance kept
    ],
)
def test_endpoint_window_capacities(rpm, tpm, window_s, req_cap, tok_cap):
    spec = EndpointSpec(rpm=rpm, max_concurrency=4, tpm=tpm, window_s=window_s)
    assert spec.req_capacity == pytest.approx(req_cap)
    assert spec.tok_capacity == pytest.approx(tok_cap)
    ep = Endpoint("e", spec)
    assert ep.req == pytest.approx(req_cap)  # an empty window
    assert ep.tok == pytest.approx(tok_cap)


def test_endpoint_admits_a_whole_window_at_once_then_waits_for_the_oldest():
    # 6 RPM over 60 s: six calls at once (an upstream counting a sliding minute takes
    # them), the seventh when the first leaves the window, not 10 s after the sixth.
    ep = Endpoint("e", EndpointSpec(rpm=6, max_concurrency=100, window_s=60.0))
    for k in range(6):
        assert ep.can_start(0, float(k))
        ep.take(0, float(k))
    assert not ep.can_start(0, 5.0)
    assert ep.ready_in(0, 5.0) == pytest.approx(55.0)  # the call at t=0 leaves at 60
    assert not ep.can_start(0, 59.999)
    assert ep.can_start(0, 60.0)  # half-open: the charge at 0 is out at 60
    ep.take(0, 60.0)
    assert ep.ready_in(0, 60.0) == pytest.approx(1.0)  # next: the charge at 1
    assert ep.req == pytest.approx(0.0)
    assert ep.requests == 7 and ep.in_flight == 7


def test_endpoint_window_forgets_old_charges():
    ep = Endpoint("e", EndpointSpec(rpm=120, max_concurrency=100, tpm=6000, window_s=3.0))
    ep.take(50, 0.0)
    ep.refill(2.0)
    assert ep.req == pytest.approx(5.0) and ep.tok == pytest.approx(250.0)
    ep.refill(1000.0)
    assert ep.req == pytest.approx(6.0)
    assert ep.tok == pytest.approx(300.0)  # 100 tokens/s x 3 s
    assert not ep.log


def test_endpoint_tpm_limit_and_ready_in():
    # Requests are plentiful (6000 rpm); 600 TPM over 1 s windows: 10 tokens in any 1 s.
    ep = Endpoint("e", EndpointSpec(rpm=6000, max_concurrency=100, tpm=600, window_s=1.0))
    assert ep.can_start(8, 0.0)
    ep.take(8, 0.0)
    assert ep.tok == pytest.approx(2.0)
    assert ep.can_start(2, 0.2)
    ep.take(2, 0.2)
    assert not ep.can_start(5, 0.5)
    assert ep.ready_in(1, 0.5) == pytest.approx(0.5)  # the 8 tokens of t=0 leave at 1
    assert ep.ready_in(10, 0.5) == pytest.approx(0.7)  # both charges must leave
    assert ep.ready_in(11, 0.5) == math.inf  # more than a window ever admits
    assert not ep.can_start(5, 0.99)
    assert ep.can_start(5, 1.0)


@pytest.mark.parametrize("rpm, tpm, window_s, tokens", [
    (6, None, 60.0, 0), (120, None, 3.0, 0), (6000, 600, 1.0, 3), (500, 60000, 10.0, 700)])
def test_endpoint_never_exceeds_its_allowance_in_any_window(rpm, tpm, window_s, tokens):
    """Calls started as soon as the endpoint allows, in bursts and trickles: no window of
    ``window_s`` holds more than the allowance, and the allowance is used (a call
    waits only while a window is full)."""
    from metasched.serve.rate_limited import max_in_window

    spec = EndpointSpec(rpm=rpm, max_concurrency=10**6, tpm=tpm, window_s=window_s)
    ep, rng = Endpoint("e", spec), np.random.default_rng(0)
    t, starts = 0.0, []
    for _ in range(400):
        t += float(rng.exponential(window_s / 50)) if rng.random() < 0.3 else 0.0
        wait = ep.ready_in(tokens, t)
        assert math.isfinite(wait)
        t += wait
        assert ep.can_start(tokens, t)
        ep.take(tokens, t)
        starts.append(t)
    cap = spec.req_capacity if tpm is None else min(spec.req_capacity,
                                                    spec.tok_capacity // tokens)
    assert max_in_window(starts, window_s) == cap


def test_endpoint_max_concurrency():
    ep = Endpoint("e", EndpointSpec(rpm=60000, max_concurrency=2, window_s=1.0))
    ep.take(0, 0.0)
    ep.take(0, 0.0)
    assert ep.req >= 1.0  # the window has room ...
    assert not ep.can_start(0, 0.0)  # ... but two calls are in flight
    ep.in_flight -= 1  # one call returns (ClusterState.finish does this)
    assert ep.can_start(0, 0.0)


def test_api_pool_total_is_concurrency_sum():
    pool = ApiPool({"a": EndpointSpec(60, 3), "b": EndpointSpec(60, 5, tpm=1000)})
    assert pool.total == 8
    assert set(pool.endpoints) == {"a", "b"}
    assert pool.endpoints["b"].spec.tpm == 1000


# ------------------------------------------------------------------ GPU


@pytest.fixture
def gpu():
    services = {
        "a": ServiceSpec(mem_gb=30, restore_s=4.0),
        "b": ServiceSpec(mem_gb=30, restore_s=7.0),
        "c": ServiceSpec(mem_gb=30, restore_s=2.0),
        "big": ServiceSpec(mem_gb=75, restore_s=15.0),
        "huge": ServiceSpec(mem_gb=100, restore_s=20.0),
    }
    return GpuPool(2, 80.0, services)


def test_gpu_restore_paid_once_then_resident(gpu):
    assert gpu.total == 2
    assert gpu.restore_cost("a", 0) == 4.0
    assert gpu.make_resident("a", 0, t=0.0) == 4.0
    assert gpu.restores == 1
    assert gpu.restore_cost("a", 0) == 0.0
    assert gpu.make_resident("a", 0, t=5.0) == 0.0  # already resident: free
    assert gpu.restores == 1
    assert gpu.restore_cost("a", 1) == 4.0  # residency is per device
    assert gpu.resident_on("a") == [0]
    assert gpu.devices[0].mem_used(gpu.services) == 30


def test_gpu_lru_eviction_when_memory_is_short(gpu):
    gpu.make_resident("a", 0, t=0.0)
    gpu.make_resident("b", 0, t=1.0)
    gpu.make_resident("a", 0, t=2.0)  # a used again: b is now least recently used
    assert gpu.evictions == 0
    assert set(gpu.devices[0].resident) == {"a", "b"}
    # 30 + 30 + 30 > 80: one service must go, and it is b (LRU), not a.
    assert gpu.make_resident("c", 0, t=3.0) == 2.0
    assert set(gpu.devices[0].resident) == {"a", "c"}
    assert gpu.evictions == 1
    assert gpu.restore_cost("b", 0) == 7.0  # b must be restored again
    assert gpu.restore_cost("a", 0) == 0.0
    assert gpu.devices[0].mem_used(gpu.services) == 60


def test_gpu_eviction_frees_as_many_as_needed(gpu):
    gpu.make_resident("a", 0, t=0.0)
    gpu.make_resident("c", 0, t=1.0)
    assert gpu.make_resident("big", 0, t=2.0) == 15.0  # 75 GB needs both evicted
    assert gpu.devices[0].resident == {"big": 2.0}
    assert gpu.evictions == 2
    assert gpu.restores == 3


def test_gpu_no_eviction_when_it_fits():
    pool = GpuPool(1, 100.0, {s: ServiceSpec(30, 1.0) for s in "abc"})
    for i, s in enumerate("abc"):
        pool.make_resident(s, 0, t=float(i))
    assert set(pool.devices[0].resident) == {"a", "b", "c"}
    assert pool.evictions == 0


def test_gpu_fits(gpu):
    assert gpu.fits("big", 0)
    assert not gpu.fits("huge", 1)


@pytest.mark.parametrize(
    "marginal, latencies, expected",
    [
        (0.0, [1.0, 0.5, 2.0], 2.0),  # no marginal cost: the slowest request
        (0.1, [1.0, 0.5, 2.0], 2.4),  # 2.0 x (1 + 0.1 x 2)
        (0.05, [0.5] * 8, 0.5 * 1.35),  # 0.5 x (1 + 0.05 x 7)
        (0.5, [3.0], 3.0),  # a batch of one costs its own latency
    ],
)
def test_gpu_batch_latency_model(marginal, latencies, expected):
    svc = ServiceSpec(mem_gb=10, restore_s=1.0, max_batch=16, batch_marginal=marginal)
    assert svc.batch_s(latencies) == pytest.approx(expected)


def test_gpu_batching_beats_serial_service():
    svc = ServiceSpec(mem_gb=10, restore_s=1.0, max_batch=16, batch_marginal=0.05)
    lat = [0.2] * 16
    assert svc.batch_s(lat) < sum(lat)


# ------------------------------------------------------------------ CPU


def test_cpu_pool_totals():
    pool = CpuPool([4, 8, 16], [16.0, 32.0, 64.0])
    assert pool.total == 28
    assert pool.n_nodes == 3
    assert pool.free == [4, 8, 16]
    assert pool.busy == pool.held == pool.held_busy == 0


def test_sandbox_goes_to_node_with_most_free_memory():
    pool = CpuPool([4, 4, 4], [16.0, 32.0, 24.0])
    assert pool.place_sandbox(8.0) == 1
    assert pool.mem_free == [16.0, 24.0, 24.0]
    # 24 GB on nodes 1 and 2, same free cores: the lower index wins.
    assert pool.place_sandbox(8.0) == 1
    assert pool.place_sandbox(8.0) == 2
    assert pool.mem_free == [16.0, 16.0, 16.0]
    assert pool.sandboxes == [0, 2, 1]


def test_sandbox_tie_on_memory_goes_to_most_free_cores():
    pool = CpuPool([4, 8], [16.0, 16.0])
    assert pool.place_sandbox(4.0) == 1
    pool.free[1] = 0  # node 1's cores are all in use
    pool.mem_free[0] = pool.mem_free[1] = 12.0
    assert pool.place_sandbox(4.0) == 0


def test_sandbox_that_fits_nowhere_changes_nothing():
    pool = CpuPool([4, 4], [8.0, 8.0])
    assert pool.place_sandbox(8.0) == 0
    assert pool.place_sandbox(8.0) == 1
    assert pool.place_sandbox(0.5) == -1
    assert pool.mem_free == [0.0, 0.0]
    assert pool.sandboxes == [1, 1]
    assert CpuPool([], []).place_sandbox(0.0) == -1


def test_sandbox_release_restores_memory():
    pool = CpuPool([4, 4], [8.0, 8.0])
    node = pool.place_sandbox(6.0)
    assert pool.place_sandbox(6.0) == 1 - node
    assert pool.place_sandbox(6.0) == -1
    pool.release_sandbox(node, 6.0)
    assert pool.mem_free[node] == 8.0
    assert pool.sandboxes[node] == 0
    assert pool.place_sandbox(6.0) == node
