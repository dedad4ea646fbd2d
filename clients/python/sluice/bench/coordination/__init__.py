"""``python -m sluice.bench coordination``: does the controller share one
storage pool among training jobs by their policies, and how fast does it
follow a change?

Starts a ``sluice-controller`` and two stages (``stage-a``, ``stage-b``: two
"nodes") from ``--bin-dir``, applies a pool ``bench`` of ``--capacity``
(default 200MiB/s, weighted-fair) and one policy per job, and runs four
training jobs j1..j4 with weights 1:2:3:4, each as two trainer processes
(rank 0 on stage A, rank 1 on stage B) reading a generated data set
(``--files`` x ``--size``, default 4000 x 128KiB) epoch after epoch through
the stages' O_DIRECT reads, cold cache. Phases of ``--phase-s`` seconds
(default 15): (a) all greedy; (b) j4's demand drops to 20MiB/s, below its
fair share; (c) j2 leaves; (d) j5 (weight 1, guarantee 60MiB/s) arrives.
A job with a demand paces itself at it, half on each rank.

Targets come from ``sluicectl simulate`` on the same policies and a
scenario file written from the phases: the controller's own decision
(demand estimates, allocation, loans) run offline, so a phase's target is
what each job reads at its last simulated tick. Per phase it reports each
job's target, the limit the simulation and the live controller enforce at
the phase's end (they should agree), the measured rate over the steady
part (after convergence, else the last half) and the error; the time to
converge (every job's rate, as a moving mean of two 1 s windows, within 5%
of its target for the rest of the phase); and the pool's use while the jobs want more than it. Then the
same phases with each stage on its own (no controller) as the comparison:
nothing enforces the pool there, so the jobs' rates say what the storage
would be asked for.

The capacity is well below what this machine reads, so the pool, not the
CPU, is the bottleneck: the uncoordinated pass measures what the same ten
trainers get with nothing limiting them (its aggregate is printed and in
the JSON as ``uncoordinated.aggregate_utilisation``), and both passes report
how busy the CPUs were.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from ..common import (
    BIN_DIR_HELP, add_dataset_args, default_bin_dir, find_binaries, load_dataset, log, output_dir, output_file,
)
from ..units import parse_bytes
from .analysis import (PhaseResult, analyse_phase, max_abs_error, max_converge, per_job, utilisation,
                       window_rates)
from .report import format_tables, phase_json, write_plot, write_trace
from .run import RunData, run_pass
from .scenario import (Job, Phase, Simulated, SimulateError, oversubscribed, parse_simulate, phase_simulated,
                       phase_targets, policies_yaml, scenario, scenario_yaml)
from .trainer import BUCKET_S

__all__ = ["main"]

WINDOW_S = 1.0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench coordination", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=4000)
    ap.set_defaults(size="128KiB", batch=2)
    ap.add_argument("--phase-s", type=int, default=15, help="seconds per phase (default 15)")
    ap.add_argument("--capacity", default="200MiB/s", help="the pool's bandwidth (default 200MiB/s)")
    ap.add_argument("--tick", default="1s", help="the controller's --tick (default 1s)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--stage-memory", default="1GiB", help="each stage's --memory-budget (default 1GiB)")
    ap.add_argument("--out-dir", default="bench-out/coordination",
                    help="where the policies, the scenario, the per-window rates, the controller's job views "
                         "and the plot go (default bench-out/coordination)")
    ap.add_argument("--plot", default=None, help="the PNG to draw (default <out-dir>/coordination.png)")
    ap.add_argument("--no-uncoordinated", action="store_true", help="skip the pass without the controller")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")
    return ap


def simulate_phases(sluicectl: str, policies: str, scenario_file: str,
                    phases: Sequence[Phase]) -> Tuple[Optional[List[Dict[str, Simulated]]], str]:
    """Returns each phase's last simulated tick from ``sluicectl simulate``
    (or None) and what happened."""
    done = subprocess.run([sluicectl, "simulate", "-f", policies, "--scenario", scenario_file, "-o", "json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        return None, f"sluicectl simulate failed (status {done.returncode}): {done.stderr.strip()[:400]}"
    try:
        ticks, problems = parse_simulate(done.stdout)
        for problem in problems:
            log(f"warning: simulate: {problem}")
        return phase_simulated(ticks, phases), "sluicectl simulate"
    except SimulateError as e:
        return None, str(e)


def controller_shares(views: Sequence[Tuple[float, list]], phases: Sequence[Phase],
                      key: str = "bytes_per_second") -> List[Dict[str, Optional[float]]]:
    """Returns, per phase, each job's ``key`` of its allocation (allocated
    ``bytes_per_second``, or ``enforced_bytes_per_second``) in the
    controller's last view before the phase ended (None where the view has
    no allocation)."""
    out = []
    for phase in phases:
        before = [jobs for t, jobs in views if t < phase.end_s]
        last = before[-1] if before else []
        out.append({j.get("id"): (j.get("allocation") or {}).get(key) for j in last})
    return out


def analyse(data: RunData, jobs: Sequence[Job], phases: Sequence[Phase],
            targets: Sequence[Dict[str, Optional[float]]]) -> Tuple[Dict[str, List[float]], List[PhaseResult]]:
    """Returns each job's rate per window and each phase's result."""
    windows = int(round(phases[-1].end_s / WINDOW_S))
    rates = {job.id: window_rates(data.buckets.get(job.id, {}), BUCKET_S, WINDOW_S, windows) for job in jobs}
    results = []
    for phase, target in zip(phases, targets):
        present = [j.id for j in jobs if j.present(phase.end_s - 1e-6)]
        lo, hi = int(round(phase.start_s / WINDOW_S)), int(round(phase.end_s / WINDOW_S))
        results.append(analyse_phase(phase.name, per_job(rates, present, lo, hi),
                                     {j: target.get(j) for j in present}, WINDOW_S))
    return rates, results


def _summary(results: List[PhaseResult], jobs, phases, capacity: float, limits=None) -> dict:
    """Returns the JSON of one pass; ``limits`` (coordinated pass only) is,
    per phase, ``(allocated, simulated enforced, controller enforced)``
    by job."""
    busy = [r for r, p in zip(results, phases) if oversubscribed(jobs, p, capacity)]
    u = utilisation(busy, capacity)
    out = {"phases": [phase_json(r, *(limits[i] if limits else ())) for i, r in enumerate(results)],
           "max_error_pct": None if max_abs_error(results) is None else round(max_abs_error(results), 2),
           "max_converge_s": max_converge(results),
           "aggregate_utilisation": None if u is None else round(u, 4)}
    if limits:
        gap = max_enforced_gap(limits)
        out["max_enforced_gap_pct"] = None if gap is None else round(gap, 2)
    return out


def max_enforced_gap(limits) -> Optional[float]:
    """Returns the largest difference, in percent of the simulated figure,
    between what the simulation and the controller enforce for a job at a
    phase's end (None without a pair to compare)."""
    gaps = [abs(controller[job] - sim) / sim * 100
            for _, simulated, controller in limits for job, sim in simulated.items()
            if sim and controller.get(job) is not None]
    return max(gaps) if gaps else None


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        capacity = parse_bytes(args.capacity[:-2] if args.capacity.endswith("/s") else args.capacity)
    except ValueError as e:
        raise SystemExit(f"error: --capacity: {e}") from None
    if args.phase_s < 2:
        raise SystemExit("error: --phase-s must be at least 2 seconds")
    bins = find_binaries(args.bin_dir, ("sluice-controller", "sluice-stage", "sluicectl"))
    output_dir(args.out_dir, "--out-dir")
    if args.plot:
        output_file(args.plot, "--plot")
    ds = load_dataset(args)
    jobs, phases = scenario(args.phase_s, capacity)
    policies, scenario_file = os.path.join(args.out_dir, "policies.yaml"), os.path.join(args.out_dir, "scenario.yaml")
    with open(policies, "w") as f:
        f.write(policies_yaml(jobs, capacity))
    with open(scenario_file, "w") as f:
        f.write(scenario_yaml(jobs, phases[-1].end_s, parse_tick(args.tick), parse_bytes(args.stage_memory)))
    simulated, source = simulate_phases(bins["sluicectl"], policies, scenario_file, phases)
    targets = phase_targets(simulated) if simulated else None
    log(f"targets: {source}")
    duration = phases[-1].end_s
    with tempfile.TemporaryDirectory(prefix="sluice-coordination-") as tmp:
        log(f"coordinated pass: controller, 2 stages, {2 * len(jobs)} trainers, {duration:.0f} s ...")
        coord = run_pass(bins, ds, jobs, duration, args, tmp, policies)
    controller = controller_shares(coord.controller_views, phases)
    enforced = controller_shares(coord.controller_views, phases, "enforced_bytes_per_second")
    if targets is None:
        targets = [{j.id: alloc.get(j.id) for j in jobs} for alloc in controller]
        source = "the controller's allocation at each phase's end (simulate unavailable)"
        log(f"targets: {source}")
    uncoord = None
    if not args.no_uncoordinated:
        with tempfile.TemporaryDirectory(prefix="sluice-coordination-") as tmp:
            log(f"uncoordinated pass: 2 stages on their own, {duration:.0f} s ...")
            uncoord = run_pass(bins, ds, jobs, duration, args, tmp, None)
    rates, results = analyse(coord, jobs, phases, targets)
    u_rates, u_results = analyse(uncoord, jobs, phases, targets) if uncoord else (None, None)
    sim_enforced = [{j: s.enforced for j, s in phase.items()} for phase in simulated] if simulated \
        else [{} for _ in phases]
    limits = list(zip(controller, sim_enforced, enforced))
    print(format_tables(results, u_results, limits, capacity))
    result = _summary(results, jobs, phases, capacity, limits)
    result.update({"capacity_mib_s": capacity / 2**20, "phase_s": args.phase_s, "targets_from": source,
                   "cpu_share": _round(coord.cpu_share), "machine_cpu_busy": _round(coord.machine_busy)})
    if uncoord:
        result["uncoordinated"] = dict(_summary(u_results, jobs, phases, capacity),
                                       cpu_share=_round(uncoord.cpu_share), machine_cpu_busy=_round(uncoord.machine_busy))
    print(f"max error {_fmt(result['max_error_pct'], '.1f')}%, slowest convergence "
          f"{_fmt(result['max_converge_s'], '.0f')} s, pool used {_fmt(result['aggregate_utilisation'], '.1%')} "
          f"while oversubscribed, enforced limits within {_fmt(result['max_enforced_gap_pct'], '.1f')}% of the "
          f"simulation's; sluice + trainers used {_fmt(coord.cpu_share, '.0%')} of the CPUs "
          f"(machine busy {_fmt(coord.machine_busy, '.0%')})"
          + (f"; uncoordinated: the jobs read {_fmt(result['uncoordinated']['aggregate_utilisation'], '.0%')} "
             f"of the capacity, max error {_fmt(result['uncoordinated']['max_error_pct'], '.0f')}%, "
             f"CPU {_fmt(uncoord.cpu_share, '.0%')}" if uncoord else ""))
    write_trace(os.path.join(args.out_dir, "windows.csv"),
                {"coordinated": rates, **({"uncoordinated": u_rates} if u_rates else {})}, phases, targets)
    with open(os.path.join(args.out_dir, "controller-jobs.json"), "w") as f:
        json.dump([{"t_s": round(t, 3), "jobs": v} for t, v in coord.controller_views], f)
    log(f"per-window rates: {args.out_dir}/windows.csv; the controller's job views: "
        f"{args.out_dir}/controller-jobs.json")
    plot = args.plot or os.path.join(args.out_dir, "coordination.png")
    why = write_plot(plot, phases, jobs, rates, targets, capacity, u_rates)
    log(f"plot: {plot}" if why is None else f"no plot: {why}")
    if args.json:
        print(json.dumps(result))
    return 0


def parse_tick(text: str) -> float:
    """Returns seconds of ``1s`` or ``500ms``."""
    t = text.strip()
    try:
        return float(t[:-2]) / 1000 if t.endswith("ms") else float(t[:-1] if t.endswith("s") else t)
    except ValueError:
        raise SystemExit(f"error: cannot read --tick {text!r}; write e.g. 1s or 500ms") from None


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


def _fmt(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)
