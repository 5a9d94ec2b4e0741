"""The real traces in benchmarks/data/real: they load as traces, their prompts file
covers every prompt, their sizes are SOURCES.md's, and the converter's parsing of the
sources' fields."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from metasched.errors import ConfigError
from metasched.sim.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "benchmarks" / "data" / "real"
SIZES = {"agentcgroup": (175, 120, 43), "mini_swe_agent": (500, 500, 0)}


def _converter():
    spec = importlib.util.spec_from_file_location("real_traces",
                                                  ROOT / "benchmarks" / "real_traces.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("source", sorted(SIZES))
def test_trace_loads_with_the_sizes_sources_md_gives(source: str) -> None:
    w = read_trace(REAL / f"{source}.jsonl.gz")
    trajs = [t for step in w.steps for t in step]
    runs = Counter(t.prompt for t in trajs)
    assert (len(trajs), len(runs), sum(n >= 2 for n in runs.values())) == SIZES[source]
    prompts = {json.loads(line)["prompt"]: json.loads(line)
               for line in gzip.open(REAL / f"{source}.prompts.jsonl.gz", "rt")}
    assert set(prompts) == set(runs)
    assert all(p["text"] and p["repo"].count("/") == 1 for p in prompts.values())
    # A prompt's runs are in one RL step (siblings run together, as GRPO's do).
    step_of = {}
    for s, step in enumerate(w.steps):
        for t in step:
            assert step_of.setdefault(t.prompt, s) == s


@pytest.mark.parametrize(("command", "kind"), [
    ("grep -rn foo .", "code_search"), ("cd /testbed && python -m pytest tests/x.py", "test_run"),
    ("sed -i 's/a/b/' f.py", "edit"), ("sed -n 1,20p f.py", "read"),
    ("pip install -e .", "pip_install"),
    ("python reproduce.py", "python"), ("ls -la", "list"), ("git diff", "git"),
    ("cat <<'EOF' > x.py\nprint(1)\nEOF", "edit"), ("make", "other"),
])
def test_command_types(command: str, kind: str) -> None:
    assert _converter().command_type(command) == kind


def test_instance_of_a_container_image() -> None:
    assert _converter()._instance("swerebench/sweb.eval.x86_64.rdflib_1776_rdflib-1117") == (
        "rdflib__rdflib-1117", "rdflib/rdflib")


def test_a_damaged_gzip_trace_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"type": "trajectory"}\n' * 50)[:30])
    with pytest.raises(ConfigError, match=r"t\.jsonl\.gz:1: .*cannot read trace"):
        read_trace(path)


def test_prompt_features_read_the_text_and_the_repository(tmp_path: Path) -> None:
    from metasched.core.prompt_features import NAMES, PromptFeaturizer, PromptInfo, read_prompts

    infos = read_prompts(REAL / "agentcgroup.prompts.jsonl.gz")
    fx = PromptFeaturizer.fit(infos.values())
    rows = {k: fx.row(k, v) for k, v in infos.items()}
    assert all(len(r) == len(NAMES) and not np.isnan(r).any() for r in rows.values())
    # Distinct texts, distinct bags of words (some instances share a statement).
    texts = {v.text for v in infos.values()}
    assert len({tuple(np.round(r[3:-1], 6)) for r in rows.values()}) == len(texts)
    unseen = fx.row("new", PromptInfo("Fix the parser", "someone/elsewhere", "python"))
    assert np.isnan(unseen[-1]) and not np.isnan(unseen[:-1]).any()
    assert np.isnan(fx.row("none", None)).all()
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a", "text": "x"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: not a prompt line"):
        read_prompts(bad)
