"""The real-trace converter (benchmarks/real_traces.py) on small hand-written sources in
each repository's raw layout, read back as traces and prompts; and, where the converter
has written them, the full real traces in benchmarks/data/real."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from metasched.errors import ConfigError
from metasched.sim.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "benchmarks" / "data" / "real"
SIZES = {"agentcgroup": (175, 120, 43), "mini_swe_agent": (500, 500, 0)}


def _converter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_traces",
                                                  ROOT / "benchmarks" / "real_traces.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------ hand-written sources

def _lines(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _call(tool: str, start: str, end: str | None) -> dict:
    c = {"timestamp": f"2026-01-02T{start}Z", "tool": tool, "id": f"call-{tool}-{start}",
         "input": {}}
    if end is not None:
        c["end_timestamp"] = f"2026-01-02T{end}Z"
    return c


def _message(kind: str, at: str, content: object, model: str | None = None,
             sidechain: bool = False) -> dict:
    m: dict = {"role": kind, "content": content}
    if model:
        m["model"] = model
    return {"type": kind, "isSidechain": sidechain, "timestamp": f"2026-01-02T{at}Z",
            "message": m}


def _agentcgroup_run(image: str, model: str | None, calls: list[dict],
                     trace: list[dict]) -> dict[str, str]:
    res = {"image": image, "start_time": "2026-01-02T00:00:00"}
    if model:
        res["model"] = model
    return {"tool_calls.json": json.dumps(calls), "results.json": json.dumps(res),
            "trace.jsonl": _lines({"type": "summary", "summary": "a run"}, *trace)}


IMAGE = "swerebench/sweb.eval.x86_64.acme_1776_{}"
WIDGETS = "Fix this issue: the widget counter skips zero when it wraps around."
GADGETS = "Fix this issue: gadgets lose their labels after a copy."

AGENTCGROUP = {  # run directory -> its files; two runs of widgets-7, one of gadgets-3
    "experiments/all_images_haiku/acme__widgets-7/attempt_1": _agentcgroup_run(
        IMAGE.format("widgets-7"), "haiku",
        [_call("Bash", "10:00:02.000", "10:00:05.500"),
         _call("Read", "10:00:09.100", "10:00:09.400"),  # listed out of order
         _call("Read", "10:00:09.000", "10:00:09.250"),
         _call("Edit", "10:00:12.400", "10:00:13.000"),
         _call("Bash", "10:00:20.000", None)],  # cut off: no end
        [_message("user", "10:00:00.000", WIDGETS),
         _message("assistant", "10:00:01.000", [], "claude-3-5-haiku"),
         _message("assistant", "10:30:00.000", [], sidechain=True),
         _message("assistant", "10:00:40.000", [])]),
    "experiments/all_images_local/acme__widgets-7/attempt_1": _agentcgroup_run(
        IMAGE.format("widgets-7"), None,
        [_call("Bash", "11:00:05.000", "11:00:06.000")],
        [_message("user", "11:00:00.000", WIDGETS),
         _message("assistant", "11:00:10.000", [], "qwen3-coder")]),
    "experiments/all_images_haiku/acme__gadgets-3/attempt_1": _agentcgroup_run(
        IMAGE.format("gadgets-3"), None,
        [_call("Grep", "12:00:01.000", "12:00:01.500")],
        [_message("user", "12:00:00.000", GADGETS),
         _message("assistant", "12:00:03.000", [], "claude-3-5-haiku")]),
    "experiments/replays/acme__widgets-7/attempt_1": _agentcgroup_run(  # a replay: left out
        IMAGE.format("widgets-7"), "haiku", [_call("Bash", "13:00:00.000", "13:00:01.000")],
        []),
    "experiments/all_images_haiku/acme__empty-1/attempt_1": _agentcgroup_run(  # no calls
        IMAGE.format("empty-1"), "haiku", [], []),
}


def _mini_traj(instance: str | None, responses: list[tuple[int, str]],
               task: str = "The widget counter skips zero.") -> str:
    msgs: list[dict] = [{"role": "system", "content": "Answer with one bash block."},
                        {"role": "user", "content": f"<pr_description>{task}</pr_description>"}]
    for created, text in responses:
        msgs.append({"role": "assistant", "content": text,
                     "extra": {"response": {"created": created}}})
        msgs.append({"role": "user", "content": "<returncode>0</returncode>"})
    d: dict = {"info": {}, "messages": msgs, "trajectory_format": "mini-swe-agent-1"}
    if instance:
        d["instance_id"] = instance
    return json.dumps(d)


def _bash(command: str) -> str:
    return f"THOUGHT: next.\n\n```bash\n{command}\n```"


SUBMIT = _bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A")
TRAJS = "swebench_results/20251118_gemini-3-pro-74pct/trajs"
MINI_SWE_AGENT = {  # file -> text; two runs of widgets-7, one of sprockets-12
    f"{TRAJS}/acme__widgets-7/acme__widgets-7.traj.json": _mini_traj("acme__widgets-7", [
        (1000, _bash("cd /testbed && grep -rn count src")),
        (1012, _bash("sed -i 's/>/>=/' src/count.py")),
        (1030, _bash("cd /testbed && python -m pytest tests")), (1031, SUBMIT)]),
    f"{TRAJS}/acme__widgets-7/acme__widgets-7.rerun.traj.json": _mini_traj(
        "acme__widgets-7", [(2000, _bash("ls -la")), (2003, "No block this time."),
                            (2010, SUBMIT)]),
    f"{TRAJS}/acme__sprockets-12/acme__sprockets-12.traj.json": _mini_traj(  # id: its name
        None, [(500, _bash("cat setup.py")), (505, SUBMIT)], "Sprockets fail to install."),
    f"{TRAJS}/acme__short-1/acme__short-1.traj.json": _mini_traj(  # one response: left out
        "acme__short-1", [(700, SUBMIT)]),
    "swebench_results/elsewhere/acme__other-2.traj.json": _mini_traj(  # not the run's folder
        "acme__other-2", [(1, _bash("ls")), (2, SUBMIT)]),
}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                           "user.email=t@localhost", *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _source_repo(root: Path, files: dict[str, str]) -> tuple[Path, str]:
    """A git checkout holding ``files`` in one commit; its path and the commit."""
    root.mkdir()
    _git(root, "init", "-q")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "runs")
    return root, _git(root, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both hand-written sources run through the converter's command (two trajectories a
    step, so a repeated prompt's runs start a step of their own)."""
    tmp = tmp_path_factory.mktemp("real")
    files = {f"{d}/{name}": text for d, run in AGENTCGROUP.items() for name, text in run.items()}
    acg, acg_sha = _source_repo(tmp / "agentcgroup", files)
    msa, _ = _source_repo(tmp / "mini-swe-agent", MINI_SWE_AGENT)
    # Not committed: the converter reads the commit, not the checkout's files.
    extra = tmp / "agentcgroup" / "experiments/all_images_haiku/acme__late-9/attempt_1"
    extra.mkdir(parents=True)
    for name, text in _agentcgroup_run(IMAGE.format("late-9"), "haiku",
                                       [_call("Bash", "09:00:00.000", "09:00:01.000")],
                                       []).items():
        (extra / name).write_text(text)
    mod = _converter()
    mod.STEP_TRAJECTORIES = 2
    out = tmp / "out"
    mod.main(["--agentcgroup", str(acg), "--agentcgroup-commit", acg_sha,
              "--mini-swe-agent", str(msa), "--out", str(out)])  # mini-swe-agent at HEAD
    return out


def _turns(t) -> list[tuple]:
    return [(round(u.gen_s, 3), u.action.name, u.action.true_s, u.together, u.same_turn)
            for u in t.turns]


def test_agentcgroup_converts_tool_calls_to_turns(converted: Path) -> None:
    w = read_trace(converted / "agentcgroup.jsonl.gz")
    got = [[(t.prompt, t.task, _turns(t)) for t in step] for step in w.steps]
    assert got == [
        [("acme__gadgets-3", "swe_haiku", [(1.0, "Grep", 0.5, False, False),
                                           (1.5, "reward", 0.001, False, False)])],
        [("acme__widgets-7", "swe_haiku", [(2.0, "Bash", 3.5, False, False),
                                           (3.5, "Read", 0.25, True, False),
                                           (0.0, "Read", 0.3, False, True),
                                           (3.0, "Edit", 0.6, False, False),
                                           (27.0, "reward", 0.001, False, False)]),
         ("acme__widgets-7", "swe_qwen3", [(5.0, "Bash", 1.0, False, False),
                                           (4.0, "reward", 0.001, False, False)])]]


def test_mini_swe_agent_converts_responses_to_turns(converted: Path) -> None:
    w = read_trace(converted / "mini_swe_agent.jsonl.gz")
    got = [[(t.prompt, t.task, _turns(t)) for t in step] for step in w.steps]
    assert got == [
        [("acme__sprockets-12", "swe_gemini3", [(4.999, "read", 0.001, False, False),
                                                (0.0, "reward", 0.001, False, False)])],
        [("acme__widgets-7", "swe_gemini3", [(2.999, "list", 0.001, False, False),
                                             (6.999, "other", 0.001, False, False),
                                             (0.0, "reward", 0.001, False, False)]),
         ("acme__widgets-7", "swe_gemini3", [(11.999, "code_search", 0.001, False, False),
                                             (17.999, "edit", 0.001, False, False),
                                             (0.999, "test_run", 0.001, False, False),
                                             (0.0, "reward", 0.001, False, False)])]]


@pytest.mark.parametrize(("source", "prompts"), [
    ("agentcgroup", {"acme__gadgets-3": ("acme/gadgets", GADGETS),
                     "acme__widgets-7": ("acme/widgets", WIDGETS)}),
    ("mini_swe_agent", {
        "acme__sprockets-12": ("acme/sprockets",
                               "<pr_description>Sprockets fail to install.</pr_description>"),
        "acme__widgets-7": ("acme/widgets",
                            "<pr_description>The widget counter skips zero.</pr_description>")}),
])
def test_prompts_file_names_each_prompt_once(converted: Path, source: str,
                                             prompts: dict) -> None:
    from metasched.core.prompt_features import read_prompts

    got = read_prompts(converted / f"{source}.prompts.jsonl.gz")
    assert {k: (v.repo, v.text, v.language) for k, v in got.items()} == {
        k: (*v, "python") for k, v in prompts.items()}


def test_a_missing_source_is_a_one_line_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_traces.py"),
                        "--agentcgroup", str(tmp_path / "absent")], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {tmp_path / 'absent'}: no commit HEAD in a git " \
                               "repository there"


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


def test_prompt_features_read_the_text_and_the_repository(converted: Path,
                                                          tmp_path: Path) -> None:
    from metasched.core.prompt_features import NAMES, PromptFeaturizer, PromptInfo, read_prompts

    infos = {**read_prompts(converted / "agentcgroup.prompts.jsonl.gz"),
             **{f"m/{k}": v for k, v in
                read_prompts(converted / "mini_swe_agent.prompts.jsonl.gz").items()}}
    fx = PromptFeaturizer.fit(infos.values())
    rows = {k: fx.row(k, v) for k, v in infos.items()}
    assert all(len(r) == len(NAMES) and not np.isnan(r).any() for r in rows.values())
    # Distinct texts, distinct bags of words.
    assert len({tuple(np.round(r[3:-1], 6)) for r in rows.values()}) == len(rows) == 4
    unseen = fx.row("new", PromptInfo("Fix the parser", "someone/elsewhere", "python"))
    assert np.isnan(unseen[-1]) and not np.isnan(unseen[:-1]).any()
    assert np.isnan(fx.row("none", None)).all()
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a", "text": "x"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: not a prompt line"):
        read_prompts(bad)


# ------------------------------------------------------------ the full real traces

@pytest.mark.parametrize("source", sorted(SIZES))
def test_real_trace_has_the_sizes_sources_md_gives(source: str) -> None:
    if not (REAL / f"{source}.jsonl.gz").exists():
        pytest.skip(f"benchmarks/data/real/{source}.jsonl.gz not produced: run the converter "
                    "as benchmarks/data/real/SOURCES.md says")
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
