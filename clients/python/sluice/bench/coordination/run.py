"""One pass of the scenario on real processes: two stages (with a
controller that shares the pool, or each on its own), one trainer process
per rank of every job, and what each job received per time bucket.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import subprocess
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..common import Daemon, get_json, log, wait_for
from ..dataset import BenchDataset, evict
from ..stage import StageProcess, pid_cpu_seconds
from . import trainer
from .analysis import cpu_busy
from .scenario import STAGES, Job

WORLD = 2
# Seconds the trainer processes get to import before the clock starts.
READY_TIMEOUT_S = 60.0


class RunData(NamedTuple):
    """What one pass measured: bytes per job per ``trainer.BUCKET_S`` bucket
    after ``t0``, the controller's job views polled during the run
    (``[(seconds after t0, jobs)]``, empty without a controller), the CPU
    the benchmark's own processes used as a fraction of all CPUs (stages,
    controller, trainers, from their start), and the busy fraction of the
    whole machine over the run (other work included)."""

    buckets: Dict[str, Dict[int, int]]
    controller_views: List[Tuple[float, list]]
    cpu_share: Optional[float]
    machine_busy: Optional[float]


def _cpu_counters() -> List[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


class _Poller(threading.Thread):
    """Polls the controller's ``/api/v1/jobs`` every ``period`` seconds."""

    def __init__(self, http: str, t0: float, period: float = 0.5) -> None:
        super().__init__(name="controller-poller", daemon=True)
        self.http, self.t0, self.period = http, t0, period
        self.views: List[Tuple[float, list]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.period):
            try:
                self.views.append((time.monotonic() - self.t0, get_json(self.http, "/api/v1/jobs", timeout=2)))
            except (OSError, ValueError):
                pass  # a missed poll only thins the record


def _start_controller(bins: Dict[str, str], tmp: str, tick: str, policies: str) -> Daemon:
    controller = Daemon.start([bins["sluice-controller"], "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
                               "--tick", tick, "--database-url", f"sqlite://{tmp}/sluice.db"],
                              os.path.join(tmp, "controller.log"))
    done = subprocess.run([bins["sluicectl"], "--server", f"http://{controller.ready['grpc']}", "apply", "-f", policies],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        controller.stop()
        raise SystemExit(f"error: sluicectl apply -f {policies} failed:\n{done.stderr}")
    return controller


def _start_stages(bins: Dict[str, str], tmp: str, ds: BenchDataset, args, grpc: Optional[str]) -> List[StageProcess]:
    stages = []
    for sid in STAGES:
        # O_DIRECT: every epoch reads the device (buffered, the second was
        # the page cache's, and the pool's capacity went unmeasured).
        extra = ["--memory-budget", args.stage_memory, "--stage-id", sid, "--node", sid.replace("stage", "node"),
                 "--direct-io", "true"]
        if grpc:
            extra += ["--controller", f"http://{grpc}"]
        stages.append(StageProcess.start(bins["sluice-stage"], os.path.join(tmp, f"{sid}.sock"), {"bench": ds.root},
                                         extra, stderr_path=os.path.join(tmp, f"{sid}.log")))
    return stages


def run_pass(bins: Dict[str, str], ds: BenchDataset, jobs: Sequence[Job], duration_s: float, args, tmp: str,
             policies: Optional[str]) -> RunData:
    """Runs the scenario once; with ``policies`` under a controller that
    applied them, else with standalone stages."""
    evict(ds.paths())
    controller = _start_controller(bins, tmp, args.tick, policies) if policies else None
    stages: List[StageProcess] = []
    procs = []
    poller = None
    try:
        stages = _start_stages(bins, tmp, ds, args, controller.ready["grpc"] if controller else None)
        if controller:
            http = controller.ready["http"]
            wait_for("both stages to connect to the controller", lambda: True if sum(
                s.get("state") == "connected" for s in get_json(http, "/api/v1/stages")) == len(stages) else None,
                timeout=30, every=0.1)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        go = ctx.Event()
        t0_value = ctx.Value("d", 0.0)
        for job in jobs:
            for rank, stage in enumerate(stages):
                r = trainer.Rank(job.id, rank, WORLD, stage.socket, 0.0, job.arrive_s,
                                 duration_s if job.leave_s is None else job.leave_s, job.demand, args.batch, args.seed)
                p = ctx.Process(target=trainer.run, args=(r, out, go, t0_value), name=f"{job.id}-{rank}", daemon=True)
                p.start()
                procs.append(p)
        seen = [0]
        wait_for("the trainer processes to start", lambda: _count_ready(out, seen, len(procs)), timeout=READY_TIMEOUT_S,
                 every=0.05)
        t0 = time.monotonic() + 0.2
        t0_value.value = t0
        cpu0 = _cpu_counters()
        go.set()
        if controller:
            poller = _Poller(controller.ready["http"], t0)
            poller.start()
        buckets, finished, trainer_cpu = _collect(out, procs, t0 + duration_s)
        cpu = _cpu_counters()
        wall = time.monotonic() - t0
        own = trainer_cpu + sum(pid_cpu_seconds(p.pid) for p in [*(s.proc for s in stages),
                                                                   *([controller.proc] if controller else [])])
        for p in procs:
            p.join(timeout=10)
    finally:
        if poller:
            poller.stopping.set()
        for p in procs:
            if p.is_alive():
                p.terminate()
        codes = [s.stop() for s in stages]
        if controller:
            controller.stop()
    if codes != [0] * len(codes):
        raise SystemExit(f"error: a stage exited with {codes} on SIGTERM\n" + "\n".join(s.stderr_tail() for s in stages))
    if finished < len(procs):
        log(f"warning: {len(procs) - finished} trainer process(es) did not report their end")
    return RunData(buckets, poller.views if poller else [], own / wall / os.cpu_count(), cpu_busy(cpu0, cpu))


def _count_ready(out, seen: List[int], want: int) -> Optional[bool]:
    """Counts the trainers' ``ready`` reports into ``seen[0]``; True once ``want`` came."""
    while True:
        try:
            message = out.get_nowait()
        except queue.Empty:
            break
        if message[0] == "ready":
            seen[0] += 1
        elif message[0] == "error":
            raise SystemExit(f"error: trainer {message[1]} rank {message[2]} failed:\n{message[3]}")
    return True if seen[0] >= want else None


def _collect(out, procs, end: float) -> Tuple[Dict[str, Dict[int, int]], int, float]:
    """Drains the trainers' reports until every process said it is done (or
    a grace period after ``end`` ran out); fails on a trainer's error.
    Returns the bytes per job per bucket, how many finished and their CPU
    seconds."""
    buckets: Dict[str, Dict[int, int]] = {}
    finished, cpu = 0, 0.0
    deadline = end + 20.0
    while finished < len(procs) and time.monotonic() < deadline:
        try:
            message = out.get(timeout=0.5)
        except queue.Empty:
            continue
        kind = message[0]
        if kind == "bytes":
            _, job, _rank, bucket, n = message
            per = buckets.setdefault(job, {})
            per[bucket] = per.get(bucket, 0) + n
        elif kind == "done":
            finished += 1
            cpu += message[3]
        elif kind == "error":
            raise SystemExit(f"error: trainer {message[1]} rank {message[2]} failed:\n{message[3]}")
    return buckets, finished, cpu
