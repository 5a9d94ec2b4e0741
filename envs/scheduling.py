"""``metasched/ActionScheduling-v0``: one scheduling decision per step over the simulator.

The env drives the foundation's :class:`~metasched.sim.simulator.Simulator` (same state,
same guard) and encodes it with the core's
:class:`~metasched.core.observation.ObservationEncoder`; see that module for the observation
and action layout. An env step applies one grant (or waits) and advances the simulator
to the next instant where a decision is possible.

Reward over the interval between two decisions, by ``RewardConfig.objective``:

- ``"act"`` (default): ``-(progress * time-in-system of unfinished actions + efficiency *
  held-but-idle resource-seconds) * scale + step_bonus * RL steps completed``; the
  progress part sums to ``-scale * total ACT`` over an episode that runs to the end.
- ``"step"``: ``-(progress * rise of the step potential + efficiency * granted or held
  resource-seconds over the pool's capacity) * scale + step_bonus * RL steps
  completed``. The step potential (``metasched.sim.step_progress``) is the time of the
  steps done plus the current step's projected end (its critical path: the largest over
  its trajectories of elapsed plus true remaining work) less its start; it starts at 0,
  so the progress part sums to ``-scale * total step time`` over an episode that runs to
  the end. Synchronous profiles only. Mean ACT stays in ``episode_metrics`` and the
  core's starvation guard (``max_wait_s``) keeps bounding every action's wait.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from metasched.agents.baselines import make_advisor
from metasched.core.cluster_config import ClusterConfig
from metasched.core.metrics import API_BUSY, API_HELD, CPU_BUSY, CPU_HELD, GPU_BUSY, GPU_HELD
from metasched.core.observation import OBS_HIGH, F, ObsConfig, ObservationEncoder
from metasched.errors import ConfigError, one_of
from metasched.sim.seeds import TRAIN_SEED_MAX
from metasched.sim.simulator import Simulator, cost_model_for
from metasched.sim.step_progress import StepProgress
from metasched.sim.workload_config import WorkloadConfig

OBJECTIVES = ("act", "step")


@dataclass(frozen=True)
class RewardConfig:
    """Reward weights and objective (``"act"`` or ``"step"``; see the module docstring)."""

    progress: float = 1.0
    efficiency: float = 1.0
    step_bonus: float = 0.0
    invalid_penalty: float = 0.0
    scale: float = 0.01
    objective: str = "act"

    def __post_init__(self) -> None:
        one_of(self.objective, OBJECTIVES, "reward.objective")


@dataclass(frozen=True)
class Randomization:
    """Domain randomisation of the profile at every reset (uniform ranges)."""

    load: tuple[float, float] = (1.0, 1.0)  # multiplies trajectories per step
    estimate_error: tuple[float, float] | None = None  # replaces the profile's sigma
    generation_scale: tuple[float, float] = (1.0, 1.0)  # multiplies LLM generation times
    # Scales every pool of the cluster (``ClusterConfig.scaled``, as ``cluster.scale``),
    # drawn log-uniformly: contended clusters as often as roomy ones. None: the cluster.
    cluster_scale: tuple[float, float] | None = None


def scale_workload(w: WorkloadConfig, load: float = 1.0, estimate_error: float | None = None,
                   generation_scale: float = 1.0, steps: int | None = None) -> WorkloadConfig:
    """``w`` with more or fewer trajectories per step, another estimate error, scaled
    generation times, or another number of steps."""
    tasks = w.tasks
    if generation_scale != 1.0:
        tasks = tuple(replace(t, generation_s=replace(
            t.generation_s, median=t.generation_s.median * generation_scale,
            lo=t.generation_s.lo * generation_scale, hi=t.generation_s.hi * generation_scale))
            for t in tasks)
    return replace(w, tasks=tasks,
                   trajectories_per_step=max(1, round(w.trajectories_per_step * load)),
                   estimate_error=w.estimate_error if estimate_error is None else estimate_error,
                   steps=w.steps if steps is None else steps)


class ActionSchedulingEnv(gym.Env):
    """Learn action-level scheduling decisions on a workload profile and cluster.

    Args:
        workload: a profile name (``"coding"``, ...) or a ``WorkloadConfig``.
        cluster: the cluster; default: the profile's own.
        obs_config: observation sizes (K slots, L levels, caps on nodes/devices/...).
        reward: reward weights.
        episode_steps: RL steps per episode (the episode terminates after them).
        horizon_mean_s: if set, each episode is truncated after an exponentially
            distributed time with this mean (a stochastic horizon).
        max_wait_s: the core's starvation guard (None: off).
        randomization: domain randomisation applied at each reset.
        load: load multiplier (trajectories per step), for a curriculum.
        seed_range: simulation seeds are drawn from ``[lo, hi)`` (training seeds by
            default; evaluation seeds are disjoint).
        render_mode: ``None`` or ``"ansi"``: ``render()`` returns a text view of the
            queue (the K slots, their legal levels, the advisor's choice) and the pools.
        estimates: ``"given"`` (each action's own estimate) or ``"online"`` (the live
            dispatcher's cost model, learned within the episode from measured durations:
            what the policy will see live).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, workload: str | WorkloadConfig = "coding",
                 cluster: ClusterConfig | None = None, *, obs_config: ObsConfig | None = None,
                 reward: RewardConfig | None = None, episode_steps: int = 1,
                 horizon_mean_s: float | None = None, max_wait_s: float | None = 300.0,
                 randomization: Randomization | None = None, load: float = 1.0,
                 seed_range: tuple[int, int] = (0, TRAIN_SEED_MAX),
                 render_mode: str | None = None, estimates: str = "given") -> None:
        super().__init__()
        cost_model_for(estimates)  # a bad value fails here, not at the first reset
        self.estimates = estimates
        one_of(render_mode, self.metadata["render_modes"], "render_mode", null=True)
        self.render_mode = render_mode
        if isinstance(workload, str):
            from metasched.compose import profile

            workload, default_cluster = profile(workload)
            cluster = cluster or default_cluster
        if cluster is None:
            raise ValueError("a cluster is required with a WorkloadConfig")
        self.base_workload = workload
        self.cluster = cluster
        self.obs_config = obs_config or ObsConfig()
        self.reward_config = reward or RewardConfig()
        if self.reward_config.objective == "step" and workload.max_offpolicyness is not None:
            raise ConfigError("reward.objective", "the step objective needs synchronous "
                              "steps (the workload sets max_offpolicyness)")
        self.episode_steps = episode_steps
        self.horizon_mean_s = horizon_mean_s
        self.max_wait_s = max_wait_s
        self.randomization = randomization
        self.load = load
        self.seed_range = seed_range
        cfg = self.obs_config
        # Build once to validate sizes against the observation caps.
        self.sim = Simulator(scale_workload(workload, steps=1), cluster, seed_range[0])
        self.encoder = ObservationEncoder(self.sim.state, cfg, make_advisor(cfg))
        self.observation_space = spaces.Dict({
            "slots": spaces.Box(0.0, OBS_HIGH, (cfg.k_slots * F,), np.float32),
            "backlog": spaces.Box(0.0, OBS_HIGH, (9,), np.float32),
            "pools": spaces.Box(0.0, OBS_HIGH, (cfg.pool_size(),), np.float32),
            "action_mask": spaces.MultiBinary(cfg.n_actions),
        })
        self.action_space = spaces.Discrete(cfg.n_actions)
        self._horizon = np.inf
        self._obs: dict[str, np.ndarray] | None = None
        self.sim_seed = seed_range[0]

    # ------------------------------------------------------------------ gym API

    def set_load(self, load: float) -> None:
        """Set the load multiplier used from the next reset (curriculum)."""
        self.load = float(load)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, np.ndarray], dict]:
        super().reset(seed=seed)
        options = options or {}
        rng = self.np_random
        load = float(options.get("load", self.load))
        est, gen, cluster = None, 1.0, self.cluster
        r = self.randomization
        if r is not None and not options.get("no_randomization", False):
            load *= rng.uniform(*r.load)
            if r.estimate_error is not None:
                est = rng.uniform(*r.estimate_error)
            gen = rng.uniform(*r.generation_scale)
            if r.cluster_scale is not None:
                lo, hi = np.log(r.cluster_scale)
                cluster = cluster.scaled(float(np.exp(rng.uniform(lo, hi))),
                                         ("cpu", "gpu", "api"))
        self.sim_seed = int(options.get("sim_seed", rng.integers(*self.seed_range)))
        workload = scale_workload(self.base_workload, load, est, gen, self.episode_steps)
        self.sim = Simulator(workload, cluster, self.sim_seed, max_wait_s=self.max_wait_s,
                             serve_stalled=True, cost_model=cost_model_for(self.estimates))
        self.encoder = ObservationEncoder(self.sim.state, self.obs_config,
                                          make_advisor(self.obs_config))
        self._progress = StepProgress(self.sim)
        self._potential = 0.0  # the step potential's last value (0 at the start)
        self._horizon = (rng.exponential(self.horizon_mean_s) if self.horizon_mean_s
                         else np.inf)
        self._done = not self.sim.next_decision()
        self._obs = self.encoder.observe(self.sim.state)
        return self._obs, self._info()

    def step(self, action: int) -> tuple[dict[str, np.ndarray], float, bool, bool, dict]:
        if self._obs is None:
            raise RuntimeError("call reset() before step()")
        sim, state = self.sim, self.sim.state
        rc = self.reward_config
        if self._done:
            return self._obs, 0.0, True, False, self._info()
        step_obj = rc.objective == "step"
        used0 = self._used() if step_obj else self._held_idle()
        in_sys0, steps0 = state.in_system_s, len(state.metrics.steps)
        grant = self.encoder.grant(state, int(action))
        invalid = grant is None and int(action) != self.obs_config.n_actions - 1
        if grant is None:
            sim.wait()
        else:
            sim.apply(grant)
        self._done = not sim.next_decision()
        if step_obj:
            potential = self._progress.potential()
            progress, self._potential = potential - self._potential, potential
            used = self._used() - used0
        else:
            progress, used = state.in_system_s - in_sys0, self._held_idle() - used0
        reward = -rc.scale * (rc.progress * progress + rc.efficiency * used)
        reward += rc.step_bonus * (len(state.metrics.steps) - steps0)
        if invalid:
            reward -= rc.invalid_penalty
        self._obs = self.encoder.observe(state)
        truncated = not self._done and state.t >= self._horizon
        return self._obs, float(reward), self._done, bool(truncated), self._info(invalid)

    def render(self) -> str | None:
        """The text view (``render_mode="ansi"``) of the state the last observation
        encodes; None without a render mode."""
        if self.render_mode is None:
            return None
        from metasched.core.text_view import text_view

        return text_view(self.sim.state, self.encoder)

    def action_masks(self) -> np.ndarray:
        """Legal actions now (for sb3-contrib's MaskablePPO); wait is always legal."""
        if self._obs is None:
            return np.eye(1, self.obs_config.n_actions, self.obs_config.n_actions - 1,
                          dtype=bool)[0]
        return self._obs["action_mask"].astype(bool)

    # ------------------------------------------------------------------ helpers

    def _held_idle(self) -> float:
        tot = self.sim.state.metrics.totals
        return tot[CPU_HELD] + tot[GPU_HELD] + tot[API_HELD]

    def _used(self) -> float:
        """Resource-seconds granted or held so far, each pool's over its capacity."""
        state = self.sim.state
        tot = state.metrics.totals
        out = 0.0
        for cap, busy, held in ((state.cpu.total, CPU_BUSY, CPU_HELD),
                                (state.gpu.total, GPU_BUSY, GPU_HELD),
                                (state.api.total, API_BUSY, API_HELD)):
            if cap:
                out += (tot[busy] + tot[held]) / cap
        return out

    def _info(self, invalid: bool = False) -> dict[str, Any]:
        state = self.sim.state
        info: dict[str, Any] = {"t": state.t, "sim_seed": self.sim_seed, "invalid": invalid,
                                "pending": state.n_pending, "guard_fired": self.sim.guard.fired}
        if self._done:
            r = self.sim.result()
            info["episode_metrics"] = {
                "mean_act_s": float(r.act.mean()) if r.act.size else float("nan"),
                "mean_step_s": float(r.step_s.mean()) if r.step_s.size else float("nan"),
                "utilisation": r.utilisation(), "failed": int(r.counters["failed"])}
        return info
