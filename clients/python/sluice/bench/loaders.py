"""The emulated training loop and the loaders it is fed by.

Every loader yields batches (lists of sample bytes) in the same shuffled
order: the ``SHUFFLE`` plan of :mod:`sluice.plan` for ``(seed, epoch)``
over the files sorted by name, which is the order the stage delivers.
The loop takes a batch, then "computes" by sleeping, as DLIO emulates an
accelerator.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import resource
import time
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence

from .. import plan as splan
from ..client import DEFAULT_PREFETCH
from .common import stage_session
from .dataset import BenchDataset

__all__ = ["LoopResult", "train_loop", "run_naive", "run_threadpool", "run_torch", "run_sluice"]

Batches = Iterator[List[bytes]]


class LoopResult(NamedTuple):
    samples: int
    bytes: int
    wall_s: float
    stall_s: float
    compute_s: float
    cpu_s: float

    def as_dict(self) -> dict:
        wall = self.wall_s or 1e-9
        return {
            "samples_per_s": self.samples / wall,
            "mib_per_s": self.bytes / wall / 2**20,
            # DLIO / MLPerf Storage: accelerator utilisation = compute / wall.
            "au": self.compute_s / wall if self.compute_s > 0 else 0.0,
            "stall_s": self.stall_s,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "samples": self.samples,
            "bytes": self.bytes,
        }


def _cpu(children: bool) -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    t = ru.ru_utime + ru.ru_stime
    if children:
        rc = resource.getrusage(resource.RUSAGE_CHILDREN)
        t += rc.ru_utime + rc.ru_stime
    return t


def epoch_order(ds: BenchDataset, seed: int, epoch: int) -> List[int]:
    """Returns the file indices of one epoch, in the stage's plan order."""
    return splan.permutation(ds.files, seed, epoch, True)


def train_loop(make_batches: Callable[[int], Batches], epochs: int, compute_s: float,
               children_cpu: bool = False, extra_cpu: Optional[Callable[[], float]] = None) -> LoopResult:
    """Runs ``epochs`` epochs over ``make_batches(epoch)`` and measures them.

    Stall time is the time spent waiting for the next batch; compute time is
    the time actually spent in the per-batch sleep. CPU is this process's
    (threads included), plus reaped children's with ``children_cpu``, plus
    ``extra_cpu()``'s delta (the stage's).
    """
    samples = nbytes = 0
    stall = compute = 0.0
    cpu0 = _cpu(children_cpu)
    extra0 = extra_cpu() if extra_cpu else 0.0
    t0 = time.perf_counter()
    for epoch in range(epochs):
        batches = make_batches(epoch)
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            stall += time.perf_counter() - t
            if batch is None:
                break
            samples += len(batch)
            nbytes += sum(map(len, batch))
            if compute_s > 0:
                t = time.perf_counter()
                time.sleep(compute_s)
                compute += time.perf_counter() - t
    wall = time.perf_counter() - t0
    cpu = _cpu(children_cpu) - cpu0
    if extra_cpu:
        cpu += extra_cpu() - extra0
    return LoopResult(samples, nbytes, wall, stall, compute, cpu)


def _read(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _chunks(seq: Sequence, n: int) -> Iterator[list]:
    for i in range(0, len(seq), n):
        yield list(seq[i:i + n])


Read = Callable[[int], bytes]


def _file_reader(ds: BenchDataset) -> Read:
    paths = ds.paths()
    return lambda i: _read(paths[i])


def run_naive(ds: BenchDataset, batch: int, epochs: int, compute_s: float, seed: int,
              read: Optional[Read] = None) -> LoopResult:
    """The trainer reads each sample itself, one at a time (``read``: sample
    index -> bytes; default: the data set's files)."""
    read = read or _file_reader(ds)

    def batches(epoch: int) -> Batches:
        for idx in _chunks(epoch_order(ds, seed, epoch), batch):
            yield [read(i) for i in idx]

    return train_loop(batches, epochs, compute_s)


def run_threadpool(ds: BenchDataset, batch: int, epochs: int, compute_s: float, seed: int,
                   threads: int, read: Optional[Read] = None) -> LoopResult:
    """A hand-tuned read-ahead pool: ``threads`` readers keep a bounded window
    of futures (4 per thread, at least two batches) ahead of the loop."""
    read = read or _file_reader(ds)
    window = max(4 * threads, 2 * batch)

    def batches(epoch: int) -> Batches:
        order = epoch_order(ds, seed, epoch)
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="readahead") as pool:
            pending: collections.deque = collections.deque()
            it = iter(order)
            for i in itertools.islice(it, window):
                pending.append(pool.submit(read, i))
            while pending:
                out = []
                while pending and len(out) < batch:
                    out.append(pending.popleft().result())
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append(pool.submit(read, nxt))
                yield out

    return train_loop(batches, epochs, compute_s)


class _ReadDataset:
    """A map-style dataset reading whole samples (the plain PyTorch
    baseline: files, or objects through a plain S3 client)."""

    def __init__(self, read: Read, n: int) -> None:
        self.read = read
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        return self.read(i)


def _collate_list(batch: list) -> list:
    return batch


def run_torch(ds: BenchDataset, batch: int, epochs: int, compute_s: float, seed: int,
              workers: int, read: Optional[Read] = None) -> LoopResult:
    """``torch.utils.data.DataLoader`` with ``workers`` worker processes."""
    from torch.utils.data import DataLoader

    dataset = _ReadDataset(read or _file_reader(ds), ds.files)

    def batches(epoch: int) -> Batches:
        loader = DataLoader(dataset, batch_size=batch, sampler=epoch_order(ds, seed, epoch),
                            num_workers=workers, collate_fn=_collate_list)
        return iter(loader)

    # Workers are reaped when each epoch's iterator finishes, so their CPU
    # shows up in RUSAGE_CHILDREN within the loop.
    return train_loop(batches, epochs, compute_s, children_cpu=True)


class SluiceRun(NamedTuple):
    result: LoopResult
    peak_rss_bytes: int
    stage_cpu_s: float


def run_sluice(ds: BenchDataset, batch: int, epochs: int, compute_s: float, seed: int, binary: str,
               stage_memory: str, stage_args: Sequence[str], prefetch: int = DEFAULT_PREFETCH) -> SluiceRun:
    """Starts a stage serving the data set and reads each epoch's plan through it
    (``prefetch`` batches received ahead by the client's thread; 0: none)."""
    with stage_session(binary, ds, stage_memory, stage_args) as s:
        stage, dataset = s.stage, s.dataset

        def batches(epoch: int) -> Batches:
            with dataset.epoch(epoch, seed=seed, batch=batch, prefetch=prefetch) as it:
                while True:
                    out = [data for _name, data in itertools.islice(it, batch)]
                    if not out:
                        return
                    yield out

        stage_cpu0 = stage.cpu_seconds()
        result = train_loop(batches, epochs, compute_s, extra_cpu=stage.cpu_seconds)
        peak = stage.peak_rss_bytes()
        stage_cpu = stage.cpu_seconds() - stage_cpu0
    return SluiceRun(result, peak, stage_cpu)
