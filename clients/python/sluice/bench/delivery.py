"""``python -m sluice.bench delivery``: how fast samples get from the stage
into the training loop.

(a) **hot**: samples already in the page cache, one consumer (the client's
plan iterator with its prefetch thread), 100 KiB and 1 MiB samples: the
socket path (samples copied through the socket) against the shared-memory
path (samples handed over by offset in the job's region). Each path first
reads one untimed epoch (page cache, region and tuner warm), then
``--hot-epochs`` timed ones. Reports samples/s, GiB/s and the stage's CPU
seconds per GiB delivered.

(b) **torch**, cold cache: a PyTorch ``DataLoader`` (batch ``--batch``,
the default collate) over a plain directory data set (each item read into
a ``uint8`` tensor with ``readinto``), over ``sluice.torch.SluiceDataset``
with ``SluiceSampler`` and over ``SluiceIterableDataset``, each with
``--workers`` worker processes, returning the samples as they come
(``uint8`` tensors). Every file is evicted from the page cache before each
run; the order is the same shuffle for every loader.

(c) **decode**: the same with a CPU-heavy transform in the workers: real
JPEG files (generated once, ``--jpeg-files`` of ``--jpeg-side`` pixels
square) decoded with Pillow into ``uint8`` image tensors.

Rounds (``--repeat``) run every variant in turn and report each one's
median. With ``--json`` stdout ends with one object: ``{"hot": [{"size",
"path", "samples_per_s", "gib_per_s", "stage_cpu_s_per_gib"}], "torch":
[{"loader", "workers", "transform", "samples_per_s"}]}``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

from .. import plan as splan
from ..client import Client
from .common import BIN_DIR_HELP, add_dataset_args, dataset_options, default_bin_dir, load_dataset, log, stage_binary_or_exit, stage_session
from .dataset import BenchDataset, evict, prepare
from .stage import StageProcess
from .units import format_bytes, parse_bytes

PARTS = ("hot", "torch", "decode")
LOADERS = ("dataloader-dir", "sluice-map", "sluice-iterable")

#: The job the mount loader's paths name (``MOUNT/@<job>/bench/...``).
MOUNT_JOB = "torch-mount"
GiB = 2**30


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench delivery", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap, files=20000, beside="the hot-* and jpeg-* data sets are made")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--workers", default="0,1,2,4,8", help="DataLoader num_workers values (default 0,1,2,4,8)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every variant; medians reported (default 1)")
    ap.add_argument("--hot-sizes", default="100KiB,1MiB", help="sample sizes of the hot part (default 100KiB,1MiB)")
    ap.add_argument("--hot-bytes", default="2GiB", help="size of each hot data set (default 2GiB)")
    ap.add_argument("--hot-epochs", type=int, default=2, help="timed epochs per hot run (default 2)")
    ap.add_argument("--jpeg-files", type=int, default=5000, help="JPEG files of the decode part (default 5000)")
    ap.add_argument("--jpeg-side", type=int, default=256, help="width and height of each JPEG (default 256)")
    ap.add_argument("--bin-dir", default=default_bin_dir(), help=BIN_DIR_HELP)
    ap.add_argument("--stage-memory", default="2GiB", help="the stage's --memory-budget (default 2GiB)")
    ap.add_argument("--stage-arg", action="append", default=[], help="extra argument for sluice-stage (repeatable)")
    ap.add_argument("--json", action="store_true", help="end stdout with one JSON object of the results")
    return ap


# -- (a) hot, one consumer ----------------------------------------------------------


def _warm(ds: BenchDataset) -> None:
    for path in ds.paths():
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass


def _hot_epoch(stage: StageProcess, client: Client, epoch: int, batch: int, seed: int) -> tuple:
    ds = client.dataset("bench")
    cpu0, t0 = stage.cpu_seconds(), time.perf_counter()
    n = nbytes = 0
    with ds.epoch(epoch, seed=seed, batch=batch) as it:
        for _name, data in it:
            n += 1
            nbytes += len(data)
    return n, nbytes, time.perf_counter() - t0, stage.cpu_seconds() - cpu0


def run_hot(args, binary: str) -> List[dict]:
    out = []
    for size_text in args.hot_sizes.split(","):
        size = parse_bytes(size_text.strip())
        files = max(64, parse_bytes(args.hot_bytes) // size)
        ds = prepare(os.path.join(os.path.dirname(args.dir) or ".", f"hot-{files}x{format_bytes(size)}"),
                     files, size, 0, log=log)
        _warm(ds)
        runs: Dict[str, List[tuple]] = {"socket": [], "shm": []}
        with stage_session(binary, ds, args.stage_memory, args.stage_arg) as session:
            stage = session.stage
            clients = {path: Client(stage.socket, job=f"hot-{path}", shared_memory=(path == "shm"))
                       for path in runs}
            if not clients["shm"].shared_memory:
                raise SystemExit("error: the stage did not grant shared memory (is it started with "
                                 "--shared-memory false, or is this not Linux?)")
            epoch = 0
            for path, c in clients.items():  # the untimed warm-up epoch
                _hot_epoch(stage, c, epoch, args.batch, args.seed)
            for round_ in range(args.repeat):
                epoch += 1
                for path, c in clients.items():
                    got = [_hot_epoch(stage, c, epoch * 100 + e, args.batch, args.seed)
                           for e in range(args.hot_epochs)]
                    n, nbytes, wall, cpu = (sum(x[i] for x in got) for i in range(4))
                    runs[path].append((n / wall, nbytes / wall / GiB, cpu / (nbytes / GiB)))
                    log(f"  hot {format_bytes(size)} {path}: {n / wall:,.0f} samples/s, "
                        f"{nbytes / wall / GiB:.2f} GiB/s, stage {cpu / (nbytes / GiB):.3f} s/GiB")
            for c in clients.values():
                c.close()
        for path, rs in runs.items():
            mid = sorted(rs)[(len(rs) - 1) // 2]
            out.append({"size": size, "path": path, "samples_per_s": round(mid[0], 1),
                        "gib_per_s": round(mid[1], 3), "stage_cpu_s_per_gib": round(mid[2], 3),
                        "runs": [round(r[0], 1) for r in rs]})
    return out


# -- (b), (c) PyTorch DataLoaders, cold ------------------------------------------------


class DirDataset:
    """The plain-directory baseline: item ``i`` is ``(name, uint8 tensor)``
    read with one ``readinto``, then ``transform``."""

    def __init__(self, ds: BenchDataset, transform: Optional[Callable] = None) -> None:
        self.paths = ds.paths()
        self.names = [os.path.relpath(p, ds.root) for p in self.paths]
        self.sizes = [os.path.getsize(p) for p in self.paths]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch

        t = torch.empty(self.sizes[i], dtype=torch.uint8)
        with open(self.paths[i], "rb", buffering=0) as f:
            f.readinto(memoryview(t.numpy()))
        return self.names[i], t if self.transform is None else self.transform(t)


def decode_jpeg(sample):
    """The CPU-heavy transform: a JPEG (``uint8`` tensor) to an RGB image
    tensor, with Pillow."""
    import numpy
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(sample.numpy())) as img:
        return torch.from_numpy(numpy.asarray(img.convert("RGB")))


def prepare_jpegs(root: str, files: int, side: int) -> BenchDataset:
    """Writes (once) ``files`` JPEG images of ``side`` x ``side`` pixels
    under ``root``/data, each different; returns the data set."""
    data = os.path.join(root, "data")
    marker = os.path.join(root, "complete")
    if not os.path.exists(marker):
        import numpy
        from PIL import Image

        log(f"writing {files} JPEG files ({side}x{side}) into {data} ...")
        rng = numpy.random.default_rng(7)
        os.makedirs(data, exist_ok=True)
        base = rng.integers(0, 255, (side, side, 3), dtype=numpy.uint8)
        for i in range(files):
            d = os.path.join(data, f"{i // 1000:03d}")
            os.makedirs(d, exist_ok=True)
            pixels = numpy.roll(base, i, axis=(0, 1)) ^ numpy.uint8(i % 251)
            Image.fromarray(pixels).save(os.path.join(d, f"{i:07d}.jpg"), quality=90)
        open(marker, "w").close()
    names = sorted((os.path.relpath(os.path.join(d, f), data).replace(os.sep, "/")
                    for d, _, fs in os.walk(data) for f in fs), key=str.encode)
    sizes = [os.path.getsize(os.path.join(data, n)) for n in names]
    return BenchDataset(root, data, len(names), sum(sizes) // max(1, len(names)), 0, names, sizes)


def loader_epoch(kind: str, workers: int, ds: BenchDataset, stage: Optional[StageProcess], epoch: int,
                 seed: int, batch: int, transform: Optional[Callable] = None, mount: Optional[str] = None,
                 store: Optional[BenchDataset] = None) -> float:
    """One cold epoch of ``kind`` through a DataLoader; returns samples/s.

    ``dataloader-dir`` reads ``store`` (default ``ds``: where the files are,
    perhaps behind a latency harness) in the epoch's shuffle;
    ``dataloader-mount`` reads the same files through the stage's ``mount``
    (as job ``MOUNT_JOB``) in that shuffle, ``dataloader-mount-sampler``
    through the mount with ``MountSampler``; ``sluice-map`` and
    ``sluice-iterable`` are the socket client's datasets."""
    import warnings

    from torch.utils.data import DataLoader

    # More workers than cores is the point of some rows, not a mistake.
    warnings.filterwarnings("ignore", message="This DataLoader will create")

    from ..torch import MountSampler, SluiceDataset, SluiceIterableDataset, SluiceSampler, collate

    store = store or ds
    evict(ds.paths())  # (a latency harness keeps no pages of its own)
    through = ds._replace(root=os.path.join(mount, f"@{MOUNT_JOB}", "bench")) if mount else None
    if kind.startswith("dataloader-mount"):
        evict(through.paths())  # the mount's own page cache
    order = splan.permutation(ds.files, seed, epoch, True)
    t0 = time.perf_counter()
    sampler = dataset = None
    if kind == "dataloader-mount-sampler":
        loader_ds = DirDataset(through, transform)
        sampler = MountSampler(loader_ds.paths, stage.socket, seed=seed)
        sampler.set_epoch(epoch)
        loader = DataLoader(loader_ds, batch_size=batch, sampler=sampler, num_workers=workers)
    elif kind in ("dataloader-dir", "dataloader-mount"):
        loader = DataLoader(DirDataset(through if kind == "dataloader-mount" else store, transform),
                            batch_size=batch, sampler=order, num_workers=workers)
    elif kind == "sluice-map":
        dataset = SluiceDataset(stage.socket, "bench", job="torch-map", transform=transform)
        sampler = SluiceSampler(dataset, seed=seed)
        sampler.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                            collate_fn=collate)
    elif kind == "sluice-iterable":
        dataset = SluiceIterableDataset(stage.socket, "bench", job="torch-iter", seed=seed,
                                        batch=batch, transform=transform)
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=batch, num_workers=workers, collate_fn=collate)
    else:
        raise ValueError(f"unknown loader {kind!r}")
    n = 0
    for names, _samples in loader:
        n += len(names)
    wall = time.perf_counter() - t0
    if sampler is not None:
        sampler.close()
    if dataset is not None:
        dataset.close()
    if n != ds.files:
        raise SystemExit(f"error: {kind} with {workers} workers delivered {n} of {ds.files} samples")
    return n / wall


def run_torch(args, binary: str, ds: BenchDataset, transform_name: str,
              transform: Optional[Callable]) -> List[dict]:
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    runs: Dict[tuple, List[float]] = {}
    epoch = 0
    with stage_session(binary, ds, args.stage_memory, args.stage_arg) as session:
        stage = session.stage
        for round_ in range(args.repeat):
            for w in workers:
                for kind in LOADERS:
                    epoch += 1
                    rate = loader_epoch(kind, w, ds, stage, epoch, args.seed, args.batch, transform)
                    runs.setdefault((kind, w), []).append(rate)
                    log(f"  {transform_name} {kind} workers={w}: {rate:,.0f} samples/s")
    return [{"loader": kind, "workers": w, "transform": transform_name,
             "samples_per_s": round(statistics.median(rates), 1), "runs": [round(r, 1) for r in rates]}
            for (kind, w), rates in runs.items()]


# -- output ---------------------------------------------------------------------------


def format_tables(hot: List[dict], torch_rows: List[dict]) -> str:
    lines = []
    if hot:
        lines.append(f"{'hot':6} {'path':7} {'samples/s':>10} {'GiB/s':>7} {'stage s/GiB':>12}  vs socket")
        by_size: Dict[int, Dict[str, dict]] = {}
        for r in hot:
            by_size.setdefault(r["size"], {})[r["path"]] = r
        for size, rows in by_size.items():
            for path in ("socket", "shm"):
                r = rows.get(path)
                if r is None:
                    continue
                ratio = "" if "socket" not in rows else f"{r['samples_per_s'] / rows['socket']['samples_per_s']:.2f}x"
                lines.append(f"{format_bytes(size):6} {path:7} {r['samples_per_s']:10,.0f} {r['gib_per_s']:7.2f} "
                             f"{r['stage_cpu_s_per_gib']:12.3f}  {ratio}")
    if torch_rows:
        lines.append("")
        lines.append(f"{'transform':9} {'loader':16} {'workers':>7} {'samples/s':>10}  vs dataloader-dir")
        base = {(r["transform"], r["workers"]): r["samples_per_s"] for r in torch_rows
                if r["loader"] == "dataloader-dir"}
        for r in torch_rows:
            b = base.get((r["transform"], r["workers"]))
            ratio = "" if not b else f"{r['samples_per_s'] / b:.2f}x"
            lines.append(f"{r['transform']:9} {r['loader']:16} {r['workers']:7} {r['samples_per_s']:10,.0f}  {ratio}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        raise SystemExit(f"error: unknown part(s) {', '.join(sorted(unknown)) or '(none given)'}; "
                         f"choose from {', '.join(PARTS)}")
    if args.repeat < 1 or args.hot_epochs < 1:
        raise SystemExit("error: --repeat and --hot-epochs must be >= 1")
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"error: --workers must list worker counts >= 0, not {args.workers!r}") from None
    try:
        hot_sizes = [parse_bytes(x) for x in args.hot_sizes.split(",")]
        hot_bytes = parse_bytes(args.hot_bytes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not workers or min(workers) < 0:
        raise SystemExit("error: --workers must list worker counts >= 0")
    if min(hot_sizes) < 1 or hot_bytes < 1:
        raise SystemExit("error: --hot-sizes and --hot-bytes must be at least 1 byte")
    if "decode" in parts and (args.jpeg_files < 1 or args.jpeg_side < 8):
        raise SystemExit("error: --jpeg-files must be >= 1 and --jpeg-side >= 8")
    binary = stage_binary_or_exit(args.bin_dir)
    dataset_options(args)  # checked up front, written only for the part that reads it
    hot, torch_rows = [], []
    if "hot" in parts:
        log("hot: socket vs shared memory ...")
        hot = run_hot(args, binary)
    if "torch" in parts or "decode" in parts:
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"error: the torch and decode parts need torch: {e}") from None
    if "torch" in parts:
        ds = load_dataset(args)
        log(f"torch, cold: {ds.files} files of {format_bytes(ds.size)} ...")
        torch_rows += run_torch(args, binary, ds, "none", None)
    if "decode" in parts:
        jpegs = prepare_jpegs(os.path.join(os.path.dirname(args.dir) or ".",
                                           f"jpeg-{args.jpeg_files}x{args.jpeg_side}"),
                              args.jpeg_files, args.jpeg_side)
        log(f"decode, cold: {jpegs.files} JPEG files ...")
        torch_rows += run_torch(args, binary, jpegs, "decode", decode_jpeg)
    print(format_tables(hot, torch_rows))
    if args.json:
        print(json.dumps({"hot": hot, "torch": torch_rows}))
    return 0
