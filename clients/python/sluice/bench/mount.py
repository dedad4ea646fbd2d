"""``python -m sluice.bench mount``: unmodified file-reading PyTorch code
through the stage's mount (``sluice-stage --mount``), against the same code
on the plain directory and against the socket client.

Cold cache, a torchvision-style file data set (each item one file read
into a ``uint8`` tensor with ``readinto``), batch ``--batch``, the default
collate, ``--workers`` worker processes; every loader reads the same
shuffle of the same epoch number:

- ``dataloader-dir``: the plain directory (behind ``sluice-slowfs`` with
  ``--latency``, the same store the stage reads);
- ``dataloader-mount``: the same files through the mount, default
  sampler (no order given: each open is a read through the stage);
- ``dataloader-mount-sampler``: through the mount with
  ``sluice.torch.MountSampler``, which hands the epoch's order to the stage
  so that the workers' opens are served from the prefetch buffer;
- ``socket``: ``SluiceDataset`` with ``SluiceSampler`` (the client).

Before each run every file is evicted from the page cache (the store's and
the mount's). Rounds (``--repeat``) run every loader in turn, interleaved,
and report each one's median.

**hot**: a data set read before (``--hot-files`` files, its pages in the
page cache, the mount's included), one consumer in one process: every file
opened and read through the mount in an epoch's order, against the socket
client's epoch of the same order (``Client.dataset().epoch()``), and the
same files opened and read on the plain directory (what the kernel alone
costs).

With ``--json`` stdout ends with one object in the shape of ``prefetch``'s:
``{"dataset", "batch", "seed", "storage", "results": [{"loader", "workers",
"samples_per_s", "mib_per_s", "runs"}], "hot": {"mount_samples_per_s",
"socket_samples_per_s", "dir_samples_per_s"}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Callable, List, Optional

from ..client import Client
from .common import (add_dataset_args, add_loader_args, load_dataset, loader_options, log, stage_binary_or_exit,
                     stage_session)
from .dataset import BenchDataset, evict, prepare
from .delivery import loader_epoch
from .harness import HarnessError
from .prefetch import median_of_rounds
from .storage import open_storage
from .units import format_bytes

#: The benchmark's loader names, in the order each round runs them, and
#: the kind of ``loader_epoch`` each one is.
LOADERS = {
    "dataloader-dir": "dataloader-dir",
    "dataloader-mount": "dataloader-mount",
    "dataloader-mount-sampler": "dataloader-mount-sampler",
    "socket": "sluice-map",
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench mount", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=20000, beside="the hot part's data set is made")
    add_loader_args(ap, list(LOADERS), "1,2,4,8")
    ap.add_argument("--hot-files", type=int, default=10000,
                    help="files of the hot part (100 KiB each unless --size; 0 skips it; default 10000)")
    return ap


def run_cold(args, binary: str, ds: BenchDataset, store: BenchDataset, stage_args: List[str],
             loaders: List[str], workers: List[int]) -> List[dict]:
    runs: List[dict] = []
    epoch = 0
    with tempfile.TemporaryDirectory(prefix="sluice-mount-") as mount:
        with stage_session(binary, store, args.stage_memory, [*stage_args, "--mount", mount]) as session:
            for round_ in range(args.repeat):
                for w in workers:
                    for name in loaders:
                        epoch += 1
                        rate = loader_epoch(LOADERS[name], w, ds, session.stage, epoch, args.seed, args.batch,
                                            mount=mount, store=store)
                        runs.append({"loader": name, "workers": w, "samples_per_s": rate,
                                     "mib_per_s": rate * ds.total_bytes / ds.files / 2**20})
                        log(f"  {name} workers={w}: {rate:,.0f} samples/s (round {round_ + 1})")
    results = median_of_rounds(runs)
    for r in results:
        r["samples_per_s"] = round(r["samples_per_s"], 1)
        r["mib_per_s"] = round(r["mib_per_s"], 1)
    return results


def _read_all(paths: List[str]) -> int:
    n = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            n += len(f.read())
    return n


def run_hot(args, binary: str, ds: BenchDataset) -> dict:
    """One consumer, a data set read before: the mount against the socket."""
    rates = {"dir": [], "mount": [], "socket": []}
    with tempfile.TemporaryDirectory(prefix="sluice-mount-") as mount:
        with stage_session(binary, ds, args.stage_memory, [*args.stage_arg, "--mount", mount]) as session:
            through = ds._replace(root=os.path.join(mount, "@hot", "bench")).paths()
            client = Client(session.stage.socket, job="hot-socket")
            dataset = client.dataset("bench")

            def socket_epoch(epoch: int) -> None:
                with dataset.epoch(epoch, seed=args.seed, batch=args.batch) as it:
                    for _ in it:
                        pass

            def files_epoch(paths: List[str]) -> Callable[[int], None]:
                def epoch_fn(epoch: int) -> None:
                    order = list(paths)
                    random.Random(args.seed * 1000 + epoch).shuffle(order)
                    _read_all(order)
                return epoch_fn

            epochs = (("dir", files_epoch(ds.paths())), ("mount", files_epoch(through)), ("socket", socket_epoch))
            for name, epoch_fn in epochs:
                epoch_fn(0)  # untimed: pages in, buffers and tuner warm
            for round_ in range(args.repeat):
                for name, epoch_fn in epochs:
                    t0 = time.perf_counter()
                    epoch_fn(round_ + 1)
                    rate = ds.files / (time.perf_counter() - t0)
                    rates[name].append(rate)
                    log(f"  hot {name}: {rate:,.0f} samples/s")
            client.close()
    mid = {name: sorted(rs)[(len(rs) - 1) // 2] for name, rs in rates.items()}
    return {"files": ds.files, "size": ds.size, "mount_samples_per_s": round(mid["mount"], 1),
            "socket_samples_per_s": round(mid["socket"], 1), "dir_samples_per_s": round(mid["dir"], 1),
            "runs": {name: [round(r, 1) for r in rs] for name, rs in rates.items()}}


def format_table(results: List[dict], hot: Optional[dict]) -> str:
    lines = [f"{'loader':26} {'workers':>7} {'samples/s':>10} {'MiB/s':>8}  vs dataloader-dir  vs socket"]
    by = {(r["loader"], r["workers"]): r["samples_per_s"] for r in results}
    for r in results:
        dir_rate = by.get(("dataloader-dir", r["workers"]))
        socket_rate = by.get(("socket", r["workers"]))
        vs_dir = f"{r['samples_per_s'] / dir_rate:.2f}x" if dir_rate else ""
        vs_socket = f"{r['samples_per_s'] / socket_rate:.2f}x" if socket_rate else ""
        lines.append(f"{r['loader']:26} {r['workers']:7} {r['samples_per_s']:10,.0f} {r['mib_per_s']:8.1f}  "
                     f"{vs_dir:>16}  {vs_socket:>9}")
    if hot:
        ratio = hot["mount_samples_per_s"] / hot["socket_samples_per_s"]
        lines.append(f"hot ({hot['files']} files, one consumer): mount {hot['mount_samples_per_s']:,.0f} samples/s, "
                     f"socket {hot['socket_samples_per_s']:,.0f} samples/s ({ratio:.2f}x); the plain directory "
                     f"{hot['dir_samples_per_s']:,.0f} samples/s")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    loaders, workers, latency_ms = loader_options(args, list(LOADERS))
    if args.repeat < 1 or args.hot_files < 0:
        raise SystemExit("error: --repeat must be >= 1 and --hot-files >= 0")
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: the mount benchmark needs torch: {e}") from None
    binary = stage_binary_or_exit(args.bin_dir)
    ds = load_dataset(args)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
    try:
        with open_storage("dir", args.latency, latency_ms, ds, args.bin_dir, repo) as storage:
            log(f"cold: {ds.files} files of {format_bytes(ds.size)}, +{latency_ms:g} ms per operation ...")
            results = run_cold(args, binary, ds, storage.view, [*storage.stage_args, *args.stage_arg],
                               loaders, workers)
    except HarnessError as e:
        raise SystemExit(f"error: the slowfs harness: {e}") from None
    hot = None
    if args.hot_files:
        hot_ds = prepare(os.path.join(os.path.dirname(args.dir) or ".",
                                      f"{args.hot_files}x{format_bytes(ds.size)}"),
                         args.hot_files, ds.size, log=log)
        evict(hot_ds.paths())
        log(f"hot: {hot_ds.files} files read before, one consumer ...")
        hot = run_hot(args, binary, hot_ds)
    print(f"data set: {ds.files} files of {format_bytes(ds.size)} in {ds.root}; batch {args.batch}, cold cache; "
          f"+{latency_ms:g} ms per storage operation")
    print(format_table(results, hot))
    if args.json:
        print(json.dumps({"dataset": ds.describe(), "batch": args.batch, "seed": args.seed,
                          "storage": {"kind": "dir", "latency_ms": latency_ms}, "results": results,
                          "hot": hot}))
    return 0
