"""``python -m sluice.bench cache``: the node cache under per-epoch random order.

Writes (or reuses) a data set, then measures three things through a real
stage, counting source reads and cache hits from its ``/metrics``:

1. **Stable subset vs LRU**: a cache of ``--fraction`` of the data set, each
   policy in turn, ``--epochs`` epochs in a fresh random order each. The
   best any cache can do under uniform random order is a hit ratio of
   cache / data set from the second epoch on; LRU falls short of it.
2. **Fits**: a cache larger than the data set: from the second epoch on,
   nothing is read from the source.
3. **Shared**: two jobs with different orders read the same data set at once,
   ``--epochs`` epochs each, through one cache that fits: each sample is read
   from the source once (source bytes against the data set's bytes).

Each run also reports the stage's peak resident memory (``VmHWM``) against
its memory budget (cache plus 512MiB for prefetch buffers), with the cache
full.

Every epoch reads the data set with the page cache evicted first; with
``--store``/``--latency`` the source is the slow-storage harness (as in
``prefetch``), so the samples/s column shows what a hit saves.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import List, Optional

from ..client import Client
from .common import add_dataset_args, add_stage_args, fetch_metrics, load_dataset, log, metric_value
from .harness import HarnessError
from .stage import StageProcess, StageStartError, find_stage_binary
from .storage import Storage, open_storage
from .units import format_bytes, parse_duration_ms

DATASET = "bench"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=2000)
    ap.add_argument("--fraction", type=float, default=0.5,
                    help="cache size as a fraction of the data set in the policy comparison (default 0.5)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs per run (default 4)")
    ap.add_argument("--store", choices=("dir", "s3"), default="dir", help="dir or s3 (default dir)")
    ap.add_argument("--latency", default="0ms", help="added to every storage operation (default 0ms)")
    # The stage's memory is the cache plus what prefetching needs, and the
    # client reads in next(): neither is an option here.
    add_stage_args(ap, memory=False, prefetch=False)
    return ap


class _Counters:
    """The stage's source reads and cache hits, summed over jobs."""

    def __init__(self, stage: StageProcess) -> None:
        self.stage = stage

    def now(self) -> dict:
        samples = fetch_metrics(self.stage.metrics)
        reads = metric_value(samples, "sluice_stage_storage_reads_total", dataset=DATASET) or 0
        read_bytes = metric_value(samples, "sluice_stage_storage_read_bytes_total", dataset=DATASET) or 0
        return {"source_reads": int(reads), "source_bytes": int(read_bytes),
                "hits": int(metric_value(samples, "sluice_stage_cache_hits_total", dataset=DATASET) or 0),
                "cached_bytes": int(metric_value(samples, "sluice_stage_cache_bytes", dataset=DATASET) or 0)}


def _epoch(stage: StageProcess, storage: Storage, job: str, epoch: int, seed: int, batch: int) -> int:
    """Reads one epoch as ``job``; returns the samples read."""
    n = 0
    with Client(stage.socket, job=job) as client:
        with client.dataset(DATASET).epoch(epoch, seed=seed, batch=batch) as it:
            for _name, _data in it:
                n += 1
    return n


#: Memory budget beyond the cache: what prefetch buffers may use.
BUFFERS = 512 << 20


def _start(binary: str, tmp: str, storage: Storage, cache_bytes: int, policy: str, extra: List[str]) -> StageProcess:
    budget = cache_bytes + BUFFERS
    return StageProcess.start(binary, f"{tmp}/stage-{policy}.sock", {DATASET: storage.view.root},
                              ["--memory-budget", str(budget), "--cache-memory", str(cache_bytes),
                               "--cache-policy", policy, *storage.stage_args, *extra],
                              stderr_path=f"{tmp}/stage-{policy}.stderr", timeout=120)


def _optimum_hit_ratio(sizes, cache_bytes: int) -> float:
    """The best share of an epoch's samples a cache of ``cache_bytes`` can
    answer under a fresh random order: it keeps as many whole samples as
    fit (the smallest), and each is read once an epoch."""
    kept, room = 0, cache_bytes
    for size in sorted(sizes):
        if size > room:
            break
        kept, room = kept + 1, room - size
    return kept / len(sizes)


def _memory(stage: StageProcess, cache_bytes: int) -> dict:
    """The stage's peak RSS and its budget."""
    peak = stage.peak_rss_bytes()
    log(f"  stage peak RSS {format_bytes(peak)}, memory budget {format_bytes(cache_bytes + BUFFERS)}")
    return {"peak_rss_bytes": peak, "memory_budget_bytes": cache_bytes + BUFFERS}


def _epochs(binary: str, tmp: str, storage: Storage, cache_bytes: int, policy: str, args) -> dict:
    """Runs ``args.epochs`` epochs through a fresh stage; one row per epoch,
    and the stage's memory."""
    stage = _start(binary, tmp, storage, cache_bytes, policy, args.stage_arg)
    rows = []
    try:
        counters = _Counters(stage)
        for epoch in range(args.epochs):
            storage.evict()
            before = counters.now()
            t0 = time.perf_counter()
            n = _epoch(stage, storage, "cache-bench", epoch, args.seed, args.batch)
            seconds = time.perf_counter() - t0
            after = counters.now()
            reads = after["source_reads"] - before["source_reads"]
            hits = after["hits"] - before["hits"]
            rows.append({"epoch": epoch, "samples": n, "samples_per_s": n / seconds, "source_reads": reads,
                         "hits": hits, "hit_ratio": hits / n, "cached_bytes": after["cached_bytes"]})
            log(f"  {policy:6} epoch {epoch}: {n / seconds:8.0f} samples/s, {reads:6} source reads, "
                f"hit ratio {hits / n:6.1%}, cache holds {format_bytes(after['cached_bytes'])}")
        memory = _memory(stage, cache_bytes)
    finally:
        stage.stop()
    return {"epochs": rows, **memory}


def _shared(binary: str, tmp: str, storage: Storage, cache_bytes: int, args) -> dict:
    """Two jobs, different orders, ``args.epochs`` epochs each at the same
    time."""
    stage = _start(binary, tmp, storage, cache_bytes, "stable", args.stage_arg)
    try:
        storage.evict()
        counters = _Counters(stage)
        before = counters.now()
        got = {}

        def run(job: str, seed: int) -> None:
            got[job] = sum(_epoch(stage, storage, job, epoch, seed, args.batch)
                           for epoch in range(args.epochs))

        threads = [threading.Thread(target=run, args=(f"job-{i}", args.seed + i)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = counters.now()
        memory = _memory(stage, cache_bytes)
    finally:
        stage.stop()
    reads = after["source_reads"] - before["source_reads"]
    read_bytes = after["source_bytes"] - before["source_bytes"]
    ratio = read_bytes / storage.view.total_bytes
    log(f"  shared: 2 jobs x {args.epochs} epochs read {sum(got.values())} samples with {reads} source "
        f"reads, {format_bytes(read_bytes)} from the source = {ratio:.3f}x the data set "
        f"({storage.view.files} samples)")
    return {"epochs": args.epochs, "samples": sum(got.values()), "source_reads": reads,
            "source_bytes": read_bytes, "source_bytes_per_dataset_bytes": ratio,
            "hits": after["hits"] - before["hits"], **memory}


def _mean(rows: List[dict], key: str) -> float:
    later = rows[1:] or rows
    return sum(r[key] for r in later) / len(later)


def main(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 < args.fraction < 1:
        raise SystemExit("error: --fraction must be between 0 and 1")
    if args.epochs < 2:
        raise SystemExit("error: --epochs must be at least 2 (the first epoch fills the cache)")
    try:
        latency_ms = parse_duration_ms(args.latency)
        binary = find_stage_binary(args.bin_dir)
    except (ValueError, StageStartError) as e:
        raise SystemExit(f"error: {e}") from None
    ds = load_dataset(args)
    total = ds.total_bytes
    cache_bytes = int(total * args.fraction)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
    optimum = _optimum_hit_ratio(ds.sizes, cache_bytes)
    result = {"files": args.files, "dataset_bytes": total, "cache_bytes": cache_bytes,
              "optimum_hit_ratio": optimum}
    try:
        with open_storage(args.store, args.latency, latency_ms, ds, args.bin_dir, repo) as storage, \
                tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
            log(f"data set {format_bytes(total)}, cache {format_bytes(cache_bytes)} "
                f"(optimum hit ratio {optimum:.1%})")
            for policy in ("stable", "lru"):
                run = _epochs(binary, tmp, storage, cache_bytes, policy, args)
                rows = run["epochs"]
                result[policy] = {**run, "hit_ratio": _mean(rows, "hit_ratio"),
                                  "samples_per_s": _mean(rows, "samples_per_s")}
            fits = int(total * 1.25)
            run = _epochs(binary, tmp, storage, fits, "stable", args)
            first = run["epochs"][0]["samples_per_s"]
            later = run["epochs"][1:]
            result["fits"] = {"cache_bytes": fits, **run,
                              "later_source_fraction": max(r["source_reads"] for r in later) / args.files,
                              "later_speedup_min": min(r["samples_per_s"] for r in later) / first}
            log(f"  fits: epochs 2+ read at most {result['fits']['later_source_fraction']:.1%} of the data "
                f"set from the source, at {result['fits']['later_speedup_min']:.2f}x epoch 1's samples/s "
                f"or more")
            result["shared"] = _shared(binary, tmp, storage, fits, args)
            result["storage"] = storage.describe()
    except (HarnessError, StageStartError) as e:
        raise SystemExit(f"error: {e}") from None
    s, l = result["stable"], result["lru"]
    print(f"hit ratio from epoch 2 on: stable {s['hit_ratio']:.1%}, LRU {l['hit_ratio']:.1%}, "
        f"optimum {result['optimum_hit_ratio']:.1%}; samples/s stable {s['samples_per_s']:.0f}, "
        f"LRU {l['samples_per_s']:.0f}")
    if args.json:
        print(json.dumps(result))
    return 0
