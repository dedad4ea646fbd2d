"""``python -m sluice.bench train``: a real training loop fed four ways, and
how busy each keeps the accelerator (AU).

A torchvision model (``--model``, ResNet-50 by default) trains on JPEG
images in a torchvision ``ImageFolder`` tree (``--files`` images of
``--side`` pixels square, ``--classes`` class folders, written once):
each step moves a batch to the device, normalises it there, runs forward
and backward (bf16 autocast, channels-last on CUDA) and an SGD step, and
waits for the device to finish. The ``DataLoader``'s ``--workers`` decode
each JPEG with Pillow, resize a random part of it to a ``--crop`` square
and flip it half the time, as an ImageNet pipeline does. The loaders:

- ``dataloader-dir``: an unmodified ``ImageFolder`` on the plain directory
  (behind ``sluice-slowfs`` with ``--latency``, the same store the stage
  reads), the epoch's shuffle as its sampler;
- ``dataloader-mount``: the same ``ImageFolder`` through the stage's mount,
  the same shuffle (no order given to the stage);
- ``dataloader-mount-sampler``: through the mount with
  ``sluice.torch.MountSampler`` (the stage knows the epoch's order);
- ``socket``: ``SluiceDataset`` + ``SluiceSampler``, the same decode and
  crop as its transform.

Before each epoch every file is evicted from the page cache (the store's
and the mount's): every epoch is cold. Rounds (``--repeat``) run every
loader in turn and report each one's median epoch. Per epoch: samples/s,
the time the loop waited for data, and AU: the share of the epoch's wall
time spent in training steps (the DLIO benchmark's definition, with real
steps instead of emulated ones). ``ceiling`` is the step rate on one batch
held on the device (no loading at all): the most any loader can reach.

With ``--json`` stdout ends with one object in the shape of ``prefetch``'s:
``{"dataset", "model", "device", "batch", "storage", "ceiling_samples_per_s",
"results": [{"loader", "workers", "samples_per_s", "au", "wait_s", "runs"}]}``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
import time
from typing import Dict, List, Optional

from .. import plan as splan
from .common import add_loader_args, loader_options, log, output_dir, stage_binary_or_exit, stage_session
from .dataset import BenchDataset, evict
from .harness import HarnessError
from .prefetch import median_of_rounds
from .storage import open_storage
from .units import format_bytes

LOADERS = ("dataloader-dir", "dataloader-mount", "dataloader-mount-sampler", "socket")
MODELS = ("resnet50", "resnet18", "small")
#: The job the mount loaders' paths name (``MOUNT/@<job>/bench/...``).
MOUNT_JOB = "train-mount"
# ImageNet's channel means and deviations, on the 0-255 scale.
_MEAN = (123.675, 116.28, 103.53)
_STD = (58.395, 57.12, 57.375)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sluice.bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10000, help="JPEG images (default 10000)")
    ap.add_argument("--side", type=int, default=384, help="width and height of each image (default 384)")
    ap.add_argument("--crop", type=int, default=224, help="side of the random crop trained on (default 224)")
    ap.add_argument("--classes", type=int, default=100, help="class folders (default 100)")
    ap.add_argument("--dir", default=None, help="where the images live (default bench-out/train-<files>x<side>)")
    ap.add_argument("--model", default="resnet50", choices=MODELS, help="what trains (default resnet50)")
    ap.add_argument("--device", default="auto", help="torch device: auto (cuda when there is one), cuda, cpu")
    ap.add_argument("--batch", type=int, default=128, help="samples per step (default 128)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    add_loader_args(ap, LOADERS, "8")
    return ap


# -- the images ------------------------------------------------------------------------


def _write_images(args) -> None:
    root, first, count, side, classes = args
    import numpy
    from PIL import Image

    for i in range(first, first + count):
        rng = numpy.random.default_rng(i)
        # Colour blocks with grain, each image different: at 384 pixels
        # square about 100 KiB, ImageNet's mean file size.
        coarse = rng.integers(0, 256, (side // 16 + 1, side // 16 + 1, 3), dtype=numpy.uint8)
        pixels = numpy.kron(coarse, numpy.ones((16, 16, 1), dtype=numpy.uint8))[:side, :side]
        grain = rng.integers(-80, 81, (side, side, 3), dtype=numpy.int16)
        pixels = numpy.clip(pixels.astype(numpy.int16) + grain, 0, 255).astype(numpy.uint8)
        path = os.path.join(root, "train", f"c{i % classes:03d}", f"{i:07d}.jpg")
        Image.fromarray(pixels).save(path, quality=90)


def prepare_images(dir: str, files: int, side: int, classes: int) -> BenchDataset:
    """Writes (once, in parallel) ``files`` JPEG images in ``classes`` class
    folders under ``dir``/data-FILES-SIDE-CLASSES/train (one tree per shape,
    so another shape never mixes with it); returns the data set."""
    import multiprocessing

    root = os.path.join(dir, f"data-{files}-{side}-{classes}")
    marker = os.path.join(dir, f"complete-{files}-{side}-{classes}")
    if not os.path.exists(marker):
        log(f"writing {files} JPEG images ({side}x{side}, {classes} classes) into {root} ...")
        shutil.rmtree(root, ignore_errors=True)
        for c in range(classes):
            os.makedirs(os.path.join(root, "train", f"c{c:03d}"), exist_ok=True)
        chunk = 250
        jobs = [(root, first, min(chunk, files - first), side, classes) for first in range(0, files, chunk)]
        with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
            pool.map(_write_images, jobs)
        open(marker, "w").close()
    names = sorted((os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                    for d, _, fs in os.walk(os.path.join(root, "train")) for f in fs), key=str.encode)
    if len(names) != files:
        raise SystemExit(f"error: {root} holds {len(names)} files, not {files}: remove {dir} and run again")
    sizes = [os.path.getsize(os.path.join(root, n)) for n in names]
    return BenchDataset(dir, root, files, sum(sizes) // files, 0, names, sizes)


class Augment:
    """The workers' CPU work: a PIL image (or a JPEG as a ``uint8`` tensor,
    decoded first) to a random part resized to a ``crop`` square, flipped
    half the time, as a ``uint8`` CHW tensor (ImageNet's training
    augmentation; normalising happens on the device)."""

    def __init__(self, crop: int) -> None:
        from torchvision import transforms

        self.crop = crop
        self.pipeline = transforms.Compose([transforms.RandomResizedCrop(crop), transforms.RandomHorizontalFlip(),
                                            transforms.PILToTensor()])

    def __call__(self, image):
        from PIL import Image

        if not isinstance(image, Image.Image):
            with Image.open(io.BytesIO(image.numpy())) as img:
                image = img.convert("RGB")
        return self.pipeline(image)


# -- the training step ------------------------------------------------------------------


def _model(name: str, classes: int):
    """A torchvision ResNet, or ``small``: two convolutions, for trying the
    benchmark out on a CPU."""
    import torchvision
    from torch import nn

    if name == "small":
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))
    return getattr(torchvision.models, name)(num_classes=classes)


class Trainer:
    """One training step on ``device``: ``step(images, labels)`` returns once
    the device has finished it."""

    def __init__(self, model: str, classes: int, device: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.backends.cudnn.benchmark = True
        self.memory_format = torch.channels_last if self.cuda else torch.contiguous_format
        self.model = _model(model, classes).to(self.device, memory_format=self.memory_format)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor(_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(_STD, device=self.device).view(1, 3, 1, 1)

    def step(self, images, labels) -> None:
        torch = self.torch
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        x = ((images.float() - self.mean) / self.std).contiguous(memory_format=self.memory_format)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = torch.nn.functional.cross_entropy(self.model(x), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def ceiling(self, batch: int, last: int, crop: int, classes: int, warmup: int = 10, steps: int = 30) -> float:
        """Samples/s of steps on one batch already on the device, after
        warming up on batches of ``batch`` and of ``last`` samples (an
        epoch's last batch: a shape of its own, which cuDNN would
        otherwise tune for inside the first epoch timed)."""
        torch = self.torch

        def batch_of(n: int):
            return (torch.randint(0, 256, (n, 3, crop, crop), dtype=torch.uint8, device=self.device),
                    torch.randint(0, classes, (n,), device=self.device))

        if last:
            for _ in range(3):
                self.step(*batch_of(last))
        images, labels = batch_of(batch)
        for _ in range(warmup):
            self.step(images, labels)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(images, labels)
        return steps * batch / (time.perf_counter() - t0)


# -- one epoch of a loader ----------------------------------------------------------------


def _class_of(name: str) -> str:
    return name.rsplit("/", 2)[-2]


def _loader(kind: str, workers: int, args, ds: BenchDataset, store: BenchDataset, stage, mount: Optional[str],
            epoch: int, augment: Augment, pin: bool):
    """(loader, labels-of-batch, things to close) for one epoch of ``kind``."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from ..torch import MountSampler, SluiceDataset, SluiceSampler, collate

    options = dict(batch_size=args.batch, num_workers=workers, pin_memory=pin, drop_last=False)
    if kind == "socket":
        dataset = SluiceDataset(stage.socket, "bench", job="train-socket", transform=augment)
        sampler = SluiceSampler(dataset, seed=args.seed)
        sampler.set_epoch(epoch)
        classes = sorted({_class_of(n) for n in ds.names})
        index = {c: i for i, c in enumerate(classes)}

        def labels(batch):
            names, images = batch
            return images, torch.tensor([index[_class_of(n)] for n in names])

        return DataLoader(dataset, sampler=sampler, collate_fn=collate, **options), labels, [sampler, dataset]
    root = os.path.join(mount, f"@{MOUNT_JOB}", "bench") if kind.startswith("dataloader-mount") else store.root
    folder = ImageFolder(os.path.join(root, "train"), transform=augment)
    if len(folder) != ds.files:
        raise SystemExit(f"error: ImageFolder found {len(folder)} images under {root}, expected {ds.files}")
    if kind == "dataloader-mount-sampler":
        sampler = MountSampler([p for p, _ in folder.samples], stage.socket, seed=args.seed)
        sampler.set_epoch(epoch)
        closing = [sampler]
    else:
        sampler = splan.permutation(ds.files, args.seed, epoch, True)
        closing = []
    return DataLoader(folder, sampler=sampler, **options), tuple, closing


def train_epoch(kind: str, workers: int, args, ds: BenchDataset, store: BenchDataset, stage,
                mount: Optional[str], epoch: int, trainer: Trainer, augment: Augment) -> dict:
    """One cold epoch of ``kind`` feeding ``trainer``."""
    import warnings

    # More workers than cores is the point of some rows, not a mistake.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    evict(ds.paths())  # (a latency harness keeps no pages of its own)
    if mount:
        evict(os.path.join(mount, f"@{MOUNT_JOB}", "bench", n) for n in ds.names)
    t0 = time.perf_counter()
    loader, labels_of, closing = _loader(kind, workers, args, ds, store, stage, mount, epoch, augment,
                                         trainer.cuda)
    n = 0
    wait = steps = 0.0
    it = iter(loader)
    while True:
        a = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        b = time.perf_counter()
        images, labels = labels_of(batch)
        trainer.step(images, labels)
        wait += b - a
        steps += time.perf_counter() - b
        n += len(labels)
    wall = time.perf_counter() - t0
    for c in closing:
        c.close()
    if n != ds.files:
        raise SystemExit(f"error: {kind} with {workers} workers delivered {n} of {ds.files} images")
    return {"loader": kind, "workers": workers, "samples_per_s": n / wall, "au": steps / wall,
            "wait_s": wait, "wall_s": wall}


def run(args, binary: str, ds: BenchDataset, store: BenchDataset, stage_args: List[str], loaders: List[str],
        workers: List[int], trainer: Trainer, augment: Augment) -> List[dict]:
    runs: List[dict] = []
    epoch = 0
    with tempfile.TemporaryDirectory(prefix="sluice-train-") as tmp:
        # Only the mount loaders need FUSE.
        mount = tmp if any(kind.startswith("dataloader-mount") for kind in loaders) else None
        mount_args = ["--mount", mount] if mount else []
        with stage_session(binary, store, args.stage_memory, [*stage_args, *mount_args]) as session:
            for round_ in range(args.repeat):
                for w in workers:
                    for kind in loaders:
                        epoch += 1
                        r = train_epoch(kind, w, args, ds, store, session.stage, mount, epoch, trainer, augment)
                        runs.append(r)
                        log(f"  {kind} workers={w}: {r['samples_per_s']:,.0f} samples/s, AU {r['au']:.1%}, "
                            f"waited {r['wait_s']:.1f} of {r['wall_s']:.1f} s (round {round_ + 1})")
    results = median_of_rounds(runs)
    for r in results:
        for key, digits in (("samples_per_s", 1), ("au", 4), ("wait_s", 2), ("wall_s", 2)):
            r[key] = round(r[key], digits)
    return results


def format_table(results: List[dict], ceiling: float) -> str:
    lines = [f"{'loader':26} {'workers':>7} {'samples/s':>10} {'AU':>7} {'waited s':>9}  vs dataloader-dir",
             f"{'ceiling (no loading)':26} {'':>7} {ceiling:10,.0f}"]
    base: Dict[int, float] = {r["workers"]: r["samples_per_s"] for r in results if r["loader"] == "dataloader-dir"}
    for r in results:
        b = base.get(r["workers"])
        ratio = f"{r['samples_per_s'] / b:.2f}x" if b else ""
        lines.append(f"{r['loader']:26} {r['workers']:7} {r['samples_per_s']:10,.0f} {r['au']:7.1%} "
                     f"{r['wait_s']:9.1f}  {ratio:>16}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    loaders, workers, latency_ms = loader_options(args, LOADERS)
    if args.repeat < 1 or args.files < 1 or args.batch < 1 or args.classes < 1:
        raise SystemExit("error: --repeat, --files, --batch and --classes must be >= 1")
    if not 0 < args.crop <= args.side:
        raise SystemExit("error: --crop must be between 1 and --side")
    if args.classes > args.files:
        raise SystemExit(f"error: --classes {args.classes} is more than --files {args.files}: "
                         "every class folder needs an image")
    try:
        import torch
        import torchvision  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: the train benchmark needs torch, torchvision and Pillow: {e}") from None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise SystemExit(f"error: --device {args.device}: torch cannot use it here ({str(e).splitlines()[0]})") \
            from None
    binary = stage_binary_or_exit(args.bin_dir)
    images = output_dir(args.dir or os.path.join("bench-out", f"train-{args.files}x{args.side}"), "--dir")
    ds = prepare_images(images, args.files, args.side, args.classes)
    trainer = Trainer(args.model, args.classes, device)
    name = torch.cuda.get_device_name(trainer.device) if trainer.cuda else "cpu"
    ceiling = trainer.ceiling(args.batch, ds.files % args.batch, args.crop, args.classes)
    log(f"{args.model} on {name}: {ceiling:,.0f} samples/s with no loading")
    augment = Augment(args.crop)
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
    try:
        with open_storage("dir", args.latency, latency_ms, ds, args.bin_dir, repo) as storage:
            log(f"{ds.files} images of {format_bytes(ds.size)} on average, +{latency_ms:g} ms per operation ...")
            results = run(args, binary, ds, storage.view, [*storage.stage_args, *args.stage_arg], loaders,
                          workers, trainer, augment)
    except HarnessError as e:
        raise SystemExit(f"error: the slowfs harness: {e}") from None
    # The page cache is evicted before every epoch; a node cache given
    # with --stage-arg is not, which is what it is for.
    kept = ", the stage's node cache kept" if any(a.startswith("--cache-") for a in args.stage_arg) else ""
    print(f"{args.model} on {name}, batch {args.batch}, {ds.files} JPEG images of {format_bytes(ds.size)} "
          f"({args.side}px, crop {args.crop}), +{latency_ms:g} ms per storage operation, "
          f"page cache evicted before every epoch{kept}:")
    print(format_table(results, ceiling))
    if args.json:
        print(json.dumps({"dataset": ds.describe(), "model": args.model, "device": name, "batch": args.batch,
                          "storage": {"kind": "dir", "latency_ms": latency_ms},
                          "ceiling_samples_per_s": round(ceiling, 1), "results": results}))
    return 0
