"""Convert public agent trajectories with per-turn timings into the trace format.

    python benchmarks/real_traces.py --agentcgroup PATH/TO/agentcgroup \\
        --agentcgroup-commit 5af9e7b8f37a93513206c331c7ec0ff149e89f27 \\
        --mini-swe-agent PATH/TO/mini-swe-agent \\
        --mini-swe-agent-commit d12a71affd95403b036b2bdbd827349b77bfffb9 \\
        [--out benchmarks/data/real]

Each source is a clone of its public repository (a checkout or a bare git directory, read
with ``git show`` at ``HEAD`` or ``--*-commit``, so the checkout's files are not read);
the output, written into ``--out`` (git ignores the generated files there), is one
gzipped JSONL trace per source (``trajectory`` lines with prompt ids, replayable with
``workload.trace=``) and one gzipped JSONL of its prompts (``prompt``, ``repo``,
``language``, ``text``: what a framework knows before the first turn).
``benchmarks/data/real/SOURCES.md`` names each source, its license, its commit, how to
clone it and what each field is made of. Nothing here reaches the network.

``agentcgroup``: Claude Code runs on SWE-rebench instances (two models; some instances
run several times): every tool call's start and end (ms). A turn is a tool call; its
``gen_s`` is the pause since the previous call ended (the model's turn); calls that
start before the previous one has ended ran in parallel (``together``/``same_turn``).
The last turn is the final message: its ``gen_s`` is the pause from the last call's end
to the session's last message, and its action is a nominal ``reward`` of 1 ms (the runs
time no test run).

``mini_swe_agent``: mini-swe-agent on SWE-bench Verified (one model, one run each):
each model response's start (``created``, whole seconds). A turn is a response and the
bash command it runs; the source does not time the command apart from the response, so
``gen_s`` is the whole turn's wall time (the next response's start less this one's) and
the command is a nominal 1 ms action of its type (the command's first word). The last
response (the submission) is the ``reward``; its own time is unknown (0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

NOMINAL_S = 0.001  # an action the source does not time
TIMEOUT_S = 3600.0
PROMPT_CHARS = 4000  # the prompt text kept per prompt (the statement)
STEP_TRAJECTORIES = 24  # about this many trajectories per RL step; a prompt's runs together
OUT = Path(__file__).resolve().parent / "data" / "real"  # where the benchmarks read them
MINI_SWE_AGENT_TRAJS = "swebench_results/20251118_gemini-3-pro-74pct/trajs"


class Git:
    """Read files of one commit of a clone (a checkout or a bare git directory)."""

    def __init__(self, repo: str, commit: str = "HEAD") -> None:
        self.repo, self.commit = repo, commit
        r = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"error: {repo}: no commit {commit} in a git repository there")
        self.sha = r.stdout.strip()

    def _run(self, *args: str) -> str:
        return subprocess.run(["git", "-C", self.repo, *args], check=True,
                              capture_output=True, text=True).stdout

    def files(self, under: str) -> list[str]:
        """Every file path under ``under``."""
        return self._run("ls-tree", "-r", "--name-only", self.sha, under).split("\n")[:-1]

    def text(self, path: str) -> str | None:
        """A file's text (None if absent)."""
        r = subprocess.run(["git", "-C", self.repo, "show", f"{self.sha}:{path}"],
                           capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None


def produced(path: str | Path) -> Path:
    """``path``, or a one-line exit saying how to produce it where it is absent (the real
    traces are written by this converter, not kept in the repository)."""
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"error: {path} is absent: write it with benchmarks/real_traces.py "
                         "from the public repositories (benchmarks/data/real/SOURCES.md "
                         "gives the commands)")
    return path


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _action(name: str, seconds: float, reward: bool = False) -> dict:
    a = {"kind": "cpu", "name": name, "duration_s": round(max(seconds, NOMINAL_S), 3),
         "timeout_s": max(TIMEOUT_S, 2.0 * seconds)}
    if reward:
        a["reward"] = True
    return a


# ---------------------------------------------------------------- agentcgroup

_RUN_DIRS = ("all_images_haiku", "all_images_local", "batch_swebench_18tasks",
             "branchfs_motivation", "empirical_study_20260305_full")
_MODELS = {"haiku": "haiku", "qwen3": "qwen3", None: "haiku"}  # the runner's default: haiku


def _instance(image: str) -> tuple[str, str]:
    """The SWE-rebench instance id and repository of a run's container image."""
    name = image.rsplit("/", 1)[-1].split(":")[0].split("sweb.eval.x86_64.")[-1]
    owner, _, rest = name.partition("_1776_")
    repo = rest.rsplit("-", 1)[0]
    return f"{owner}__{rest}", f"{owner}/{repo}"


def _session(trace: str | None) -> tuple[float | None, float | None, str | None, str | None]:
    """First and last message times, the first user message's text, the model."""
    if not trace:
        return None, None, None, None
    first = last = text = model = None
    for line in trace.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "timestamp" not in d or d.get("isSidechain"):
            continue
        t = _t(d["timestamp"])
        first = t if first is None else min(first, t)
        last = t if last is None else max(last, t)
        m = d.get("message")
        if isinstance(m, dict):
            if text is None and d.get("type") == "user" and isinstance(m.get("content"), str):
                text = m["content"]
            model = model or m.get("model")
    return first, last, text, model


def agentcgroup_runs(git: Git) -> Iterator[dict]:
    """One dict per real run: prompt, repo, model, text, turns."""
    for path in git.files("experiments"):
        if not path.endswith("/tool_calls.json") or path.split("/")[1] not in _RUN_DIRS:
            continue
        d = path.rsplit("/", 1)[0]
        calls = json.loads(git.text(path) or "[]")
        res = json.loads(git.text(f"{d}/results.json") or "{}")
        if not calls or not res.get("image"):
            continue
        prompt, repo = _instance(res["image"])
        start, end, text, model = _session(git.text(f"{d}/trace.jsonl"))
        calls = [c for c in calls if c.get("end_timestamp")]  # a call cut off has no end
        if not calls:
            continue
        calls.sort(key=lambda c: _t(c["timestamp"]))
        turns, last_end = [], None
        for c in calls:
            s, e = _t(c["timestamp"]), _t(c["end_timestamp"])
            turn = {"gen_s": 0.0, "action": _action(c["tool"], e - s)}
            if last_end is None:
                turn["gen_s"] = round(max(0.0, s - start), 3) if start is not None else 0.0
            elif s < last_end:  # issued with the one before it, in one model message
                turns[-1]["together"] = True
                turn["same_turn"] = True
            else:
                turn["gen_s"] = round(s - last_end, 3)
            turns.append(turn)
            last_end = e if last_end is None else max(last_end, e)
        final = max(0.0, end - last_end) if end is not None else 0.0
        turns.append({"gen_s": round(final, 3), "action": _action("reward", 0.0, True)})
        who = res.get("model") or ("qwen3" if model and "qwen" in model.lower() else None)
        yield {"prompt": prompt, "repo": repo, "model": _MODELS.get(who, who),
               "text": text, "turns": turns, "run": d}


# ---------------------------------------------------------------- mini-swe-agent

_TYPES = (  # (type, first words), as the coding profile classifies bash commands
    ("test_run", ("pytest", "tox", "./tests/runtests.py", "runtests.py")),
    ("pip_install", ("pip", "pip3")),
    ("python", ("python", "python3")),
    ("code_search", ("grep", "find", "rg", "ag")),
    ("read", ("cat", "head", "tail", "sed", "nl", "less")),
    ("git", ("git",)),
    ("list", ("ls", "tree")),
)


def command_type(command: str) -> str:
    """The action type of a bash command (its first word; ``cd X &&`` skipped)."""
    parts = [p.strip() for p in re.split(r"&&|;|\|", command) if p.strip()]
    words = next((p.split() for p in parts if not p.startswith("cd ")), [""])
    first = words[0] if words else ""
    if first in ("python", "python3") and ("pytest" in words or "runtests" in command):
        return "test_run"
    if first in ("sed", "perl") and "-i" in words or first in ("echo", "cat") and ">" in command:
        return "edit"
    for name, firsts in _TYPES:
        if first in firsts or first.endswith(firsts):
            return name
    return "other"


_BASH = re.compile(r"```bash\s*\n(.*?)```", re.S)


def mini_swe_agent_runs(git: Git, under: str) -> Iterator[dict]:
    """One dict per trajectory file under ``under``."""
    for path in git.files(under):
        if not path.endswith(".traj.json"):
            continue
        d = json.loads(git.text(path) or "{}")
        msgs = d.get("messages", [])
        prompt = d.get("instance_id") or path.rsplit("/", 1)[-1].split(".")[0]
        text = next((m["content"] for m in msgs if m.get("role") == "user"), None)
        resp = [(m, m.get("extra", {}).get("response", {}).get("created")) for m in msgs
                if m.get("role") == "assistant"]
        resp = [(m, float(c)) for m, c in resp if c is not None]
        if len(resp) < 2:
            continue
        turns = []
        for k, (m, created) in enumerate(resp):
            found = _BASH.findall(m.get("content") or "")
            last = k == len(resp) - 1
            wall = resp[k + 1][1] - created if not last else 0.0
            name = "reward" if last else command_type(found[0]) if found else "other"
            turns.append({"gen_s": max(0.0, wall - (0.0 if last else NOMINAL_S)),
                          "action": _action(name, 0.0, last)})
        owner, _, rest = prompt.partition("__")
        yield {"prompt": prompt, "repo": f"{owner}/{rest.rsplit('-', 1)[0]}",
               "model": "gemini3", "text": text, "turns": turns, "run": path}


# ---------------------------------------------------------------- writing


def write(runs: list[dict], out: Path, source: str) -> tuple[int, int, int]:
    """Write ``<source>.jsonl.gz`` (trajectories; a prompt's runs in one step) and
    ``<source>.prompts.jsonl.gz``; returns (trajectories, prompts, turns)."""
    by_prompt: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: (r["prompt"], r["run"])):
        by_prompt.setdefault(r["prompt"], []).append(r)
    out.mkdir(parents=True, exist_ok=True)
    step, in_step, n_turns = 0, 0, 0
    with gzip.open(out / f"{source}.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(f"# {source}: see SOURCES.md\n")
        for prompt, group in by_prompt.items():
            if in_step and in_step + len(group) > STEP_TRAJECTORIES:
                step, in_step = step + 1, 0
            for r in group:
                line = {"type": "trajectory", "task": f"swe_{r['model']}", "step": step,
                        "prompt": prompt, "turns": r["turns"]}
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
                n_turns += len(r["turns"])
            in_step += len(group)
    with gzip.open(out / f"{source}.prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for prompt, group in by_prompt.items():
            text = next((r["text"] for r in group if r["text"]), None)
            f.write(json.dumps({"prompt": prompt, "repo": group[0]["repo"],
                                "language": "python",
                                "text": text[:PROMPT_CHARS] if text else None}) + "\n")
    return len(runs), len(by_prompt), n_turns


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: its arguments; None: ``sys.argv``'s)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agentcgroup", help="a clone of the agentcgroup repository")
    ap.add_argument("--agentcgroup-commit", default="HEAD")
    ap.add_argument("--mini-swe-agent", help="a clone of the mini-swe-agent fork with the "
                    "Gemini 3 Pro SWE-bench Verified trajectories")
    ap.add_argument("--mini-swe-agent-commit", default="HEAD")
    ap.add_argument("--out", type=Path, default=OUT,
                    help="folder to write into (default: benchmarks/data/real)")
    a = ap.parse_args(argv)
    if not (a.agentcgroup or a.mini_swe_agent):
        ap.error("give --agentcgroup, --mini-swe-agent or both")
    out = a.out
    if a.agentcgroup:
        g = Git(a.agentcgroup, a.agentcgroup_commit)
        n = write(list(agentcgroup_runs(g)), out, "agentcgroup")
        print(f"agentcgroup @ {g.sha}: {n[0]} trajectories, {n[1]} prompts, {n[2]} turns")
    if a.mini_swe_agent:
        g = Git(a.mini_swe_agent, a.mini_swe_agent_commit)
        runs = list(mini_swe_agent_runs(g, MINI_SWE_AGENT_TRAJS))
        n = write(runs, out, "mini_swe_agent")
        print(f"mini_swe_agent @ {g.sha}: {n[0]} trajectories, {n[1]} prompts, {n[2]} turns")


if __name__ == "__main__":
    main()
