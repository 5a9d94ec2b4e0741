"""The OpenAI-compatible front door (``/v1/chat/completions``, ``/v1/completions``)
against ``benchmarks/openai_stub.py``, a local HTTP server process that speaks the
OpenAI streaming format and is **not vLLM** (the real-vLLM checks are
``test_serve_openai_vllm.py``'s): pass-through byte for byte, the priority stamp, a
trajectory kept on one replica, the trace's ``generation`` lines, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from metasched.core.engine import GenerationLine
from metasched.core.predictor import Predictor, TrajRecord
from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig
from metasched.serve.generation_door import Generation
from tests.helpers import free_port
from tests.serve_helpers import serving

STUB = Path(__file__).parents[1] / "benchmarks" / "openai_stub.py"


def _records() -> list[TrajRecord]:
    """Made-up trajectories: task ``long`` has 10 turns of ~5 s, ``short`` one of
    ~0.2 s."""
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(40):
        recs.append(TrajRecord("long", None, tuple(
            ("bash", 2.0 * rng.uniform(0.8, 1.2), 3.0) for _ in range(10))))
        recs.append(TrajRecord("short", None, (("bash", 0.1 * rng.uniform(0.8, 1.2), 0.1),)))
    return recs


def _predictor() -> Predictor:
    """Fitted on :func:`_records`."""
    return Predictor.fit(_records())


@pytest.fixture(scope="module")
def stubs():
    """Two stub replicas (separate processes)."""
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, str(STUB), "--port", str(p), "--echo-priority"],
                              stderr=subprocess.PIPE) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _door(stubs, tmp_path, order: str = "predicted"):
    dcfg = DispatcherConfig(scheduler="elastic_greedy", trace=str(tmp_path / "trace.jsonl"))
    cfg = ServeConfig(languages=[], generation={"replicas": stubs, "order": order})
    return serving(dcfg, cfg, predictor=_predictor())


BODIES = [
    ("/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize("path,body", BODIES)
@pytest.mark.parametrize("stream", [True, False])
def test_passes_answer_through_byte_for_byte(stubs, tmp_path, path, body, stream):
    body = {**body, "stream": stream}
    with _door(stubs, tmp_path, order="fifo") as s:
        direct = httpx.post(stubs[0] + path, json=body, timeout=30)
        through = httpx.post(s.url + path, json=body, timeout=30)
    assert through.status_code == direct.status_code == 200
    assert through.content == direct.content
    assert through.headers["content-type"] == direct.headers["content-type"]


def test_stamps_longest_predicted_remaining_first(stubs, tmp_path):
    body = {"model": "m", "prompt": [1, 2], "stream": True}
    got = {}
    with _door(stubs, tmp_path) as s:
        for task in ("long", "short"):
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=30,
                           headers={"X-Trajectory-Id": f"t-{task}", "X-Task": task})
            first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
            got[task] = first["metasched_priority"]
        plain = httpx.post(s.url + "/v1/completions", json={**body, "priority": 3},
                           timeout=30)
    assert got["long"] < got["short"] < 0  # lower first: the long trajectory's turn
    assert '"metasched_priority": 3' in plain.text  # no trajectory: the client's own


def test_keeps_a_trajectory_on_one_replica_and_traces_its_turns(stubs, tmp_path):
    body = {"model": "m", "prompt": [1, 2, 3, 4], "stream": True}
    with _door(stubs, tmp_path) as s:
        for turn in range(3):
            for traj in ("a", "b"):
                r = httpx.post(s.url + "/v1/completions", json=body, timeout=30,
                               headers={"X-Trajectory-Id": traj, "X-Turn": str(turn),
                                        "X-Task": "long"})
                assert r.status_code == 200
    lines = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    gens = [x for x in lines if x["type"] == "generation"]
    assert len(gens) == 6
    for g in gens:
        GenerationLine.model_validate({k: v for k, v in g.items() if k != "type"})
        assert (g["prompt_tokens"], g["output_tokens"]) == (4, 16)
        assert g["queue_s"] >= 0 and g["run_s"] >= 0
    replicas = {t: {g["replica"] for g in gens if g["trajectory"] == t} for t in "ab"}
    assert all(len(r) == 1 for r in replicas.values())
    assert [g["turn"] for g in gens if g["trajectory"] == "a"] == [0, 1, 2]


@pytest.mark.parametrize("body,says", [
    ({"prompt": [1]}, "model: "),
    ({"model": "m"}, "prompt: "),
    ({"model": "m", "prompt": [1], "stream": "often"}, "stream: "),
])
def test_bad_request_is_one_line(stubs, tmp_path, body, says):
    with _door(stubs, tmp_path) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 422
    assert r.json()["detail"].startswith(says) and "\n" not in r.json()["detail"]


def test_without_replicas_answers_404():
    with serving() as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 404 and "generation.replicas" in r.json()["detail"]


def test_unreachable_replica_is_502(tmp_path):
    cfg = ServeConfig(languages=[], generation={"replicas": [f"http://127.0.0.1:{free_port()}"]})
    with serving(config=cfg) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 502 and "unreachable" in r.json()["detail"]


def _sse(n: int) -> bytes:
    """A streamed completion of ``n`` one-token chunks, then its usage and [DONE]."""
    events = [json.dumps({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
              for i in range(n)]
    events.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 3,
                                                       "completion_tokens": n}}))
    return b"".join(f"data: {e}\n\n".encode() for e in [*events, "[DONE]"])


@pytest.mark.parametrize("n,cut", [(16, 7), (16, 1000), (20_000, 4093)])
def test_counts_a_stream_cut_anywhere(n, cut):
    # The door passes on whatever pieces the replica's reads give; the count must not
    # depend on where they cut the events, nor on whether it ran at the end or (a long
    # answer, over what the door holds) as the pieces passed.
    whole = _sse(n)
    gen = Generation(None, None, 0, None, 3, t0=0.0, stream=True)
    pieces = [whole[i:i + cut] for i in range(0, len(whole), cut)]
    for k, piece in enumerate(pieces):
        gen.arrived(piece, 1.0 + k)
    gen.count()
    assert (gen.output_tokens, gen.usage["completion_tokens"]) == (n, n)
    first_end = whole.index(b"\n\n") + 1  # the first event's last byte
    assert gen.first_s == 1.0 + first_end // cut  # the piece that completed it
    assert not gen.held and gen.rest == b""


class _Recording(Predictor):
    """The predictor, keeping the generation gaps it is given (by trajectory)."""

    def observe(self, key, task, group, name, seconds, **kw):
        if name == "gen":
            self.__dict__.setdefault("gaps", {}).setdefault(key, []).append(seconds)
        super().observe(key, task, group, name, seconds, **kw)


def test_feeds_the_predictor_the_generation_it_measured(stubs, tmp_path):
    # Two trajectories with the same timeline: an action, 1 s of the client's own
    # time around a generation, a second action. Only a's generation goes through the
    # door: its gap is learned as the generation's measured time; b's as the wall gap.
    # (The predictor is fitted on made-up trajectories; nothing here is scored.)
    echo = {"kind": "cpu", "argv": ["true"], "timeout_s": 10}
    body = {"model": "m", "prompt": [1, 2, 3], "stream": True}
    dcfg = DispatcherConfig(scheduler="elastic_greedy", trace=str(tmp_path / "trace.jsonl"))
    cfg = ServeConfig(languages=[], generation={"replicas": stubs})
    p = _Recording.fit(_records())
    with serving(dcfg, cfg, predictor=p) as s, \
            httpx.Client(base_url=s.url, timeout=30) as http:
        for traj, base in (("a", s.url), ("b", stubs[0])):
            hdr = {"X-Trajectory-Id": traj, "X-Task": "long"}
            r = http.post("/v1/actions", json=echo, params={"wait": 10},
                          headers={**hdr, "X-Turn": "0"})
            assert r.json()["status"] == "done"
            time.sleep(0.5)
            assert httpx.post(base + "/v1/completions", json=body, headers=hdr).is_success
            time.sleep(0.5)
            r = http.post("/v1/actions", json=echo, params={"wait": 10},
                          headers={**hdr, "X-Turn": "1"})
            assert r.json()["status"] == "done"
        ids = {t: s.dispatcher.trajectories.get(t).id for t in "ab"}
        feats = {t: p.features(ids[t]) for t in "ab"}
        est = {t: p.remaining(ids[t]).p50 for t in "ab"}
    line = next(json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()
                if '"generation"' in x)
    measured = line["queue_s"] + line["run_s"]
    gaps = p.__dict__["gaps"]
    assert gaps[ids["a"]][-1] == pytest.approx(measured, abs=1e-6)
    assert gaps[ids["b"]][-1] >= 1.0  # the wall gap, the client's time in it
    assert feats["a"][11] < feats["b"][11]  # log elapsed
    assert est["a"] != est["b"]
