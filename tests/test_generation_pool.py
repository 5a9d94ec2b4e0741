"""The LLM's generation as a pool: the engine model, the pool's batching, priorities,
prefix cache and preemption, the simulator's opt-in, and the engine fit from a trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metasched.agents import make_scheduler
from metasched.agents.meta_options import FEATURES, GENERATION_OPTIONS, OPTIONS
from metasched.agents.meta_policy import (
    MetaNetwork,
    ValueEstimates,
    load_meta_checkpoint,
    save_meta_checkpoint,
)
from metasched.calibration.engine_fit import COSTS, fit_engine
from metasched.calibration.samples import read_samples
from metasched.compose import compose, load_profile
from metasched.core.engine import EngineModel
from metasched.core.trace_writer import TraceWriter
from metasched.errors import ConfigError
from metasched.evaluation.predictors import fitted_predictor
from metasched.sim.generation import GenerationConfig, GenerationPool, GenRequest
from metasched.sim.seeds import EVAL_SEED_OFFSET
from metasched.sim.simulator import Simulator


class _Traj:
    def __init__(self, id: int) -> None:
        self.id = id


class _Clock:
    """Drives a pool alone: its events in time order, and the order requests finish."""

    def __init__(self, engine: EngineModel, replicas: int = 1, affinity: bool = False,
                 priority=None) -> None:
        cfg = GenerationConfig(replicas=replicas, engine=engine, prompt_tokens=100,
                               tool_output_tokens=10, affinity=affinity)
        self.events: list[tuple[float, int, object]] = []
        self.finished: list[GenRequest] = []
        self.pool = GenerationPool(cfg, self._push, self.finished.append, priority)

    def _push(self, t: float, payload: object) -> None:
        self.events.append((t, len(self.events), payload))

    def run(self) -> None:
        while self.events:
            self.events.sort(key=lambda e: (e[0], e[1]))
            t, _, payload = self.events.pop(0)
            self.pool.on_event(payload, t)


ENGINE = EngineModel(decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_ctx_s=1e-6,
                     prefill_base_s=0.002, prefill_per_token_s=1e-4)


@pytest.mark.parametrize("n,ctx,dt", [(1, 0, 0.5), (4, 1000, 0.05), (32, 10**5, 2.0),
                                      (7, 3, 0.0)])
def test_steps_within_is_the_inverse_of_steps_s(n, ctx, dt):
    k = ENGINE.steps_within(n, ctx, dt)
    assert ENGINE.steps_s(n, ctx, k) <= dt + 1e-12 < ENGINE.steps_s(n, ctx, k + 1)


def test_one_request_takes_its_prefill_and_its_decode_steps():
    c = _Clock(ENGINE)
    c.pool.submit(GenRequest(_Traj(0), 0, prompt=500, out=20, submit_t=0.0), 0.0)
    c.run()
    (q,) = c.finished
    assert q.end_t == pytest.approx(ENGINE.prefill_s(500) + ENGINE.steps_s(1, 500, 20))
    assert q.run_s == pytest.approx(q.end_t) and q.done == 20


def test_an_arrival_joins_the_batch_at_the_next_step():
    c = _Clock(ENGINE)
    c.pool.submit(GenRequest(_Traj(0), 0, prompt=100, out=1000, submit_t=0.0), 0.0)
    c.events.sort(key=lambda e: e[0])
    t = 1.0  # mid-segment: the long request's steps are cut at the step in progress
    c.events = [e for e in c.events if e[0] <= t]
    c.pool.submit(GenRequest(_Traj(1), 0, prompt=100, out=5, submit_t=t), t)
    c.run()
    short = next(q for q in c.finished if q.traj.id == 1)
    assert short.start_t < t + ENGINE.step_s(1, 2000)  # admitted within one step
    assert short.end_t < c.finished[-1].end_t


def test_an_aborted_request_leaves_its_batch_at_once_and_never_finishes():
    c = _Clock(ENGINE.model_copy(update={"max_seqs": 1}))
    for i, out in enumerate((1000, 10, 10)):
        c.pool.submit(GenRequest(_Traj(i), 0, prompt=100, out=out, submit_t=0.0), 0.0)
    t = 1.0  # 0 runs (its 1,000 steps take ~11 s), 1 and 2 wait
    c.pool.abort(0, t)
    c.pool.abort(1, t)
    c.run()
    assert [q.traj.id for q in c.finished] == [2]
    (q,) = c.finished
    assert t < q.start_t < t + ENGINE.step_s(1, 1100)  # took the freed batch at once
    assert c.pool.replicas[0].ctx == 0 and not c.pool.replicas[0].running


@pytest.mark.parametrize("order", ["fifo", "priority"])
def test_priority_decides_who_joins_a_full_batch(order):
    engine = ENGINE.model_copy(update={"max_seqs": 1})
    prio = {0: 0.0, 1: 5.0, 2: 1.0}  # 2 (submitted after 1) has the higher priority
    c = _Clock(engine, priority=None if order == "fifo" else (lambda q: prio[q.traj.id]))
    for i in range(3):
        c.pool.submit(GenRequest(_Traj(i), 0, prompt=100, out=10, submit_t=0.0), 0.0)
    c.run()
    ids = [q.traj.id for q in c.finished]
    assert ids == ([0, 1, 2] if order == "fifo" else [0, 2, 1])


@pytest.mark.parametrize("preempt", [False, True])
def test_priority_preemption_lets_a_later_urgent_request_in(preempt):
    engine = ENGINE.model_copy(update={"max_seqs": 1})
    prio = {0: 5.0, 1: 0.0}
    c = _Clock(engine, priority=lambda q: prio[q.traj.id])
    c.pool.config = c.pool.config.model_copy(update={"priority_preemption": preempt})
    c.pool.submit(GenRequest(_Traj(0), 0, prompt=100, out=50, submit_t=0.0), 0.0)
    c.pool.submit(GenRequest(_Traj(1), 0, prompt=100, out=5, submit_t=0.1), 0.1)
    c.run()
    assert [q.traj.id for q in c.finished] == ([1, 0] if preempt else [0, 1])
    assert c.pool.n_preemptions == int(preempt)


def test_affinity_finds_the_trajectory_prefix_in_the_cache():
    c = _Clock(ENGINE, replicas=2, affinity=True)
    c.pool.submit(GenRequest(_Traj(7), 0, prompt=300, out=10, submit_t=0.0), 0.0)
    c.run()
    c.pool.submit(GenRequest(_Traj(7), 1, prompt=330, out=10, submit_t=5.0), 5.0)
    c.run()
    first, second = c.finished
    assert first.replica == second.replica and second.cached == 310
    assert second.prefill_tokens == 20  # only the new tokens are prefilled


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_full_kv_cache_preempts_and_everything_still_finishes(preemption):
    engine = ENGINE.model_copy(update={"kv_tokens": 1500, "preemption": preemption})
    c = _Clock(engine)
    for i in range(6):
        c.pool.submit(GenRequest(_Traj(i), 0, prompt=200, out=300, submit_t=0.0), 0.0)
    c.run()
    assert len(c.finished) == 6 and all(q.done == q.out for q in c.finished)
    assert c.pool.n_preemptions > 0
    assert all(r.ctx == 0 and not r.running for r in c.pool.replicas)
    if preemption == "swap":
        assert any(q.swap_tokens > 0 for q in c.finished)


def _small(overrides: list[str], pool: bool = True, trajectories: int = 8):
    return load_profile(compose("eval", [
        "workload=swe_grouped", *(["+generation=swe_grouped"] if pool else []),
        f"workload.trajectories_per_step={trajectories}", "workload.steps=1", *overrides]))


def test_the_pool_is_opt_in_and_a_run_with_it_is_deterministic():
    w, c = _small(["generation.replicas=2"])
    off = _small([], pool=False)[0]
    assert off.generation is None and Simulator(off, c, 0).llm is None
    steps = []
    for _ in range(2):
        sim = Simulator(w, c, 3)
        r = sim.run(make_scheduler("rate_greedy"))
        steps.append(r.step_s.tolist())
        assert sim.llm.pool.summary()["requests"] > 8
        assert all(t.end_t == t.end_t for t in sim.step_trajs)  # every trajectory ended
    assert steps[0] == steps[1]


def test_more_replicas_shorten_a_contended_step():
    w1, c = _small(["generation.replicas=1"], trajectories=16)
    w8, _ = _small(["generation.replicas=8"], trajectories=16)
    s1 = Simulator(w1, c, 0).run(make_scheduler("rate_greedy")).step_s.mean()
    s8 = Simulator(w8, c, 0).run(make_scheduler("rate_greedy")).step_s.mean()
    assert s8 < 0.8 * s1


@pytest.mark.parametrize("overrides,field", [
    (["generation.order=predicted"], "workload.generation.order"),
    (["generation.replicas=0"], "workload.generation.replicas"),
    (["+generation.engine.kv_tokens=-1"], "workload.generation.engine.kv_tokens"),
    (["generation.overprovision=1", "+workload.max_offpolicyness=1"],
     "workload.generation.overprovision"),
])
def test_bad_generation_settings_are_one_line_errors(overrides, field):
    with pytest.raises(ConfigError) as e:
        w, c = _small(overrides)
        Simulator(w, c, 0)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_the_engine_model_is_recovered_from_a_simulated_trace(tmp_path):
    """metasched-calibrate's engine fit recovers every cost the trace tells within 10%."""
    true = EngineModel(decode_base_s=0.007, decode_per_seq_s=4e-5, decode_per_ctx_s=6e-8,
                       prefill_base_s=0.003, prefill_per_token_s=4e-5)
    w, c = _small(["generation.replicas=2"])
    w = w.__class__(**{**{f: getattr(w, f) for f in w.__dataclass_fields__},
                       "generation": w.generation.model_copy(update={"engine": true})})
    path = tmp_path / "gen.jsonl"
    with TraceWriter(path, c, w.services) as tw:
        Simulator(w, c, 0, trace_writer=tw).run(make_scheduler("rate_greedy"))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum(x["type"] == "generation" for x in lines) > 100
    fit = fit_engine(read_samples(path).generations)
    for cost in COSTS[:5]:
        assert fit.fitted[cost]
        assert getattr(fit.engine, cost) == pytest.approx(getattr(true, cost), rel=0.10), cost
    assert not fit.fitted["swap_per_token_s"]  # recompute: no swap in the trace
    assert np.isfinite(fit.rel_rmse)


def test_a_meta_policy_option_sets_the_generation_order(tmp_path):
    """The meta-policy's generation option stamps later turns from the predictor (fitted
    on training seed 0; run on an evaluation seed); the plain rule leaves FIFO; the
    option and its order survive a checkpoint."""
    w, c = _small(["generation.replicas=1"])
    opts = list(GENERATION_OPTIONS)
    k = [o.name for o in opts].index("rate_greedy+generation=predicted")
    f, n = len(FEATURES), len(opts)
    b2 = np.zeros(n)
    b2[k] = 1.0
    net = MetaNetwork(np.zeros((f, 4)), np.zeros(4), np.zeros((4, n)), b2, np.zeros(f),
                      np.ones(f))
    save_meta_checkpoint(tmp_path / "m", net, opts, "rate_greedy", "step",
                         {}, ValueEstimates(np.zeros((n, f + 1)), np.ones(n), np.zeros(f),
                                            np.ones(f)), {})
    meta = load_meta_checkpoint(tmp_path / "m", gate=False)
    assert meta.options[k].generation == "predicted"
    assert [o.name for o in meta.options[:len(OPTIONS)]] == [o.name for o in OPTIONS]
    stamps = {}
    for name, sched in (("meta", meta), ("plain", make_scheduler("rate_greedy"))):
        path = tmp_path / f"{name}.jsonl"
        with TraceWriter(path, c, w.services) as tw:
            sim = Simulator(w, c, EVAL_SEED_OFFSET, predictor=fitted_predictor(w),
                            trace_writer=tw)
            sim.run(sched)
        assert all(t.end_t == t.end_t for t in sim.step_trajs)  # every trajectory ended
        stamps[name] = [x["priority"] for x in map(json.loads, path.read_text().splitlines())
                        if x["type"] == "generation"]
    assert meta.choice.name == "rate_greedy+generation=predicted"
    assert any(p < 0 for p in stamps["meta"])  # longest predicted remaining first
    assert not any(stamps["plain"])  # FIFO: no stamp


def test_overprovisioning_keeps_the_first_to_finish_and_aborts_the_rest():
    w, c = _small(["generation.replicas=2", "generation.overprovision=3"])
    sim = Simulator(w, c, 0)
    r = sim.run(make_scheduler("rate_greedy"))
    trajs = sim.step_trajs
    aborted = [t for t in trajs if t.id in sim.over.aborted]
    kept = [t for t in trajs if t.id not in sim.over.aborted]
    assert (len(trajs), len(kept), len(aborted)) == (11, 8, 3)  # one group of 8, +3
    last = max(t.end_t for t in kept)
    assert all(t.end_t == last for t in aborted)  # aborted as the 8th finished
    assert r.step_s.tolist() == [last - trajs[0].start_t]
    assert not sim.state.trajectories  # every one closed, its sandbox freed
    base = Simulator(_small(["generation.replicas=2"])[0], c, 0)
    base.run(make_scheduler("rate_greedy"))
    assert [t.turns for t in base.step_trajs] == [t.turns for t in trajs[:8]]  # same draws
