"""``python -m sluice.bench apply``: how long from ``sluicectl apply`` until
every stage runs the new settings.

Starts a ``sluice-controller`` (SQLite store in a temp dir) and ``--stages``
stages (default 2) from ``--bin-dir``, each with one trainer connection of
the same job, so every stage carries the job the policy selects. Then, for
``--applies`` rounds (default 20), it writes the policy with a new limit,
runs ``sluicectl apply -f`` and polls the controller's
``GET /api/v1/stages`` until every stage has acknowledged a version newer
than before (``acked_version == desired_version``). The time from starting
``sluicectl`` to that moment is one sample; the median and the worst are
reported (``--json``: one object at the end of stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from typing import List, Optional

from .. import Client
from .common import BIN_DIR_HELP, Daemon, default_bin_dir, find_binaries, get_json, log, quantile, wait_for

POLICY = """apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {{name: bench}}
spec: {{capacity: {{bandwidth: 10GB/s}}}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {{name: bench}}
spec:
  selector: {{matchLabels: {{team: bench}}}}
  pool: bench
  limit: {{bandwidth: {rate}MB/s}}
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench apply", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2, help="stages to start (default 2)")
    ap.add_argument("--applies", type=int, default=20, help="applies to time (default 20)")
    ap.add_argument("--tick", default="1s", help="the controller's --tick (default 1s)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.applies < 1 or args.stages < 1:
        raise SystemExit("error: --applies and --stages must be >= 1")
    binary = find_binaries(args.bin_dir, ("sluice-controller", "sluice-stage", "sluicectl"))
    daemons: List[Daemon] = []
    clients: List[Client] = []
    with tempfile.TemporaryDirectory(prefix="sluice-apply-") as tmp:
        try:
            data = os.path.join(tmp, "data")
            os.makedirs(data)
            with open(os.path.join(data, "a.bin"), "wb") as f:
                f.write(b"x" * 1024)
            controller = Daemon.start([binary["sluice-controller"], "--grpc-addr", "127.0.0.1:0",
                                       "--http-addr", "127.0.0.1:0", "--tick", args.tick,
                                       "--database-url", f"sqlite://{tmp}/sluice.db"],
                                      os.path.join(tmp, "controller.log"))
            daemons.append(controller)
            grpc, http = controller.ready["grpc"], controller.ready["http"]
            for i in range(args.stages):
                sock = os.path.join(tmp, f"stage{i}.sock")
                daemons.append(Daemon.start(
                    [binary["sluice-stage"], "--socket", sock, "--metrics-addr", "127.0.0.1:0",
                     "--dataset", f"bench={data}", "--stage-id", f"stage-{i}", "--node", f"node-{i}",
                     "--controller", f"http://{grpc}"], os.path.join(tmp, f"stage{i}.log")))
                clients.append(Client(sock, job="bench-job", labels={"team": "bench"}))
            log(f"controller on {grpc}, {args.stages} stage(s); waiting for them to report the job ...")
            wait_for("every stage to report the job", lambda: next(
                (True for j in get_json(http, "/api/v1/jobs")
                 if j["id"] == "bench-job" and len(j["stages"]) == args.stages),
                None), timeout=30, every=0.002)
            policy = os.path.join(tmp, "policy.yaml")
            times: List[float] = []
            for round_ in range(args.applies + 1):
                before = {s["id"]: s["desired_version"] for s in get_json(http, "/api/v1/stages")}
                with open(policy, "w") as f:
                    f.write(POLICY.format(rate=100 + round_))
                started = time.perf_counter()
                subprocess.run([binary["sluicectl"], "--server", f"http://{grpc}", "apply", "-f", policy],
                               check=True, stdout=subprocess.DEVNULL)

                def all_acked():
                    stages = get_json(http, "/api/v1/stages")
                    done = len(stages) == args.stages and all(
                        s["state"] == "connected" and s["acked_version"] == s["desired_version"]
                        and s["desired_version"] > before.get(s["id"], 0) for s in stages)
                    return True if done else None

                wait_for(f"apply {round_} to be acknowledged", all_acked, every=0.002)
                if round_ > 0:  # the first apply creates the pool and warms up
                    times.append(time.perf_counter() - started)
        finally:
            for c in clients:
                c.close()
            for d in daemons:
                d.stop()
    result = {
        "stages": args.stages, "applies": len(times), "tick": args.tick,
        "median_ms": statistics.median(times) * 1000, "worst_ms": max(times) * 1000,
        "p90_ms": quantile(times, 0.9) * 1000, "samples_ms": [round(t * 1000, 2) for t in times],
    }
    print(f"sluicectl apply -> every stage acknowledged ({args.stages} stages, {len(times)} applies): "
          f"median {result['median_ms']:.1f} ms, p90 {result['p90_ms']:.1f} ms, worst {result['worst_ms']:.1f} ms")
    if args.json:
        print(json.dumps(result))
    return 0
