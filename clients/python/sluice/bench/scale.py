"""``python -m sluice.bench scale``: the controller under many stages.

Starts a ``sluice-controller`` (SQLite store in a temp dir, or ``--store``)
and ``sluice-loadgen``, which opens ``--stages`` simulated stage sessions
from one process (a connection each, a few jobs each, telemetry every
second, an ``Ack`` for every push, like real stages). Once every stage is
connected and the controller has stopped publishing, it measures over
``--window`` seconds: the controller's CPU (cores, averaged) and peak RSS,
the duration of its control-loop passes (p99, from
``sluice_controller_tick_seconds``), and ``--applies`` policy applies, each
timed from starting ``sluicectl apply`` until every simulated stage has
acknowledged a new settings version (every apply changes every job's
limit, so every stage gets one). The apply figures are over applies: p50
and p99 of the time until the *last* stage acknowledged.

Builds nothing: ``--bin-dir`` (default ``$SLUICE_BIN_DIR``, else the
repository's ``target/release``) must hold
``sluice-controller``, ``sluicectl`` and ``sluice-loadgen``. With ``--json``
stdout ends with one object ``{"stages", "controller_cpu_cores",
"controller_rss_bytes", "tick_ms_p99", "apply_ms_p50", "apply_ms_p99",
...}``. The load generator shares the machine: its CPU is reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .common import (
    BIN_DIR_HELP, Daemon, default_bin_dir, fetch_metrics, find_binaries, log, metric_value, output_dir, quantile,
    wait_for,
)
from .stage import pid_cpu_seconds, rss_bytes

POLICY = """apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {{name: scale}}
spec: {{capacity: {{bandwidth: 100TiB/s}}}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {{name: scale}}
spec:
  selector: {{matchLabels: {{sim: "true"}}}}
  pool: scale
  limit: {{bandwidth: {limit}MiB/s}}
"""

# Each simulated job spans this many stages and asks 20 MiB/s on each: a
# limit below 16 x 20 MiB/s binds, so a changed limit changes every stage.
STAGES_PER_JOB = 16
DEMAND_MIB_S = 20
LIMIT_MIB_S = 200


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, required=True, help="simulated stages")
    ap.add_argument("--jobs-per-stage", type=int, default=3, help="jobs on each stage (default 3)")
    ap.add_argument("--applies", type=int, default=10, help="applies to time (default 10)")
    ap.add_argument("--window", type=float, default=40.0,
                    help="seconds of steady state the CPU and tick figures cover (default 40)")
    ap.add_argument("--tick", default="1s", help="the controller's --tick (default 1s)")
    ap.add_argument("--store", help="the controller's --database-url (default: SQLite in a temp dir)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--log-dir", help="keep the controller's and the load generator's logs here")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")
    return ap


class LoadGen:
    """``sluice-loadgen`` with its JSON lines read on a thread."""

    def __init__(self, argv: Sequence[str], log_path: str) -> None:
        with open(log_path, "w") as err:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, bufsize=1)
        self.lines: "queue.Queue[dict]" = queue.Queue()
        threading.Thread(target=self._read, name="loadgen-stdout", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict:
        """Returns the next line of ``event`` (others are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise TimeoutError(f"sluice-loadgen said no {event!r} within {timeout:g} s")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line.get("event") == event:
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def histogram(samples, name: str) -> List[Tuple[float, float]]:
    """Returns a Prometheus histogram's cumulative buckets ``[(le, count)]``."""
    out = [(float(ls["le"]), v) for n, ls, v in samples if n == f"{name}_bucket" and "le" in ls]
    return sorted(out)


def histogram_quantile(before: List[Tuple[float, float]], after: List[Tuple[float, float]],
                       q: float) -> Optional[float]:
    """The upper bound of the bucket holding quantile ``q`` of the
    observations made between two readings of one histogram."""
    counts = dict(before)
    delta = [(le, c - counts.get(le, 0.0)) for le, c in after]
    if not delta or delta[-1][1] <= 0:
        return None
    rank = q * delta[-1][1]
    return next((le for le, c in delta if c >= rank), math.inf)


def _settled(http: str, stages: int):
    """A check that is true once every stage is connected and the
    controller published nothing new for 3 s."""
    last: Dict[str, float] = {}

    def check():
        samples = fetch_metrics(http, timeout=10)
        connected = metric_value(samples, "sluice_controller_stages", state="connected") or 0
        pushes = metric_value(samples, "sluice_controller_settings_pushes_total") or 0
        now = time.monotonic()
        if connected < stages or pushes != last.get("pushes"):
            last.update(pushes=pushes, since=now)
            return None
        return True if now - last["since"] >= 3.0 else None

    return check


def run(args, binary: Dict[str, str], tmp: str) -> dict:
    store = args.store or f"sqlite://{tmp}/sluice.db"
    logs = args.log_dir or tmp
    controller = Daemon.start([binary["sluice-controller"], "--grpc-addr", "127.0.0.1:0",
                               "--http-addr", "127.0.0.1:0", "--tick", args.tick, "--database-url", store],
                              os.path.join(logs, "controller.log"))
    loadgen: Optional[LoadGen] = None
    try:
        grpc, http = controller.ready["grpc"], controller.ready["http"]
        policy = os.path.join(tmp, "policy.yaml")

        def apply(limit: int) -> None:
            with open(policy, "w") as f:
                f.write(POLICY.format(limit=limit))
            subprocess.run([binary["sluicectl"], "--server", f"http://{grpc}", "apply", "-f", policy],
                           check=True, stdout=subprocess.DEVNULL)

        apply(LIMIT_MIB_S)
        loadgen = LoadGen([binary["sluice-loadgen"], "--controller", f"http://{grpc}", "--stages", str(args.stages),
                           "--jobs-per-stage", str(args.jobs_per_stage), "--stages-per-job", str(STAGES_PER_JOB),
                           "--demand", f"{DEMAND_MIB_S}MiB/s"], os.path.join(logs, "loadgen.log"))
        started = time.monotonic()
        connected = loadgen.expect("connected", timeout=60 + args.stages / 100)
        log(f"{args.stages} stages connected in {connected['seconds']:.1f} s; waiting for the controller to settle ...")
        wait_for("every stage connected and no new settings for 3 s", _settled(http, args.stages),
                 timeout=120 + args.stages / 100, every=0.5)
        settle_s = time.monotonic() - started
        log(f"settled after {settle_s:.1f} s; measuring {args.window:g} s with {args.applies} applies ...")

        pid = controller.proc.pid
        ticks = histogram(fetch_metrics(http, timeout=10), "sluice_controller_tick_seconds")
        cpu0, lg_cpu0, t0 = pid_cpu_seconds(pid), pid_cpu_seconds(loadgen.proc.pid), time.monotonic()
        all_acked: List[float] = []
        per_stage_p50: List[float] = []
        missing = 0
        gap = args.window / max(1, args.applies)
        for round_ in range(args.applies):
            at = t0 + round_ * gap
            time.sleep(max(0.0, at - time.monotonic()))
            loadgen.send(f"mark apply-{round_} 60")
            apply(LIMIT_MIB_S + 1 + round_ % 2 * 8)  # 201, 209, 201, ...: every job's limit moves
            acked = loadgen.expect("acked", timeout=90)
            missing += acked["missing"]
            if acked["max_ms"] is not None:
                all_acked.append(acked["max_ms"])
                per_stage_p50.append(acked["p50_ms"])
            log(f"apply {round_}: every stage acknowledged after {acked['max_ms']} ms "
                f"(half of them after {acked['p50_ms']} ms; {acked['missing']} missing)")
        time.sleep(max(0.0, t0 + args.window - time.monotonic()))
        elapsed = time.monotonic() - t0
        cpu = (pid_cpu_seconds(pid) - cpu0) / elapsed
        lg_cpu = (pid_cpu_seconds(loadgen.proc.pid) - lg_cpu0) / elapsed
        samples = fetch_metrics(http, timeout=10)
        ticks_after = histogram(samples, "sluice_controller_tick_seconds")
        tick_p99 = histogram_quantile(ticks, ticks_after, 0.99)
        tick_p50 = histogram_quantile(ticks, ticks_after, 0.5)
        tick_count = ticks_after[-1][1] - ticks[-1][1] if ticks and ticks_after else 0
        rss, peak = rss_bytes(pid)
        loadgen.send("stats")
        stats = loadgen.expect("stats", timeout=10)
    finally:
        if loadgen:
            loadgen.stop()
        controller.stop()
    return {
        "stages": args.stages,
        "jobs": max(1, args.stages * args.jobs_per_stage // STAGES_PER_JOB),
        "store": store.split(":", 1)[0],
        "controller_cpu_cores": round(cpu, 3),
        "controller_rss_bytes": peak,
        "controller_rss_end_bytes": rss,
        "tick_ms_p50": None if tick_p50 is None else round(tick_p50 * 1000, 2),
        "tick_ms_p99": None if tick_p99 is None else round(tick_p99 * 1000, 2),
        "ticks_per_s": round(tick_count / elapsed, 2),
        "apply_ms_p50": round(quantile(all_acked, 0.5), 1) if all_acked else None,
        "apply_ms_p99": round(quantile(all_acked, 0.99), 1) if all_acked else None,
        "apply_stage_ms_p50": round(quantile(per_stage_p50, 0.5), 1) if per_stage_p50 else None,
        "applies": len(all_acked),
        "acks_missing": missing,
        "settle_s": round(settle_s, 1),
        "loadgen_cpu_cores": round(lg_cpu, 3),
        "loadgen_failures": stats["failures"],
        "loadgen_sessions": stats["sessions"],
        "window_s": round(elapsed, 1),
    }


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.stages < 1 or args.applies < 1 or args.jobs_per_stage < 1:
        raise SystemExit("error: --stages, --jobs-per-stage and --applies must be at least 1")
    binary = find_binaries(args.bin_dir, ("sluice-controller", "sluicectl", "sluice-loadgen"))
    if args.log_dir:
        output_dir(args.log_dir, "--log-dir")
    with tempfile.TemporaryDirectory(prefix="sluice-scale-") as tmp:
        result = run(args, binary, tmp)
    mib = result["controller_rss_bytes"] / 2**20
    print(f"{result['stages']} stages, {result['jobs']} jobs: controller {result['controller_cpu_cores']:.2f} cores, "
          f"peak RSS {mib:.0f} MiB, tick p99 {result['tick_ms_p99']} ms; apply -> every stage acknowledged "
          f"p50 {result['apply_ms_p50']} ms, p99 {result['apply_ms_p99']} ms ({result['applies']} applies, "
          f"{result['acks_missing']} acks missing); load generator {result['loadgen_cpu_cores']:.2f} cores, "
          f"{result['loadgen_failures']} session failures")
    if args.json:
        print(json.dumps(result))
    return 0
