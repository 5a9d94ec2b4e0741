"""E2B's conventions, with the real e2b SDK: /home/user is the home and working
directory of commands and files alike; a sandbox killed, past its timeout or unknown
is not running; user="root" is refused in one line."""

from __future__ import annotations

import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from metasched.runtime.dispatch import DispatcherConfig  # noqa: E402
from tests.serve_helpers import serving  # noqa: E402
from tests.test_serve_e2b import opts  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with serving(DispatcherConfig(scheduler="elastic_greedy")) as srv:
        yield srv


def test_home_user_round_trip(served):
    sb = e2b.Sandbox.create(**opts(served))
    try:
        sb.files.write("/home/user/x.txt", "from files")
        r = sb.commands.run("cat /home/user/x.txt; echo; pwd; echo $HOME; cat ~/x.txt; echo;"
                            " mkdir -p sub && echo from commands > /home/user/sub/y.txt")
        assert r.stdout.split("\n")[:5] == ["from files", "/home/user", "/home/user",
                                            "from files", ""], r.stdout
        assert sb.files.read("/home/user/sub/y.txt") == "from commands\n"
        assert sb.files.read("sub/y.txt") == "from commands\n"
        assert sb.commands.run("pwd", cwd="/home/user/sub").stdout == "/home/user/sub\n"
        assert "/home/user/x.txt" in [e.path for e in sb.files.list("/home/user")]
    finally:
        sb.kill()


def test_is_running_after_kill_timeout_and_for_an_unknown_sandbox(served):
    sb = e2b.Sandbox.create(**opts(served))
    assert sb.is_running()
    sb.kill()
    assert not sb.is_running()
    short = e2b.Sandbox.create(timeout=1, **opts(served))
    assert short.is_running()
    deadline = time.monotonic() + 10
    while short.is_running():
        assert time.monotonic() < deadline, "still running past its timeout"
        time.sleep(0.2)
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect(short.sandbox_id, **opts(served))
    # An id never made: the health check answers as for a killed one.
    r = httpx.get(f"{served.url}/e2b/health", headers={"E2b-Sandbox-Id": "ms-made-up"})
    assert r.status_code == 502


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_another_user_is_refused_in_one_line(served, user):
    sb = e2b.Sandbox.create(**opts(served))
    try:
        with pytest.raises(e2b.SandboxException) as info:
            sb.commands.run("whoami", user=user)
        message = str(info.value)
        assert f"user {user!r}: not offered here" in message and "\n" not in message
        with pytest.raises(e2b.SandboxException, match="not offered here"):
            sb.files.write("/home/user/a.txt", "x", user=user)
        with pytest.raises(e2b.SandboxException, match="not offered here"):
            sb.files.read("/home/user/a.txt", user=user)
        assert sb.commands.run("id -u", user="user").exit_code == 0
    finally:
        sb.kill()


def test_every_e2b_route_is_on_the_http_page():
    from pathlib import Path
    from types import SimpleNamespace

    from metasched.serve.e2b.filesystem import files_router
    from metasched.serve.e2b.interpreter import Interpreter, interpreter_router
    from metasched.serve.e2b.lifecycle import lifecycle_router

    page = (Path(__file__).parent.parent / "docs" / "api" / "http.md").read_text()
    routers = [lifecycle_router(None, None), files_router(None),
               interpreter_router(Interpreter(SimpleNamespace(service=None)))]
    for router in routers:
        for route in router.routes:
            for method in route.methods:
                assert f"`{method} /e2b{route.path}`" in page, (method, route.path)
