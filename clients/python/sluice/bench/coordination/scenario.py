"""The benchmark's scenario as data: the jobs, the four phases, the policies
that share the pool among them, the scenario file ``sluicectl simulate``
reads, and its answer turned into each phase's targets (all pure).
"""

from __future__ import annotations

import json
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

MiB = 2**20
POOL = "bench"
STAGES = ("stage-a", "stage-b")
NODES = ("node-a", "node-b")  # one stage on each


class Job(NamedTuple):
    """A training job: two ranks, one on each stage.

    ``demand`` is ``[(at_s, bytes_per_s or None)]`` sorted by time, None
    meaning greedy (as fast as it gets data); ``leave_s`` None means it
    stays to the end.
    """

    id: str
    weight: int
    arrive_s: float
    leave_s: Optional[float]
    demand: Tuple[Tuple[float, Optional[float]], ...]
    guarantee: Optional[int] = None

    def demand_at(self, t: float) -> Optional[float]:
        """Returns the job's demand in bytes/s at ``t`` (None: greedy)."""
        current = None
        for at, rate in self.demand:
            if at <= t:
                current = rate
        return current

    def present(self, t: float) -> bool:
        return self.arrive_s <= t and (self.leave_s is None or t < self.leave_s)


class Phase(NamedTuple):
    name: str
    start_s: float
    end_s: float


def scenario(phase_s: float, capacity: int = 200 * MiB) -> Tuple[List[Job], List[Phase]]:
    """Returns the jobs and phases: j1..j4 weights 1..4 greedy; (b) j4's
    demand drops to a tenth of ``capacity`` (20MiB/s of 200MiB/s, below its
    fair share of four tenths); (c) j2 leaves; (d) j5 (weight 1, guaranteed
    three tenths of the capacity) arrives."""
    p = float(phase_s)
    low_demand, guarantee = capacity // 10, capacity * 3 // 10
    names = ("a: all greedy", f"b: j4 drops to {rate_text(low_demand)}", "c: j2 leaves",
             f"d: j5 arrives (guarantee {rate_text(guarantee)})")
    jobs = [
        Job("j1", 1, 0.0, None, ((0.0, None),)),
        Job("j2", 2, 0.0, 2 * p, ((0.0, None),)),
        Job("j3", 3, 0.0, None, ((0.0, None),)),
        Job("j4", 4, 0.0, None, ((0.0, None), (p, float(low_demand)))),
        Job("j5", 1, 3 * p, None, ((3 * p, None),), guarantee),
    ]
    phases = [Phase(name, i * p, (i + 1) * p) for i, name in enumerate(names)]
    return jobs, phases


def oversubscribed(jobs: Sequence[Job], phase: Phase, capacity: float) -> bool:
    """Whether the jobs present at the end of ``phase`` together want more
    than ``capacity`` (any greedy job does)."""
    t = phase.end_s - 1e-6
    total = 0.0
    for job in jobs:
        if job.present(t):
            demand = job.demand_at(t)
            if demand is None:
                return True
            total += demand
    return total > capacity


def rate_text(bytes_per_s: float) -> str:
    """Returns a policy byte rate: ``200MiB/s``, or ``1234B/s`` when not whole MiB."""
    n = int(round(bytes_per_s))
    return f"{n // MiB}MiB/s" if n % MiB == 0 else f"{n}B/s"



def policies_yaml(jobs: Sequence[Job], capacity: int) -> str:
    """Returns the pool and one JobPolicy per job, selecting on ``job: <id>``."""
    docs = [f"apiVersion: sluice.dev/v1\nkind: StoragePool\nmetadata: {{name: {POOL}}}\n"
            f"spec:\n  capacity: {{bandwidth: {rate_text(capacity)}}}\n  sharing: weighted-fair\n"]
    for job in jobs:
        doc = (f"apiVersion: sluice.dev/v1\nkind: JobPolicy\nmetadata: {{name: {job.id}}}\n"
               f"spec:\n  selector: {{matchLabels: {{job: {job.id}}}}}\n  pool: {POOL}\n  weight: {job.weight}\n")
        if job.guarantee:
            doc += f"  guarantee: {{bandwidth: {rate_text(job.guarantee)}}}\n"
        docs.append(doc)
    return "---\n".join(docs)


def _seconds(t: float) -> str:
    return f"{t:g}s"


def scenario_yaml(jobs: Sequence[Job], duration_s: float, tick_s: float = 1.0, memory: int = 2**30,
                  readers: int = 64) -> str:
    """Returns the ``sluicectl simulate --scenario`` file of these jobs, each
    stage on its own node with the stages' ``memory`` budget and ``readers``."""
    lines = [f"tick: {_seconds(tick_s)}", f"duration: {_seconds(duration_s)}", "nodes:"]
    for node, stage in zip(NODES, STAGES):
        lines.append(f"  - {{name: {node}, stages: [{stage}], readers: {readers}, memory: {memory}}}")
    lines.append("jobs:")
    for job in jobs:
        lines += [f"  - id: {job.id}", f"    labels: {{job: {job.id}}}",
                  f"    stages: [{', '.join(STAGES)}]", f"    arrive: {_seconds(job.arrive_s)}"]
        if job.leave_s is not None:
            lines.append(f"    leave: {_seconds(job.leave_s)}")
        lines.append("    demand:")
        for at, rate in job.demand:
            lines.append(f"      - {{at: {_seconds(at)}, bandwidth: {'greedy' if rate is None else rate_text(rate)}}}")
    return "\n".join(lines) + "\n"


class SimulateError(ValueError):
    """``sluicectl simulate`` answered something this benchmark cannot read."""


class Simulated(NamedTuple):
    """One job at one simulated tick (bytes/s): what the engine allocates,
    what its stages enforce (allocation plus any loan of capacity nobody
    wants) and what it then reads (its demand, capped by the enforced
    limit)."""

    allocated: float
    enforced: float
    rate: float


def parse_simulate(text: str) -> Tuple[List[Tuple[float, Dict[str, Simulated]]], List[str]]:
    """Returns ``[(time_s, {job: Simulated})]`` per tick of ``sluicectl
    simulate -o json``'s answer, sorted by time, and the distinct problems
    the engine reported."""
    try:
        doc = json.loads(text)
        ticks, problems = [], []
        for tick in doc["ticks"]:
            problems += [str(p) for p in tick.get("problems") or [] if str(p) not in problems]
            ticks.append((float(tick["time_s"]),
                          {j["job"]: Simulated(float(j["bytes_per_second"]), float(j["enforced_bytes_per_second"]),
                                               float(j["rate_bytes_per_second"]))
                           for j in tick["jobs"]}))
    except (ValueError, KeyError, TypeError) as e:
        raise SimulateError(f"cannot read simulate's JSON: {e!r}") from None
    return sorted(ticks, key=lambda t: t[0]), problems


def phase_simulated(ticks: Sequence[Tuple[float, Dict[str, Simulated]]],
                    phases: Sequence[Phase]) -> List[Dict[str, Simulated]]:
    """Returns each phase's last simulated tick, where the simulated
    control loop has settled after the phase's change."""
    out = []
    for phase in phases:
        inside = [jobs for t, jobs in ticks if phase.start_s <= t < phase.end_s]
        if not inside:
            raise SimulateError(f"simulate has no tick in phase {phase.name!r} "
                                f"({phase.start_s:g}s..{phase.end_s:g}s)")
        out.append(dict(inside[-1]))
    return out


def phase_targets(simulated: Sequence[Dict[str, Simulated]]) -> List[Dict[str, float]]:
    """Returns each phase's targets: what each job reads at the phase's
    last simulated tick."""
    return [{job: s.rate for job, s in phase.items()} for phase in simulated]
