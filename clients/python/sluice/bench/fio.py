"""fio on the benchmark's files: the device limit the loaders compare to.

Random whole-file reads of the same files (``--opendir`` over the data set,
``--openfiles`` = number of files), every file read once, at several queue
depths and in two modes: ``direct`` (``O_DIRECT``, libaio) and ``buffered``
(through the page cache, io_uring: the kernel's workers run the reads in
parallel, where libaio would block on each buffered submission). fio
invalidates the files' cached pages before each run. The best is the device
limit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Optional

from .dataset import BenchDataset

__all__ = ["FIO_MODES", "fio_available", "run_fio"]

FIO_MODES = ("direct", "buffered")

_ALIGN = 4096


def fio_available() -> Optional[str]:
    """Returns the fio executable's path, or None when fio is not on PATH."""
    return shutil.which("fio")


def run_fio(ds: BenchDataset, iodepth: int, runtime_s: int = 60, mode: str = "direct") -> dict:
    """Runs one fio randread job and returns a result dict (see prefetch's JSON).

    ``mode``: ``direct`` or ``buffered`` (see the module's text).

    For a fixed-size set the block is the whole file (rounded up to 4 KiB for
    O_DIRECT), so one I/O is one sample; for a set with size variation it is
    the mean size rounded the same way and samples/s is derived from bytes/s.
    Raises ``RuntimeError`` with fio's output when fio fails.
    """
    if mode not in FIO_MODES:
        raise ValueError(f"fio mode must be one of {', '.join(FIO_MODES)}, got {mode!r}")
    direct = mode == "direct"
    bs = -(-ds.size // _ALIGN) * _ALIGN if direct else ds.size
    args = [
        fio_available() or "fio", "--name=sluice-bench", f"--opendir={ds.root}", "--rw=randread",
        f"--bs={bs}", f"--direct={int(direct)}", f"--ioengine={'libaio' if direct else 'io_uring'}",
        f"--iodepth={iodepth}", "--invalidate=1",
        f"--openfiles={ds.files}", "--file_service_type=random", f"--runtime={runtime_s}",
        "--group_reporting", "--output-format=json",
    ]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    text = proc.stdout[proc.stdout.index("{"):]  # fio may print notes before the JSON
    job = json.loads(text)["jobs"][0]
    read = job["read"]
    runtime = (read.get("runtime") or job.get("job_runtime") or 1) / 1000.0
    bw = read["bw_bytes"]
    samples_per_s = read["iops"] if ds.size_stdev == 0 else bw / (ds.total_bytes / ds.files)
    return {
        "loader": "fio",
        "mode": mode,
        "iodepth": iodepth,
        "block_bytes": bs,
        "samples_per_s": samples_per_s,
        "mib_per_s": bw / 2**20,
        "au": 0.0,
        "stall_s": 0.0,
        "cpu_s": (job.get("usr_cpu", 0.0) + job.get("sys_cpu", 0.0)) / 100.0 * runtime,
        "wall_s": runtime,
        "latency_mean_us": read.get("clat_ns", {}).get("mean", 0.0) / 1000.0,
    }
