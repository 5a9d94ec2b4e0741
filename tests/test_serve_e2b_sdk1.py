"""E2B's SDK 1.x through the service's door on its debug mode's fixed ports
(``e2b_sdk1_ports``, :mod:`metasched.serve.e2b.sdk1_door`).

The routing is checked with httpx, sending what SDK 1.x sends (its wire calls: no
sandbox in any URL, no header at all on the interpreter's). SDK 1.x itself cannot
share this venv with 2.x: the slow tests run it in a subprocess with the Python in
``METASCHED_E2B1_PYTHON``::

    python -m venv /tmp/e2b1-venv
    /tmp/e2b1-venv/bin/pip install e2b==1.11.1 e2b-code-interpreter==1.5.2 pydantic click

(``pydantic`` and ``click``: what rllm imports on the way to its E2B tool). rllm's
``E2BPythonInterpreter`` is imported, unmodified, from the rllm checkout named by
``METASCHED_RLLM``: a source tree holding ``rllm/``, or a git directory of
rllm-org/rllm, whose ``rllm/`` is extracted to a temporary directory.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("connectrpc")

from metasched.errors import ConfigError  # noqa: E402
from metasched.runtime.dispatch import Dispatcher, DispatcherConfig  # noqa: E402
from metasched.serve import ServeConfig, create_app  # noqa: E402
from metasched.serve.e2b.sdk1_door import SDK1_PORTS  # noqa: E402
from metasched.serve.server import BackgroundServer  # noqa: E402
from tests.serve_helpers import serving  # noqa: E402

API, ENVD, INTERPRETER = (f"http://127.0.0.1:{p}" for p in SDK1_PORTS)
DRIVER = Path(__file__).with_name("e2b_sdk1_driver.py")


def _ports_free() -> str | None:
    """Why SDK 1.x's ports cannot be had here (None: they can)."""
    for port in SDK1_PORTS:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                return f"127.0.0.1:{port} is in use here ({e.strerror}): SDK 1.x's ports are fixed"
    return None


@pytest.fixture(scope="module")
def door():
    why = _ports_free()
    if why:
        pytest.skip(why)
    with serving(config=ServeConfig(languages=[], e2b_sdk1_ports=True)) as srv:
        yield srv


def _create(base: str) -> dict:
    r = httpx.post(f"{base}/sandboxes", json={
        "templateID": "code-interpreter-v1", "timeout": 120, "metadata": {}, "envVars": {},
        "secure": False, "allow_internet_access": True}, headers={"X-API-KEY": "unused"})
    assert r.status_code == 201, r.text
    return r.json()


def _execute(code: str) -> tuple[int, list[dict] | str]:
    """A cell as SDK 1.x's interpreter sends it: no header naming a sandbox."""
    r = httpx.post(f"{INTERPRETER}/execute", timeout=60, json={
        "code": code, "context_id": None, "language": None, "env_vars": None})
    if r.status_code != 200:
        return r.status_code, r.text
    return 200, [json.loads(line) for line in r.text.splitlines()]


def _text(events: list[dict] | str) -> str | None:
    return next((e.get("text") for e in events if e["type"] == "result"), None)


def test_door_port_taken_is_one_line_at_start():
    # Before the module's door is made (it holds the ports while the module runs).
    why = _ports_free()
    if why:
        pytest.skip(why)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 49983))
        taken.listen()
        app = create_app(lambda: Dispatcher(DispatcherConfig(scheduler="elastic_greedy")),
                         ServeConfig(languages=[], e2b_sdk1_ports=True))
        with pytest.raises(ConfigError) as e:
            BackgroundServer(app).start()
    assert str(e.value) == ("e2b_sdk1_ports: 127.0.0.1:49983 (SDK 1.x's envd) is in use: "
                            "its ports are fixed; free it, or leave the door off")
    assert _ports_free() is None  # what it had bound, it let go


@pytest.mark.parametrize("settings, said", [
    ({"e2b_sdk1_ports": True, "token": "t" * 16}, "sends no credential"),
    ({"e2b_sdk1_ports": True, "port": 3000}, "port 3000 is one of SDK 1.x's"),
    ({"e2b_sdk1_replace": True}, "needs e2b_sdk1_ports"),
])
def test_door_settings_refused_in_one_line(settings, said):
    with pytest.raises(ConfigError, match=said):
        ServeConfig(**settings)


def test_serve_setting_reaches_the_service():
    from metasched.cli.serve_app import serve_config

    both = serve_config({"e2b_sdk1_ports": True, "e2b_sdk1_replace": True}, {})
    assert both.e2b_sdk1_ports and both.e2b_sdk1_replace
    assert not serve_config({}, {}).e2b_sdk1_ports


def test_door_replaces_its_sandbox_with_e2b_sdk1_replace():
    # Its own service, before the module's door is made.
    why = _ports_free()
    if why:
        pytest.skip(why)
    with serving(config=ServeConfig(languages=[], e2b_sdk1_ports=True,
                                    e2b_sdk1_replace=True)):
        first = _create(API)
        assert _execute("x = 1")[0] == 200
        second = _create(API)
        assert httpx.get(f"{ENVD}/health", headers={
            "X-Access-Token": first["envdAccessToken"]}).status_code == 502  # ended
        status, events = _execute("'x' in globals()")
        assert status == 200 and _text(events) == "False"  # the new one's kernel
        assert [s["sandboxID"] for s in httpx.get(f"{API}/sandboxes").json()] == [
            second["sandboxID"]]
        httpx.delete(f"{API}/sandboxes/{second['sandboxID']}")


@pytest.mark.slow
def test_rllm_restarts_its_sandbox_after_a_cell_that_does_not_end(rllm_path):
    # Its own service (e2b_sdk1_replace), before the module's door is made.
    python = _sdk1_python()
    why = _ports_free()
    if why:
        pytest.skip(why)
    with serving(config=ServeConfig(languages=[], e2b_sdk1_ports=True,
                                    e2b_sdk1_replace=True)) as srv:
        seen = _drive(python, "rllm_restart", pythonpath=rllm_path)
        assert httpx.get(f"{srv.url}/e2b/sandboxes").json() == []
    first, second = seen["ids"]
    calls = seen["calls"]
    assert first != second and calls[0]["stdout"] == "5\n"
    assert calls[1]["error"] == "Sandbox error, please try again."  # rllm's own words
    assert calls[2]["stdout"] == "False\n"  # a new sandbox: nothing of the old one
    assert calls[3]["stdout"] == "42\n" and calls[3]["error"] is None


def test_door_routes_to_the_one_live_sandbox_and_refuses_two(door):
    first = _create(API)
    assert first["envdAccessToken"], "a door sandbox needs a token: envd calls find it so"
    other = _create(f"{door.url}/e2b")  # through the 2.x route: not a door sandbox
    assert "envdAccessToken" not in other
    assert _execute("x = 41\nx + 1")[1][-1]["type"] == "end_of_execution"
    token = {"X-Access-Token": first["envdAccessToken"]}
    assert httpx.get(f"{ENVD}/health", headers=token).status_code == 204
    second = _create(API)
    status, message = _execute("x")
    assert status == 409 and "\n" not in message
    assert message.startswith("2 sandboxes made through SDK 1.x's door are live (")
    assert "cannot name its sandbox" in message and "E2B_SANDBOX_URL" in message
    # envd calls carry their sandbox's token: still routed with two live.
    assert httpx.get(f"{ENVD}/health", headers={
        "X-Access-Token": second["envdAccessToken"]}).status_code == 204
    assert httpx.delete(f"{API}/sandboxes/{second['sandboxID']}").status_code == 204
    status, events = _execute("x")
    assert status == 200 and _text(events) == "41"  # the first one's state
    assert httpx.delete(f"{API}/sandboxes/{first['sandboxID']}").status_code == 204
    assert httpx.get(f"{ENVD}/health", headers=token).status_code == 502  # not running
    status, message = _execute("x")
    assert status == 404 and message.startswith("no sandbox made through SDK 1.x's door")
    assert httpx.get(f"{ENVD}/health").status_code == 502  # no token, none live
    httpx.delete(f"{door.url}/e2b/sandboxes/{other['sandboxID']}")


# ----------------------------------------------------------------- SDK 1.x itself

def _sdk1_python() -> str:
    python = os.environ.get("METASCHED_E2B1_PYTHON")
    if not python:
        pytest.skip("METASCHED_E2B1_PYTHON unset: a Python with e2b-code-interpreter 1.x "
                    "(see this module's docstring)")
    found = subprocess.run([python, "-c", "import importlib.metadata as m; "
                            "print(m.version('e2b-code-interpreter'))"],
                           capture_output=True, text=True)
    if found.returncode or not found.stdout.startswith("1."):
        said = found.stdout.strip() or found.stderr.strip()[-200:]
        pytest.skip(f"{python} has no e2b-code-interpreter 1.x ({said})")
    return python


def _drive(python: str, *args: str, pythonpath: str | None = None) -> dict:
    env = {**os.environ, "E2B_DEBUG": "true", "E2B_API_KEY": "unused"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([python, str(DRIVER), *args], capture_output=True, text=True,
                       env=env, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def rllm_path(tmp_path_factory) -> str:
    """A directory holding rllm's ``rllm`` package (see the module docstring)."""
    given = os.environ.get("METASCHED_RLLM")
    if not given:
        pytest.skip("METASCHED_RLLM unset: an rllm-org/rllm checkout or git directory")
    if (Path(given) / "rllm/tools/code_tools/e2b_tool.py").is_file():
        return given
    out = tmp_path_factory.mktemp("rllm")
    archive = subprocess.run(["git", f"--git-dir={given}", "archive", "HEAD", "rllm"],
                             capture_output=True)
    if archive.returncode:
        pytest.skip(f"METASCHED_RLLM={given}: neither a source tree nor a git directory "
                    f"of rllm ({archive.stderr.decode(errors='replace').strip()[-200:]})")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return str(out)


@pytest.mark.slow
def test_sdk1_sandbox_through_the_door(door):
    seen = _drive(_sdk1_python(), "sdk")
    assert seen["text"] == "42" and seen["stdout"] == ["hi\n"] and seen["after_error"] == "82"
    name, value, traceback = seen["error"]
    assert (name, value) == ("ZeroDivisionError", "division by zero")
    assert 'File "<cell>", line 2, in f' in traceback
    assert seen["command"] == [0, "/home/user\n/home/user\n", "oops\n"]
    assert seen["cat"] == "from files\n" and seen["read"] == "from commands\n"
    assert {"made.txt", "notes.txt"} <= set(seen["listed"])
    assert seen["cell_sees_file"] == "from commands\n"
    # kill() in debug mode sends nothing (the SDK's own choice): still running until
    # killed by id, then not.
    assert seen["running"] and seen["running_after_kill"]
    assert seen["delete"] == 204 and not seen["running_after_delete"]
    assert httpx.get(f"{door.url}/e2b/sandboxes").json() == []


@pytest.mark.slow
def test_rllm_e2b_python_interpreter_runs_a_multi_turn_loop(door, rllm_path):
    seen = _drive(_sdk1_python(), "rllm", pythonpath=rllm_path)
    calls = seen["calls"]
    assert len(calls) >= 5 and all(c["error"] is None for c in calls), calls
    assert [c["stdout"] for c in calls] == ["8\n", "total 31\n", "3.875\n", "3.5\n",
                                            "before\n", "31 9\n"]
    assert [c["output"] for c in calls] == [None, "31", None, "9", None,
                                            "6.888888888888889"]
    assert "NameError: name 'undefined_name' is not defined" in calls[4]["stderr"]
    assert all(c["stderr"] is None for i, c in enumerate(calls) if i != 4)
    assert httpx.get(f"{door.url}/e2b/sandboxes").json() == []
    print(f"rllm loop: {len(calls)} calls, {sum(c['s'] for c in calls):.2f} s",
          file=sys.stderr)
