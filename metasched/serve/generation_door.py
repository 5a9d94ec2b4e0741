"""The OpenAI-compatible front door's forwarding (its routes are
:mod:`metasched.serve.openai_routes`'s): each ``/v1/chat/completions`` or
``/v1/completions`` request goes to one of the configured vLLM or SGLang replicas.

- **Priority.** The door stamps the request's ``priority`` (lower first, as vLLM's
  ``--scheduling-policy priority`` reads it, and SGLang's priority scheduling with
  ``--schedule-low-priority-values-first``: without it, higher first) from the
  dispatcher's remaining-work predictor and the trajectory the request names
  (``X-Trajectory-Id``, as ``/run_code`` takes it), under the ``order`` setting:
  ``predicted`` (longest predicted remaining first), ``least_slack`` or ``fifo``. These
  are the simulator's generation-pool orders (:mod:`metasched.sim.llm_turns`); the
  stamp is in milliseconds, since vLLM's priority is a whole number.
- **Affinity.** A trajectory's requests go to the replica its first one went to (its
  prefix cache holds the trajectory's context); a new trajectory goes to the replica
  with the fewest requests in flight.
- **Pass-through.** The replica's answer, streamed (SSE) or not, is sent back byte for
  byte, its status and content type kept; streamed, what has arrived when the client's
  side is free goes out in one write.
- **Trace.** Each finished generation is a ``generation`` line in the dispatcher's trace
  (:class:`~metasched.core.engine.GenerationLine`): prompt and output tokens (the
  replica's ``usage`` where it sends one; else output chunks and token-id prompts),
  ``queue_s`` (streamed: until the first output chunk, the prefill included; not
  streamed: 0, the replica does not say) and ``run_s`` (the rest); counted once the
  client has the answer.
- **Predictor.** The generation's time (queue and run) goes to the dispatcher's
  trajectory (:meth:`~metasched.runtime.dispatch.trajectories.Trajectories.generated`):
  the remaining-work predictor learns the turn's generation gap from it instead of the
  wall time between the trajectory's requests.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from metasched.core.predictor import group_of
from metasched.serve.config import GenerationReplicas

__all__ = ["GenerationDoor", "Generation", "count_tokens"]

# A trajectory's replica is remembered for this many trajectories (least recent first out).
_AFFINITY_KEEP = 100_000
# Request headers not forwarded: the hop's own, and the door's trajectory headers.
_DROP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
         "accept-encoding", "authorization", "x-trajectory-id", "x-turn", "x-task",
         "x-reward", "x-prompt-id"}
# Bytes of an answer held before they are counted: short answers are counted once, after
# the client has them; a long one as it passes, so that what is held stays small.
_HOLD = 256 * 1024


@dataclass(slots=True)
class Generation:
    """One forwarded request, as the trace records it, and its answer's bytes as they
    passed (held until counted)."""

    trajectory: str | None
    turn: int | None
    replica: int
    priority: int | None
    prompt_tokens: int
    t0: float
    stream: bool = False
    first_s: float | None = None  # the first output chunk's arrival, from t0
    output_tokens: int = 0
    usage: dict[str, Any] | None = None
    complete: bool = False  # the whole answer passed
    end: float = 0.0  # when it had
    held: list[tuple[float, bytes]] = field(default_factory=list)
    held_bytes: int = 0
    rest: bytes = b""  # a streamed answer's partial event, counted with what follows

    def arrived(self, piece: bytes, t: float) -> None:
        """``piece`` passed at ``t``; counted later, or now if :data:`_HOLD` bytes are
        held."""
        self.held.append((t, piece))
        self.held_bytes += len(piece)
        if self.held_bytes > _HOLD:
            self.count()

    def count(self) -> None:
        """Count the held bytes: a streamed answer's events (output tokens, the first
        one's time, the ``usage`` where sent), a whole answer's ``usage``."""
        held, self.held, self.held_bytes = self.held, [], 0
        if not self.stream:
            try:
                obj = json.loads(b"".join(piece for _, piece in held))
            except ValueError:
                return
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            return
        for t, piece in held:
            *events, self.rest = (self.rest + piece).split(b"\n\n")
            for event in events:
                self._count_event(event, t)

    def _count_event(self, event: bytes, t: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if obj.get("usage"):
                self.usage = obj["usage"]
            for choice in obj.get("choices") or ():
                n = _chunk_tokens(choice)
                if n and self.first_s is None:
                    self.first_s = t - self.t0
                self.output_tokens += n

    def line(self) -> dict[str, Any]:
        """The trace's ``generation`` line (without its ``type``)."""
        total = max(0.0, self.end - self.t0)
        queue = min(total, self.first_s or 0.0)
        usage = self.usage or {}
        return {"trajectory": self.trajectory, "turn": self.turn, "replica": self.replica,
                "priority": self.priority,
                "prompt_tokens": int(usage.get("prompt_tokens", self.prompt_tokens)),
                "output_tokens": int(usage.get("completion_tokens", self.output_tokens)),
                "queue_s": queue, "run_s": total - queue}


def count_tokens(prompt: Any) -> int:
    """Tokens of a token-id prompt (a list of ints, or a list of them); 0 for text, which
    the door does not tokenize (the replica's ``usage`` then says)."""
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        if all(isinstance(x, list) for x in prompt):
            return sum(len(x) for x in prompt)
    return 0


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """Output tokens of one streamed choice: its ``token_ids`` where the replica sends
    them (vLLM's ``return_token_ids``), else one per chunk with output (text, or a
    completion's chunk before its last: a replica without a tokenizer sends "")."""
    ids = choice.get("token_ids")
    if ids:
        return len(ids)
    delta = choice.get("delta")
    if delta is not None:
        return 1 if delta.get("content") else 0
    if choice.get("text"):
        return 1
    return 1 if "text" in choice and choice.get("finish_reason") is None else 0


class GenerationDoor:
    """The front door's forwarding to ``config.replicas`` (see the module docstring).

    Args:
        config: the replicas and the order.
        dispatcher: a function returning the service's dispatcher; its ``state.predictor``
            (the remaining-work predictor), ``trajectories`` and ``trace_writer`` are read
            where it has them (a dispatcher elsewhere has none: no stamp, no trace line).
    """

    def __init__(self, config: GenerationReplicas, dispatcher: Any) -> None:
        self.config = config
        self._dispatcher = dispatcher
        self._session: aiohttp.ClientSession | None = None  # made on the loop, when first used
        self.in_flight = [0] * len(config.replicas)
        self._affinity: OrderedDict[str, int] = OrderedDict()

    async def close(self) -> None:
        """Close the client (its kept-alive connections)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ decisions

    def replica_for(self, trajectory: str | None) -> int:
        """The trajectory's replica (its first request's); a new one (or none given) goes
        to the replica with the fewest requests in flight."""
        if trajectory is not None:
            i = self._affinity.get(trajectory)
            if i is not None:
                self._affinity.move_to_end(trajectory)
                return i
        i = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        if trajectory is not None:
            self._affinity[trajectory] = i
            if len(self._affinity) > _AFFINITY_KEEP:
                self._affinity.popitem(last=False)
        return i

    def priority_for(self, trajectory: str | None, task: str, turn: int | None = None
                     ) -> int | None:
        """The priority to stamp (None: ``fifo``, or no predictor to ask): minus the
        predicted remaining seconds (``least_slack``: plus the time since the
        trajectory opened), in milliseconds. A trajectory the dispatcher has not seen
        act gets its task's estimate at ``turn`` (``X-Turn``). The order is the one
        the dispatcher's scheduler asks for (a meta-policy option's), else ``order``."""
        d = self._dispatcher()
        state = getattr(d, "state", None)
        order = getattr(state, "generation_order", None) or self.config.order
        if order == "fifo" or trajectory is None:
            return None
        p = getattr(state, "predictor", None)
        if p is None:
            return None
        trajs = getattr(d, "trajectories", None)
        traj = trajs.get(trajectory) if trajs is not None else None
        if traj is None:  # nothing run yet: the task's estimate at its turn
            if task not in p.static:
                return None
            remaining, since = p.static_remaining(task, turn or 0), 0.0
        else:
            remaining = p.remaining(traj.id, traj.task, group_of(traj)).p50
            since = max(0.0, state.t - traj.start_t) if traj.start_t is not None else 0.0
        if order == "least_slack":
            remaining += since
        return -int(round(remaining * 1000.0))

    # ------------------------------------------------------------------ forwarding

    async def open(self, path: str, body: dict[str, Any], headers: dict[str, str],
                   gen: Generation) -> aiohttp.ClientResponse:
        """Send ``body`` to ``gen.replica`` at ``path`` (``/v1/...``); the response's
        headers are in, its body is to be read (:meth:`relay`, :meth:`read`). The
        client is aiohttp's (its HTTP parser is C: a third less of the door's time per
        request than httpx's, measured side by side), with no decompression: the bytes
        relayed are the bytes the replica sent.

        Raises:
            aiohttp.ClientError: the replica could not be reached.
        """
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                timeout=aiohttp.ClientTimeout(sock_connect=10.0,
                                              sock_read=self.config.timeout_s))
        fwd = {k: v for k, v in headers.items() if k.lower() not in _DROP}
        fwd["accept-encoding"] = "identity"  # the bytes relayed are the bytes counted
        self.in_flight[gen.replica] += 1
        try:
            return await self._session.post(
                self.config.replicas[gen.replica] + path, headers=fwd,
                data=json.dumps(body, separators=(",", ":")).encode())
        except BaseException:
            self.in_flight[gen.replica] -= 1
            raise

    async def relay(self, resp: aiohttp.ClientResponse, gen: Generation
                    ) -> AsyncIterator[bytes]:
        """A streamed answer's body, byte for byte. What has come from the replica by the
        time the client's side is free goes out as one piece (``iter_any``): a read of
        the replica's connection often holds many events, and a write per event was most
        of what the door cost. Counting waits for :meth:`finish` (or for :data:`_HOLD`
        bytes), after the client has the bytes."""
        try:
            async for piece in resp.content.iter_any():
                gen.arrived(piece, time.perf_counter())
                yield piece
            gen.complete, gen.end = True, time.perf_counter()
        finally:
            self._closed(resp, gen)

    async def read(self, resp: aiohttp.ClientResponse, gen: Generation) -> bytes:
        """A whole (not streamed) answer's body, as sent (:meth:`finish` counts it)."""
        try:
            body = await resp.read()
        finally:
            self._closed(resp, gen)
        gen.complete, gen.end = True, time.perf_counter()
        gen.arrived(body, gen.end)
        return body

    async def finish(self, gen: Generation, status: int) -> None:
        """After the answer went out: count what is left of it and, if it came whole
        with status 200, write the trace's line and tell the dispatcher's trajectory
        (its predictor learns the turn's generation time from it). A coroutine, so that
        it runs on the dispatcher's loop: Starlette runs a plain function in a thread."""
        if not (gen.complete and status == 200):
            return
        gen.count()
        d = self._dispatcher()
        writer = getattr(d, "trace_writer", None)
        if writer is not None:
            writer.record_generation(gen.line())
        trajs = getattr(d, "trajectories", None)
        if trajs is not None and gen.trajectory is not None:
            trajs.generated(gen.trajectory, gen.end - gen.t0, d.loop.now())

    def _closed(self, resp: aiohttp.ClientResponse, gen: Generation) -> None:
        """The answer is done with: its connection is kept for reuse if it was read
        whole, else closed (which aborts the request at the replica)."""
        self.in_flight[gen.replica] -= 1
        if gen.complete or resp.content.at_eof():
            resp.release()
        else:
            resp.close()
