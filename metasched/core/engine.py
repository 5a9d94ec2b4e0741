"""An inference engine's cost model: what a continuous-batching replica (vLLM's, SGLang's)
spends on one decode step, on a prefill, and how many tokens of KV cache it holds.

A decode step of a batch of ``n`` sequences holding ``ctx`` tokens of context in all
takes ``decode_base_s + decode_per_seq_s * n + decode_per_ctx_s * ctx``: decode is
memory-bound, so the step reads the weights once (the base), does per-sequence work
(sampling, scheduling), and reads every sequence's KV cache (per context token). A
prefill of ``u`` prompt tokens not in the prefix cache takes ``prefill_base_s +
prefill_per_token_s * u`` (compute-bound); prefix-cache hits cost nothing. A replica
holds ``kv_tokens`` tokens of KV cache; when a growing batch would overflow it, a
sequence is preempted, as vLLM does: its KV is dropped and recomputed later
(``recompute``) or moved to host memory and back (``swap``, ``swap_per_token_s`` each
way).

The defaults are Llama-3.1-8B (bf16) on one H100 SXM 80 GB under vLLM; where each comes
from is in ``docs/concepts/workloads.md`` ("Generation as a pool").
"""

from __future__ import annotations

import math
from typing import Literal

from metasched.core.schema import Count, Number, Strict

__all__ = ["EngineModel"]


class EngineModel(Strict):
    """A replica's costs (see the module docstring); every field in seconds or tokens."""

    decode_base_s: Number(gt=0.0) = 6.2e-3
    decode_per_seq_s: Number(ge=0.0) = 2.0e-5
    decode_per_ctx_s: Number(ge=0.0) = 5.1e-8
    prefill_base_s: Number(ge=0.0) = 0.0
    prefill_per_token_s: Number(ge=0.0) = 3.25e-5
    kv_tokens: Count(1) = 400_000
    max_seqs: Count(1) = 256
    preemption: Literal["recompute", "swap"] = "recompute"
    swap_per_token_s: Number(ge=0.0) = 2.4e-6

    def step_s(self, n: int, ctx: float) -> float:
        """One decode step of ``n`` sequences holding ``ctx`` context tokens in all."""
        return self.decode_base_s + self.decode_per_seq_s * n + self.decode_per_ctx_s * ctx

    def prefill_s(self, tokens: float) -> float:
        """A prefill of ``tokens`` uncached prompt tokens (0 when there are none)."""
        return self.prefill_base_s + self.prefill_per_token_s * tokens if tokens > 0 else 0.0

    def steps_s(self, n: int, ctx: float, k: int) -> float:
        """``k`` decode steps of ``n`` sequences from ``ctx`` context tokens (each step
        adds a token to every sequence)."""
        return k * self.step_s(n, ctx) + self.decode_per_ctx_s * n * k * (k - 1) / 2.0

    def steps_within(self, n: int, ctx: float, dt: float) -> int:
        """How many whole decode steps of ``n`` sequences from ``ctx`` end within ``dt``."""
        if dt <= 0.0:
            return 0
        a = self.decode_per_ctx_s * n / 2.0  # steps_s = a k^2 + b k
        b = self.step_s(n, ctx) - a
        k = dt / b if a == 0.0 else (-b + math.sqrt(b * b + 4.0 * a * dt)) / (2.0 * a)
        k = int(k)
        while k > 0 and self.steps_s(n, ctx, k) > dt + 1e-12:
            k -= 1
        while self.steps_s(n, ctx, k + 1) <= dt + 1e-12:
            k += 1
        return k


class GenerationLine(Strict):
    """A trace's ``{"type": "generation", ...}`` line: one LLM turn as a clock measured
    it (the simulator's generation pool; the generation door). Replay ignores it;
    ``metasched-calibrate`` fits the engine model to the lines that carry the batch
    sums (``steps`` and after), over which ``run_s`` is linear in the model's costs:
    ``run_s = decode_base_s * steps + decode_per_seq_s * sum_batch + decode_per_ctx_s *
    sum_context + prefill_base_s * prefills + prefill_per_token_s * prefill_tokens +
    2 * swap_per_token_s * swap_tokens``.
    """

    trajectory: int | str | None = None
    turn: Count(0) | None = None
    step: Count(0) | None = None
    replica: int | str | None = None
    priority: float | None = None
    prompt_tokens: Count(0)
    output_tokens: Count(0)
    cached_tokens: Count(0) = 0
    queue_s: Number(ge=0.0)
    run_s: Number(ge=0.0)
    preempted: Count(0) = 0
    steps: Count(0) | None = None  # decode steps it was in a batch for
    sum_batch: Number(ge=0.0) | None = None  # sum of the batch's sequences over them
    sum_context: Number(ge=0.0) | None = None  # sum of the batch's context tokens
    prefills: Count(0) | None = None  # prefills its batch ran while it was in it
    prefill_tokens: Number(ge=0.0) | None = None  # their uncached tokens in all
    swap_tokens: Number(ge=0.0) | None = None  # tokens swapped in while it was in it
