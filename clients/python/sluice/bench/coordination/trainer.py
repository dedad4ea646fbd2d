"""One rank of a training job, in its own process: connects to its stage
when the job arrives, reads the data set epoch after epoch (greedy, or paced
to its share of the job's demand), and reports the bytes it received per
small time bucket to the parent until the job leaves or the run ends.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import NamedTuple, Optional, Tuple

BUCKET_S = 0.25


class Rank(NamedTuple):
    """What a trainer process needs: times are seconds after ``t0`` (a
    ``time.monotonic()`` value, the same clock in every process)."""

    job: str
    rank: int
    world: int
    socket: str
    t0: float
    arrive_s: float
    end_s: float
    demand: Tuple[Tuple[float, Optional[float]], ...]
    batch: int
    seed: int


class Pacer:
    """Keeps a rank at ``rate`` bytes/s since the demand last changed:
    :meth:`wait_s` says how long to sleep after receiving bytes."""

    def __init__(self) -> None:
        self.rate: Optional[float] = None
        self.since = 0.0
        self.bytes = 0

    def set_rate(self, rate: Optional[float], now: float) -> None:
        if rate != self.rate:
            self.rate, self.since, self.bytes = rate, now, 0

    def wait_s(self, n: int, now: float) -> float:
        self.bytes += n
        if self.rate is None:
            return 0.0
        return max(0.0, self.since + self.bytes / self.rate - now)


def run(r: Rank, out, go, t0) -> None:
    """The process body: says ``ready``, waits for ``go`` and reads the start
    time from the shared ``t0``; never raises: failures go to ``out`` as
    ``("error", ...)``."""
    try:
        from ... import Client  # noqa: F401 - import before saying ready
        out.put(("ready", r.job, r.rank))
        go.wait()
        _read(r._replace(t0=t0.value), out)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put(("error", r.job, r.rank, traceback.format_exc()))
    out.put(("done", r.job, r.rank, sum(os.times()[:2])))


def _demand(r: Rank, t: float) -> Optional[float]:
    current = None
    for at, rate in r.demand:
        if at <= t:
            current = rate
    return None if current is None else current / r.world


def _read(r: Rank, out) -> None:
    from ... import Client  # imported here: the spawned child imports the package itself

    clock = time.monotonic
    delay = r.t0 + r.arrive_s - clock()
    if delay > 0:
        time.sleep(delay)
    end = r.t0 + r.end_s
    client = Client(r.socket, job=r.job, labels={"job": r.job}, rank=r.rank, world_size=r.world)
    pacer = Pacer()
    bucket, held = -1, 0
    try:
        dataset = client.dataset("bench")
        epoch = 0
        while clock() < end:
            with dataset.epoch(epoch, seed=r.seed, batch=r.batch) as it:
                for _name, data in it:
                    now = clock()
                    t = now - r.t0
                    b = int(t // BUCKET_S)
                    if b != bucket:
                        if held:
                            out.put(("bytes", r.job, r.rank, bucket, held))
                        bucket, held = b, 0
                    held += len(data)
                    if now >= end:
                        break
                    pacer.set_rate(_demand(r, t), now)
                    pause = pacer.wait_s(len(data), now)
                    if pause > 0:
                        time.sleep(min(pause, end - now))
            epoch += 1
    finally:
        if held:
            out.put(("bytes", r.job, r.rank, bucket, held))
        client.close()
