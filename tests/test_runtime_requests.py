"""Requests (strict JSON parsing, round trip) and the online cost model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metasched.core.cost_model import CostModel
from metasched.errors import ConfigError, one_of, validation_error
from metasched.runtime.requests import Request, Result, parse_request

CPU = {"kind": "cpu", "argv": ["/bin/echo", "hi"], "timeout_s": 5}


def test_cpu_request_defaults_and_signature():
    r = parse_request(dict(CPU, task="swe"))
    assert (r.kind, r.argv, r.min_cores, r.max_cores, r.task) == ("cpu", ("/bin/echo", "hi"),
                                                                  1, 1, "swe")
    assert r.name == "echo" and r.signature == "cpu:swe:echo"
    assert len(r.id) == 32  # a fresh key when none is given
    assert parse_request(dict(CPU)).id != r.id
    # a name not given is never the error: a program's overlong basename is cut to 256
    assert parse_request(dict(CPU, argv=["/x/" + "p" * 300])).name == "p" * 256


@pytest.mark.parametrize("req", [
    dict(CPU, id="a", trajectory="t1", prompt="p-7", turn=3, reward=True, est_s=0.5,
         min_cores=2,
         max_cores=8, parallel_fraction=0.9, mem_limit_mb=512, cpu_time_s=10,
         env={"A": "1"}, name="pytest"),
    {"kind": "gpu", "id": "g", "service": "orm", "payload": [1, 2], "timeout_s": 3},
    {"kind": "gpu", "id": "c", "argv": ["nvidia-smi"], "timeout_s": 3},
    {"kind": "api", "id": "h", "endpoint": "search", "tokens": 20, "timeout_s": 3,
     "http": {"url": "http://127.0.0.1:9/x", "method": "POST", "json": {"q": 1}}},
])
def test_round_trip_through_json(req):
    r = parse_request(req)
    assert parse_request(r.to_dict()) == r
    assert parse_request(__import__("json").loads(r.to_json())) == r


@pytest.mark.parametrize("req, message", [
    ({"kind": "tpu", "timeout_s": 1}, "kind: must be one of cpu, gpu, api"),
    (dict(CPU, timeout_s=-1), "timeout_s: must be > 0 (got -1)"),
    (dict(CPU, timeout_s=0), "timeout_s: must be > 0"),
    ({"kind": "cpu", "timeout_s": 1}, "argv: is required"),
    (dict(CPU, argv="ls -l"), "argv: must be a list (got 'ls -l')"),
    (dict(CPU, argv=[]), "argv: must have at least 1 item(s) (got [])"),
    (dict(CPU, argv=["ls", 3]), "argv[1]: must be a string (got 3)"),
    (dict(CPU, argv=["", "x"]), "argv[0]: the program must not be empty"),
    (dict(CPU, argv=["ls", "a\0b"]), "argv[1]: must not contain NUL characters"),
    (dict(CPU, min_cores=4, max_cores=2), "max_cores: must be >= 4"),
    (dict(CPU, min_cores=0), "min_cores: must be >= 1"),
    (dict(CPU, parallel_fraction=1.5), "parallel_fraction: must be <= 1 (got 1.5)"),
    (dict(CPU, min_cores=2.5), "min_cores: must be a whole number (got 2.5)"),
    (dict(CPU, min_cores=True), "min_cores: must be a whole number (got True)"),
    (dict(CPU, turn=10**7), "turn: must be <= 1000000 (got 10000000)"),
    (dict(CPU, timeout_s=float("inf")), "timeout_s: must be a finite number (got inf)"),
    (dict(CPU, workspace_mb=64), "workspace_mb: only a trajectory has a workspace"),
    (dict(CPU, trajectory="t", prompt=["p"]), "prompt: must be a string (got ['p'])"),
    (dict(CPU, trajectory="t", prompt=""), "prompt: must not be empty"),
    (dict(CPU, trajectory="t", prompt=True), "prompt: must be a string (got True)"),
    (dict(CPU, prompt="p"), "prompt: only a trajectory answers a prompt (give its trajectory"),
    (dict(CPU, trajectory="t", prompt="p" * 257), "prompt: must have at most 256 characters"),
    (dict(CPU, trajectory="t" * 257), "trajectory: must have at most 256 characters"),
    (dict(CPU, id="i" * 257), "id: must have at most 256 characters"),
    (dict(CPU, task="k" * 257), "task: must have at most 256 characters"),
    ({"kind": "api", "timeout_s": 1, "endpoint": "e", "http": {"url": "http://h"},
      "prompt": "p"}, "prompt: only a trajectory answers a prompt"),
    (dict(CPU, call="f"), "call: unknown field"),
    ({"kind": "api", "timeout_s": 1, "endpoint": "e", "http": {"url": "http://h", "x": 1}},
     "http.x: unknown field (expected one of: body, headers, json, method, url)"),
    ({"kind": "gpu", "timeout_s": 1, "service": "rm", "min_cores": 2},
     "min_cores: only commands (requests with an argv) have it"),
    (dict(CPU, env={"A": 1}), "env.A: must be a string"),
    (dict(CPU, env={"A=B": "1"}), "env: bad variable name"),
    (dict(CPU, env={"A": "x\0"}), "env.A: must not contain NUL characters"),
    (dict(CPU, service="orm"), "service: only gpu requests have it (this is cpu)"),
    (dict(CPU, colour="red"), "colour: unknown field"),
    (dict(CPU, reward="yes"), "reward: must be true or false"),
    (dict(CPU, turn=-1), "turn: must be >= 0"),
    (dict(CPU, est_s=0), "est_s: must be > 0"),
    ({"kind": "gpu", "timeout_s": 1}, "service: give either a service"),
    ({"kind": "gpu", "timeout_s": 1, "service": "a", "argv": ["x"]}, "not both"),
    ({"kind": "api", "timeout_s": 1, "endpoint": "e"}, "http: an api request needs"),
    ({"kind": "api", "timeout_s": 1, "endpoint": "e", "http": {"url": "ftp://x"}},
     "http.url: must start with http:// or https://"),
    ({"kind": "api", "timeout_s": 1, "endpoint": "e", "http": "http://x"},
     "http: must be a JSON object"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_requests_fail_with_one_line_naming_the_field(req, message):
    with pytest.raises(ConfigError) as e:
        parse_request(req, "jobs.jsonl:7")
    text = str(e.value)
    assert message in text and text.startswith("jobs.jsonl:7") and "\n" not in text


@pytest.mark.parametrize("given, prompt", [("p-3", "p-3"), (17, "17"), (None, None)])
def test_prompt_is_text_like_the_trajectory(given, prompt):
    r = parse_request(dict(CPU, trajectory="t", prompt=given))
    assert r.prompt == prompt
    assert ("prompt" in r.to_dict()) == (prompt is not None)


def test_api_request_with_a_callable_is_not_replayable():
    async def call():
        return 1
    r = parse_request({"kind": "api", "endpoint": "e", "timeout_s": 1}, call=call)
    assert r.call is call and not r.replayable
    assert parse_request(dict(CPU)).replayable


def test_a_request_built_in_python_gets_the_same_checks_and_defaults():
    r = Request(kind="cpu", argv=["/usr/bin/pytest", "-q"], timeout_s=5, min_cores=2)
    assert (r.name, r.max_cores, len(r.id)) == ("pytest", 2, 32)
    assert r == parse_request(r.to_dict())
    with pytest.raises(ConfigError) as e:  # one line, as from JSON
        Request(kind="cpu", argv=["x"], timeout_s=-1)
    assert str(e.value) == "timeout_s: must be > 0 (got -1)"
    with pytest.raises(ConfigError) as e:
        Request(kind="gpu", timeout_s=1)  # neither a service nor an argv
    assert e.value.field == "service" and "\n" not in str(e.value)


def test_null_is_an_optional_fields_default_and_whole_floats_are_whole_numbers():
    r = parse_request(dict(CPU, env=None, mem_limit_mb=None, est_s=None, id=None,
                           min_cores=2.0, trajectory=17))
    assert (r.env, r.mem_limit_mb, r.min_cores, r.max_cores, r.trajectory) == (
        None, None, 2, 2, "17")
    assert r.id  # a fresh key for a null id
    with pytest.raises(ConfigError, match="task: must be a string"):
        parse_request(dict(CPU, task=None))
    with pytest.raises(ConfigError, match="min_cores: must be a whole number"):
        parse_request(dict(CPU, min_cores="2"))  # strict: text is not a number


def test_requests_with_different_callables_are_the_same_request():
    async def a():
        return 1

    async def b():
        return 2
    api = {"kind": "api", "id": "k", "endpoint": "e", "timeout_s": 1}
    assert parse_request(api, call=a) == parse_request(api, call=b)
    assert "call" not in parse_request(api, call=a).to_dict()


@pytest.mark.parametrize("errors, kw, message", [
    # FastAPI's body errors: "body" left out, a whole-body error named by root.
    ([{"type": "missing", "loc": ("body", "code"), "msg": "Field required"}],
     {"strip": ("body",), "root": "body"}, "code: is required"),
    ([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
       "ctx": {"error": "Expecting value"}}], {"strip": ("body",), "root": "body"},
     "body: not valid JSON (Expecting value)"),
    ([{"type": "string_type", "loc": ("env", 3, "[key]"), "input": 3}], {"loc": "j:2"},
     "j:2: env: bad key: must be a string (got 3)"),
    ([{"type": "greater_than_equal", "loc": ("a", 0, "b"), "input": -1, "ctx": {"ge": 0}}],
     {"at": ("x",)}, "x.a[0].b: must be >= 0 (got -1)"),
    ([{"type": "something_new", "loc": ("a",), "msg": "Pydantic's words", "input": 1}], {},
     "a: Pydantic's words (got 1)"),
    ([], {"loc": "j:9"}, "j:9: invalid"),
])
def test_validation_errors_are_one_line_naming_the_field(errors, kw, message):
    assert str(validation_error(errors, **kw)) == message


@pytest.mark.parametrize("value, kw, ok", [
    ("a", {}, True), ("c", {}, False), (None, {}, False), (None, {"null": True}, True),
    ([1], {}, False),
])
def test_one_of(value, kw, ok):
    if ok:
        assert one_of(value, ("a", "b"), "f", **kw) == value
        return
    with pytest.raises(ConfigError) as e:
        one_of(value, ("a", "b"), "f", **kw)
    assert str(e.value).startswith("f: must be one of a, b") and "(got " in str(e.value)


@given(st.dictionaries(st.sampled_from(sorted({
    "id", "kind", "task", "name", "trajectory", "prompt", "turn", "reward", "timeout_s", "est_s",
    "argv",
    "env", "min_cores", "max_cores", "parallel_fraction", "mem_limit_mb", "cpu_time_s",
    "service", "payload", "endpoint", "tokens", "http", "bogus"})),
    st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20), st.floats(), st.text(max_size=5),
              st.lists(st.text(max_size=3), max_size=3),
              st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))))
def test_any_dict_parses_or_fails_with_config_error(d):
    try:
        r = parse_request(d)
    except ConfigError as e:
        assert "\n" not in str(e)
        return
    assert r.kind in ("cpu", "gpu", "api") and r.timeout_s > 0
    assert parse_request(r.to_dict()) == r


def test_result_json_round_trip_and_act():
    r = Result("k", "done", queued_at=10.0, started_at=10.5, finished_at=12.0,
               allocation={"cores": [1]}, attempts=1)
    assert Result.from_json(r.to_json()) == r
    assert r.act_s == pytest.approx(2.0) and r.ok
    assert math.isnan(Result("k", "rejected").act_s)


def test_cost_model_prior_then_ewma_in_one_core_units():
    m = CostModel(alpha=0.5, default_s=2.0)
    assert m.estimate("cpu:t:x") == 2.0
    assert m.estimate("cpu:t:x", hint=0.3) == 0.3
    # 1 s on 4 cores of a fully parallel action = 4 one-core seconds
    m.observe("cpu:t:x", 1.0, cores=4, parallel_fraction=1.0)
    assert m.estimate("cpu:t:x", hint=0.3) == pytest.approx(4.0)
    m.observe("cpu:t:x", 2.0)
    assert m.estimate("cpu:t:x") == pytest.approx(3.0)
    m.observe("cpu:t:x", math.nan)  # ignored
    assert m.count["cpu:t:x"] == 2


def test_cost_model_save_load(tmp_path):
    m = CostModel()
    m.observe("api:t:e", 0.25)
    m.save(tmp_path / "c.json")
    n = CostModel()
    n.load(tmp_path / "c.json")
    n.load(tmp_path / "missing.json")
    assert n.estimate("api:t:e") == pytest.approx(0.25)


@pytest.mark.parametrize("kw", [{"alpha": 0}, {"alpha": 1.5}, {"default_s": 0}])
def test_cost_model_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        CostModel(**kw)
