"""The DLIO benchmark, unmodified, on the plain directory and through the
stage's mount: DLIO's own accelerator utilization (AU) and throughput per
epoch, cold first epoch (the page cache emptied, a fresh stage), later
epochs as DLIO runs them.

Workloads are DLIO's unet3d and resnet50 shapes scaled to this machine,
both with DLIO's PyTorch reader:

* **unet3d**: ``unet3d_a100`` with 64 npz files of 16 MiB (sd 4 MiB)
  instead of 168 of 140 MiB; the compute time per batch is scaled by the
  same factor as the record size (0.636 s x 16 MiB / 140 MiB), so a
  simulated accelerator needs as many bytes per second as DLIO's.
* **resnet50**: ``resnet50_a100``'s 112 KiB records as 2,048 JPEG files
  (one sample per file) in batches of 64, compute scaled per sample
  (0.435 s / 400 samples x 64).

The loaders run interleaved (dir, mount, dir, mount with ``--repeat``),
each DLIO run with the data set's pages evicted first; the mount run gets
a stage started for it, reading as job ``dlio`` (``MOUNT/@dlio/<workload>``)
with no order (DLIO opens files itself: the mount reads large files
sequentially ahead, or lets the kernel read them from the directory).

DLIO needs ``pip install dlio-benchmark`` with MPICH (``scripts/dlio-env``
installs both into ``.venv``). With ``--json`` stdout ends with one object::

    {"benchmark": "dlio", "results": [{"workload", "loader", "au_percent": [...],
     "samples_per_s": [...], "runs"}]}

where lists are per epoch (medians over rounds).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

from .common import BIN_DIR_HELP, default_bin_dir, log, stage_binary_or_exit
from .dataset import evict
from .stage import StageProcess

# DLIO configuration overrides per workload (scaled shapes, see above).
WORKLOADS: Dict[str, Dict[str, object]] = {
    "unet3d": {
        "workload": "unet3d_a100",
        "dataset.format": "npz",
        "dataset.num_files_train": 64,
        "dataset.num_samples_per_file": 1,
        "dataset.record_length": 16 * 2**20,
        "dataset.record_length_stdev": 4 * 2**20,
        "dataset.record_length_resize": 2 * 2**20,
        "reader.batch_size": 7,
        "train.computation_time": round(0.636 * 16 * 2**20 / 146600628, 4),
    },
    "resnet50": {
        "workload": "resnet50_a100",
        "framework": "pytorch",
        "dataset.format": "jpeg",
        "dataset.num_files_train": 2048,
        "dataset.num_samples_per_file": 1,
        "dataset.record_length": 114660,
        "dataset.record_length_resize": 150528,
        "reader.data_loader": "pytorch",
        "reader.batch_size": 64,
        "train.computation_time": round(0.435 / 400 * 64, 4),
    },
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench dlio", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--dir", default="bench-out/dlio", help="where the generated data sets live (default bench-out/dlio)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per DLIO run (default 3)")
    ap.add_argument("--read-threads", type=int, default=2, help="DLIO reader.read_threads (default 2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of both loaders; medians reported (default 1)")
    ap.add_argument("--dlio", default=None, help="the dlio_benchmark program (default: next to this python)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--stage-memory", default="2GiB", help="the stage's --memory-budget (default 2GiB)")
    ap.add_argument("--stage-arg", action="append", default=[], help="extra argument for sluice-stage (repeatable)")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")
    return ap


def _overrides(shape: Dict[str, object], data_folder: str, epochs: int, read_threads: int) -> List[str]:
    args = [f"workload={shape['workload']}"]
    settings = {k: v for k, v in shape.items() if k != "workload"}
    settings.update({"dataset.data_folder": data_folder, "train.epochs": epochs,
                     "reader.read_threads": read_threads, "workflow.checkpoint": False})
    return args + [f"++workload.{k}={v}" for k, v in settings.items()]


def _run_dlio(program: str, overrides: List[str], out: str, expect: str) -> str:
    """Runs DLIO once with its output in ``out`` (log beside it); returns
    the path of ``expect`` there, raising with the log's tail when DLIO
    failed or did not write it."""
    log_path = out + ".log"
    with open(log_path, "w") as f:
        run = subprocess.run([program, *overrides, f"hydra.run.dir={out}"], stdout=f, stderr=subprocess.STDOUT,
                             cwd=os.path.dirname(out))
    path = os.path.join(out, expect)
    if run.returncode != 0 or not os.path.exists(path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"dlio_benchmark failed (status {run.returncode}):\n{tail}")
    return path


def _dlio(program: str, overrides: List[str], out: str) -> dict:
    """Runs DLIO training once; returns its summary's metrics."""
    with open(_run_dlio(program, overrides, out, "summary.json")) as f:
        return json.load(f)["metric"]


def _files(root: str) -> List[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]


def generate(program: str, name: str, shape: Dict[str, object], root: str, work: str) -> None:
    """Generates the workload's data set with DLIO unless it is there."""
    count = shape["dataset.num_files_train"]
    if len(_files(os.path.join(root, "train"))) == count:
        return
    shutil.rmtree(root, ignore_errors=True)
    log(f"generating {name}: {count} files in {root} ...")
    overrides = _overrides(shape, root, 1, 1) + ["++workload.workflow.generate_data=True",
                                                 "++workload.workflow.train=False"]
    _run_dlio(program, overrides, os.path.join(work, f"generate-{name}"), "")


def run_once(args, program: str, binary: str, name: str, shape: Dict[str, object], root: str, loader: str,
             work: str, tag: str) -> dict:
    evict(_files(root))
    out = os.path.join(work, f"{name}-{loader}-{tag}")
    if loader == "dir":
        return _dlio(program, _overrides(shape, root, args.epochs, args.read_threads), out)
    mount = tempfile.mkdtemp(prefix="sluice-dlio-mnt-", dir=work)
    stage = StageProcess.start(binary, os.path.join(work, f"stage-{tag}.sock"), {name: root},
                               ["--memory-budget", args.stage_memory, "--mount", mount, *args.stage_arg],
                               stderr_path=out + ".stage.log")
    try:
        folder = os.path.join(mount, "@dlio", name)
        return _dlio(program, _overrides(shape, folder, args.epochs, args.read_threads), out)
    finally:
        code = stage.stop()
        os.rmdir(mount)
        if code != 0:
            raise RuntimeError(f"sluice-stage exited with status {code}; see {out}.stage.log")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise SystemExit(f"error: unknown workload(s) {unknown}: use {','.join(WORKLOADS)}")
    if args.epochs < 1 or args.repeat < 1 or args.read_threads < 1:
        raise SystemExit("error: --epochs, --repeat and --read-threads must be >= 1")
    program = args.dlio or os.path.join(os.path.dirname(sys.executable), "dlio_benchmark")
    if not os.access(program, os.X_OK):
        raise SystemExit(f"error: no dlio_benchmark at {program}: run scripts/dlio-env (DLIO and MPICH)")
    binary = stage_binary_or_exit(args.bin_dir)
    base = os.path.abspath(args.dir)
    os.makedirs(base, exist_ok=True)
    runs: Dict[tuple, List[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-dlio-", dir=base) as work:
        for name in names:
            root = os.path.join(base, name)
            generate(program, name, WORKLOADS[name], root, work)
            for round_ in range(args.repeat):
                for loader in ("dir", "mount"):
                    metric = run_once(args, program, binary, name, WORKLOADS[name], root, loader, work,
                                      f"{round_}")
                    au = [round(x, 1) for x in metric["train_au_percentage"]]
                    rate = [round(x, 1) for x in metric["train_throughput_samples_per_second"]]
                    runs.setdefault((name, loader), []).append({"au_percent": au, "samples_per_s": rate})
                    log(f"  {name} {loader}: AU % per epoch {au}, samples/s {rate} (round {round_ + 1})")
    results = []
    for (name, loader), rs in runs.items():
        def median(key: str) -> List[float]:
            per_epoch = zip(*(r[key] for r in rs))
            return [sorted(v)[(len(v) - 1) // 2] for v in map(list, per_epoch)]
        results.append({"workload": name, "loader": loader, "au_percent": median("au_percent"),
                        "samples_per_s": median("samples_per_s"), "runs": rs})
    print(format_table(results))
    if args.json:
        print(json.dumps({"benchmark": "dlio", "epochs": args.epochs, "read_threads": args.read_threads,
                          "results": results}))
    return 0


def format_table(results: List[dict]) -> str:
    lines = [f"{'workload':10} {'loader':7} {'epoch':>5} {'AU %':>7} {'samples/s':>10}"]
    for r in results:
        for epoch, (au, rate) in enumerate(zip(r["au_percent"], r["samples_per_s"]), 1):
            lines.append(f"{r['workload']:10} {r['loader']:7} {epoch:>5} {au:>7.1f} {rate:>10.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
