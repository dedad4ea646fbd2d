"""The arithmetic over what the trainers delivered (pure): each job's
throughput per window, when a phase converged, each job's error against its
target, and how much of the pool was used.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

TOLERANCE = 0.05


def window_rates(buckets: Mapping[int, int], bucket_s: float, window_s: float, windows: int) -> List[float]:
    """Returns bytes/s in each of ``windows`` windows of ``window_s`` from 0,
    given the bytes delivered per ``bucket_s`` bucket (bucket ``i`` covers
    ``[i * bucket_s, (i + 1) * bucket_s)``; ``window_s`` must be a whole
    number of buckets)."""
    per = window_s / bucket_s
    if per < 1 or abs(per - round(per)) > 1e-9:
        raise ValueError(f"a {window_s}s window is not a whole number of {bucket_s}s buckets")
    per = int(round(per))
    out = [0.0] * windows
    for i, n in buckets.items():
        w = i // per
        if 0 <= w < windows:
            out[w] += n
    return [b / window_s for b in out]


def within(rate: float, target: float, tolerance: float = TOLERANCE) -> bool:
    """Whether ``rate`` is within ``tolerance`` (a fraction) of ``target``."""
    return abs(rate - target) <= tolerance * target


SMOOTH_WINDOWS = 2


def smoothed(rates: Sequence[float], span: int = SMOOTH_WINDOWS) -> List[float]:
    """Returns the moving mean of ``rates`` over ``span`` windows (fewer at
    the start): one 1 s window of a job reading 20 MiB/s in 256 KiB fetches
    swings by a fetch or two either way, which is 1-3% alone."""
    out = []
    for w in range(len(rates)):
        part = rates[max(0, w - span + 1):w + 1]
        out.append(sum(part) / len(part))
    return out


def converged_at(rates: Mapping[str, Sequence[float]], targets: Mapping[str, float],
                 tolerance: float = TOLERANCE, span: int = SMOOTH_WINDOWS) -> Optional[int]:
    """Returns the index of the first window from which every job's moving
    mean over ``span`` windows (see :func:`smoothed`) stays within
    ``tolerance`` of its target to the end, or None if the last one is not.
    ``rates`` holds each job's windows of one phase."""
    n = min((len(r) for r in rates.values()), default=0)
    means = {job: smoothed(rates[job][:n], span) for job in targets}
    first = None
    for w in range(n - 1, -1, -1):
        if not all(within(means[job][w], targets[job], tolerance) for job in targets):
            break
        first = w
    return first


class JobResult(NamedTuple):
    job: str
    target: Optional[float]
    measured: float

    @property
    def error_pct(self) -> Optional[float]:
        """(measured - target) / target in percent; None without a target."""
        if self.target is None:
            return None
        return (self.measured - self.target) / self.target * 100 if self.target > 0 else math.inf


class PhaseResult(NamedTuple):
    name: str
    converge_s: Optional[float]
    steady_s: float
    jobs: List[JobResult]

    @property
    def total(self) -> float:
        return sum(j.measured for j in self.jobs)


def steady_start(converged: Optional[int], windows: int) -> int:
    """Returns the first steady window: where it converged, else the last half."""
    return converged if converged is not None else windows // 2


def analyse_phase(name: str, rates: Mapping[str, Sequence[float]], targets: Mapping[str, Optional[float]],
                  window_s: float = 1.0, tolerance: float = TOLERANCE) -> PhaseResult:
    """Returns the phase's convergence time and each job's mean rate over its
    steady part. ``rates`` and ``targets`` are keyed by the phase's jobs; a
    job without a target (None) leaves the phase unconverged."""
    windows = min(len(r) for r in rates.values())
    known = all(t is not None for t in targets.values())
    converged = converged_at(rates, targets, tolerance) if known else None
    start = steady_start(converged, windows)
    steady = max(windows - start, 1)
    jobs = [JobResult(job, targets[job], sum(rates[job][start:start + steady]) / steady) for job in targets]
    return PhaseResult(name, None if converged is None else converged * window_s, steady * window_s, jobs)


def utilisation(phases: Sequence[PhaseResult], capacity: float) -> Optional[float]:
    """Returns the pool's use over ``phases``' steady parts as a fraction of
    ``capacity`` (weighted by each steady part's length), None without phases."""
    seconds = sum(p.steady_s for p in phases)
    if seconds <= 0:
        return None
    return sum(p.total * p.steady_s for p in phases) / seconds / capacity


def max_abs_error(phases: Sequence[PhaseResult]) -> Optional[float]:
    errors = [abs(j.error_pct) for p in phases for j in p.jobs if j.error_pct is not None]
    return max(errors) if errors else None


def max_converge(phases: Sequence[PhaseResult]) -> Optional[float]:
    """Returns the slowest phase's convergence, None if one never converged."""
    times = [p.converge_s for p in phases]
    return None if not times or any(t is None for t in times) else max(times)


def cpu_busy(before: Sequence[int], after: Sequence[int]) -> Optional[float]:
    """Returns the busy fraction of all CPUs between two ``/proc/stat`` ``cpu``
    lines' counters (user nice system idle iowait irq softirq steal)."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    idle = delta[3] + delta[4]
    return (total - idle) / total if total > 0 else None


def per_job(rates: Dict[str, List[float]], jobs: Sequence[str], lo: int, hi: int) -> Dict[str, List[float]]:
    """Returns each of ``jobs``' windows ``lo..hi`` (missing jobs read as 0)."""
    return {job: (rates.get(job) or [0.0] * hi)[lo:hi] for job in jobs}
