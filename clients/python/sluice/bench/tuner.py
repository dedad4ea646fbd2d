"""``python -m sluice.bench tuner``: does the stage's auto-tuner find the device's rate, and let go?

Three phases, each on a cold data set, no compute unless said:

a. **fixed**: for each reader count in ``--fixed`` (default 1,2,4,8,16,32,64)
   a stage with ``--readers N`` (tuner off) serves one epoch; samples/s of
   the best count is the reference rate.
b. **tuning**: a stage with ``--initial-readers 1`` (tuner on) serves epochs,
   each evicted first, for at least ``--tune-seconds``. ``/metrics`` is polled every
   ``--poll-ms`` (the job's ``sluice_stage_readers``,
   ``sluice_stage_buffer_capacity_bytes`` and
   ``sluice_stage_delivered_samples_total``); the result is the time from
   the plan's submission until the consumer's rolling 0.5 s throughput first
   reaches 90% of the best fixed rate (target: 5 s; the tuner ticks every
   100 ms).
c. **compute-bound**: the same stage then serves another epoch to a loop
   that computes ``--compute-ms`` per batch (default: what makes the loop
   need ``--compute-fraction`` = 1/4 of the best rate); the tuner should
   bring readers and buffer capacity down.

The trace (t, phase, readers, buffer_bytes, samples_per_s, ...) goes to
``--trace FILE.csv``; with matplotlib, ``--plot FILE.png`` draws readers and
throughput over both phases.
"""

from __future__ import annotations

import argparse
import csv
import json
import threading
import time
from typing import List, Optional

from .common import (
    add_dataset_args, add_stage_args, fetch_metrics, first_reach, load_dataset, log, metric_value,
    output_file, read_epochs, rolling_rate, stage_binary_or_exit, stage_session, Timeline,
)
from .dataset import BenchDataset, evict
from .units import format_bytes

FIXED = (1, 2, 4, 8, 16, 32, 64)
JOB = "tuner"
ROLLING_S = 0.5
TARGET_FRACTION = 0.9
TARGET_S = 5.0
TRACE_FIELDS = ("t", "phase", "readers", "buffer_bytes", "samples_per_s", "stage_samples_per_s",
                "delivered_samples", "buffer_used_bytes")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench tuner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=20000)
    ap.add_argument("--fixed", default=",".join(map(str, FIXED)),
                    help="reader counts of phase a (default 1,2,4,8,16,32,64)")
    ap.add_argument("--best-rate", type=float, default=None,
                    help="skip phase a and take this many samples/s as the best fixed rate")
    ap.add_argument("--tune-seconds", type=float, default=8.0,
                    help="phase b reads whole epochs until this much time has passed (default 8)")
    ap.add_argument("--compute-ms", default="auto",
                    help="compute per batch in phase c, or 'auto' (default): the loop needs "
                         "--compute-fraction of the best rate")
    ap.add_argument("--compute-fraction", type=float, default=0.25,
                    help="share of the best rate the phase c loop needs with --compute-ms auto (default 0.25)")
    ap.add_argument("--compute-seconds", type=float, default=10.0,
                    help="phase c reads until this much time has passed, epochs cut short (default 10)")
    ap.add_argument("--skip-compute", action="store_true", help="leave out phase c")
    ap.add_argument("--poll-ms", type=float, default=100.0, help="/metrics polling period (default 100)")
    ap.add_argument("--initial-readers", type=int, default=1, help="the stage's --initial-readers (default 1)")
    ap.add_argument("--trace", default=None, help="write the trace to this CSV file")
    ap.add_argument("--plot", default=None, help="draw readers and throughput into this PNG (needs matplotlib)")
    add_stage_args(ap)
    return ap


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    try:
        args.fixed_counts = [int(x) for x in args.fixed.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --fixed takes comma-separated reader counts, got {args.fixed!r}") from None
    if args.best_rate is None and (not args.fixed_counts or min(args.fixed_counts) < 1):
        raise SystemExit("error: --fixed needs reader counts >= 1 (or give --best-rate)")
    if args.best_rate is not None and args.best_rate <= 0:
        raise SystemExit("error: --best-rate must be > 0")
    if args.compute_ms.strip().lower() == "auto":
        args.compute_ms = None
        if not 0 < args.compute_fraction <= 1:
            raise SystemExit("error: --compute-fraction must be in (0, 1]")
    else:
        try:
            args.compute_ms = float(args.compute_ms)
        except ValueError:
            raise SystemExit(f"error: --compute-ms must be milliseconds or 'auto', got {args.compute_ms!r}") from None
        if args.compute_ms < 0:
            raise SystemExit("error: --compute-ms must be >= 0")
    if args.poll_ms <= 0 or args.tune_seconds <= 0 or args.compute_seconds <= 0:
        raise SystemExit("error: --poll-ms, --tune-seconds and --compute-seconds must be > 0")
    if args.initial_readers < 1:
        raise SystemExit("error: --initial-readers must be >= 1")
    return args


def compute_ms_for(best_rate: float, batch: int, fraction: float) -> float:
    """Compute per batch that makes a loop of ``batch`` samples need
    ``fraction`` of ``best_rate`` samples/s."""
    return batch / (best_rate * fraction) * 1000.0


# -- phase a -------------------------------------------------------------------------


def run_fixed(ds: BenchDataset, binary: str, args, readers: int) -> dict:
    evict(ds.paths())
    with stage_session(binary, ds, args.stage_memory, ["--readers", str(readers), *args.stage_arg],
                       job=JOB) as s:
        timeline = Timeline()
        read_epochs(s.dataset, [0], args.seed, args.batch, 0.0, args.prefetch, timeline)
    wall = timeline.end
    return {"readers": readers, "samples_per_s": len(timeline) / wall if wall else 0.0,
            "mib_per_s": timeline.bytes / wall / 2**20 if wall else 0.0, "wall_s": wall}


# -- phases b and c ------------------------------------------------------------------


class Poller:
    """Polls the stage's /metrics for the job every ``period`` seconds into
    ``rows`` (dicts with t on the timeline's clock and the current phase)."""

    def __init__(self, addr: str, timeline: Timeline, period: float) -> None:
        self.addr = addr
        self.timeline = timeline
        self.period = period
        self.phase = "start"
        self.rows: List[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-bench-poller", daemon=True)

    def start(self) -> "Poller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            phase = self.phase
            try:
                samples = fetch_metrics(self.addr, timeout=1.0)
            except OSError:
                self.errors += 1
            else:
                t = self.timeline.now()
                self.rows.append({
                    "t": t, "phase": phase,
                    "readers": metric_value(samples, "sluice_stage_readers", job=JOB),
                    "buffer_bytes": metric_value(samples, "sluice_stage_buffer_capacity_bytes", job=JOB),
                    "buffer_used_bytes": metric_value(samples, "sluice_stage_buffer_used_bytes", job=JOB),
                    "delivered_samples": metric_value(samples, "sluice_stage_delivered_samples_total", job=JOB),
                })
            next_at += self.period
            self._stop.wait(max(0.0, next_at - time.perf_counter()))


def fill_rates(rows: List[dict], times: List[float], width: float = ROLLING_S) -> None:
    """Adds the consumer's rolling rate at each row's time, and the stage's
    (from its delivered counter over the same width)."""
    for i, row in enumerate(rows):
        row["samples_per_s"] = rolling_rate(times, row["t"], width)
        j = i
        while j > 0 and rows[j - 1]["t"] > row["t"] - width:
            j -= 1
        prev = rows[j - 1] if j > 0 else None
        if prev is not None and prev["delivered_samples"] is not None and row["delivered_samples"] is not None:
            row["stage_samples_per_s"] = (row["delivered_samples"] - prev["delivered_samples"]) / (row["t"] - prev["t"])
        else:
            row["stage_samples_per_s"] = None


def row_at(rows: List[dict], t: float) -> Optional[dict]:
    """Returns the last row polled at or before ``t`` (or the first one)."""
    best = None
    for row in rows:
        if row["t"] <= t or best is None:
            best = row
        if row["t"] > t:
            break
    return best


def phase_summary(rows: List[dict], phase: str) -> dict:
    """Readers and buffer capacity at the start, end, min and max of a phase."""
    sel = [r for r in rows if r["phase"] == phase and r["readers"] is not None]
    if not sel:
        return {}
    readers = [r["readers"] for r in sel]
    buffers = [r["buffer_bytes"] for r in sel if r["buffer_bytes"] is not None]
    out = {"readers_start": readers[0], "readers_end": readers[-1], "readers_min": min(readers),
           "readers_max": max(readers)}
    if buffers:
        out.update(buffer_start=buffers[0], buffer_end=buffers[-1], buffer_min=min(buffers),
                   buffer_max=max(buffers))
    return out


def run_tuned(ds: BenchDataset, binary: str, args, best_rate: float) -> dict:
    """Phases b and c on one stage; returns the summary and the trace."""
    evict(ds.paths())
    stage_args = ["--initial-readers", str(args.initial_readers), *args.stage_arg]
    compute_ms = args.compute_ms if args.compute_ms is not None else \
        compute_ms_for(best_rate, args.batch, args.compute_fraction)
    out: dict = {"compute_ms": compute_ms}
    with stage_session(binary, ds, args.stage_memory, stage_args, job=JOB) as s:
        if not s.stage.metrics:
            raise RuntimeError("the stage reported no metrics address")
        timeline = Timeline()  # t=0: just before the first plan's submission
        poller = Poller(s.stage.metrics, timeline, args.poll_ms / 1000.0)
        poller.phase = "tuning"
        poller.start()
        try:
            epoch = 0
            tune_start = 0.0
            evict_s = 0.0
            while True:
                read_epochs(s.dataset, [epoch], args.seed, args.batch, 0.0, args.prefetch, timeline)
                epoch += 1
                if timeline.now() >= args.tune_seconds:
                    break
                # Every epoch reads cold, like the first: with buffered reads
                # the previous epoch would otherwise still be in the page cache.
                poller.phase = "evict"
                evict_start = timeline.now()
                evict(ds.paths())
                evict_s += timeline.now() - evict_start
                poller.phase = "tuning"
            tune_end = timeline.now()
            tune_samples = len(timeline)
            if not args.skip_compute:
                poller.phase = "evict"
                evict(ds.paths())
                poller.phase = "compute-bound"
                compute_start = timeline.now()
                compute0 = timeline.compute_s
                first = len(timeline)
                read_epochs(s.dataset, range(epoch, epoch + 1000), args.seed, args.batch, compute_ms / 1000.0,
                            args.prefetch, timeline, deadline_s=compute_start + args.compute_seconds)
                compute_end = timeline.now()
                wall = compute_end - compute_start
                out["compute_bound"] = {
                    "compute_ms": compute_ms,
                    "needed_samples_per_s": args.batch / (compute_ms / 1000.0) if compute_ms > 0 else None,
                    "samples_per_s": (len(timeline) - first) / wall if wall > 0 else 0.0,
                    "au": (timeline.compute_s - compute0) / wall if wall > 0 else 0.0,
                    "start_s": compute_start, "end_s": compute_end,
                }
            time.sleep(2 * args.poll_ms / 1000.0)  # one more poll after the last sample
        finally:
            poller.stop()
    rows = poller.rows
    fill_rates(rows, timeline.times)
    tune_times = timeline.times[:tune_samples]
    target = TARGET_FRACTION * best_rate
    reached = first_reach(tune_times, target, ROLLING_S)
    at = row_at(rows, reached) if reached is not None else None
    out["tuning"] = {
        "target_samples_per_s": target,
        "time_to_90pct_s": reached,
        "met_target": reached is not None and reached <= TARGET_S,
        "readers_at_90pct": at["readers"] if at else None,
        "samples_per_s": (tune_samples / (tune_end - tune_start - evict_s)
                          if tune_end - tune_start > evict_s else 0.0),
        "epochs": epoch,
        "end_s": tune_end,
        **phase_summary(rows, "tuning"),
    }
    if "compute_bound" in out:
        out["compute_bound"].update(phase_summary(rows, "compute-bound"))
    out["poll_errors"] = poller.errors
    out["rows"] = rows
    return out


# -- output ----------------------------------------------------------------------------


def write_trace(path: str, rows: List[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TRACE_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in TRACE_FIELDS})


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if not v.is_integer() else str(int(v))
    return v


def write_plot(path: str, rows: List[dict], best_rate: float, reached: Optional[float]) -> Optional[str]:
    """Draws readers, buffer capacity and throughput over time; returns why
    not when matplotlib does not import."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib does not import ({e})"
    t = [r["t"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    ax1.plot(t, [r["samples_per_s"] for r in rows], label="consumer, rolling 0.5 s")
    ax1.plot(t, [r.get("stage_samples_per_s") if r.get("stage_samples_per_s") is not None else float("nan")
                 for r in rows], label="stage delivered", alpha=0.5, lw=0.8)
    ax1.axhline(best_rate, color="gray", ls="--", lw=0.8, label="best fixed")
    ax1.axhline(TARGET_FRACTION * best_rate, color="gray", ls=":", lw=0.8, label="90% of best")
    if reached is not None:
        ax1.axvline(reached, color="green", lw=0.8, label=f"90% at {reached:.2f} s")
    ax1.set_ylabel("samples/s")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.step(t, [r["readers"] if r["readers"] is not None else float("nan") for r in rows], where="post",
             color="C3", label="readers")
    ax2.set_ylabel("readers")
    ax2.set_xlabel("seconds since the plan")
    ax3 = ax2.twinx()
    nan = float("nan")  # gauges the stage had not set yet are gaps, not zeros
    ax3.step(t, [r["buffer_bytes"] / 2**20 if r["buffer_bytes"] is not None else nan for r in rows],
             where="post", color="C4", alpha=0.6, label="buffer capacity")
    ax3.set_ylabel("buffer MiB")
    for ax in (ax1, ax2):
        start = None
        for r in rows + [{"phase": None, "t": t[-1] if t else 0}]:
            if r["phase"] == "compute-bound" and start is None:
                start = r["t"]
            elif r["phase"] != "compute-bound" and start is not None:
                ax.axvspan(start, r["t"], color="orange", alpha=0.08)
                start = None
    lines = ax2.get_legend_handles_labels()
    more = ax3.get_legend_handles_labels()
    ax2.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    ax1.set_title("sluice-stage tuner: phase b from 1 reader (cold epochs), phase c (shaded) compute-bound")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _n(value, fmt: str = ".0f") -> str:
    return "?" if value is None else format(value, fmt)


def format_report(fixed: List[dict], best: dict, tuned: dict) -> str:
    lines = []
    if fixed:
        lines += ["phase a: fixed readers (tuner off), one cold epoch each, no compute",
                  f"{'readers':>8} {'samples/s':>10} {'MiB/s':>8}"]
        for r in fixed:
            lines.append(f"{r['readers']:8d} {r['samples_per_s']:10.0f} {r['mib_per_s']:8.1f}"
                         f"{'  best' if r is best else ''}")
        lines.append("")
    else:
        lines.append(f"best fixed rate given: {best['samples_per_s']:.0f} samples/s")
    tu = tuned["tuning"]
    reached = tu["time_to_90pct_s"]
    if reached is not None:
        verdict = (f"90% of {best['samples_per_s']:.0f} samples/s reached at {reached:.2f} s "
                   f"({'meets' if tu['met_target'] else 'misses'} the {TARGET_S:g} s target) with "
                   f"{_n(tu['readers_at_90pct'])} readers")
    else:
        verdict = f"never reached 90% of {best['samples_per_s']:.0f} samples/s in {tu['end_s']:.1f} s"
    lines.append(f"phase b: tuner on from {_n(tu.get('readers_start'))} reader(s), no compute, "
                 f"{tu['epochs']} epoch(s): {verdict}; readers max {_n(tu.get('readers_max'))}, "
                 f"end {_n(tu.get('readers_end'))}; {tu['samples_per_s']:.0f} samples/s over the phase")
    cb = tuned.get("compute_bound")
    if cb:
        lines.append(f"phase c: {cb['compute_ms']:.2f} ms compute per batch (needs "
                     f"{_n(cb['needed_samples_per_s'])} samples/s): {cb['samples_per_s']:.0f} samples/s, "
                     f"AU {cb['au'] * 100:.1f}%; readers {_n(cb.get('readers_start'))} -> "
                     f"{_n(cb.get('readers_end'))} (min {_n(cb.get('readers_min'))}), buffer "
                     f"{format_bytes(cb.get('buffer_start') or 0)} -> {format_bytes(cb.get('buffer_end') or 0)}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    binary = stage_binary_or_exit(args.bin_dir)
    for path, flag in ((args.trace, "--trace"), (args.plot, "--plot")):
        if path:
            output_file(path, flag)
    ds = load_dataset(args)
    fixed: List[dict] = []
    if args.best_rate is None:
        for n in args.fixed_counts:
            log(f"phase a: --readers {n} ...")
            r = run_fixed(ds, binary, args, n)
            log(f"  {r['samples_per_s']:.0f} samples/s")
            fixed.append(r)
        best = max(fixed, key=lambda r: r["samples_per_s"])
    else:
        best = {"readers": None, "samples_per_s": args.best_rate, "given": True}
    best_rate = best["samples_per_s"]
    log(f"phase b{'/c' if not args.skip_compute else ''}: tuner on, --initial-readers {args.initial_readers} ...")
    tuned = run_tuned(ds, binary, args, best_rate)
    rows = tuned.pop("rows")
    if args.trace:
        write_trace(args.trace, rows)
    plot_note = None
    if args.plot:
        plot_note = write_plot(args.plot, rows, best_rate, tuned["tuning"]["time_to_90pct_s"])
        if plot_note:
            log(f"no plot: {plot_note}")
    print(f"data set: {ds.files} files of {format_bytes(ds.size)}, {format_bytes(ds.total_bytes)} in {ds.root}; "
          f"batch {args.batch}, cold cache")
    print(format_report(fixed, best, tuned))
    if args.trace:
        print(f"trace: {args.trace} ({len(rows)} rows)")
    if args.plot and not plot_note:
        print(f"plot: {args.plot}")
    if args.json:
        doc = {"dataset": ds.describe(), "batch": args.batch, "fixed": fixed,
               "best_fixed": {"readers": best["readers"], "samples_per_s": best_rate},
               **tuned, "trace": args.trace, "plot": None if plot_note else args.plot,
               "plot_skipped": plot_note}
        print(json.dumps(doc))
    return 0
