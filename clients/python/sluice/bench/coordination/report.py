"""How the results are shown: a table per phase, the JSON object, and the
plot of each job's throughput over time (with matplotlib, when it imports).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from .analysis import PhaseResult
from .scenario import Job, MiB, Phase


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x / MiB, 2)


def _pct(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 2)


def phase_json(p: PhaseResult, controller: Optional[Dict[str, Optional[float]]] = None,
               simulated_enforced: Optional[Dict[str, float]] = None,
               controller_enforced: Optional[Dict[str, Optional[float]]] = None) -> dict:
    """Returns one phase of the JSON output (rates in MiB/s): per job its
    target, measured rate and error, and with a controller its allocation
    there (``controller_mib_s``) and the limit the simulation and the
    controller enforce at the phase's end."""
    jobs = []
    for j in p.jobs:
        row = {"job": j.job, "target_mib_s": _mib(j.target), "measured_mib_s": _mib(j.measured),
               "error_pct": _pct(j.error_pct)}
        if controller is not None:
            row["controller_mib_s"] = _mib(controller.get(j.job))
        if simulated_enforced is not None:
            row["simulated_enforced_mib_s"] = _mib(simulated_enforced.get(j.job))
        if controller_enforced is not None:
            row["controller_enforced_mib_s"] = _mib(controller_enforced.get(j.job))
        jobs.append(row)
    return {"name": p.name, "converge_s": p.converge_s, "steady_s": p.steady_s, "jobs": jobs,
            "total_mib_s": _mib(p.total)}


def _cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_tables(coordinated: Sequence[PhaseResult], uncoordinated: Optional[Sequence[PhaseResult]],
                  limits: Sequence[tuple], capacity: float) -> str:
    """Returns a table per phase: target, the limits the simulation and
    the controller enforce at the phase's end (``limits``: per phase,
    allocated, simulated enforced and controller enforced, by job),
    measured and error with the controller, and without it beside."""
    out: List[str] = []
    for i, p in enumerate(coordinated):
        u = uncoordinated[i] if uncoordinated else None
        conv = "never" if p.converge_s is None else f"{p.converge_s:.0f} s"
        out.append(f"phase {p.name}: converged after {conv}; pool used {p.total / capacity * 100:.1f}%"
                   + (f" (uncoordinated {u.total / capacity * 100:.1f}%)" if u else ""))
        out.append(f"  {'job':4} {'target':>9} {'sim limit':>10} {'ctl limit':>10} {'measured':>9} {'error':>8}"
                   + (f" | {'uncoord':>9} {'error':>8}" if u else ""))
        by_job = {j.job: j for j in u.jobs} if u else {}
        for j in p.jobs:
            _, simulated, enforced = limits[i]
            line = (f"  {j.job:4} {_cell(_mib(j.target), '9.1f')} {_cell(_mib(simulated.get(j.job)), '10.1f')} "
                    f"{_cell(_mib(enforced.get(j.job)), '10.1f')} {_mib(j.measured):9.1f} {_cell(j.error_pct, '+7.1f')}%")
            if u and j.job in by_job:
                uj = by_job[j.job]
                line += f" | {_mib(uj.measured):9.1f} {_cell(uj.error_pct, '+7.1f')}%"
            out.append(line)
    out.append("(MiB/s; measured over each phase's steady part: after convergence, else its last half)")
    return "\n".join(out)


def write_trace(path: str, passes: Dict[str, Dict[str, List[float]]], phases: Sequence[Phase],
                targets: Sequence[Dict[str, Optional[float]]], window_s: float = 1.0) -> None:
    """Writes each pass's rate per job per window, with its phase's target,
    as CSV (``pass,job,window_end_s,phase,mib_s,target_mib_s``)."""
    with open(path, "w") as f:
        f.write("pass,job,window_end_s,phase,mib_s,target_mib_s\n")
        for name, rates in passes.items():
            for job, series in rates.items():
                for w, rate in enumerate(series):
                    i = next((k for k, p in enumerate(phases) if p.start_s <= w * window_s < p.end_s), None)
                    target = targets[i].get(job) if i is not None else None
                    f.write(f"{name},{job},{(w + 1) * window_s:g},{phases[i].name.split(':')[0] if i is not None else ''},"
                            f"{rate / MiB:.3f},{'' if target is None else f'{target / MiB:.3f}'}\n")


def write_plot(path: str, phases: Sequence[Phase], jobs: Sequence[Job], rates: Dict[str, List[float]],
               targets: Sequence[Dict[str, Optional[float]]], capacity: float,
               uncoordinated: Optional[Dict[str, List[float]]] = None) -> Optional[str]:
    """Draws each job's throughput per window (solid), its target per phase
    (dashed) and the phase boundaries; a second panel for the uncoordinated
    pass. Returns None when written, else why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib does not import ({e})"
    panels = [("with the controller", rates)] + ([("each stage on its own", uncoordinated)] if uncoordinated else [])
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(11, 3.6 * len(panels)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, series) in zip(axes[:, 0], panels):
        for k, spec in enumerate(jobs):
            job, colour = spec.id, colours[k % len(colours)]
            shown = [(w + 1, r / MiB) for w, r in enumerate(series.get(job, [])) if spec.present(w + 0.5)]
            ax.step([x for x, _ in shown], [y for _, y in shown], where="pre", color=colour, label=job)
            for phase, target in zip(phases, targets):
                if target.get(job) is not None:
                    ax.hlines(target[job] / MiB, phase.start_s, phase.end_s, colors=colour, linestyles="dashed")
        ax.axhline(capacity / MiB, color="grey", linewidth=0.8, linestyle=":", label="pool capacity")
        for phase in phases[1:]:
            ax.axvline(phase.start_s, color="black", linewidth=0.6)
        for phase in phases:
            ax.text(phase.start_s + 0.3, 0.97, phase.name.split(":")[0], transform=ax.get_xaxis_transform(),
                    va="top", fontsize=9)
        ax.set_ylabel("MiB/s per 1 s window")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[-1, 0].set_xlabel("seconds (dashed: targets from sluicectl simulate)")
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
