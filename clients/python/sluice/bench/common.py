"""What the benchmark subcommands share: the data set and stage options, a
stage session, the consumer's per-sample timeline and the pure arithmetic
over it (windows, rolling rates), rate parsing, and reading ``/metrics``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import os
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..client import DEFAULT_PREFETCH, Client, Dataset
from .dataset import BenchDataset, prepare
from .stage import StageProcess, StageStartError, find_stage_binary
from .units import format_bytes, parse_bytes, parse_duration_ms

__all__ = [
    "add_dataset_args", "add_stage_args", "add_loader_args", "dataset_options", "load_dataset", "loader_options", "stage_binary_or_exit", "log",
    "StageSession", "stage_session", "Timeline", "read_epochs",
    "WindowRate", "window_rate", "rolling_rate", "first_reach",
    "parse_byte_rate", "parse_ops_rate", "epochs_for",
    "parse_prometheus", "metric_value", "fetch_metrics",
    "find_binaries", "Daemon", "get_json", "wait_for",
]


def log(*args) -> None:
    """Progress goes to stderr; stdout holds the table and the JSON."""
    print(*args, file=sys.stderr, flush=True)


# -- options ----------------------------------------------------------------


def add_dataset_args(ap, files: int = 5000, beside: str = "") -> None:
    """The data set's shape and the loop's batch and seed; ``beside`` says
    what other data sets the benchmark makes next to ``--dir``."""
    ap.add_argument("--files", type=int, default=files, help=f"number of files (default {files})")
    ap.add_argument("--size", default="100KiB", help="mean file size, e.g. 100KiB, 2.7MB (default 100KiB)")
    ap.add_argument("--size-stdev", default="0", help="standard deviation of file sizes (default 0)")
    ap.add_argument("--dir", default=None,
                    help="where the data set lives (default bench-out/<files>x<size>[-sd<stdev>]" +
                         (f"; {beside} beside it, in its parent directory" if beside else "") + "); "
                         "an existing data set of the same shape is reused")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed of every epoch's order (default 0)")
    ap.add_argument("--batch", type=int, default=32, help="samples per batch (default 32)")


#: The repository this package sits in (its binaries are built under target/).
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def default_bin_dir() -> str:
    """``$SLUICE_BIN_DIR``, else the repository's ``target/release``: found
    from this package, not from the current directory (run elsewhere, a
    relative default found no binary, and the loaders that need one were
    skipped)."""
    return os.environ.get("SLUICE_BIN_DIR") or os.path.join(REPO, "target", "release")


BIN_DIR_HELP = ("directory holding the sluice binaries (default $SLUICE_BIN_DIR, else the repository's "
                "target/release)")


def add_stage_args(ap, memory: bool = True, prefetch: bool = True) -> None:
    """Where the stage binary is and how it runs: ``--stage-memory`` and
    the client's ``--prefetch`` only for benchmarks that use them."""
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    if memory:
        ap.add_argument("--stage-memory", default="1GiB", help="the stage's --memory-budget (default 1GiB)")
    ap.add_argument("--stage-arg", action="append", default=[],
                    help="extra argument for sluice-stage (repeatable), e.g. --stage-arg=--burst-ms=50")
    if prefetch:
        ap.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH,
                        help=f"batches the sluice client receives ahead on its thread; 0: in next() "
                             f"(default {DEFAULT_PREFETCH})")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")


def load_dataset(args) -> BenchDataset:
    """Validates the data set options and returns the (reused or written) data set."""
    size, stdev = dataset_options(args)
    return prepare(args.dir, args.files, size, stdev, log=log)


def dataset_options(args) -> Tuple[int, int]:
    """Validates the data set options, exiting with a clear error on a bad
    one, and sets ``args.dir`` when none was given; returns the sample size
    and its standard deviation in bytes."""
    try:
        size = parse_bytes(args.size)
        stdev = parse_bytes(args.size_stdev)
        parse_bytes(getattr(args, "stage_memory", "0"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.files < 1 or size < 1:
        raise SystemExit("error: --files and --size must be at least 1")
    if not 0 <= args.seed < 2**64:
        raise SystemExit("error: --seed must be between 0 and 2^64 - 1")
    if args.batch < 1:
        raise SystemExit("error: --batch must be >= 1")
    if getattr(args, "prefetch", 0) < 0:
        raise SystemExit("error: --prefetch must be >= 0")
    if args.dir is None:
        suffix = f"-sd{format_bytes(stdev)}" if stdev else ""
        args.dir = os.path.join("bench-out", f"{args.files}x{format_bytes(size)}{suffix}")
    return size, stdev


def add_loader_args(ap, loaders: Sequence[str], workers: str) -> None:
    """The options of a DataLoader benchmark that reads through a stage,
    perhaps behind ``sluice-slowfs``; :func:`loader_options` reads them."""
    ap.add_argument("--workers", default=workers, help=f"DataLoader num_workers values (default {workers})")
    ap.add_argument("--loaders", default=",".join(loaders), help=f"comma-separated subset of {','.join(loaders)}")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every loader; medians reported (default 1)")
    ap.add_argument("--latency", default="0ms",
                    help="added to every storage operation by sluice-slowfs, e.g. 5ms (default 0ms: the "
                         "directory itself)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--stage-memory", default="2GiB", help="the stage's --memory-budget (default 2GiB)")
    ap.add_argument("--stage-arg", action="append", default=[], help="extra argument for sluice-stage (repeatable)")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")


def loader_options(args, known: Sequence[str]) -> Tuple[List[str], List[int], float]:
    """``--loaders`` (a subset of ``known``), ``--workers`` and ``--latency``
    of a DataLoader benchmark: (loaders, worker counts, milliseconds);
    exits with a clear error on a bad value."""
    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    if set(loaders) - set(known) or not loaders:
        raise SystemExit(f"error: --loaders: choose from {', '.join(known)}")
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"error: --workers takes comma-separated worker counts, not {args.workers!r}") from None
    try:
        latency_ms = parse_duration_ms(args.latency)
    except ValueError as e:
        raise SystemExit(f"error: --latency: {e}") from None
    if not workers or min(workers) < 0:
        raise SystemExit("error: --workers must list worker counts >= 0")
    return loaders, workers, latency_ms


def stage_binary_or_exit(bin_dir: str) -> str:
    try:
        return find_stage_binary(bin_dir)
    except StageStartError as e:
        raise SystemExit(f"error: {e}") from None


# -- a stage serving the data set ------------------------------------------------


class StageSession(NamedTuple):
    stage: StageProcess
    client: Client
    dataset: Dataset


@contextlib.contextmanager
def stage_session(binary: str, ds: BenchDataset, stage_memory: str, stage_args: Sequence[str],
                  job: str = "bench") -> Iterator[StageSession]:
    """Starts a stage serving ``ds`` as dataset ``bench``, connects as ``job``
    and yields the session; closes the client and stops the stage after,
    raising when the stage did not exit 0 on SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        stage = StageProcess.start(binary, f"{tmp}/stage.sock", {"bench": ds.root},
                                   ["--memory-budget", stage_memory, *stage_args],
                                   stderr_path=f"{tmp}/stage.stderr")
        client = None
        try:
            client = Client(stage.socket, job=job)
            dataset = client.dataset("bench")
            if dataset.file_count != ds.files:
                raise RuntimeError(f"the stage lists {dataset.file_count} files in {ds.root}, "
                                   f"the data set has {ds.files}")
            yield StageSession(stage, client, dataset)
        finally:
            if client is not None:
                client.close()
            code = stage.stop()
        if code != 0:
            raise RuntimeError(f"sluice-stage exited with status {code} on SIGTERM\n{stage.stderr_tail()}")


# -- the consumer's timeline ------------------------------------------------------


class Timeline:
    """When each sample reached the consumer (seconds since ``t0``) and its
    size, in arrival order. ``compute_s`` sums the emulated compute."""

    def __init__(self, t0: Optional[float] = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.times: List[float] = []
        self.sizes: List[int] = []
        self.compute_s = 0.0

    def __len__(self) -> int:
        return len(self.times)

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    @property
    def end(self) -> float:
        return self.times[-1] if self.times else 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0


def read_epochs(dataset: Dataset, epochs: Sequence[int], seed: int, batch: int, compute_s: float,
                prefetch: int, timeline: Timeline, deadline_s: Optional[float] = None) -> None:
    """The emulated training loop: takes a batch, then sleeps ``compute_s``;
    stamps each sample as the loop receives it. Stops early (closing the
    iterator) once ``deadline_s`` seconds of the timeline have passed."""
    times, sizes, t0 = timeline.times, timeline.sizes, timeline.t0
    perf = time.perf_counter
    for epoch in epochs:
        with dataset.epoch(epoch, seed=seed, batch=batch, prefetch=prefetch) as it:
            while True:
                n = 0
                for _name, data in itertools.islice(it, batch):
                    times.append(perf() - t0)
                    sizes.append(len(data))
                    n += 1
                if n == 0:
                    break
                if compute_s > 0:
                    t = perf()
                    time.sleep(compute_s)
                    timeline.compute_s += perf() - t
                if deadline_s is not None and perf() - t0 >= deadline_s:
                    return


# -- arithmetic over a timeline (pure) -----------------------------------------------


class WindowRate(NamedTuple):
    start: float
    length: float      # the part of the window the run covered
    samples: int
    bytes: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.length if self.length > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.length if self.length > 0 else 0.0


def window_rate(times: Sequence[float], sizes: Sequence[int], start: float, length: float,
                end: Optional[float] = None) -> WindowRate:
    """Returns what arrived in ``[start, start + length)``.

    ``times`` must be sorted. The window is cut at ``end`` (default: the last
    arrival) so that a run shorter than the window is not diluted by time
    after it; ``WindowRate.length`` says how much of the window was used.
    """
    if length <= 0:
        raise ValueError(f"a window needs a positive length, got {length}")
    if end is None:
        end = times[-1] if times else start
    stop = min(start + length, end)
    if stop <= start:
        return WindowRate(start, 0.0, 0, 0)
    lo = bisect.bisect_left(times, start)
    hi = bisect.bisect_left(times, stop)
    if stop == end:  # include the last arrival itself
        hi = bisect.bisect_right(times, stop)
    return WindowRate(start, stop - start, hi - lo, sum(sizes[lo:hi]))


def rolling_rate(times: Sequence[float], at: float, width: float = 0.5) -> float:
    """Returns samples/s over ``(at - width, at]`` (``times`` sorted)."""
    return (bisect.bisect_right(times, at) - bisect.bisect_right(times, at - width)) / width


def first_reach(times: Sequence[float], target: float, width: float = 0.5) -> Optional[float]:
    """Returns the first arrival time at which the rolling ``width``-second
    rate reaches ``target`` samples/s, or None if it never does."""
    need = target * width
    lo = 0
    for i, t in enumerate(times):
        while times[lo] <= t - width:
            lo += 1
        if i - lo + 1 >= need - 1e-9:
            return t
    return None


_OPS_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([kKmM]?)\s*(?:ops)?\s*(?:/\s*s)?\s*$")


def parse_byte_rate(text: str) -> int:
    """Returns bytes/s of ``200MiB/s``, ``1.5GB/s`` or ``209715200`` (the
    ``/s`` is optional)."""
    t = text.strip()
    if t.endswith("/s"):
        t = t[:-2]
    value = parse_bytes(t)
    if value <= 0:
        raise ValueError(f"a rate limit must be > 0, got {text!r}")
    return value


def parse_ops_rate(text: str) -> int:
    """Returns operations/s of ``2000``, ``2k``, ``2k ops/s`` or ``2000/s``."""
    m = _OPS_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as an operation rate; write e.g. 2000, 2k or 2k ops/s")
    value = float(m.group(1)) * {"": 1, "k": 1000, "m": 1_000_000}[m.group(2).lower()]
    if value < 1 or value != int(value):
        raise ValueError(f"an operation rate must be a whole number >= 1 per second, got {text!r}")
    return int(value)


def epochs_for(seconds: float, per_epoch_s: float) -> int:
    """Returns how many epochs of ``per_epoch_s`` last at least ``seconds``."""
    if per_epoch_s <= 0:
        raise ValueError("an epoch must take a positive time")
    return max(1, math.ceil(seconds / per_epoch_s - 1e-9))


# -- /metrics ----------------------------------------------------------------------

_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> List[Tuple[str, Dict[str, str], float]]:
    """Returns ``(name, labels, value)`` for each sample of a Prometheus text
    exposition (comments and unparsable lines are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL_RE.findall(m.group(2) or "")}
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), labels, value))
    return out


def metric_value(samples, name: str, **labels: str) -> Optional[float]:
    """Returns the sum of ``name``'s samples whose labels include ``labels``
    (e.g. a job's counter over all its datasets), or None if there is none."""
    found = [v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items())]
    return sum(found) if found else None


def fetch_metrics(addr: str, timeout: float = 2.0):
    """GETs ``http://<addr>/metrics`` and returns :func:`parse_prometheus` of it."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as r:
        return parse_prometheus(r.read().decode("utf-8", "replace"))


# -- the control plane's daemons ----------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (the value at the
    ceiling of ``q`` times their count)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * q) - 1)]


def output_dir(path: str, flag: str) -> str:
    """Makes the directory ``path`` a benchmark writes its output in, before
    anything runs: one it cannot make is an error naming ``flag``, not a
    traceback at the end of the run (with its figures lost)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise SystemExit(f"error: {flag} {path}: not writable")
    return path


def output_file(path: str, flag: str) -> str:
    """Checks, before anything runs, that the file ``path`` can be written
    (its directory made if missing); see :func:`output_dir`."""
    if os.path.isdir(path):
        raise SystemExit(f"error: {flag} {path}: is a directory, give a file name")
    output_dir(os.path.dirname(os.path.abspath(path)), flag)
    return path


def find_binaries(bin_dir: str, names: Sequence[str]) -> Dict[str, str]:
    """Returns ``{name: path}`` of each executable under ``bin_dir``; exits
    saying how to build them when one is missing."""
    found = {name: os.path.join(bin_dir, name) for name in names}
    missing = [p for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not found: build with `cargo build --release --bins` "
                         "or pass --bin-dir")
    return found


class Daemon(NamedTuple):
    """A started ``sluice-controller`` (or any binary that prints one JSON
    ready line on stdout first), logging to ``log_path``."""

    proc: subprocess.Popen
    ready: dict
    log_path: str

    @classmethod
    def start(cls, argv: Sequence[str], log_path: str) -> "Daemon":
        """Starts ``argv`` and returns once it printed its ready line; exits
        naming the log when it does not."""
        with open(log_path, "w") as err:
            proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=err, text=True,
                                    stdin=subprocess.DEVNULL)
        line = proc.stdout.readline()
        try:
            return cls(proc, json.loads(line), log_path)
        except ValueError:
            proc.kill()
            proc.wait(timeout=10)
            # The log may live in a directory removed on the way out: quote
            # its last lines, which hold the daemon's own reason.
            try:
                with open(log_path) as f:
                    said = [l.strip() for l in f.read().splitlines() if l.strip()][-3:]
            except OSError:
                said = []
            why = f": {' / '.join(said)}" if said else f"; see {log_path}"
            raise SystemExit(f"error: {os.path.basename(argv[0])} did not start (status {proc.returncode}){why}") \
                from None

    def stop(self, timeout: float = 15.0) -> int:
        """Sends SIGTERM and returns the exit status (killing it after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def get_json(http: str, path: str, timeout: float = 5.0):
    """GETs ``http://<http><path>`` and returns the decoded JSON body."""
    with urllib.request.urlopen(f"http://{http}{path}", timeout=timeout) as r:
        return json.load(r)


def wait_for(what: str, check, timeout: float = 20.0, every: float = 0.01):
    """Polls ``check()`` until it returns something truthy and returns that;
    raises ``TimeoutError`` saying ``what`` it waited for after ``timeout``
    seconds. The one polling helper of the benchmarks and the tests."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
