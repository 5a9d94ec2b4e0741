"""The direct stream between a dispatcher and a node's daemon (``submit="stream"``): its
challenge, its frames, and a real :class:`NodeDaemon` serving a real :class:`NodeLink`
over it (commands run, are cancelled, and end with the stream). Every server here
listens on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import time
from contextlib import asynccontextmanager

import pytest
from helpers import running

from metasched.runtime.backend import CommandSpec
from metasched.runtime.ray_backend import channel
from metasched.runtime.sandbox.config import SandboxConfig

# Ray binds its servers to 127.0.0.1 only with clusters off (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
pytest.importorskip("ray", reason="needs the ray extra (pip install 'metasched[ray]')")


async def _serve_once(handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("right", [True, False])
async def test_only_a_peer_holding_the_secret_passes_the_challenge(right):
    secret = channel.new_secret()
    verdict = asyncio.get_running_loop().create_future()

    async def handler(reader, writer):
        verdict.set_result(await channel.serve_challenge(reader, writer, secret))
        writer.close()
    server, port = await _serve_once(handler)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await channel.answer_challenge(reader, writer,
                                       secret if right else channel.new_secret())
        ok = await asyncio.wait_for(verdict, 10)
        writer.close()
    assert ok is right


async def test_a_peer_that_does_not_answer_is_refused_after_the_timeout(monkeypatch):
    monkeypatch.setattr(channel, "CHALLENGE_TIMEOUT_S", 0.2)

    verdict = asyncio.get_running_loop().create_future()

    async def handler(reader, writer):
        verdict.set_result(await channel.serve_challenge(reader, writer, b"s" * 32))
    server, port = await _serve_once(handler)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        ok = await asyncio.wait_for(verdict, 10)
        writer.close()
    waited = time.monotonic() - t0
    assert ok is False and waited >= 0.15


async def test_what_one_loop_turn_puts_goes_in_one_frame_and_broken_frames_raise():
    got: asyncio.Queue = asyncio.Queue()

    async def handler(reader, writer):
        try:
            while True:
                await got.put(await channel.read_frame(reader))
        except channel.ChannelError as e:
            await got.put(e)
    server, port = await _serve_once(handler)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        out = channel.Outbox(writer)
        for i in range(3):
            out.put(("start", i, b"x"))
        await asyncio.sleep(0.05)  # the turn ends: one frame of three
        out.put(("cancel", 1, None))
        await asyncio.sleep(0.05)
        writer.write(struct.pack("!I", channel.MAX_FRAME_BYTES + 1))
        await writer.drain()
        frames = [await asyncio.wait_for(got.get(), 10) for _ in range(3)]
        writer.close()
    first, second, broken = frames
    assert first == [("start", 0, b"x"), ("start", 1, b"x"), ("start", 2, b"x")]
    assert second == [("cancel", 1, None)]
    assert isinstance(broken, channel.ChannelError) and "broken" in str(broken)


async def test_a_stream_cut_mid_frame_is_an_error_not_a_message():
    got = asyncio.get_running_loop().create_future()

    async def handler(reader, writer):
        try:
            got.set_result(await channel.read_frame(reader))
        except channel.ChannelError as e:
            got.set_result(e)
    server, port = await _serve_once(handler)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        data = pickle.dumps([1, 2, 3])
        writer.write(struct.pack("!I", len(data)) + data[:-2])  # then the stream ends
        await writer.drain()
        writer.close()
        err = await asyncio.wait_for(got, 10)
    assert isinstance(err, channel.ChannelError) and str(err) == "the stream ended"


# --- a real node daemon on the stream ---------------------------------------------------

def _sleeping(marker: str) -> list:
    return running(["sleep", marker])


async def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def _cmd(*argv: str) -> bytes:
    from metasched.runtime.ray_backend.node_daemon import pack

    return pack(CommandSpec(argv=argv, timeout_s=30.0), 1, None)


@asynccontextmanager
async def _agent_and_link(secret: bytes | None = None):
    """A NodeDaemon of this process (2 cores, commands unconfined) with a NodeLink on its
    stream, opened as :meth:`NodeLink.connect` opens it (``secret``: the one the link
    answers with, if not the daemon's); both closed at the end."""
    from metasched.runtime.ray_backend.commands import NodeLink
    from metasched.runtime.ray_backend.node_daemon import NodeDaemon

    daemon = NodeDaemon(SandboxConfig(isolation="none"), [], None, cores=[0, 1])
    try:
        assert "error" not in await daemon.describe()
        key = channel.new_secret()
        host, port = await daemon.open_stream(key)
        assert host == "127.0.0.1"  # the node's address as Ray has it: loopback here
        reader, writer = await asyncio.open_connection(host, port)
        await channel.answer_challenge(reader, writer, secret or key)
        link = NodeLink(reader, writer)
        try:
            yield link
        finally:
            await link.close()
    finally:
        daemon.close()


async def test_commands_on_the_stream_run_in_order_and_their_results_come_back(ray_session):
    async with _agent_and_link() as link:
        cmds = [link.start(_cmd("/bin/echo", str(i))) for i in range(5)]
        outs = await asyncio.wait_for(asyncio.gather(*(c.wait() for c in cmds)), 30)
    assert [o.stdout.strip() for o in outs] == [str(i) for i in range(5)]
    assert all(o.ok and len(o.detail["cores"]) == 1 for o in outs)


async def test_a_cancelled_command_is_killed_and_one_behind_it_in_the_queue_runs(ray_session):
    marker = f"{40 + os.getpid() % 1000 / 1000:.3f}"

    async with _agent_and_link() as link:
        long = link.start(_cmd("sleep", marker))
        waiting = asyncio.ensure_future(long.wait())
        assert await _wait_for(lambda: bool(_sleeping(marker)))
        waiting.cancel()  # as the dispatcher cancels: the daemon kills it
        gone = await _wait_for(lambda: not _sleeping(marker))
        after = await asyncio.wait_for(link.start(_cmd("/bin/echo", "next")).wait(), 30)
    assert gone and after.ok and after.stdout.strip() == "next"


async def test_the_end_of_the_stream_kills_its_commands(ray_session):
    marker = f"{50 + os.getpid() % 1000 / 1000:.3f}"

    async with _agent_and_link() as link:
        cmd = link.start(_cmd("sleep", marker))
        assert await _wait_for(lambda: bool(_sleeping(marker)))
        await link.close()  # the dispatcher went away
        out = await cmd.wait()
        gone = await _wait_for(lambda: not _sleeping(marker))
    assert not out.ok and out.reason == "the dispatcher closed"
    assert gone


async def test_a_peer_with_the_wrong_secret_runs_nothing(ray_session, tmp_path):
    flag = tmp_path / "ran"

    async with _agent_and_link(secret=channel.new_secret()) as link:
        cmd = link.start(_cmd("/bin/touch", str(flag)))
        out = await asyncio.wait_for(cmd.wait(), 30)  # the daemon hung up
        await asyncio.sleep(0.2)
        out = out
    assert not out.ok and out.reason.startswith("ray: lost the node's daemon (")
    assert not flag.exists()


async def test_commands_started_on_a_broken_stream_fail_with_the_reason():
    from metasched.runtime.ray_backend.commands import NodeLink

    async def hang_up(reader, writer):
        writer.close()
    server, port = await _serve_once(hang_up)
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        link = NodeLink(reader, writer)
        first = await asyncio.wait_for(link.start(b"never read").wait(), 10)
        later = await link.start(b"never sent").wait()
        await link.close()
    assert not first.ok and first.reason.startswith("ray: lost the node's daemon (")
    assert later.reason == first.reason
