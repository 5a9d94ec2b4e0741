"""Every app's overrides are checked before Hydra runs: an unknown key names the nearest
known one, and ``+key`` adds a key only under the maps of the user's own names and the
schema-read nodes (whose schema names the nearest field)."""

from __future__ import annotations

import pytest

from metasched.cli.app import preflight
from metasched.compose import compose, load_profile
from metasched.errors import ConfigError


def _error(app: str, args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        preflight(app, args)
    assert e.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize(("app", "args", "message"), [
    ("eval", ["+n_seed=1"], "error: n_seed: not a setting; did you mean n_seeds?"),
    ("eval", ["n_seed=1"], "error: n_seed: not a setting; did you mean n_seeds?"),
    ("plan", ["+n_seed=1"], "error: n_seed: not a setting; did you mean n_seeds?"),
    ("eval", ["~shedulers"], "error: shedulers: not a setting; did you mean schedulers?"),
    ("eval", ["workload=rm_math", "workload.step=3"],
     "error: workload.step: not a setting of workload; did you mean workload.steps?"),
    ("train", ["+ppo.bc.expertt=fifo"],
     "error: ppo.bc.expertt: not a setting of ppo.bc; did you mean ppo.bc.expert?"),
    ("train", ["+obs.k_slot=8"], "error: obs.k_slot: not a setting of obs; did you mean "
     "obs.k_slots?"),
    ("loop", ["evaluation.n_seed=3"],
     "error: evaluation.n_seed: not a setting of evaluation; did you mean evaluation.n_seeds?"),
    ("dispatch", ["jobs=j", "isolation=none"],
     "error: isolation: not a setting; did you mean sandbox.isolation?"),
    ("dispatch", ["jobs=j", "+ray.adress=x"],
     "error: ray.adress: not a setting of ray; did you mean ray.address?"),
    ("serve", ["limits.mem=1"], "error: limits.mem: not a setting of limits; did you mean "
     "limits.mem_mb?"),
    ("serve", ["+prot=1"], "error: prot: not a setting; did you mean port?"),
    ("calibrate", ["+plots=false"], "error: plots: not a setting; did you mean plot?"),
    ("calibrate", ["+fooo=1"], "error: fooo: not a setting (+ adds none here); --cfg job "
     "prints every setting"),
    ("dispatch", ["jobs=j", "+fooo=1"], "error: fooo: not a setting (+ adds keys under "
     "scheduler_params, services, endpoints, sandbox.templates, sandbox, limits, deadlines "
     "only); --cfg job prints every setting"),
])
def test_an_unknown_key_names_the_nearest_and_plus_adds_no_typo(app, args, message, capsys):
    assert _error(app, args, capsys) == message


@pytest.mark.parametrize(("app", "args"), [
    ("eval", ["+workload.max_offpolicyness=1"]),                  # a schema's optional field
    ("eval", ["+scheduler_params.slack_first_oracle.margin=0.2"]),  # a scheduler's parameter
    ("dispatch", ["jobs=j", "+services.rm=metasched.runtime.gpu:linear_scorer"]),
    ("dispatch", ["jobs=j", "+endpoints={search: {rpm: 600, max_concurrency: 64}}"]),
    ("serve", ["+sandbox.templates.repo=/srv/repo", "+sandbox.env_allow=[LANG]",
               "+tokens.ci=0123456789abcdef0123", "++port=9090"]),
    ("train", ["ppo.bc.expert=fifo"]),
])
def test_keys_meant_to_be_added_pass(app, args, capsys):
    preflight(app, args)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("key", "field", "near"), [
    ("workload.n_trajectories_x", "workload.n_trajectories_x", "trajectories_per_step"),
    ("cluster.cpu.nodez", "cluster.cpu.nodez", "nodes"),
])
def test_a_schema_node_names_its_nearest_field(key, field, near):
    """What ``+`` under a schema-read node leaves to the schema is refused there."""
    cfg = compose("eval", [f"+{key}=3"])
    with pytest.raises(ConfigError) as e:
        load_profile(cfg)
    assert e.value.field == field
    assert e.value.problem.startswith(f"unknown field, did you mean {near}? (expected one of:")
