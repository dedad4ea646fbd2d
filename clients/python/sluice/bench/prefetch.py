"""``python -m sluice.bench prefetch``: cold-cache training-loop throughput.

Generates (or reuses) a DLIO-shaped data set, then for each loader evicts
every file from the page cache and runs an emulated training loop (take a
batch, sleep ``--compute-ms``), reporting samples/s, MiB/s, accelerator
utilisation (AU = compute time / loop wall time), stall time and CPU time.

Loaders: ``naive`` (the loop reads each file itself), ``threadpool`` (a
read-ahead pool of 4 to 128 threads), ``torch`` (DataLoader with 1, 2, 4 and
8 workers, when torch imports), ``sluice`` (a ``sluice-stage`` started from
``--bin-dir``), ``fio`` (random whole-file reads, ``O_DIRECT`` at queue
depths 1, 16 and 64 and buffered at 16 and 64, when fio is on PATH: the
device limit; local directory only) and ``limit`` (the slow-storage
harness's own rate, 256 reads in flight).

``--store s3`` serves the data set from an S3-compatible server
(``s3s-fs``, see ``scripts/s3-server``) behind ``sluice-slowhttp``; the
baselines read it with a plain signed-GET client. ``--latency 5ms`` adds
that much to every storage operation, identically for every loader: to
every open and read call through ``sluice-slowfs`` (``--store dir``) or to
every request through ``sluice-slowhttp`` (``--store s3``).

With ``--compute-ms auto`` sluice's rate without compute is measured first,
and the compute time is set so that the loop needs half of that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from . import loaders
from .common import add_dataset_args, add_stage_args, load_dataset, log
from .dataset import evict
from .fio import fio_available, run_fio
from .harness import HarnessError
from .stage import StageStartError, find_stage_binary
from .storage import Storage, open_storage
from .units import format_bytes, parse_duration_ms

ALL_LOADERS = ("naive", "threadpool", "torch", "sluice", "fio", "limit")
THREADS = (4, 8, 16, 32, 64, 128)
TORCH_WORKERS = (1, 2, 4, 8)
FIO_RUNS = (("direct", 1), ("direct", 16), ("direct", 64), ("buffered", 16), ("buffered", 64))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench prefetch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=5000)
    ap.add_argument("--compute-ms", default="0",
                    help="emulated compute per batch in ms, or 'auto' (half of sluice's no-compute rate)")
    ap.add_argument("--epochs", type=int, default=1, help="epochs per loader run (default 1)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every loader, run in turn; each loader's median run is reported (default 1)")
    ap.add_argument("--loaders", default=",".join(ALL_LOADERS),
                    help=f"comma-separated subset of {','.join(ALL_LOADERS)} (default all)")
    ap.add_argument("--threads", default=",".join(map(str, THREADS)),
                    help="thread counts of the threadpool loader (default 4,8,16,32,64,128)")
    ap.add_argument("--torch-workers", default=",".join(map(str, TORCH_WORKERS)),
                    help="num_workers values of the torch loader (default 1,2,4,8)")
    ap.add_argument("--store", choices=("dir", "s3"), default="dir",
                    help="where the data set is read from: the directory, or an S3-compatible "
                         "server serving it (default dir)")
    ap.add_argument("--latency", default="0ms",
                    help="added to every storage operation by the harness, e.g. 5ms (default 0ms)")
    ap.add_argument("--fio-runtime", type=int, default=60, help="cap on each fio run in seconds (default 60)")
    add_stage_args(ap)
    return ap


_log = log


class Bench:
    """Runs the selected loaders over one data set with one compute time."""

    def __init__(self, args, ds, binary: Optional[str], storage: Optional[Storage] = None) -> None:
        self.args = args
        self.ds = ds
        self.binary = binary
        self.paths = ds.paths()
        self.storage = storage or Storage("dir", 0.0, ds)
        # Where loaders read: the data set itself or the harness's view of it.
        self.view = self.storage.view

    def _cold(self) -> None:
        evict(self.paths)

    def naive(self, compute_s: float) -> List[dict]:
        self._cold()
        r = loaders.run_naive(self.view, self.args.batch, self.args.epochs, compute_s, self.args.seed,
                              self.storage.read)
        return [{"loader": "naive", **r.as_dict()}]

    def threadpool(self, compute_s: float) -> List[dict]:
        out = []
        for n in _ints(self.args.threads, "--threads"):
            self._cold()
            r = loaders.run_threadpool(self.view, self.args.batch, self.args.epochs, compute_s, self.args.seed, n,
                                       self.storage.read)
            out.append({"loader": "threadpool", "threads": n, **r.as_dict()})
        return _mark_best(out)

    def torch(self, compute_s: float) -> List[dict]:
        try:
            import torch  # noqa: F401
        except ImportError as e:
            return [{"loader": "torch", "skipped": f"torch does not import: {e}"}]
        out = []
        for n in _ints(self.args.torch_workers, "--torch-workers"):
            self._cold()
            r = loaders.run_torch(self.view, self.args.batch, self.args.epochs, compute_s, self.args.seed, n,
                                  self.storage.read)
            out.append({"loader": "torch", "workers": n, **r.as_dict()})
        return _mark_best(out)

    def sluice(self, compute_s: float) -> List[dict]:
        self._cold()
        run = loaders.run_sluice(self.view, self.args.batch, self.args.epochs, compute_s, self.args.seed,
                                 self.binary, self.args.stage_memory,
                                 [*self.storage.stage_args, *self.args.stage_arg], self.args.prefetch)
        return [{"loader": "sluice", "prefetch": self.args.prefetch, **run.result.as_dict(),
                 "peak_rss_bytes": run.peak_rss_bytes, "stage_cpu_s": run.stage_cpu_s}]

    def limit(self, compute_s: float) -> List[dict]:
        if self.storage.kind == "dir" and self.storage.latency_ms == 0:
            return [{"loader": "limit", "skipped": "no harness: fio gives the device limit"}]
        self._cold()
        return [self.storage.limit()]

    def fio(self, compute_s: float) -> List[dict]:
        if self.storage.kind != "dir" or self.storage.latency_ms > 0:
            return [{"loader": "fio", "skipped": "the local device only: the limit row measures the harness"}]
        if not fio_available():
            return [{"loader": "fio", "skipped": "fio is not on PATH"}]
        out = []
        for mode, depth in FIO_RUNS:
            self._cold()
            try:
                out.append(run_fio(self.ds, depth, self.args.fio_runtime, mode))
            except (RuntimeError, ValueError, KeyError) as e:
                out.append({"loader": "fio", "mode": mode, "iodepth": depth, "skipped": str(e)})
        return _mark_best(out)


def _ints(text: str, flag: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag} takes comma-separated whole numbers, not {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: {flag} takes numbers of at least 1, not {text!r}")
    return values


def median_of_rounds(runs: List[dict]) -> List[dict]:
    """Folds repeated runs of each (loader, variant) into its median run.

    Rounds run every loader in turn, so slow and fast periods of shared
    storage fall on all loaders alike; the median of each is reported, with
    every run's samples/s kept in ``runs``."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["loader"], _variant(r)), []).append(r)
    results = []
    for group in groups.values():
        ran = sorted((r for r in group if "skipped" not in r), key=lambda r: r["samples_per_s"])
        if not ran:
            results.append(group[0])
            continue
        median = dict(ran[(len(ran) - 1) // 2])
        median["runs"] = [round(r["samples_per_s"], 1) for r in group if "skipped" not in r]
        results.append(median)
    return results


def _mark_best(results: List[dict]) -> List[dict]:
    ran = [r for r in results if "skipped" not in r]
    if ran:
        best = max(ran, key=lambda r: r["samples_per_s"])
        for r in ran:
            r["best"] = r is best
    return results


def _variant(r: dict) -> str:
    if "mode" in r:
        return f"{r['mode']} qd={r['iodepth']}"
    for key, label in (("threads", "threads"), ("workers", "workers"), ("iodepth", "qd"),
                       ("prefetch", "prefetch"), ("concurrency", "inflight")):
        if key in r:
            return f"{label}={r[key]}"
    return ""


def format_table(results: List[dict]) -> str:
    """Returns the results as an aligned text table."""
    head = f"{'loader':10} {'variant':15} {'samples/s':>10} {'MiB/s':>8} {'AU':>6} {'stall s':>8} {'CPU s':>7}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['loader']:10} {_variant(r):15} {'-':>10} {'-':>8} {'-':>6} {'-':>8} {'-':>7}  "
                         f"skipped: {r['skipped'].splitlines()[0][:100]}")
            continue
        notes = []
        if r.get("best"):
            notes.append("best (device limit)" if r["loader"] == "fio" else "best")
        if "peak_rss_bytes" in r:
            notes.append(f"stage peak RSS {format_bytes(r['peak_rss_bytes'])}")
        if r["loader"] == "limit":
            notes.append("the harness's own rate")
            lines.append(f"{r['loader']:10} {_variant(r):15} {r['samples_per_s']:10.0f} {r['mib_per_s']:8.1f} "
                         f"{'-':>6} {'-':>8} {'-':>7}  {', '.join(notes)}")
            continue
        lines.append(f"{r['loader']:10} {_variant(r):15} {r['samples_per_s']:10.0f} {r['mib_per_s']:8.1f} "
                     f"{r['au'] * 100:5.1f}% {r['stall_s']:8.2f} {r['cpu_s']:7.2f}  {', '.join(notes)}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    selected = [x.strip() for x in args.loaders.split(",") if x.strip()]
    unknown = set(selected) - set(ALL_LOADERS)
    if unknown or not selected:
        raise SystemExit(f"error: unknown loader(s) {', '.join(sorted(unknown)) or '(none given)'}; "
                         f"choose from {', '.join(ALL_LOADERS)}")
    if args.epochs < 1:
        raise SystemExit("error: --epochs must be >= 1")
    if args.repeat < 1:
        raise SystemExit("error: --repeat must be >= 1")
    _ints(args.threads, "--threads")
    _ints(args.torch_workers, "--torch-workers")
    auto = args.compute_ms.strip().lower() == "auto"
    if not auto:
        try:
            compute_ms = float(args.compute_ms)
            if not 0 <= compute_ms < 3_600_000:
                raise ValueError(compute_ms)
        except ValueError:
            raise SystemExit(f"error: --compute-ms must be a number of milliseconds from 0 to an hour, or 'auto', got {args.compute_ms!r}") from None

    binary = None
    if "sluice" in selected or auto:
        try:
            binary = find_stage_binary(args.bin_dir)
        except StageStartError as e:
            if auto:
                raise SystemExit(f"error: --compute-ms auto measures sluice first: {e}") from None
            # A loader asked for that cannot run is an error, not a row
            # marked skipped under an exit status of 0.
            raise SystemExit(f"error: the sluice loader: {e}") from None

    try:
        latency_ms = parse_duration_ms(args.latency)
    except ValueError as e:
        raise SystemExit(f"error: --latency: {e}") from None
    ds = load_dataset(args)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
    try:
        with open_storage(args.store, args.latency, latency_ms, ds, args.bin_dir, repo) as storage:
            return _run(args, selected, auto, compute_ms if not auto else 0.0, ds, binary, storage)
    except HarnessError as e:
        raise SystemExit(f"error: the {args.store} harness: {e}") from None


def _run(args, selected, auto, compute_ms, ds, binary, storage) -> int:
    size, stdev = ds.size, ds.size_stdev
    bench = Bench(args, ds, binary, storage)
    calibration = None
    if auto:
        _log("calibrating: sluice without compute ...")
        calibration = bench.sluice(0.0)[0]
        rate = calibration["samples_per_s"]
        compute_ms = args.batch / (rate / 2) * 1000.0
        _log(f"sluice reads {rate:.0f} samples/s without compute; compute per batch set to {compute_ms:.2f} ms")

    runs: List[dict] = []
    for round_ in range(args.repeat):
        for name in ALL_LOADERS:
            if name not in selected:
                continue
            _log(f"running {name} (round {round_ + 1} of {args.repeat}) ...")
            for r in getattr(bench, name)(compute_ms / 1000.0):
                r.setdefault("compute_ms", compute_ms if name != "fio" else 0.0)
                runs.append(r)
                if "skipped" not in r:
                    _log(f"  {name} {_variant(r)}: {r['samples_per_s']:.0f} samples/s, {r['mib_per_s']:.1f} MiB/s")
    results = median_of_rounds(runs)
    for name in ("threadpool", "torch", "fio"):
        _mark_best([r for r in results if r["loader"] == name])

    print(f"data set: {ds.files} files of {format_bytes(size)}"
          f"{f' (stdev {format_bytes(stdev)})' if stdev else ''}, {format_bytes(ds.total_bytes)} in {ds.root}; "
          f"batch {args.batch}, compute {compute_ms:.2f} ms/batch, {args.epochs} epoch(s), cold cache; "
          f"store {storage.kind}, +{storage.latency_ms:g} ms per operation")
    print(format_table(results))
    if args.json:
        doc = {"dataset": ds.describe(), "batch": args.batch, "compute_ms": compute_ms, "epochs": args.epochs,
               "seed": args.seed, "storage": storage.describe(), "results": results}
        if calibration is not None:
            doc["calibration"] = calibration
        print(json.dumps(doc))
    if all("skipped" in r for r in results):
        # Nothing was measured: a script or CI run must not take it for a result.
        reasons = "; ".join(sorted({f"{r['loader']}: {r['skipped']}" for r in results}))
        print(f"error: none of the loaders ran ({reasons})", file=sys.stderr)
        return 1
    return 0
