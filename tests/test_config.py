"""Config validation: every bad field raises a one-line ConfigError naming the field,
and malformed action specs (fuzzed with Hypothesis) never raise anything else."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metasched.compose import PROFILES, profile
from metasched.core.actions import KINDS
from metasched.core.cluster_config import parse_cluster
from metasched.errors import ConfigError
from metasched.sim.dists import Z90, Z99, parse_dist
from metasched.sim.sampling import sample_trajectory
from metasched.sim.workload_config import check_compatible, parse_workload


def load(w: dict, c: dict):
    wc, cc = parse_workload(w), parse_cluster(c)
    check_compatible(wc, cc)
    return wc, cc


def assert_one_line_error(excinfo, field: str) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert excinfo.value.field == field, msg
    assert msg.startswith(f"{field}: "), msg
    assert excinfo.value.problem and excinfo.value.problem in msg


# ------------------------------------------------------------------ valid configs


@pytest.mark.parametrize("name", PROFILES)
def test_profiles_load(name):
    w, c = profile(name)
    check_compatible(w, c)
    assert w.name == name and w.steps >= 1 and w.trajectories_per_step >= 1
    assert w.tasks
    for t in w.tasks:
        assert math.isclose(sum(a.prob for a in t.actions), 1.0) or not t.actions
        assert t.reward.kind in KINDS


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("scale", [0.5, 0.125])
def test_cluster_scale_is_the_planner_scaling_of_every_pool(name, scale):
    _, full = profile(name)
    _, scaled = profile(name, [f"cluster.scale={scale}"])
    assert scaled == full.scaled(scale, ("cpu", "gpu", "api"))


def test_cluster_scale_quarter_of_mixed():
    _, c = profile("mixed", ["cluster.scale=0.25"])
    assert (c.cpu_nodes, c.cores_per_node, c.mem_gb_per_node) == (6, 16, 512)
    assert c.gpu_devices == 1
    judge = c.endpoints["llm_judge"]
    assert (judge.rpm, judge.tpm, judge.max_concurrency) == (125, 150_000, 32)


@pytest.mark.parametrize("bad", [0, -1, "x", True])
def test_cluster_scale_must_be_positive(bad):
    d = {"name": "c", "scale": bad, "cpu": {"nodes": 1, "cores_per_node": 8}}
    with pytest.raises(ConfigError) as e:
        parse_cluster(d)
    assert_one_line_error(e, "cluster.scale")


# Published per-type figures of the mini-swe-agent SWE-bench trajectories (WORKLOADS:
# "Real coding-agent timings"): type -> (share, median s, p90 s); all actions: median
# 0.26 s, p90 0.51 s.
MINI_SWE_AGENT = {"code_search": (0.293, 0.241, 0.366), "python": (0.256, 0.339, 0.579),
                  "read": (0.202, 0.234, 0.296), "edit": (0.114, 0.232, 0.289),
                  "test_run": (0.043, 0.397, 1.02), "other": (0.028, 0.243, 0.380),
                  "pip_install": (0.027, 3.38, 15.6), "git": (0.025, 0.240, 0.347),
                  "list": (0.013, 0.243, 0.313)}


def test_coding_action_mix_matches_the_measured_one():
    w, _ = profile("coding")
    (task,) = w.tasks
    rng = np.random.default_rng(0)
    names, times = [], []
    for _ in range(600):
        for turn in sample_trajectory(task, rng, w.estimate_error).turns[:-1]:
            names.append(turn.action.name)
            times.append(min(turn.action.true_s, turn.action.timeout_s))
    names, times = np.array(names), np.array(times)
    assert set(names) == set(MINI_SWE_AGENT)
    for name, (share, median, p90) in MINI_SWE_AGENT.items():
        x = times[names == name]
        assert abs(len(x) / len(times) - share) < 0.01, name
        assert np.percentile(x, [50, 90]) == pytest.approx([median, p90], rel=0.1), name
    # The mix as a whole: the tails are no longer counted twice.
    assert np.percentile(times, [50, 90]) == pytest.approx([0.26, 0.51], rel=0.06)


def test_retool_is_tool_bound():
    """Per trajectory, the code runs (queueing included) take several times the
    generation under first come first served: the tools set the step time."""
    from metasched.agents import make_scheduler
    from metasched.envs.scheduling import scale_workload
    from metasched.sim.simulator import Simulator

    w, c = profile("retool")
    w = scale_workload(w, steps=1)
    sim = Simulator(w, c, 0, max_wait_s=300)
    r = sim.run(make_scheduler("fifo"))
    trajs = sim.instance.steps[0]
    gen = sum(turn.gen_s for t in trajs for turn in t.turns)
    assert r.act.sum() > 5 * gen
    assert r.utilisation()["cpu"] > 0.6


def test_valid_config_parses_to_expected_values(valid_config):
    w, c = load(*valid_config)
    tasks = {t.name: t for t in w.tasks}
    assert [t.name for t in w.tasks] == ["code", "rm", "search"]
    shell, tests = tasks["code"].actions  # sorted by name: shell, tests
    assert (shell.name, tests.name) == ("shell", "tests")
    assert shell.duration_s.median == 0.3
    assert shell.duration_s.sigma == pytest.approx(math.log(5 / 0.3) / Z99)
    assert tests.duration_s.sigma == pytest.approx(math.log(10 / 2) / Z90)
    assert (tests.min_cores, tests.max_cores, tests.parallel_fraction) == (1, 8, 0.8)
    assert (shell.min_cores, shell.max_cores) == (1, 1)
    reward = tasks["code"].reward
    assert (reward.prob, reward.min_cores, reward.max_cores) == (1.0, 2, 8)
    assert reward.duration_s.sigma == 0.0 and reward.duration_s.median == 10.0
    assert tasks["rm"].reward.service == "rm7b" and w.services["rm7b"].max_batch == 8
    assert tasks["search"].reward.tokens.hi == 8000
    assert tasks["code"].sandbox.mem_gb == 4
    assert c.cpu_nodes == 2 and c.endpoints["judge"].tpm == 600000
    assert c.endpoints["web"].window_s == 60.0  # default: the per-minute quota
    assert c.resources() == {"cpu": 32, "gpu": 1, "api": 32}


@pytest.mark.parametrize("d, expected", [
    (2.5, (2.5, 0.0, 2.5, 2.5)),  # a plain number is a constant
    ({"median": 1.0}, (1.0, 0.0, 0.0, math.inf)),
    ({"median": 2.0, "p90": 4.0, "min": 1.0, "max": 8.0},
     (2.0, math.log(2.0) / Z90, 1.0, 8.0)),
])
def test_parse_dist(d, expected):
    dist = parse_dist(d, "x")
    assert (dist.median, dist.sigma, dist.lo, dist.hi) == pytest.approx(expected)
    assert dist.tail_sigma is None


@pytest.mark.parametrize("median, p90, p99", [(0.397, 1.02, 61.4), (3.38, 15.6, 60.1),
                                              (1.0, 3.0, 4.0)])
def test_dist_with_p90_and_p99_holds_all_three_quantiles(median, p90, p99):
    dist = parse_dist({"median": median, "p90": p90, "p99": p99}, "x")
    assert dist.sigma == pytest.approx(math.log(p90 / median) / Z90)
    assert dist.tail_sigma == pytest.approx(math.log(p99 / p90) / (Z99 - Z90))
    x = dist.sample(np.random.default_rng(0), 400_000)
    q = np.percentile(x, [50, 90, 99])
    assert q == pytest.approx([median, p90, p99], rel=0.03)
    # One draw consumes one normal, as a plain log-normal does: the body below the p90
    # is the log-normal through the median and p90, draw for draw.
    plain = parse_dist({"median": median, "p90": p90}, "x")
    a = dist.sample(np.random.default_rng(1), 1000)
    b = plain.sample(np.random.default_rng(1), 1000)
    body = b <= p90
    assert np.array_equal(a[body], b[body])
    # Above it the tail is heavier or lighter than the body's, as the p99 says.
    assert (np.sign(a[~body] - b[~body]) == np.sign(dist.tail_sigma - dist.sigma)).all()


# ------------------------------------------------------------------ bad fields


def _at(d: dict, path: str):
    *parents, last = path.split("/")
    for p in parents:
        d = d[p]
    return d, last


def setter(path: str, value):
    def apply(d):
        parent, key = _at(d, path)
        parent[key] = copy.deepcopy(value)
    return apply


def deleter(path: str):
    def apply(d):
        parent, key = _at(d, path)
        del parent[key]
    return apply


SHELL = "tasks/code/actions/shell"
TESTS = "tasks/code/actions/tests"
F_SHELL = "workload.tasks.code.actions.shell"
F_TESTS = "workload.tasks.code.actions.tests"

BAD_WORKLOAD = [
    ("negative duration median", setter(f"{SHELL}/duration_s/median", -1),
     f"{F_SHELL}.duration_s.median"),
    ("zero duration", setter(f"{SHELL}/duration_s", 0), f"{F_SHELL}.duration_s"),
    ("p99 below median", setter(f"{SHELL}/duration_s/p99", 0.1), f"{F_SHELL}.duration_s.p99"),
    ("p90 below median", setter(f"{TESTS}/duration_s/p90", 1), f"{F_TESTS}.duration_s.p90"),
    ("p99 below p90", setter(f"{TESTS}/duration_s/p99", 4), f"{F_TESTS}.duration_s.p99"),
    ("NaN duration", setter(f"{SHELL}/duration_s/median", math.nan),
     f"{F_SHELL}.duration_s.median"),
    ("median above max", setter("tasks/code/generation_s/max", 1.0),
     "workload.tasks.code.generation_s"),
    ("probabilities do not sum to 1", setter(f"{SHELL}/prob", 0.5), "workload.tasks.code.actions"),
    ("prob above 1", setter(f"{SHELL}/prob", 1.5), f"{F_SHELL}.prob"),
    ("prob is a bool", setter(f"{SHELL}/prob", True), f"{F_SHELL}.prob"),
    ("unknown kind", setter(f"{SHELL}/kind", "tpu"), f"{F_SHELL}.kind"),
    ("missing kind", deleter(f"{SHELL}/kind"), f"{F_SHELL}.kind"),
    ("missing timeout", deleter(f"{SHELL}/timeout_s"), f"{F_SHELL}.timeout_s"),
    ("unknown service", setter("tasks/rm/reward/service", "nope"),
     "workload.tasks.rm.reward.service"),
    ("unknown field in action", setter(f"{SHELL}/bogus", 1), f"{F_SHELL}.bogus"),
    ("unknown field in dist", setter(f"{SHELL}/duration_s/mean", 1), f"{F_SHELL}.duration_s.mean"),
    ("unknown field in task", setter("tasks/code/weight", 1), "workload.tasks.code.weight"),
    ("unknown top-level field", setter("stepz", 1), "workload.stepz"),
    ("cores [4, 2]", setter(f"{TESTS}/cores", [4, 2]), f"{F_TESTS}.cores[1]"),
    ("cores [0, 2]", setter(f"{TESTS}/cores", [0, 2]), f"{F_TESTS}.cores[0]"),
    ("cores of three", setter(f"{TESTS}/cores", [1, 2, 3]), f"{F_TESTS}.cores"),
    ("cores fractional", setter(f"{TESTS}/cores", [1, 2.5]), f"{F_TESTS}.cores[1]"),
    ("parallel fraction above 1", setter(f"{TESTS}/parallel_fraction", 1.5),
     f"{F_TESTS}.parallel_fraction"),
    ("timeout 0", setter(f"{SHELL}/timeout_s", 0), f"{F_SHELL}.timeout_s"),
    ("timeout infinite", setter(f"{SHELL}/timeout_s", math.inf), f"{F_SHELL}.timeout_s"),
    ("empty endpoint", setter("tasks/search/actions/web/endpoint", ""),
     "workload.tasks.search.actions.web.endpoint"),
    ("steps 0", setter("steps", 0), "workload.steps"),
    ("fractional trajectories", setter("trajectories_per_step", 2.5),
     "workload.trajectories_per_step"),
    ("negative estimate error", setter("estimate_error", -0.1), "workload.estimate_error"),
    ("negative sandbox memory", setter("tasks/code/sandbox/mem_gb", -4),
     "workload.tasks.code.sandbox.mem_gb"),
    ("service without mem_gb", deleter("services/rm7b/mem_gb"), "workload.services.rm7b.mem_gb"),
    ("max_batch 0", setter("services/rm7b/max_batch", 0), "workload.services.rm7b.max_batch"),
    ("no tasks", setter("tasks", {}), "workload.tasks"),
    ("actions not a mapping", setter("tasks/code/actions", [1]), "workload.tasks.code.actions"),
    ("task not a mapping", setter("tasks/code", 3), "workload.tasks.code"),
]

BAD_COMPATIBILITY = [
    ("unknown endpoint", setter("tasks/search/actions/web/endpoint", "nope"), None,
     "workload.tasks.search.actions.web.endpoint"),
    ("GPU service bigger than a device", setter("services/rm7b/mem_gb", 100), None,
     "workload.tasks.rm.reward.service"),
    ("no GPU", None, setter("gpu/devices", 0), "workload.tasks.rm.reward.service"),
    ("tokens above the bucket", setter("tasks/search/reward/tokens/max", 20000), None,
     "workload.tasks.search.reward.tokens"),
    ("sandbox bigger than a node", setter("tasks/code/sandbox/mem_gb", 100), None,
     "workload.tasks.code.sandbox.mem_gb"),
    ("more cores than a node", setter("tasks/code/reward/cores", [32, 64]), None,
     "workload.tasks.code.reward.cores"),
]

BAD_CLUSTER = [
    ("rpm 0", setter("api/endpoints/web/rpm", 0), "cluster.api.endpoints.web.rpm"),
    ("missing rpm", deleter("api/endpoints/web/rpm"), "cluster.api.endpoints.web.rpm"),
    ("max_concurrency 0", setter("api/endpoints/judge/max_concurrency", 0),
     "cluster.api.endpoints.judge.max_concurrency"),
    ("negative tpm", setter("api/endpoints/judge/tpm", -1), "cluster.api.endpoints.judge.tpm"),
    ("window 0", setter("api/endpoints/judge/window_s", 0), "cluster.api.endpoints.judge.window_s"),
    ("unknown field", setter("gpu/bogus", 1), "cluster.gpu.bogus"),
    ("unknown section", setter("tpu", {}), "cluster.tpu"),
    ("fractional nodes", setter("cpu/nodes", 1.5), "cluster.cpu.nodes"),
    ("negative gpu memory", setter("gpu/mem_gb", -80), "cluster.gpu.mem_gb"),
    ("string cores", setter("cpu/cores_per_node", "16"), "cluster.cpu.cores_per_node"),
    ("negative launch", setter("cpu/launch_s", -0.01), "cluster.cpu.launch_s"),
    ("launch p90 below it", lambda c: (setter("cpu/launch_s", 0.01)(c),
                                       setter("cpu/launch_p90_s", 0.005)(c))[-1],
     "cluster.cpu.launch_p90_s"),
]


@pytest.mark.parametrize("mutate, field", [pytest.param(m, f, id=i) for i, m, f in BAD_WORKLOAD])
def test_bad_workload_field(valid_config, mutate, field):
    w, _ = valid_config
    mutate(w)
    with pytest.raises(ConfigError) as excinfo:
        parse_workload(w)
    assert_one_line_error(excinfo, field)


@pytest.mark.parametrize("mutate_w, mutate_c, field",
                         [pytest.param(w, c, f, id=i) for i, w, c, f in BAD_COMPATIBILITY])
def test_workload_incompatible_with_cluster(valid_config, mutate_w, mutate_c, field):
    w, c = valid_config
    if mutate_w:
        mutate_w(w)
    if mutate_c:
        mutate_c(c)
    wc, cc = parse_workload(w), parse_cluster(c)  # each is valid on its own
    with pytest.raises(ConfigError) as excinfo:
        check_compatible(wc, cc)
    assert_one_line_error(excinfo, field)


@pytest.mark.parametrize("mutate, field", [pytest.param(m, f, id=i) for i, m, f in BAD_CLUSTER])
def test_bad_cluster_field(valid_config, mutate, field):
    _, c = valid_config
    mutate(c)
    with pytest.raises(ConfigError) as excinfo:
        parse_cluster(c)
    assert_one_line_error(excinfo, field)


def test_zero_prob_action_is_not_checked_against_the_cluster(valid_config):
    w, c = valid_config
    w["tasks"]["code"]["actions"]["tests"]["cores"] = [32, 64]  # no node has 32 cores ...
    w["tasks"]["code"]["actions"]["tests"]["prob"] = 0.0  # ... but it never happens
    w["tasks"]["code"]["actions"]["shell"]["prob"] = 1.0
    load(w, c)


# ------------------------------------------------------------------ Hypothesis: fuzzed specs

SERVICES = {"rm": {"mem_gb": 10, "restore_s": 1.0, "max_batch": 4}}
TEMPLATES = {
    "cpu": {"kind": "cpu", "prob": 1.0, "duration_s": {"median": 1.0, "p99": 5.0},
            "timeout_s": 30, "cores": [1, 4], "parallel_fraction": 0.5},
    "gpu": {"kind": "gpu", "prob": 1.0, "duration_s": 0.5, "timeout_s": 30, "service": "rm"},
    "api": {"kind": "api", "prob": 1.0, "duration_s": 1.0, "timeout_s": 30, "endpoint": "e",
            "tokens": {"median": 100, "max": 200}},
}
SPECIAL = [0, 1, -1, 0.5, -0.0, 1e-320, 1e308, -1e308, 2**62, math.inf, -math.inf, math.nan]
HUGE_INTS = st.one_of(st.integers(min_value=2**1024, max_value=2**1100),
                      st.integers(max_value=-(2**1024), min_value=-(2**1100)))


def numbers(hostile: bool):
    base = st.one_of(st.integers(-5, 100), st.integers(), st.floats(), st.sampled_from(SPECIAL))
    return st.one_of(base, HUGE_INTS) if hostile else base


def scalars(hostile: bool):
    return st.one_of(numbers(hostile), st.none(), st.booleans(), st.text(max_size=6),
                     st.sampled_from(["cpu", "gpu", "api", "rm", "e", "tpu", ""]))


def values(hostile: bool):
    """Anything a YAML/JSON config could hold: scalars, lists, mappings (str keys)."""
    scalar = scalars(hostile)
    return st.one_of(
        scalar, st.lists(scalar, max_size=3),
        st.dictionaries(st.sampled_from(["median", "p90", "p99", "min", "max", "x"]), scalar,
                        max_size=4))


def dists(hostile: bool):
    num = numbers(hostile)
    return st.one_of(
        num, values(hostile),
        st.fixed_dictionaries({}, optional={"median": num, "p90": num, "p99": num, "min": num,
                                            "max": num}))


def field_values(key: str, hostile: bool):
    if key in ("duration_s", "tokens"):
        return dists(hostile)
    if key == "cores":
        return st.one_of(st.lists(numbers(hostile), max_size=3), values(hostile))
    if key == "service" and not hostile:
        return scalars(False)  # hashable values only (see test_unhashable_service)
    return values(hostile)


FIELDS = ("kind", "prob", "duration_s", "timeout_s", "cores", "parallel_fraction", "service",
          "endpoint", "tokens")


@st.composite
def action_specs(draw, hostile: bool = False):
    """A valid action of a random kind with each field kept, replaced by an arbitrary
    value or removed, and perhaps unknown fields added."""
    d = dict(TEMPLATES[draw(st.sampled_from(sorted(TEMPLATES)))])
    for key in FIELDS:
        op = draw(st.sampled_from(["keep", "keep", "keep", "replace", "delete"]))
        if op == "replace":
            d[key] = draw(field_values(key, hostile))
        elif op == "delete":
            d.pop(key, None)
    if draw(st.integers(0, 9)) == 0:  # now and then, unknown fields
        if hostile:
            keys = st.one_of(st.text(max_size=4), st.integers(), st.just("a\nb"))
        else:
            keys = st.sampled_from(["bogus", "Kind", "cores_", ""])
        d.update(draw(st.dictionaries(keys, values(hostile), min_size=1, max_size=3)))
    return d


def workload_with(action, as_reward: bool) -> dict:
    task = {"turns": 1, "generation_s": 1.0, "sandbox": None,
            "actions": {"x": TEMPLATES["cpu"]}, "reward": TEMPLATES["cpu"]}
    if as_reward:
        task["reward"] = action
    else:
        task["actions"] = {"x": action}
    return {"name": "fuzz", "services": SERVICES, "tasks": {"t": task}}


def check_parses_or_config_error(action, as_reward: bool) -> None:
    try:
        w = parse_workload(workload_with(action, as_reward))
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and "\r" not in msg, msg
        assert msg.startswith("workload.tasks.t."), msg
        return
    # Parsed: the action type must be usable as it stands.
    (task,) = w.tasks
    a = task.reward if as_reward else task.actions[0]
    assert a.kind in KINDS
    assert 0.0 <= a.prob <= 1.0
    if not as_reward:
        assert a.prob == pytest.approx(1.0)  # the only action: probabilities sum to 1
    assert math.isfinite(a.timeout_s) and a.timeout_s > 0
    d = a.duration_s
    assert math.isfinite(d.median) and d.median > 0
    assert math.isfinite(d.sigma) and d.sigma >= 0
    assert 0 <= d.lo <= d.median <= d.hi
    assert isinstance(a.min_cores, int) and isinstance(a.max_cores, int)
    assert 1 <= a.min_cores <= a.max_cores
    assert 0.0 <= a.parallel_fraction <= 1.0
    if a.kind == "gpu":
        assert a.service in w.services
    if a.kind == "api":
        assert isinstance(a.endpoint, str) and a.endpoint
        assert a.tokens is not None and 0 <= a.tokens.median < math.inf
    # ... and sampling from it gives finite, non-negative durations.
    traj = sample_trajectory(task, np.random.default_rng(0), 0.5)
    for turn in traj.turns:
        assert math.isfinite(turn.action.true_s) and turn.action.true_s >= 0
        assert math.isfinite(turn.action.est_s)


@settings(max_examples=400)
@given(action=action_specs(), as_reward=st.booleans())
@example(action={**TEMPLATES["cpu"], "cores": [math.inf, math.inf]}, as_reward=False)
@example(action={**TEMPLATES["cpu"], "cores": [1, math.nan]}, as_reward=True)
@example(action={**TEMPLATES["cpu"], "duration_s": {"median": math.inf, "p99": math.inf}},
         as_reward=False)
@example(action={**TEMPLATES["api"], "tokens": {"median": 1e308, "p99": 1e308}}, as_reward=True)
@example(action={"kind": "gpu"}, as_reward=True)
@example(action={}, as_reward=False)
def test_fuzzed_action_spec_parses_or_raises_config_error(action, as_reward):
    check_parses_or_config_error(action, as_reward)


@settings(max_examples=400)
@given(action=action_specs(hostile=True), as_reward=st.booleans())
@example(action={**TEMPLATES["cpu"], "timeout_s": 10**400}, as_reward=False)
@example(action={**TEMPLATES["gpu"], "service": ["rm"]}, as_reward=True)
@example(action={**TEMPLATES["cpu"], 1: 0, "zz": 0}, as_reward=False)
@example(action={**TEMPLATES["cpu"], "a\nb": 0}, as_reward=True)
def test_fuzzed_action_spec_including_hostile_values(action, as_reward):
    check_parses_or_config_error(action, as_reward)


# ------------------------------------------------------------------ regressions


@pytest.mark.parametrize("key, value", [
    pytest.param("timeout_s", 10**400, id="timeout_s"),
    pytest.param("prob", -(10**400), id="prob"),
    pytest.param("cores", [1, 10**400], id="cores"),
])
def test_huge_int_raises_config_error(key, value):
    action = {**TEMPLATES["cpu"], key: value}
    with pytest.raises(Exception) as excinfo:
        parse_workload(workload_with(action, as_reward=False))
    assert isinstance(excinfo.value, ConfigError), repr(excinfo.value)


@pytest.mark.parametrize("service", [["rm"], {"name": "rm"}], ids=["list", "dict"])
def test_unhashable_service(service):
    action = {**TEMPLATES["gpu"], "service": service}
    with pytest.raises(Exception) as excinfo:
        parse_workload(workload_with(action, as_reward=True))
    assert isinstance(excinfo.value, ConfigError), repr(excinfo.value)


def test_mixed_type_unknown_keys():
    action = {**TEMPLATES["cpu"], 1: 0, "zz": 0}
    with pytest.raises(Exception) as excinfo:
        parse_workload(workload_with(action, as_reward=False))
    assert isinstance(excinfo.value, ConfigError), repr(excinfo.value)


@pytest.mark.parametrize("where", ["unknown field", "action name", "task name"])
def test_newline_in_key_gives_multiline_message(where):
    bad = {**TEMPLATES["cpu"], "timeout_s": 0}
    if where == "unknown field":
        w = workload_with({**TEMPLATES["cpu"], "bo\ngus": 1}, as_reward=False)
    elif where == "action name":
        w = workload_with(bad, as_reward=False)
        w["tasks"]["t"]["actions"] = {"she\nll": bad}
    else:
        w = workload_with(bad, as_reward=True)
        w["tasks"] = {"ta\nsk": w["tasks"]["t"]}
    with pytest.raises(ConfigError) as excinfo:
        parse_workload(w)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("what, mutate", [
    ("workload.services", lambda w, c: w.__setitem__("services", ["rm7b"])),
    ("cluster.cpu", lambda w, c: c.__setitem__("cpu", 5)),
    ("cluster.api", lambda w, c: c.__setitem__("api", ["endpoints"])),
    ("cluster.api.endpoints", lambda w, c: c["api"].__setitem__("endpoints", ["web"])),
])
def test_section_not_a_mapping(valid_config, what, mutate):
    w, c = valid_config
    mutate(w, c)
    with pytest.raises(Exception) as excinfo:
        load(w, c)
    assert isinstance(excinfo.value, ConfigError), repr(excinfo.value)
    assert excinfo.value.field.startswith(what)


def test_profile_composes_inside_a_running_hydra_app():
    """An app (``metasched-train`` cloning on several profiles) composes other profiles
    while its own Hydra is initialised."""
    from hydra import initialize_config_dir

    from metasched.compose import config_dir, profile

    outside = profile("retool")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        inside = profile("retool")
    assert inside == outside and inside[0].name == "retool"


def test_an_action_spec_holds_the_shared_demand_fields():
    """A simulated action's resource fields are the shared Demand's, with its defaults:
    the action type it is drawn from and a request are Demands."""
    import dataclasses

    from metasched.core.actions import ActionSpec
    from metasched.core.schema import DEMAND_FIELDS, Demand
    from metasched.runtime.requests import Request
    from metasched.sim.workload_config import ActionType

    spec_defaults = {f.name: f.default for f in dataclasses.fields(ActionSpec)}
    for name in DEMAND_FIELDS:
        assert spec_defaults[name] == Demand.model_fields[name].default, name
    assert issubclass(ActionType, Demand) and issubclass(Request, Demand)
    w, _ = profile("coding")
    t = w.tasks[0]
    for turn in sample_trajectory(t, np.random.default_rng(0), 0.0).turns:
        spec = turn.action
        typ = next(a for a in (*t.actions, t.reward) if a.name == spec.name)
        assert spec.demand == Demand(**{f: getattr(typ, f) for f in DEMAND_FIELDS})
