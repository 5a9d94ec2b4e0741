"""A text view of the scheduling state: the queue as the policy sees it, and the pools.

The env's ``render_mode="ansi"`` returns it; it reads the same ``ClusterState`` and
``ObservationEncoder`` on either clock.
"""

from __future__ import annotations

from metasched.core.observation import ObservationEncoder, batch_levels, cpu_levels
from metasched.core.state import ClusterState


def text_view(state: ClusterState, encoder: ObservationEncoder) -> str:
    """The clock, step progress, each pool's use and the K slots (with the legal
    allocation levels and the advisor's choice), one line each."""
    cpu, gpu, api = state.cpu, state.gpu, state.api
    p = state.pending
    lines = [f"t {state.t:.3f} s | step {state.step_index}: {state.step_done}/"
             f"{state.step_total} trajectories done | pending {state.n_pending} (cpu "
             f"{len(p['cpu'])}, gpu {len(p['gpu'])}, api {len(p['api'])}) | running "
             f"{state.n_running}"]
    if cpu.n_nodes:
        nodes = " ".join(f"{f}/{c}" for f, c in zip(cpu.free, cpu.cores, strict=True))
        lines.append(f"cpu  busy {cpu.busy}/{cpu.total} cores, held {cpu.held} | free per "
                     f"node {nodes}")
    for d in gpu.devices:
        resident = ", ".join(sorted(d.resident)) or "none"
        lines.append(f"gpu{d.index} {'busy' if d.busy else 'idle'} | resident {resident} "
                     f"({d.mem_used(gpu.services):g}/{d.mem_gb:g} GB)")
    for name in sorted(api.endpoints):
        ep = api.endpoints[name]
        ep.refill(state.t)
        tok = "" if ep.spec.tpm is None else f", {ep.tok:,.0f}/{ep.spec.tok_capacity:,.0f} tok"
        lines.append(f"api  {name}: {ep.req:.1f}/{ep.spec.req_capacity:.1f} req{tok}, "
                     f"{ep.in_flight}/{ep.spec.max_concurrency} in flight")
    slots = encoder.slots(state)
    if not slots:
        lines.append("queue empty")
        return "\n".join(lines) + "\n"
    mask = encoder.mask(state, slots)
    advice = encoder.advice(state)
    levels = encoder.cfg.levels
    lines.append(f"{'slot':>4} {'kind':4} {'task/action':24} {'est s':>8} {'wait s':>8} "
                 f"{'levels (legal*)':22} advised")
    for i, a in enumerate(slots):
        spec = a.spec
        if spec.kind == "cpu":  # cores per level
            sizes = [f"{c}c" if c > 0 else "-"
                     for c in cpu_levels(spec.min_cores, spec.max_cores, levels)]
        elif spec.kind == "gpu":  # batch-size caps per level
            cap = gpu.services[spec.service].max_batch
            sizes = [f"b{b}" if b > 0 else "-" for b in batch_levels(cap, levels)]
        else:
            sizes = ["run"] + ["-"] * (levels - 1)
        legal = " ".join(s + ("*" if mask[i * levels + lv] else "")
                         for lv, s in enumerate(sizes))
        adv = f"{advice[a.id]:.2f}" if a.id in advice else ""
        lines.append(f"{i:>4} {spec.kind:4} {f'{a.task}/{spec.name}'[:24]:24} "
                     f"{spec.est_s:>8.3f} {state.t - a.submit_t:>8.3f} {legal:22} {adv}")
    beyond = state.n_pending - len(slots)
    if beyond:
        lines.append(f"... {beyond} more pending beyond the {len(slots)} slots")
    return "\n".join(lines) + "\n"


__all__ = ["text_view"]
