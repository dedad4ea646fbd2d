"""PyTorch adapters: read a sluice dataset through a ``DataLoader``.

Importing this module imports torch; ``import sluice`` alone does not.

Two ways to use it:

**Map-style** (works with any sampler, but pair it with
:class:`SluiceSampler` to get prefetching)::

    ds = SluiceDataset("/run/sluice/stage.sock", "imagenet", job="resnet50",
                       transform=decode)
    sampler = SluiceSampler(ds, seed=1234)          # ranks from torch.distributed
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=8)
    for epoch in range(90):
        sampler.set_epoch(epoch)                    # submits the epoch's plan
        for names, images in loader:
            ...

The sampler hands the stage this rank's plan for the epoch when the
``DataLoader`` starts iterating, so the stage prefetches in exactly the order
the workers will ask; each worker's whole-file ``READ`` of a planned file is
then served from the stage's buffer.

**Iterable**: each worker reads every ``num_workers``-th entry of the
rank's order as a plan of its own, so every entry comes exactly once::

    ds = SluiceIterableDataset("/run/sluice/stage.sock", "imagenet",
                               job="resnet50", seed=1234, transform=decode)
    loader = DataLoader(ds, batch_size=256, num_workers=8)
    for epoch in range(90):
        ds.set_epoch(epoch)
        for names, images in loader:
            ...

**Any file-reading dataset over the stage's mount** (``sluice-stage
--mount /mnt/sluice``; a torchvision ``ImageFolder``, say): pair it with
:class:`MountSampler`, over the paths of ``/mnt/sluice/@<job>/<dataset>/``,
so that the stage knows each epoch's order and the workers' opens are
served from its buffer, each file once::

    folder = ImageFolder("/mnt/sluice/@resnet50/imagenet/train")
    sampler = MountSampler([p for p, _ in folder.samples], "/run/sluice/stage.sock", seed=1234)
    loader = DataLoader(folder, batch_size=256, sampler=sampler, num_workers=8)
    for epoch in range(90):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            ...

Both sluice datasets yield ``(name, sample)`` pairs: ``sample`` is the file's
bytes as a ``torch.uint8`` tensor (``sample="tensor"``, the default), or
``transform(tensor)`` when a transform is given (``torchvision.io.decode_jpeg``
takes it as it is). The name lets a transform-free pipeline derive labels
from paths. The default collate turns a batch into ``[names, samples]``,
stacking the samples when they have one shape (fixed-size records, or a
transform that gives one shape); for raw files of different sizes pass
``collate_fn=sluice.torch.collate``, which keeps such a batch a list.
``sample="bytes"`` gives ``bytes`` instead (as before the tensors), and
``sample="memoryview"`` the client's own objects (in ``DataLoader`` workers
only with a ``transform`` or ``collate_fn`` that turns them into objects
that pickle: a worker cannot send a ``memoryview`` to the main process, and
PyTorch's loader then waits for that batch for ever).

On a stage on the same node, samples arrive in shared memory: a tensor is a
view of the job's region, with no copy through the socket (see
:mod:`sluice.shm` for how long it stays valid: as long as it is referred
to). In a ``DataLoader`` worker, the batch then reaches the main process
the way PyTorch hands any tensor over, in shared memory by descriptor, not
pickled. The map-style dataset reads each batch with one request
(``__getitems__``), the iterable one with one ``NEXT`` per ``batch``.

Every process (the main one and each ``DataLoader`` worker) opens its own
connection, lazily, on first use: datasets can be pickled and forked freely.
When the stage restarts (a rolling update), each connection waits for it
(``reconnect`` seconds, 60 by default) and goes on: the sampler submits its
plan again and the workers' reads are sent again, an iterable worker resumes
its plan at the first sample it had not received. No sample is lost or
delivered twice.
With ``persistent_workers=True`` a worker keeps the copy of an iterable
dataset it started with; the epoch ``set_epoch`` sets in the main process
reaches it all the same (it is kept in memory shared with the workers).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import re
import select
import socket
import sys
import threading
import time
import warnings
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch.distributed as _dist
import torch.utils.data as _data

import torch as _torch
from torch.utils.data import default_collate as _default_collate

from . import plan as _plan
from .client import DEFAULT_PREFETCH, STAGE_AWAY, Client, Dataset, _tries
from .errors import (
    BadPlanError,
    ConnectionClosedError,
    ErrorCode,
    PlanConflictError,
    SluiceError,
    UnavailableError,
    error_from_code,
)
from .iterator import AlreadyReadWarning, SupersededError
from .protocol import PlanState, integer

__all__ = ["SluiceDataset", "SluiceSampler", "SluiceIterableDataset", "MountSampler", "collate"]

#: What a sample is handed over as (``sample=``).
SAMPLE_TYPES = ("tensor", "bytes", "memoryview")


def _as_tensor(data, client: Client):
    """A ``uint8`` tensor over the sample's memory (a view of shared memory
    when it came that way; bytes from a frame are copied once, as a tensor
    must own writable memory). A view of shared memory remembers its slot
    and client, so that :func:`collate` can hand it to the main process."""
    if isinstance(data, memoryview):
        if not data.nbytes:
            return _torch.empty(0, dtype=_torch.uint8)
        tensor = _torch.frombuffer(data, dtype=_torch.uint8)
        if hasattr(data.obj, "handed"):
            # The sample's own region, not the client's current one: a
            # sample fetched before a reconnection (prefetched, or held by
            # the caller) is not in the new stage's region. The version
            # tells an unchanged sample from one a transform changed in
            # place (its pages are then this process's own copy).
            tensor._sluice_slot = (client, data.obj, data.obj.region, tensor._version)
        return tensor
    if not data:
        return _torch.empty(0, dtype=_torch.uint8)
    return _torch.frombuffer(bytearray(data), dtype=_torch.uint8)


def _as_bytes(data, _client=None):
    return bytes(data) if isinstance(data, memoryview) else data


_CONVERT = {"tensor": _as_tensor, "bytes": _as_bytes, "memoryview": lambda data, _client=None: data}


def _converter(sample: str):
    if sample not in _CONVERT:
        raise ValueError(f"sample must be one of {', '.join(SAMPLE_TYPES)}, got {sample!r}")
    return _CONVERT[sample]


def collate(batch):
    """``[names, samples]`` like the default collate, for a batch of
    ``(name, sample)`` pairs, with two differences:

    * samples of different shapes (raw files of different sizes) stay a
      list instead of failing to stack;
    * in a ``DataLoader`` worker, samples that are still the stage's shared
      memory (no transform replaced them) are not copied into a new
      shared-memory batch: they are handed to the main process by
      reference, and stacked there (one copy instead of two, and none of
      PyTorch's per-batch shared-memory setup in the worker).

    Anything else is collated as the default collate does."""
    names = [name for name, _ in batch]
    samples = [sample for _, sample in batch]
    if samples and _data.get_worker_info() is not None and all(map(_unchanged_slot, samples)):
        return [names, _SlotBatch(samples)]
    if samples and all(isinstance(s, _torch.Tensor) for s in samples) \
            and len({tuple(s.shape) for s in samples}) > 1:
        return [names, samples]
    if samples and _data.get_worker_info() is None and _plain_rows(samples):
        return [names, _stack(samples)]
    return [names, _default_collate(samples)]


def _unchanged_slot(sample) -> bool:
    """Whether ``sample`` is a tensor still viewing its stage slot as it
    came (no in-place change since: the main process would map the stage's
    bytes, not this process's changed copy)."""
    slot = getattr(sample, "_sluice_slot", None)
    return slot is not None and sample._version == slot[3]


class _SlotBatch:
    """A worker's batch of samples in the stage's shared memory, on its way
    to the main process. Pickling it (as the ``DataLoader`` does to send it)
    hands the slots to the job (``HAND_OFF``) and sends only where they
    are; unpickling it in the main process maps them through its own
    connection to the job and stacks them (a list when their sizes
    differ)."""

    def __init__(self, samples) -> None:
        self.samples = samples

    def __reduce__(self):
        client, _, region, _ = self.samples[0]._sluice_slot
        owners = [s._sluice_slot[1] for s in self.samples]
        same = all(s._sluice_slot[2] is region for s in self.samples)
        if region is None or not same or not client.hand_off(owners, region):
            # The stage went away since these samples came (or they span
            # two of its lives): nobody would return the slots the main
            # process maps, so send the bytes instead.
            return (_stack, ([s.clone() for s in self.samples],))
        slots = [(o.offset, s.numel()) for o, s in zip(owners, self.samples)]
        run = client._said_run or None
        return (_rebuild_batch, (client.address, client.job, client.labels, region.ident, slots, run))


#: Connections the main process opened to map samples handed to it and
#: say it received them, by (address, job, run); kept for the process's
#: life.
_mapping_clients: dict = {}


def _rebuild_batch(address, job: str, labels, ident, slots, run=None):
    """In the main process: the samples at ``slots`` of ``job``'s region
    ``ident`` (see :attr:`sluice.shm.Region.ident`), stacked (or a list when
    their sizes differ). ``run``: the worker's trainer run, which the stage
    holds the handed-off slots for until its last connection ends. They are
    received (``TAKE``) through this process's mapping connection of the
    job and run (see `_mapping_clients`), which its samples' slots are from
    then on."""
    from . import shm as _shm

    region = _shm.region_of(ident)
    key = (str(address), job, run)
    client = _mapping_clients.get(key)
    # A connection of this process (a forked child's inherited one is its
    # parent's) whose region this is.
    ours = client is not None and client._pid == os.getpid() and not client.closed
    mapped = ours and client._region is not None and client._region.ident == ident
    if not mapped and address is not None:
        if ours:
            # Not its region: a connection to a stage that restarted since
            # (it only sends returns, so it never noticed): open a new one.
            client.close()
        try:
            client = _mapping_clients[key] = Client(address, job=job, labels=labels, shared_memory=True,
                                                    run=run, _receipts=True)
        except STAGE_AWAY:
            if region is None:
                raise
            client = None
        region = _shm.region_of(ident)
    if region is None:
        raise RuntimeError(f"a DataLoader worker handed over samples of job {job!r} in a shared-memory "
                           "region this process cannot map (the stage restarted in between?)")
    # Received: the stage takes back only what no process received (the
    # batches a loader stopped early dropped unread). Where that cannot be
    # said, the samples are copied now, before it could take them back.
    received = client is not None and client._received(ident, [offset for offset, _ in slots])
    if len({n for _, n in slots}) == 1:
        # Copied straight from the region: no tensor per sample. The
        # owners give their slots back once the copy is made.
        n = slots[0][1]
        owners = [region.slot(offset, n) for offset, _ in slots] if n else []
        return _rows(len(slots), n, [ctypes.addressof(o) for o in owners])

    def sample(offset: int, n: int):
        view = region.view(offset, n)
        return _torch.frombuffer(view if received else bytearray(view), dtype=_torch.uint8)
    return [sample(offset, n) if n else _torch.empty(0, dtype=_torch.uint8) for offset, n in slots]


def _plain_rows(samples) -> bool:
    """Whether ``samples`` are all contiguous one-dimensional ``uint8``
    tensors in CPU memory (raw samples, as the datasets give them)."""
    return all(isinstance(s, _torch.Tensor) and s.dtype == _torch.uint8 and s.dim() == 1
               and s.device.type == "cpu" and s.is_contiguous() for s in samples)


def _stack(views):
    """One tensor of the samples when their sizes agree, else the list (raw
    samples are copied by :func:`_rows`)."""
    if len({v.numel() for v in views}) != 1:
        return views
    if not _plain_rows(views):
        return _torch.stack(views)
    n = views[0].numel()
    return _rows(len(views), n, [v.data_ptr() for v in views] if n else [])


def _rows(count: int, n: int, addresses) -> "_torch.Tensor":
    """A ``count`` x ``n`` ``uint8`` tensor of the ``n`` bytes at each of
    ``addresses``, copied with one ``memmove`` each on the calling thread:
    ``torch.stack`` would split a 100 KiB copy between torch's intra-op
    threads, which then spin for more work on every core and take them from
    the ``DataLoader``'s workers and the stage (in the main process the
    thread pool is the machine's size; workers use one thread)."""
    out = _torch.empty((count, n), dtype=_torch.uint8)
    base = out.data_ptr()
    for i, address in enumerate(addresses):
        ctypes.memmove(base + i * n, address, n)
    return out


#: How many indices a sampler yields between checks that its stage is
#: still there.
RECHECK_EVERY = 256


def _went_away(client: Optional[Client]) -> bool:
    """Whether the stage closed ``client``'s idle connection (it sends
    nothing unasked, so a readable socket that reads as end of file means
    it is gone)."""
    if client is None or client.closed:
        return client is not None
    try:
        ready, _, _ = select.select([client._sock], [], [], 0)
        return bool(ready) and client._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True


def _distributed_place(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """Returns (rank, world_size): the given values, else torch.distributed's,
    else (0, 1)."""
    if rank is None or world_size is None:
        initialized = _dist.is_available() and _dist.is_initialized()
        if world_size is None:
            world_size = _dist.get_world_size() if initialized else 1
        if rank is None:
            rank = _dist.get_rank() if initialized else 0
    rank, world_size = integer(rank, "rank"), integer(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


class _PerProcess:
    """A lazily opened connection + dataset handle, one per process.

    The connection is dropped when pickled, and reopened (not reused) after a
    fork, so a ``DataLoader`` worker never talks on its parent's socket.
    """

    def __init__(self, address, dataset: str, job: str, labels, rank: int, world_size: int,
                 timeout: Optional[float], reconnect: float = 60.0, runs: bool = False,
                 plans_per_loader: bool = False) -> None:
        self.address = address
        # Whether a DataLoader worker's plans name a run of each of its
        # iterations (see `new_reading`), not its trainer's.
        self.plans_per_loader = plans_per_loader and runs
        self._readings = 0
        # What the runs of this object's trainer processes derive from (see
        # `run`); pickled with the rest.
        self._nonce: Optional[bytes] = os.urandom(16) if runs else None
        self._run: Optional[Tuple[int, int]] = None  # (pid, run) of this process
        # The process (pid, start time) that pickled this copy, if one did
        # (a trainer handing it to a worker it spawns), and the process that
        # unpickled it (a worker forked from another holds a copy of its
        # parent's object, which may have been pickled by anyone).
        self._pickled_by: Optional[Tuple[int, bytes]] = None
        self._unpickled_in: Optional[int] = None
        self.dataset_name = dataset
        self.job = job
        self.labels = dict(labels or {})
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.reconnect = reconnect
        self._pid: Optional[int] = None
        self._client: Optional[Client] = None
        self._dataset: Optional[Dataset] = None
        # The listing this process's parent read: its digest, and its
        # length, which the sampler's indices range over.
        self.expected_digest: Optional[int] = None
        self.expected_count: Optional[int] = None

    def get(self, fresh: bool = False) -> Dataset:
        """This process's handle of the dataset, connecting when it has
        none. ``fresh`` (an epoch's start): a handle opened before is
        opened again, taking the stage's listing as it is now, as a worker
        started for the epoch would."""
        if fresh and self.opened_here():
            try:
                return self._take(self._client.dataset(self.dataset_name))
            except (ConnectionClosedError, UnavailableError):
                # The stage went away since (restarted between epochs):
                # connect again below, as a worker started now would.
                self._client.close()
                self._dataset = None
        if not self.opened_here():
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            def connect() -> Client:
                return Client(self.address, job=self.job, labels=self.labels, rank=self.rank,
                              world_size=self.world_size, timeout=self.timeout, reconnect=self.reconnect,
                              run=self.run, _receipts=True)
            # A stage this dataset has read from before (in this process or
            # its parent) that does not answer is restarting: a worker that
            # starts meanwhile waits for it as a connected client does.
            known = self.expected_digest is not None
            if _data.get_worker_info() is not None:
                _end_with_trainer(self._trainer())
            self._client = _connect_again(connect, self.reconnect) if known else connect()
            self._pid = os.getpid()
            self._take(self._client.dataset(self.dataset_name))
        return self._dataset

    def opened_here(self) -> bool:
        """Whether this process holds an open handle of the dataset."""
        return self._dataset is not None and self._pid == os.getpid() and not self._client.closed

    def _take(self, ds: Dataset) -> Dataset:
        # A listing of another length makes the sampler's indices name
        # other files, or none. One of the same length (a sample
        # rewritten, a file replaced) is the one the stage plans over
        # too: an index names the same file here and in its plan.
        if self.expected_count is not None and ds.file_count != self.expected_count:
            self._client.close()
            self._dataset = None
            raise error_from_code(
                ErrorCode.BAD_PLAN,
                f"dataset {self.dataset_name!r} on the stage has {ds.file_count} files now, "
                f"{self.expected_count} when it was first listed (files were added or removed); "
                "the sampler's indices would name other files, so rebuild the dataset object")
        self.expected_digest = ds.digest
        self.expected_count = ds.file_count
        self._dataset = ds
        return ds

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = self._dataset = None

    def __del__(self) -> None:
        # Dropped with the object it serves (a notebook cell run again, a
        # `del`): the connection, and the plan and buffer it holds on the
        # stage, go now. The client and its dataset refer to each other,
        # so without this they lasted until Python's cycle collector ran.
        # Closed at once, not with BYE: that waits for the client's lock,
        # which the thread this runs on may hold (its prefetch thread).
        client = self.__dict__.get("_client")
        # At interpreter exit the prefetch threads are frozen, possibly
        # inside a read of the socket's file, which closing it would wait
        # for: the process's exit closes the connection.
        if sys.is_finalizing():
            return
        if client is not None and self.__dict__.get("_pid") == os.getpid():
            try:
                client._abort()
            except Exception:  # noqa: BLE001 - at interpreter exit
                pass

    @property
    def run(self) -> Optional[int]:
        """The run this process's plans belong to: one per trainer process
        (this process, or in a ``DataLoader`` worker its parent, the
        process that iterates the loader) and object, so that the workers
        of one trainer share their plans while a trainer restarted after a
        crash, even with the same object (forked, pickled, restored), is a
        new run. None for an object made without runs."""
        if self._nonce is None:
            return None
        pid = os.getpid()
        if self._run is None or self._run[0] != pid:
            self._run = (pid, _run_of(self._nonce, self._trainer()))
        return self._run[1]

    def new_reading(self) -> None:
        """In a ``DataLoader`` worker of an object that plans per reading:
        has the plans of this iteration of the loader name a run of their
        own, under the worker process and its count of iterations (a
        persistent worker serves many). A worker's plan is its share
        alone, so no other process need meet it; each iteration thus reads
        its epoch in full, as a plain ``DataLoader`` does, while the
        workers of an iteration abandoned mid-epoch still live (a notebook
        keeps the interrupted cell's traceback, and with it the iterator
        and its workers): joining their plans gave the new iteration what
        they had left, less the samples they held. (A run from the
        iteration's base seed would repeat under a seeded generator.)
        Nothing elsewhere; call it once the handle is open."""
        if not self.plans_per_loader or _data.get_worker_info() is None:
            return
        self._readings += 1
        run = _run_of(self._nonce + b"worker:%d:" % self._readings, os.getpid())
        self._client._plan_apart(run)

    def _trainer(self) -> int:
        """The trainer process: this one, or a ``DataLoader`` worker's."""
        pid = os.getpid()
        if _data.get_worker_info() is None:
            return pid
        return _trainer_of_worker(self._pickled_by if self._unpickled_in == pid else None)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_client"] = state["_dataset"] = state["_pid"] = state["_run"] = None
        pid = os.getpid()
        state["_pickled_by"] = (pid, _stat_fields(pid)[1])
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._unpickled_in = os.getpid()


#: The process that runs a trainer watch (see `_end_with_trainer`): a
#: worker forked from one inherits the variable, not the thread.
_watching_in: Optional[int] = None


def _end_with_trainer(trainer: int, every: float = 1.0) -> None:
    """Ends this ``DataLoader`` worker when its trainer process is gone.

    torch's own watchdog only looks between items, and a worker whose
    result pipe is full when its trainer is killed blocks on exit, joining
    the thread that writes to that pipe, for as long as a sibling worker
    holds its other end: for minutes, holding its stage connections, its
    plans and the samples lent to it. Nothing is left to hand results to,
    so the worker exits at once (its connections close with it, and the
    stage takes back what it held)."""
    global _watching_in
    me = os.getpid()
    if _watching_in == me:
        return
    _watching_in = me
    if trainer == me:
        return
    started = _stat_fields(trainer)[1]
    if not started:
        # Gone already (killed while its workers started), where the
        # process table can be read at all.
        if _stat_fields(me)[1]:
            os._exit(0)
        return

    # A worker whose parent is its trainer is handed to another parent the
    # moment the trainer exits, before anyone reaps it.
    parent = os.getppid()

    def watch() -> None:
        while _alive(trainer, started) and (trainer != parent or os.getppid() == parent):
            time.sleep(every)
        os._exit(0)

    threading.Thread(target=watch, name="sluice-trainer-watch", daemon=True).start()


def _alive(pid: int, started: bytes) -> bool:
    """Whether process ``pid`` is the one that started at ``started`` and
    has not ended (a zombie, not yet reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return False
    return len(fields) > 19 and fields[19] == started and fields[0] not in (b"Z", b"X")


def _stat_fields(pid: int) -> Tuple[Optional[int], bytes]:
    """Process ``pid``'s parent and start time (``(None, b"")`` when it is
    gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Fields 4 and 22, counted after the command name's closing
            # parenthesis.
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None, b""


def _trainer_of_worker(pickled_by: Optional[Tuple[int, bytes]]) -> int:
    """The trainer process of this ``DataLoader`` worker: the process that
    started it, as ``multiprocessing`` noted before the worker ran (its
    parent now may be another: a worker whose trainer was killed while it
    started is handed to init, which never ends, and was left running for
    good). Without that note, its parent (``fork``, ``spawn``), or, under
    ``forkserver``, whose server forks the workers, its grandparent,
    recognised as the process that pickled the worker's copy of the
    dataset for it (``pickled_by``; None for a copy inherited by fork)."""
    started_by = multiprocessing.parent_process()
    if started_by is not None and started_by.pid:
        return started_by.pid
    parent = os.getppid()
    if pickled_by is not None and pickled_by[0] != parent:
        grandparent = _stat_fields(parent)[0]
        if grandparent is not None and pickled_by == (grandparent, _stat_fields(grandparent)[1]):
            return grandparent
    return parent


def _shared_epoch():
    """An epoch number in memory shared with the processes started from
    this one (inherited by a fork, handed to a spawned process with the
    object), or None where no shared memory can be made."""
    try:
        return multiprocessing.RawValue(ctypes.c_uint64, 0)
    except OSError:
        return None


def _run_of(nonce: bytes, pid: int) -> int:
    """The run (see :class:`sluice.Client`) of the trainer process ``pid``
    for an object's ``nonce``: derived from the process's id and start
    time, so a reused pid is another run."""
    started = _stat_fields(pid)[1]
    digest = hashlib.blake2b(nonce + b"%d:" % pid + started, digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def _connect_again(connect: Callable[[], Client], reconnect: float) -> Client:
    """``connect()``, tried again for ``reconnect`` seconds while the stage
    is away, with a connected client's backoff."""
    for _ in _tries(reconnect):
        try:
            return connect()
        except STAGE_AWAY as e:
            last = e
    raise last


def _apply(transform: Optional[Callable], convert, client: Client, name: str, data):
    data = convert(data, client)
    return (name, data if transform is None else transform(data))


class SluiceDataset(_data.Dataset):
    """A map-style dataset over the stage's file list.

    Item ``i`` is ``(name, sample)`` for the file with index ``i`` (files
    sorted by name bytes, as the stage lists them), where ``sample`` is the
    file's bytes as ``sample`` says, or ``transform`` of them. ``len()`` is
    the file count. A ``DataLoader`` batch is read with one request
    (``__getitems__``); the files its sampler planned come from the
    stage's prefetch buffer.

    Args:
        address: the stage's address (see :func:`sluice.parse_address`).
        dataset: the dataset name the stage serves.
        job: the job name; use the same one for the sampler and every rank.
        labels: job labels for the stage's policies.
        transform: applied to each sample (in the worker that reads it).
        timeout: per-operation socket timeout in seconds (None: no limit).
        sample: ``"tensor"`` (a ``torch.uint8`` tensor, the default),
            ``"bytes"`` or ``"memoryview"``.
        reconnect: seconds each process keeps trying to reach its stage
            again after losing it (see :class:`sluice.Client`): a restarted
            stage costs the epoch a wait, not an error.

    Connects once in the constructor (to learn the file count) and then once
    per process that reads.
    """

    def __init__(self, address, dataset: str, job: str, labels: Optional[Mapping[str, str]] = None,
                 transform: Optional[Callable[[object], object]] = None,
                 timeout: Optional[float] = None, sample: str = "tensor", reconnect: float = 60.0) -> None:
        self.address = address
        self.dataset = dataset
        self.job = job
        self.labels = dict(labels or {})
        self.transform = transform
        self.timeout = timeout
        self.sample = sample
        self._convert = _converter(sample)
        self.reconnect = reconnect
        # Its reads name the trainer's run, which its sampler's plans share
        # (see SluiceSampler): they deliver that run's entries only.
        self._conn = _PerProcess(address, dataset, job, labels, 0, 1, timeout, reconnect, runs=True)
        ds = self._conn.get()
        self.file_count: int = ds.file_count
        self.total_bytes: int = ds.total_bytes
        self.digest: int = ds.digest

    def __len__(self) -> int:
        return self.file_count

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        """Reads a batch of items with one request (PyTorch's ``DataLoader``
        calls this for each batch)."""
        def names(ds: Dataset) -> List[str]:
            return [ds.files[i][0] for i in indices]

        ds = self._conn.get()
        try:
            got = ds.fetch(names(ds))
        except BadPlanError:
            # A worker kept from an earlier epoch (``persistent_workers``)
            # holds that epoch's listing, and the stage says the sampler
            # planned this one over a newer one: read by that (one of
            # another length raises BadPlanError saying so).
            fresh = self._conn.get(fresh=True)
            if fresh.digest == ds.digest:
                raise
            ds = fresh
            got = ds.fetch(names(ds))
        return [_apply(self.transform, self._convert, ds.client, name, data) for name, data in got]

    def name(self, index: int) -> str:
        """Returns the name of file ``index``."""
        return self._conn.get().files[index][0]

    def close(self) -> None:
        """Closes this process's connection (it reopens on next use)."""
        self._conn.close()


def _even_share(everything: List[int], rank: int, world_size: int, even: Optional[str]) -> List[int]:
    """Rank ``rank``'s share of an epoch's whole order ``everything``:
    every ``world_size``-th entry from ``rank``, then made as long as every
    other rank's as ``even`` says (see :class:`SluiceSampler`). The same
    shares as ``DistributedSampler``'s with ``drop_last`` true (``"drop"``)
    or false (``"pad"``)."""
    share = everything[rank::world_size]
    n = len(everything)
    extra = n % world_size
    if even is None or extra == 0:
        return share
    if even == "drop":
        return share[:n // world_size]
    # "pad": the padded order is the order followed by its own start, so
    # a rank without an entry in the last round takes one from there.
    return share + [everything[(rank - extra) % n]] if rank >= extra else share


def _even_length(n: int, rank: int, world_size: int, even: Optional[str]) -> int:
    """``len(_even_share(...))`` for an order of ``n`` entries."""
    if even == "drop":
        return n // world_size
    if even == "pad" and n:
        return -(-n // world_size)
    return n // world_size + (1 if rank < n % world_size else 0)


def _check_even(even: Optional[str]) -> Optional[str]:
    if even not in (None, "pad", "drop"):
        raise ValueError(f'even must be None, "pad" or "drop", got {even!r}')
    return even


class _PlanningSampler(_data.Sampler):
    """What the samplers that tell the stage an epoch's plan share: their
    own connection (``_conn``) and the plan it holds (``_plan``)."""

    _plan = None

    def close(self) -> None:
        """Closes the sampler's connection (the stage frees the plan's buffer)."""
        self._plan = None
        self._conn.close()

    def __getstate__(self) -> dict:
        # A copy (a checkpoint, a spawned process) keeps the settings and
        # the epoch, not this process's plan: it plans again when iterated.
        state = dict(self.__dict__)
        state["_plan"] = None
        return state


def _sampler_plan(submit):
    """A sampler's plan, from ``submit()``: the warning for an epoch its
    job already read in full says what it means for a sampler (its indices
    come all the same; their files are read, not prefetched), where the
    plan iterator's says that nothing comes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = submit()
    for w in caught:
        if issubclass(w.category, AlreadyReadWarning):
            client = plan.dataset.client
            warnings.warn(
                f"epoch {plan.epoch} of job {client.job!r} (shard {client.rank} of {client.world_size}) was "
                "already read in full by this job on this stage: the sampler yields its indices all the "
                "same and the dataset reads their files, but none is prefetched; to have an epoch "
                "prefetched, call set_epoch with a new epoch before each one (it reaches a sampler with "
                "persistent workers too) or use a new run", AlreadyReadWarning, stacklevel=4)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return plan


class SluiceSampler(_PlanningSampler):
    """Yields this rank's indices of an epoch and tells the stage the plan.

    Its iterator submits the epoch's ``SHUFFLE`` plan for ``(job, rank,
    epoch)`` and this process's run (see :class:`SluiceIterableDataset`)
    over the sampler's own connection when the first index is asked for
    (a ``DataLoader`` asks at once; one with workers and
    ``batch_size=None`` makes an iterator it never reads, which plans
    nothing), so the stage starts prefetching, and yields the same indices
    derived locally with :func:`sluice.plan.shuffle_plan` (a plan the
    stage refuses raises there; ``plan_state`` is that plan's state from
    then on). Call :meth:`set_epoch` before each
    epoch, as with ``DistributedSampler``: an epoch whose plan was already
    read in full is not prefetched again.

    ``rank`` and ``world_size`` default to torch.distributed's when it is
    initialized, else 0 and 1. ``len()`` is this rank's share.

    Shares differ by one sample when the data set's size is not a multiple
    of the world size, and each sample is read once per epoch. Under
    ``DistributedDataParallel``, where every rank must take the same number
    of steps, pass ``even``: ``"pad"`` gives the ranks short of one sample
    one of the epoch's first samples again (each rank gets
    ``ceil(n / world_size)``; ``DistributedSampler``'s default), ``"drop"``
    leaves the epoch's last ``n % world_size`` samples out (each rank gets
    ``n // world_size``; ``DistributedSampler(drop_last=True)``). Either
    yields exactly ``DistributedSampler``'s shares of this sampler's order.
    """

    def __init__(self, dataset: SluiceDataset, seed: int = 0, shuffle: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 even: Optional[str] = None) -> None:
        if not isinstance(dataset, SluiceDataset):
            raise TypeError(f"SluiceSampler needs a SluiceDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.seed = integer(seed, "seed", 64)
        self.shuffle = shuffle
        self.even = _check_even(even)
        self.rank, self.world_size = _distributed_place(rank, world_size)
        self.epoch = 0
        self.plan_state: Optional[PlanState] = None
        self._conn = _PerProcess(dataset.address, dataset.dataset, dataset.job, dataset.labels,
                                 self.rank, self.world_size, dataset.timeout, dataset.reconnect,
                                 runs=True)
        # The dataset's runs: its workers' reads deliver this sampler's plans.
        self._conn._nonce = dataset._conn._nonce
        self._conn.expected_digest = dataset.digest
        self._conn.expected_count = dataset.file_count
        self._plan = None

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next ``__iter__`` plans."""
        self.epoch = integer(epoch, "epoch", 64)

    def __len__(self) -> int:
        return _even_length(self.dataset.file_count, self.rank, self.world_size, self.even)

    def __iter__(self) -> Iterator[int]:
        # A generator: the plan goes to the stage at the first index asked
        # for. A DataLoader with workers and batch_size=None makes two
        # iterators an epoch and throws the first away unread; planning in
        # __iter__ had the stage prefetch for it, then replan.
        #
        # Each epoch plans over the stage's listing as it is now, which the
        # workers started for it read too; so does a loader without
        # workers, which reads with the dataset's handle in this process.
        ds = self._conn.get(fresh=True)
        if self.dataset._conn.opened_here():
            self.dataset._conn.get(fresh=True)
        # Keeping the iterator keeps this connection attached to the plan, so
        # the stage keeps its buffer until the epoch is read or a new plan
        # replaces it.
        # prefetch=0: this iterator is never read (the workers' READs deliver
        # the entries); a prefetch thread would claim them with NEXT.
        try:
            self._plan = _sampler_plan(lambda: ds.epoch(self.epoch, seed=self.seed, shuffle=self.shuffle,
                                                        prefetch=0))
        except PlanConflictError as e:
            raise error_from_code(
                ErrorCode.PLAN_CONFLICT,
                f"{e.message}; two samplers over one SluiceDataset (a training and an evaluation "
                "loader) plan the same job, rank and epoch: give the other loader a SluiceDataset "
                "of its own") from None
        self.plan_state = self._plan.state
        everything = _plan.permutation(self.dataset.file_count, self.seed, self.epoch, self.shuffle)
        order = _plan.shard(everything, self.rank, self.world_size)
        if len(order) != self._plan.length:
            raise error_from_code(ErrorCode.BAD_PLAN,
                                  f"the stage planned {self._plan.length} entries for rank {self.rank} "
                                  f"but the local derivation gives {len(order)}")
        # A padded index is read as any other (another rank's entry, so the
        # read delivers it if that rank has not yet); a dropped one is left
        # in the stage's plan, prefetched and never asked for.
        yield from self._indices(_even_share(everything, self.rank, self.world_size, self.even))

    def _indices(self, order) -> Iterator[int]:
        """Yields ``order``; when the stage went away meanwhile (its
        restart dropped the plan), plans the rest again once it is back,
        so the workers' reads are prefetched again."""
        for i, index in enumerate(order):
            if i and i % RECHECK_EVERY == 0 and _went_away(self._conn._client):
                self._replan(order[i:])
            yield index

    def _replan(self, rest) -> None:
        client = self._conn._client
        try:
            client._reconnect(ConnectionClosedError("the stage closed the connection", fatal=True),
                              client._connection)
            self._plan = self._conn._dataset.plan_indices(rest, self.epoch, prefetch=0)
        except SluiceError:
            # Not back (yet): the workers' reads go on without the plan,
            # and reconnect on their own.
            self._plan = None


def _sluice_mounts() -> List[str]:
    """The mount points of sluice stages this process sees (FUSE mounts
    of source ``sluice`` in ``/proc/self/mountinfo``), longest first."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split(" ")
        kind = rest.split(" ")
        if len(parts) > 4 and len(kind) > 1 and kind[0] in ("fuse", "fuse.sluice") and kind[1] == "sluice":
            # Spaces, tabs, newlines and backslashes are written as octal escapes.
            found.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4]))
    return sorted(found, key=len, reverse=True)


def _mount_names(paths: Sequence[str]) -> Tuple[str, str, List[str]]:
    """(job, dataset, names) of files under a stage's mount, every path
    being ``MOUNT/@<job>/<dataset>/<name>``. The ``@<job>`` directory is the
    one right under a sluice mount point, or else the first component
    starting with ``@`` (a data set's own directories may start with one)."""
    mounts = _sluice_mounts()
    found = set()
    names = []
    for path in paths:
        full = os.path.abspath(os.fspath(path))
        parts = full.split(os.sep)
        under = next((m for m in mounts if full.startswith(m.rstrip(os.sep) + os.sep)), None)
        if under is not None:
            at = len(under.rstrip(os.sep).split(os.sep))
            at = at if parts[at].startswith("@") else None
        else:
            at = next((i for i in range(len(parts)) if parts[i].startswith("@")), None)
        if at is None or at + 2 >= len(parts):
            raise ValueError(f"{path} is not under a stage's mount as MOUNT/@<job>/<dataset>/<file>: "
                             "open the data set through its @<job> directory so its reads are the job's")
        found.add((parts[at][1:], parts[at + 1]))
        names.append("/".join(parts[at + 2:]))
    if len(found) != 1:
        raise ValueError(f"the paths name {len(found)} (job, dataset) pairs ({sorted(found)[:3]}): "
                         "a MountSampler plans one data set of one job")
    job, dataset = found.pop()
    return job, dataset, names


class MountSampler(_PlanningSampler):
    """Yields this rank's indices of an epoch of a file-reading dataset
    over the stage's mount, and tells the stage that order.

    ``paths`` are the dataset's files in index order (for a torchvision
    ``ImageFolder``: ``[p for p, _ in folder.samples]``), all under
    ``MOUNT/@<job>/<dataset>/``. Its iterator shuffles them for the epoch
    (a ``torch.Generator`` seeded with ``seed + epoch``), keeps this rank's
    share (every ``world_size``-th from ``rank``), submits those files'
    names as the epoch's plan of ``job`` over the sampler's own connection
    to the stage at ``address`` when the first index is asked for, and
    yields their indices. The
    ``DataLoader``'s workers then open the files as usual: each open of a
    planned file is served from the stage's prefetch buffer and counts as
    that entry's delivery, so every file is read once, ahead, in plan order.
    Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``;
    ``even`` evens the ranks' shares as :class:`SluiceSampler`'s does.
    """

    def __init__(self, paths: Sequence[str], address, seed: int = 0, shuffle: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 labels: Optional[Dict[str, str]] = None, timeout: Optional[float] = 30.0,
                 reconnect: float = 60.0, even: Optional[str] = None) -> None:
        self.job, self.dataset_name, self.names = _mount_names(paths)
        self.seed = integer(seed, "seed", 64)
        self.shuffle = shuffle
        self.even = _check_even(even)
        self.rank, self.world_size = _distributed_place(rank, world_size)
        self.epoch = 0
        self._conn = _PerProcess(address, self.dataset_name, self.job, labels, self.rank, self.world_size,
                                 timeout, reconnect, runs=True)
        self._plan = None

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next ``__iter__`` plans."""
        self.epoch = integer(epoch, "epoch", 64)

    def __len__(self) -> int:
        return _even_length(len(self.names), self.rank, self.world_size, self.even)

    def order(self) -> List[int]:
        """This rank's indices of the current epoch, in order."""
        n = len(self.names)
        if self.shuffle:
            generator = _torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            everything = _torch.randperm(n, generator=generator).tolist()
        else:
            everything = list(range(n))
        return _even_share(everything, self.rank, self.world_size, self.even)

    def __iter__(self) -> Iterator[int]:
        # A generator (see SluiceSampler.__iter__): the plan goes to the
        # stage at the first index asked for. As a generator's frame holds
        # `self`, a sampler whose connection holds the epoch's plan lives as
        # long as its iterator (`for i in MountSampler(...)` keeps no other
        # reference to it).
        order = self.order()
        ds = self._conn.get()
        # prefetch=0: the plan is never read here; the workers' opens
        # deliver its entries. Keeping it keeps the stage's buffer for it.
        # A padded file is another rank's entry: its open here delivers that
        # entry if the other rank has not opened the file yet.
        self._plan = _sampler_plan(lambda: ds.plan_names([self.names[i] for i in order], self.epoch, prefetch=0))
        yield from order


class SluiceIterableDataset(_data.IterableDataset):
    """Streams this rank's epoch in plan order, split between workers.

    In every process that iterates it (each ``DataLoader`` worker, or the
    main process with ``num_workers=0``) it connects, submits the
    ``SHUFFLE`` plan of its share and yields ``(name, sample)`` in plan
    order until the plan ends. With ``W`` workers, worker ``w`` of rank
    ``r`` (world size ``R``) reads the shard ``w * R + r`` of ``R * W`` (the
    stage sees it as that rank): every ``W``-th entry of the rank's order,
    so across workers every entry comes exactly once, and a worker whose
    stage restarts resumes its own plan where it stopped.

    Args:
        address, dataset, job, labels, transform, timeout, sample, reconnect:
            as for :class:`SluiceDataset`.
        seed, shuffle: the plan's shuffle (see :mod:`sluice.plan`).
        rank, world_size: default to torch.distributed's, else 0 and 1.
        batch: samples asked for per ``NEXT`` round trip.
        on_error: ``"raise"`` (a failed sample raises in the worker) or
            ``"yield"`` (it is yielded as ``(name, SluiceError)``).
        prefetch: batches a background thread of each iterating process
            receives ahead (see :meth:`sluice.Dataset.epoch`); 0 receives
            them in ``next()``.
        even: ``None`` (default), ``"pad"`` or ``"drop"``: makes every
            rank's share as long, as :class:`SluiceSampler`'s ``even`` does
            (``DistributedSampler``'s shares over the epoch's order), so
            that the ranks of a ``DistributedDataParallel`` job take the
            same number of steps. The share (each worker's part of it) is
            then planned as explicit indices, derived locally from the
            same seed, instead of as a ``SHUFFLE`` plan.

    Call :meth:`set_epoch` before each epoch. Iterating an epoch that this
    trainer process already read in full raises in the main process; in
    ``DataLoader`` workers each iteration of the loader is a reading of its
    own (persistent workers too), so a new one reads the epoch in full, as
    a plain ``DataLoader`` does. ``set_epoch`` reaches persistent workers.
    ``len()`` is this rank's share (all workers together).

    Plans name the trainer process's run (see :class:`sluice.Client`),
    derived from a random value of the object and the process's id and
    start time; in ``DataLoader`` workers they name the worker process's
    own (its hand-offs stay its trainer's). A trainer restarted after a
    crash, with a new object or this one, reads its epochs in full even
    while the crashed one's workers still hold their plans, and so does a
    notebook cell run again after an interrupt while the interrupted
    iteration's workers live on in its traceback.
    """

    def __init__(self, address, dataset: str, job: str, seed: int = 0, shuffle: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None, batch: int = 32,
                 transform: Optional[Callable[[object], object]] = None,
                 labels: Optional[Mapping[str, str]] = None, on_error: str = "raise",
                 timeout: Optional[float] = None, prefetch: int = DEFAULT_PREFETCH,
                 sample: str = "tensor", reconnect: float = 60.0, even: Optional[str] = None) -> None:
        if on_error not in ("raise", "yield"):
            raise ValueError(f'on_error must be "raise" or "yield", got {on_error!r}')
        given, prefetch = prefetch, integer(prefetch, "prefetch")
        if prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (batches), got {given!r}")
        self.prefetch = prefetch
        self.address = address
        self.dataset = dataset
        self.job = job
        self.seed = integer(seed, "seed", 64)
        self.shuffle = shuffle
        self.rank, self.world_size = _distributed_place(rank, world_size)
        self.batch = batch
        self.transform = transform
        self.sample = sample
        self._convert = _converter(sample)
        self.on_error = on_error
        self.even = _check_even(even)
        self._epoch = 0
        self._shared_epoch = _shared_epoch()
        self._conn = _PerProcess(address, dataset, job, labels, self.rank, self.world_size, timeout,
                                 reconnect, runs=True, plans_per_loader=True)
        ds = self._conn.get()
        self.file_count: int = ds.file_count
        self.digest: int = ds.digest

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next iteration reads (in persistent workers
        too)."""
        self.epoch = integer(epoch, "epoch", 64)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads: what ``set_epoch`` set in the
        process that made this object, also where a ``DataLoader``'s
        persistent workers read it (they keep the copy they started with)."""
        return self._shared_epoch.value if self._shared_epoch is not None else self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._epoch = epoch
        if self._shared_epoch is not None:
            self._shared_epoch.value = epoch

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if multiprocessing.context.get_spawning_popen() is None:
            # A copy that is no process being started (a checkpoint, a
            # deep copy): the epoch as it is now, shared with nobody.
            state["_epoch"], state["_shared_epoch"] = self.epoch, None
        return state

    def __len__(self) -> int:
        return _even_length(self.file_count, self.rank, self.world_size, self.even)

    def __iter__(self) -> Iterator[tuple]:
        info = _data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers > 1:
            # Each worker reads its own share of the rank's order (every
            # num_workers-th entry), as a plan of its own: a worker that
            # loses its stage resumes its plan alone, exactly once.
            self._conn.rank = worker * self.world_size + self.rank
            self._conn.world_size = self.world_size * workers
        # An epoch reads the stage's listing as it is now (a worker started
        # for it connects anew; a loader without workers opens again).
        ds = self._conn.get(fresh=True)
        self._conn.new_reading()
        epoch = self.epoch
        if self.even is None:
            it = ds.epoch(epoch, seed=self.seed, shuffle=self.shuffle, batch=self.batch,
                          on_error=self.on_error, prefetch=self.prefetch)
        else:
            everything = _plan.permutation(self.file_count, self.seed, epoch, self.shuffle)
            share = _even_share(everything, self.rank, self.world_size, self.even)[worker::workers]
            it = ds.plan_indices(share, epoch, batch=self.batch, on_error=self.on_error,
                                 prefetch=self.prefetch)
        if it.state == PlanState.COMPLETE and _data.get_worker_info() is None:
            raise RuntimeError(
                f"epoch {epoch} of job {self.job!r} (rank {self.rank}) was already read in full; "
                "call set_epoch(epoch) with a new epoch before iterating again")
        transform, convert, client = self.transform, self._convert, ds.client
        # The iterator's prefetch thread stops when this generator is closed
        # (the DataLoader drops it, or the loop breaks).
        with it:
            try:
                for name, data in it:
                    if not isinstance(data, SluiceError):
                        data = convert(data, client)
                        if transform is not None:
                            data = transform(data)
                    yield name, data
            except SupersededError as e:
                raise SupersededError(
                    f"{e}: this process iterated the dataset again before this iteration ended (two "
                    "iterators of one DataLoader at once): iterate one at a time, or give the other "
                    "loop a SluiceIterableDataset of its own") from None

    def close(self) -> None:
        """Closes this process's connection (it reopens on next use)."""
        self._conn.close()
