"""``python -m sluice.bench listing``: a dataset of a million entries.

Writes (or reuses) a data set of ``--entries`` small files in directories of
1,000, starts a stage on it (the directory, or ``--store s3``: the same
files served by ``s3s-fs`` behind ``sluice-slowhttp`` with ``--latency``),
and measures what listing it costs: the time of the first ``OPEN`` (the
stage walks the directory or pages through the bucket prefix, 1,000 keys a
request), the stage's CPU time while it lists, its resident memory before
and after (bytes per listed entry), and the time from submitting a seed-based plan over every entry
(no names sent) to its first sample.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Optional

from ..client import Client
from .common import add_stage_args, log
from .dataset import prepare
from .harness import HarnessError
from .stage import StageProcess, StageStartError, find_stage_binary, rss_bytes
from .storage import open_storage
from .units import format_bytes, parse_duration_ms


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench listing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=1_000_000, help="files in the data set (default 1000000)")
    ap.add_argument("--dir", default=None, help="where the data set lives (default bench-out/<entries>x1B)")
    ap.add_argument("--store", choices=("dir", "s3"), default="dir", help="dir or s3 (default dir)")
    ap.add_argument("--latency", default="0ms",
                    help="added to every request to the object store, with --store s3 (default 0ms; the "
                         "slow file system of --store dir delays opens and reads, which a listing makes none of)")
    add_stage_args(ap, prefetch=False)
    return ap


def _rss(stage: StageProcess) -> int:
    return rss_bytes(stage.pid)[0]


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    if args.entries < 1:
        raise SystemExit("error: --entries must be >= 1")
    try:
        latency_ms = parse_duration_ms(args.latency)
        binary = find_stage_binary(args.bin_dir)
    except (ValueError, StageStartError) as e:
        raise SystemExit(f"error: {e}") from None
    if latency_ms and args.store == "dir":
        raise SystemExit("error: --latency applies to --store s3 here: the slow file system delays opens and "
                         "reads, and listing a directory makes none (its figure would be labelled with a "
                         "latency it never paid)")
    ds = prepare(args.dir or os.path.join("bench-out", f"{args.entries}x1B"), args.entries, 1, log=log)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
    try:
        with open_storage(args.store, args.latency, latency_ms, ds, args.bin_dir, repo) as storage, \
                tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
            stage = StageProcess.start(binary, f"{tmp}/stage.sock", {"bench": storage.view.root},
                                       ["--memory-budget", args.stage_memory, *storage.stage_args,
                                        *args.stage_arg], stderr_path=f"{tmp}/stage.stderr", timeout=600)
            try:
                result = _measure(stage, args.entries)
            finally:
                stage.stop()
            result["storage"] = storage.describe()
    except HarnessError as e:
        raise SystemExit(f"error: the {args.store} harness: {e}") from None
    print(f"{args.entries} entries ({args.store}, +{latency_ms:g} ms): listed in {result['list_s']:.2f} s "
        f"(stage CPU {result['stage_list_cpu_s']:.2f} s), "
        f"{result['bytes_per_entry']:.0f} bytes of stage memory per entry "
        f"(RSS {format_bytes(result['rss_before_bytes'])} -> {format_bytes(result['rss_after_bytes'])}), "
        f"first sample of a plan over all entries after {result['first_sample_s'] * 1000:.0f} ms")
    if args.json:
        print(json.dumps(result))
    return 0


def _measure(stage: StageProcess, entries: int) -> dict:
    before = _rss(stage)
    with Client(stage.socket, job="listing") as client:
        cpu0 = stage.cpu_seconds()
        t0 = time.perf_counter()
        dataset = client.dataset("bench")
        list_s = time.perf_counter() - t0
        list_cpu_s = stage.cpu_seconds() - cpu0
        if dataset.file_count != entries:
            raise RuntimeError(f"the stage listed {dataset.file_count} entries, the data set has {entries}")
        after = _rss(stage)
        t0 = time.perf_counter()
        with dataset.epoch(0, seed=1, batch=1, prefetch=0) as it:
            next(it)
            first = time.perf_counter() - t0
    return {"entries": entries, "list_s": list_s, "stage_list_cpu_s": list_cpu_s,
            "rss_before_bytes": before, "rss_after_bytes": after,
            "bytes_per_entry": (after - before) / entries, "first_sample_s": first}
