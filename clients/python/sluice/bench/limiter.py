"""``python -m sluice.bench limiter``: does the stage's QoS limiter hold its target?

Runs the stage twice over a cold data set, once with ``--rate-limit``
(``--rate``, default 200MiB/s) and once with ``--ops-limit`` (``--ops``,
default 2000), and reads as fast as the client can (no compute). The
delivered rate is measured from the consumer's own per-sample arrival times
over a steady window (default from t=1 s to t=11 s after the plan was
submitted) and over the whole run, and compared with the target. With the
default 100 KiB samples one sample is one storage operation, so the ops
limit is measured in samples/s (the stage's own read counter is reported
beside it).

Enough epochs are read for the run to outlast the window by a second at
the target rate (``--epochs auto``): 20000 x 100 KiB lasts 9.8 s at
200 MiB/s, so that takes two epochs. The stage reads with O_DIRECT
(``--direct-io true``, unless ``--stage-arg`` sets it), so the second epoch
is not served from the page cache.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

from .common import (
    add_dataset_args, add_stage_args, epochs_for, fetch_metrics, load_dataset, log, metric_value,
    parse_byte_rate, parse_ops_rate, read_epochs, stage_binary_or_exit, stage_session, Timeline,
    window_rate,
)
from .dataset import BenchDataset, evict
from .units import format_bytes

LIMITS = ("bytes", "ops")
JOB = "limiter"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench limiter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=20000)
    ap.add_argument("--rate", default="200MiB/s", help="byte rate limit to test (default 200MiB/s)")
    ap.add_argument("--ops", default="2000", help="operation rate limit to test, ops/s (default 2000)")
    ap.add_argument("--limits", default=",".join(LIMITS), help="which limits to run: bytes, ops (default both)")
    ap.add_argument("--window-start", type=float, default=1.0,
                    help="start of the steady window, seconds after the plan (default 1)")
    ap.add_argument("--window", type=float, default=10.0, help="length of the steady window in s (default 10)")
    ap.add_argument("--epochs", default="auto",
                    help="epochs per run, or 'auto': enough to outlast the window by 1 s at the target")
    add_stage_args(ap)
    return ap


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parses and checks the options (targets become ``args.rate_bps`` and ``args.ops_ps``)."""
    args = _parser().parse_args(argv)
    try:
        args.rate_bps = parse_byte_rate(args.rate)
        args.ops_ps = parse_ops_rate(args.ops)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    args.limit_kinds = [x.strip() for x in args.limits.split(",") if x.strip()]
    if not args.limit_kinds or set(args.limit_kinds) - set(LIMITS):
        raise SystemExit(f"error: --limits takes a comma-separated subset of {','.join(LIMITS)}")
    if args.window <= 0 or args.window_start < 0:
        raise SystemExit("error: --window must be > 0 and --window-start >= 0")
    if args.epochs != "auto":
        try:
            args.epochs = int(args.epochs)
        except ValueError:
            raise SystemExit(f"error: --epochs must be a number or 'auto', got {args.epochs!r}") from None
        if args.epochs < 1:
            raise SystemExit("error: --epochs must be >= 1")
    return args


def plan_run(kind: str, args, total_bytes: int, files: int) -> dict:
    """Returns the stage flags, target and epoch count of one limit's run."""
    if kind == "bytes":
        target, flags = args.rate_bps, ["--rate-limit", f"{args.rate_bps}B/s"]
        per_epoch_s = total_bytes / target
    else:
        target, flags = args.ops_ps, ["--ops-limit", str(args.ops_ps)]
        per_epoch_s = files / target
    need_s = args.window_start + args.window + 1.0
    epochs = epochs_for(need_s, per_epoch_s) if args.epochs == "auto" else args.epochs
    return {"limit": kind, "target": target, "flags": flags, "epochs": epochs,
            "expected_s": per_epoch_s * epochs, "unit": "bytes/s" if kind == "bytes" else "ops/s"}


def summarize(kind: str, target: float, timeline: Timeline, window_start: float, window: float) -> dict:
    """Returns the measured rates of one run: the window's and the whole run's."""
    w = window_rate(timeline.times, timeline.sizes, window_start, window)
    wall = timeline.end
    if kind == "bytes":
        measured, total = w.bytes_per_s, (timeline.bytes / wall if wall > 0 else 0.0)
    else:
        measured, total = w.samples_per_s, (len(timeline) / wall if wall > 0 else 0.0)
    return {
        "limit": kind,
        "target": target,
        "measured_10s": measured,
        "measured_total": total,
        "error_pct": (measured - target) / target * 100.0,
        "error_total_pct": (total - target) / target * 100.0,
        "window": [w.start, w.start + w.length],
        "window_complete": w.length >= window - 1e-9,
        "samples": len(timeline),
        "bytes": timeline.bytes,
        "wall_s": wall,
    }


def run_limit(ds: BenchDataset, binary: str, args, plan: dict) -> dict:
    evict(ds.paths())
    direct = [] if any(a.startswith("--direct-io") for a in args.stage_arg) else ["--direct-io", "true"]
    with stage_session(binary, ds, args.stage_memory, [*plan["flags"], *direct, *args.stage_arg], job=JOB) as s:
        before = fetch_metrics(s.stage.metrics) if s.stage.metrics else []
        timeline = Timeline()
        read_epochs(s.dataset, range(plan["epochs"]), args.seed, args.batch, 0.0, args.prefetch, timeline)
        after = fetch_metrics(s.stage.metrics) if s.stage.metrics else []
    result = summarize(plan["limit"], plan["target"], timeline, args.window_start, args.window)
    result.update(unit=plan["unit"], epochs=plan["epochs"])
    # The stage's own count of storage work, over the whole run.
    for key, name in (("stage_reads", "sluice_stage_storage_reads_total"),
                      ("stage_read_bytes", "sluice_stage_storage_read_bytes_total"),
                      ("stage_throttled_s", "sluice_stage_throttled_seconds_total")):
        a, b = metric_value(after, name, job=JOB), metric_value(before, name, job=JOB) or 0.0
        if a is not None:
            result[key] = a - b
    if "stage_reads" in result and result["wall_s"] > 0:
        result["stage_reads_per_s"] = result["stage_reads"] / result["wall_s"]
    return result


def _fmt(kind: str, value: float) -> str:
    return f"{format_bytes(value)}/s" if kind == "bytes" else f"{value:.0f} ops/s"


def format_table(results: List[dict], window_start: float, window: float) -> str:
    head = (f"{'limit':6} {'target':>12} {f'measured {window_start:g}-{window_start + window:g}s':>16} "
            f"{'error':>7} {'whole run':>12} {'error':>7} {'run s':>6}  notes")
    lines = [head, "-" * len(head)]
    for r in results:
        notes = []
        if not r["window_complete"]:
            notes.append(f"run ended at {r['wall_s']:.1f}s: window cut short")
        if "stage_reads_per_s" in r and r["limit"] == "ops":
            notes.append(f"stage reads {r['stage_reads_per_s']:.0f}/s")
        if r.get("stage_throttled_s") is not None:
            notes.append(f"readers throttled {r['stage_throttled_s']:.1f}s")
        lines.append(f"{r['limit']:6} {_fmt(r['limit'], r['target']):>12} {_fmt(r['limit'], r['measured_10s']):>16} "
                     f"{r['error_pct']:+6.1f}% {_fmt(r['limit'], r['measured_total']):>12} "
                     f"{r['error_total_pct']:+6.1f}% {r['wall_s']:6.1f}  {', '.join(notes)}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    binary = stage_binary_or_exit(args.bin_dir)
    ds = load_dataset(args)
    results = []
    for kind in args.limit_kinds:
        plan = plan_run(kind, args, ds.total_bytes, ds.files)
        log(f"{kind} limit {_fmt(kind, plan['target'])}: {plan['epochs']} epoch(s), "
            f"~{plan['expected_s']:.1f}s at the target ...")
        t = time.perf_counter()
        r = run_limit(ds, binary, args, plan)
        log(f"  window {r['window'][0]:g}-{r['window'][1]:.1f}s: {_fmt(kind, r['measured_10s'])} "
            f"({r['error_pct']:+.1f}%), whole run {_fmt(kind, r['measured_total'])} "
            f"({time.perf_counter() - t:.0f}s with start-up)")
        results.append(r)
    print(f"data set: {ds.files} files of {format_bytes(ds.size)}, {format_bytes(ds.total_bytes)} in {ds.root}; "
          f"batch {args.batch}, no compute, cold cache")
    print(format_table(results, args.window_start, args.window))
    if args.json:
        print(json.dumps({"dataset": ds.describe(), "batch": args.batch, "window_start_s": args.window_start,
                          "window_s": args.window, "results": results}))
    return 0
