"""``python -m sluice.bench soak``: trainers reading through two stages for
an hour while the controller and a stage are restarted and policies
applied at random.

Starts a ``sluice-controller`` (SQLite store in the run's directory, fixed
ports so that stages find a restarted one) and two ``sluice-stage`` with a
session to it, serving one generated data set. Four trainers (threads of
this process, jobs ``soak-a`` and ``soak-b`` on each stage, labels the
policy selects) read epoch after epoch, checking every sample's bytes and
that each epoch delivers every sample exactly once. Meanwhile, every
``--fault-every`` seconds on average, one of: a policy apply with a new
random limit, the controller stopped (SIGTERM) or killed (SIGKILL) and
started again 1 s later, stage-2 stopped or killed and started again 1 s
later. stage-1 is never restarted, so its memory over the whole run shows
any leak. Every 10 s it samples the resident memory of the controller,
both stages and this process (without the stages' shared memory its
mappings show: those pages are the stages' buffers, in their RSS).

At the end: epochs, samples, samples lost or delivered twice, trainer
errors (each with the fault, if any, in the 60 s before it), faults by
kind, and per process the median RSS of its first and last quarter (only
samples of an incarnation at least 60 s old). A process that ran the whole
hour (stage-1, the trainers) is ``flat`` when the last is at most 10%
above the first (less memory is not a leak); a restarted one (the
controller, stage-2) is reported, with the range of its incarnations'
peaks, but not judged: its quarters are different processes, each sized
by the load it met since it started. Exits non-zero when a sample was lost or duplicated, an error
is not explained by a fault, or a process's memory is not flat. Builds
nothing: ``--bin-dir`` (default ``$SLUICE_BIN_DIR``, else the repository's
``target/release``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import zlib
from typing import Dict, List, Optional, Tuple

import sluice

from .common import BIN_DIR_HELP, Daemon, default_bin_dir, find_binaries, get_json, log, output_dir, wait_for
from .stage import StageProcess, private_rss_bytes, rss_bytes

POLICY = """apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {{name: soak}}
spec: {{capacity: {{bandwidth: 400MB/s}}}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {{name: soak}}
spec:
  selector: {{matchLabels: {{team: soak}}}}
  pool: soak
  limit: {{bandwidth: {limit}MB/s}}
"""
LABELS = {"team": "soak"}
# An error in a trainer this soon after a fault is that fault's.
EXPLAINED_WITHIN_S = 60.0
MATURE_S = 60.0
FLAT = 0.10


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="how long (default 60)")
    ap.add_argument("--fault-every", type=float, default=45.0,
                    help="mean seconds between faults (default 45)")
    ap.add_argument("--files", type=int, default=2000, help="samples in the data set (default 2000)")
    ap.add_argument("--size", type=int, default=32 * 1024, help="bytes per sample at most (default 32768)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the faults and the data (default 1)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--dir", help="run directory (data set, store, logs); default: a temp dir, removed")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")
    return ap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_dataset(root: str, files: int, size: int, seed: int) -> Dict[str, int]:
    """Writes the samples and returns each one's CRC32."""
    rng = random.Random(seed)
    crcs = {}
    for i in range(files):
        name = f"part{i % 16:02d}/sample{i:06d}.bin"
        data = rng.randbytes(rng.randrange(size // 4, size + 1))
        os.makedirs(os.path.join(root, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        crcs[name] = zlib.crc32(data)
    return crcs


class Cluster:
    """The controller and the two stages, restartable."""

    def __init__(self, binary: Dict[str, str], run_dir: str, data: str) -> None:
        self.binary = binary
        self.dir = run_dir
        self.data = data
        self.grpc = f"127.0.0.1:{free_port()}"
        self.http = f"127.0.0.1:{free_port()}"
        self.starts: Dict[str, int] = collections.Counter()
        self.controller: Optional[Daemon] = None
        self.controller_since = 0.0
        self.stages: Dict[str, StageProcess] = {}
        self.stage_since: Dict[str, float] = {}
        self.lock = threading.Lock()

    def _log(self, role: str) -> str:
        self.starts[role] += 1
        return os.path.join(self.dir, f"{role}.{self.starts[role]}.log")

    def start_controller(self) -> None:
        self.controller = Daemon.start(
            [self.binary["sluice-controller"], "--grpc-addr", self.grpc, "--http-addr", self.http,
             "--database-url", f"sqlite://{self.dir}/sluice.db", "--tick", "1s", "--stage-timeout", "5s"],
            self._log("controller"))
        self.controller_since = time.monotonic()

    def start_stage(self, name: str) -> None:
        self.stages[name] = StageProcess.start(
            self.binary["sluice-stage"], os.path.join(self.dir, f"{name}.sock"), {"ds": self.data},
            ["--controller", f"http://{self.grpc}", "--stage-id", name, "--node", name,
             "--memory-budget", "256MiB"],
            stderr_path=self._log(name))
        self.stage_since[name] = time.monotonic()

    def socket(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.sock")

    def apply(self, limit: int) -> None:
        path = os.path.join(self.dir, "policy.yaml")
        with open(path, "w") as f:
            f.write(POLICY.format(limit=limit))
        subprocess.run([self.binary["sluicectl"], "--server", f"http://{self.grpc}", "apply", "-f", path],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)

    def restart(self, role: str, kill: bool) -> None:
        with self.lock:
            if role == "controller":
                proc = self.controller.proc
            else:
                proc = self.stages[role].proc
            if kill:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            elif role == "controller":
                self.controller.stop()
            else:
                self.stages[role].stop()
            time.sleep(1.0)
            if role == "controller":
                self.start_controller()
            else:
                self.start_stage(role)

    def rss(self) -> List[Tuple[str, float, int]]:
        """(role, incarnation age in s, RSS bytes) of every process."""
        now = time.monotonic()
        with self.lock:
            procs = [("controller", self.controller_since, self.controller.proc.pid)]
            procs += [(n, self.stage_since[n], s.proc.pid) for n, s in self.stages.items()]
        procs.append(("trainers", 0.0, os.getpid()))
        out = []
        for role, since, pid in procs:
            try:
                rss = private_rss_bytes(pid) if role == "trainers" else rss_bytes(pid)[0]
                out.append((role, now - since if since else now, rss))
            except OSError:
                pass  # restarting right now
        return out

    def stop(self) -> None:
        for s in self.stages.values():
            s.stop()
        if self.controller:
            self.controller.stop()


class Trainer(threading.Thread):
    """Reads epoch after epoch through one stage and checks every epoch."""

    def __init__(self, sock: str, job: str, crcs: Dict[str, int], stop: threading.Event) -> None:
        super().__init__(name=f"trainer-{job}-{os.path.basename(sock)}", daemon=True)
        self.sock, self.job, self.crcs, self.stop_ = sock, job, crcs, stop
        self.epochs = 0
        self.samples = 0
        self.lost = 0
        self.duplicated = 0
        self.corrupt = 0
        self.errors: List[Tuple[float, str]] = []

    def run(self) -> None:
        epoch = 0
        while not self.stop_.is_set():
            try:
                with sluice.Client(self.sock, job=self.job, labels=LABELS, reconnect=120) as c:
                    ds = c.dataset("ds")
                    while not self.stop_.is_set():
                        seen = collections.Counter()
                        with ds.epoch(epoch, seed=epoch, batch=16) as it:
                            for name, data in it:
                                seen[name] += 1
                                if zlib.crc32(data) != self.crcs.get(name):
                                    self.corrupt += 1
                                    self.errors.append((time.monotonic(), f"corrupt sample {name} "
                                                        f"(epoch {epoch}, {len(data)} bytes)"))
                                if self.stop_.is_set():
                                    break
                        if self.stop_.is_set():
                            break  # a cut epoch is not checked
                        self.samples += sum(seen.values())
                        self.lost += len(set(self.crcs) - set(seen))
                        self.duplicated += sum(n - 1 for n in seen.values() if n > 1)
                        self.epochs += 1
                        epoch += 1
            except Exception as e:  # noqa: BLE001 - every error is reported, then the trainer goes on
                self.errors.append((time.monotonic(), f"{type(e).__name__}: {e}"))
                epoch += 1
                time.sleep(1.0)


def flatness(samples: List[Tuple[float, str, float, int]], duration: float) -> Dict[str, dict]:
    """Per role: the median RSS of mature samples in the first and last
    quarter of the run, and, for a process that ran the whole run, whether
    the last is at most ``FLAT`` above the first. A restarted role gets no
    verdict (its quarters are different processes, each sized by the load
    it met); its incarnations and the range of their mature peaks are
    reported instead."""
    out = {}
    for role in sorted({r for _, r, _, _ in samples}):
        mine = sorted((t, age, rss) for t, r, age, rss in samples if r == role)
        peaks: List[int] = []
        previous_age = None
        for t, age, rss in mine:
            if previous_age is None or age < previous_age:
                peaks.append(0)
            previous_age = age
            if age >= MATURE_S:
                peaks[-1] = max(peaks[-1], rss)
        mature = [(t, rss) for t, age, rss in mine if age >= MATURE_S]
        first = [rss for t, rss in mature if t <= duration / 4]
        last = [rss for t, rss in mature if t >= duration * 3 / 4]
        entry: dict = {"first_mib": None, "last_mib": None, "flat": None}
        if first and last:
            a, b = statistics.median(first), statistics.median(last)
            entry = {"first_mib": round(a / 2**20, 1), "last_mib": round(b / 2**20, 1),
                     "change_pct": round((b / a - 1) * 100, 1), "flat": b / a - 1 <= FLAT}
        if len(peaks) > 1:
            mature_peaks = [p for p in peaks if p]
            entry.update(flat=None, restarted=len(peaks) - 1, peak_mib_range=[
                round(min(mature_peaks) / 2**20, 1), round(max(mature_peaks) / 2**20, 1)]
                if mature_peaks else None)
        out[role] = entry
    return out


def run(args, binary: Dict[str, str], run_dir: str) -> dict:
    rng = random.Random(args.seed)
    data = os.path.join(run_dir, "data")
    log(f"writing {args.files} samples ...")
    crcs = make_dataset(data, args.files, args.size, args.seed)
    cluster = Cluster(binary, run_dir, data)
    cluster.start_controller()
    cluster.apply(40)
    for name in ("stage-1", "stage-2"):
        cluster.start_stage(name)
    stop = threading.Event()
    trainers = [Trainer(cluster.socket(stage), job, crcs, stop)
                for stage in ("stage-1", "stage-2") for job in ("soak-a", "soak-b")]
    for t in trainers:
        t.start()
    t0 = time.monotonic()
    duration = args.minutes * 60
    faults: List[Tuple[float, str]] = []
    samples: List[Tuple[float, str, float, int]] = []
    next_fault = t0 + rng.uniform(0.5, 1.5) * args.fault_every
    next_sample = t0
    fault_errors: List[str] = []
    patience = 60.0  # how long each trainer is waited for at the end
    try:
        while time.monotonic() - t0 < duration:
            now = time.monotonic()
            if now >= next_sample:
                samples += [(now - t0, role, age, rss) for role, age, rss in cluster.rss()]
                next_sample += 10.0
            if now >= next_fault:
                kind = rng.choice(["apply", "apply", "controller-stop", "controller-kill",
                                   "stage-2-stop", "stage-2-kill"])
                faults.append((now, kind))
                log(f"{(now - t0) / 60:.1f} min: {kind}")
                try:
                    if kind == "apply":
                        cluster.apply(rng.randrange(10, 80))
                    else:
                        role = "controller" if kind.startswith("controller") else "stage-2"
                        cluster.restart(role, kill=kind.endswith("kill"))
                except Exception as e:  # noqa: BLE001 - reported in the results
                    fault_errors.append(f"{kind}: {type(e).__name__}: {e}")
                next_fault = time.monotonic() + rng.uniform(0.5, 1.5) * args.fault_every
            time.sleep(0.2)
        # The stages end on the controller's current settings.
        cluster.apply(rng.randrange(10, 80))

        def converged():
            stages = get_json(cluster.http, "/api/v1/stages")
            return len(stages) == 2 and all(
                s["state"] == "connected" and s["acked_version"] == s["desired_version"] for s in stages)

        try:
            wait_for("both stages to acknowledge the last apply", converged, timeout=60, every=0.5)
            settled = True
        except TimeoutError:
            settled = False
    except KeyboardInterrupt:
        # Ctrl-C reached the stages and the controller too (one process
        # group): the trainers would try to reach them for two minutes. They
        # are daemon threads, and the run is over: not waited for.
        patience = 1.0
        raise
    finally:
        stop.set()
        for t in trainers:
            t.join(timeout=patience)
        cluster.stop()
    errors = []
    for t in trainers:
        for at, text in t.errors:
            cause = next((k for ft, k in reversed(faults) if 0 <= at - ft <= EXPLAINED_WITHIN_S), None)
            errors.append({"at_min": round((at - t0) / 60, 2), "trainer": t.name, "error": text,
                           "explained_by": cause})
    memory = flatness(samples, duration)
    return {
        "minutes": args.minutes,
        "epochs": sum(t.epochs for t in trainers),
        "samples": sum(t.samples for t in trainers),
        "lost": sum(t.lost for t in trainers),
        "duplicated": sum(t.duplicated for t in trainers),
        "corrupt": sum(t.corrupt for t in trainers),
        "faults": dict(collections.Counter(k for _, k in faults)),
        "fault_errors": fault_errors,
        "errors": errors,
        "unexplained_errors": sum(1 for e in errors if e["explained_by"] is None),
        "settled_at_end": settled,
        "memory": memory,
    }


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.minutes <= 0 or args.fault_every <= 0 or args.files < 1:
        raise SystemExit("error: --minutes, --fault-every and --files must be above 0")
    binary = find_binaries(args.bin_dir, ("sluice-controller", "sluice-stage", "sluicectl"))
    if args.dir:
        output_dir(args.dir, "--dir")
        result = run(args, binary, os.path.abspath(args.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="sluice-soak-") as tmp:
            result = run(args, binary, tmp)
    print(f"{result['minutes']:g} min: {result['epochs']} epochs, {result['samples']} samples, "
          f"{result['lost']} lost, {result['duplicated']} delivered twice, {result['corrupt']} corrupt; "
          f"faults {result['faults']}; {len(result['errors'])} trainer errors "
          f"({result['unexplained_errors']} unexplained); settled at end: {result['settled_at_end']}")
    for role, m in result["memory"].items():
        if m.get("restarted"):
            verdict = (f"restarted {m['restarted']} times, not judged; mature peaks of its incarnations "
                       f"{m['peak_mib_range']} MiB")
        else:
            verdict = "flat" if m["flat"] else "NOT flat" if m["flat"] is False else "too few samples"
        print(f"  {role}: RSS {m['first_mib']} MiB in the first quarter, {m['last_mib']} MiB in the last "
              f"({m.get('change_pct')}%): {verdict}")
    if args.json:
        print(json.dumps(result))
    ok = (result["lost"] == 0 and result["duplicated"] == 0 and result["corrupt"] == 0
          and result["unexplained_errors"] == 0 and not result["fault_errors"] and result["settled_at_end"]
          # A run too short to judge memory (None) does not fail for it.
          and all(m["flat"] is not False for m in result["memory"].values() if not m.get("restarted")))
    return 0 if ok else 1
