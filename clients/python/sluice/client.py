"""The connection to a ``sluice-stage`` and the dataset handle built on it.

::

    import sluice

    with sluice.Client("/run/sluice/stage.sock", job="resnet50") as client:
        ds = client.dataset("imagenet")
        for epoch in range(90):
            for name, data in ds.epoch(epoch, seed=1234):
                ...

A :class:`Client` is one connection, and the protocol on it is strictly
request/response: one request is outstanding at a time. Each exchange holds
the client's lock, so threads may share a client (their requests take turns)
and a plan iterator's prefetch thread keeps receiving the next batches while
the training loop computes, with ``client.read(...)`` from another thread
slotting in between its ``NEXT`` requests. For parallel reads open one client
per thread or process (PyTorch ``DataLoader`` workers each open their own;
the :mod:`sluice.torch` adapters do that for you). Using a client in a forked
child raises ``RuntimeError``: a child must open its own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Callable, Iterator, List, Mapping, Optional, Tuple, Union

from . import plan as _plan
from . import protocol as p
from . import shm as _shm
from .errors import (
    ClaimRefusedError,
    ConnectionClosedError,
    NoDatasetError,
    ProtocolError,
    SluiceError,
    SluiceIOError,
    StageTimeoutError,
    TooLargeError,
    UnavailableError,
    UnsupportedVersionError,
    error_from_code,
)

from .iterator import PlanIterator, _Prefetcher, _Resume

__all__ = ["Client", "Dataset", "FileList", "PlanIterator", "parse_address"]

#: Batches a plan iterator receives ahead of the caller by default (see
#: :meth:`Dataset.epoch`).
DEFAULT_PREFETCH = 2

#: Listed bytes one ``FETCH`` asks for at most (the stage's frame budget).
FETCH_BYTES = 32 << 20

#: Bytes of a ``PLAN`` request besides its names or indices, at most.
PLAN_FRAME_SLACK = 1024

#: Attempts at reading a file too large for one answer in ranges of one
#: version (see ``Dataset._read_ranges``).
RANGED_TRIES = 3

#: Buffer of the socket file responses are read through. Measured with
#: ``python -m sluice.bench receive``: 1 MiB lets 100 KiB samples be read
#: with one copy each at ~15 us of CPU per sample.
RECV_BUFFER = 1 << 20

Address = Union[str, "os.PathLike[str]", Tuple[str, int]]

#: Size of the block :func:`_prime_allocator` allocates and frees.
_PRIME_BYTES = 16 << 20
_primed_pid: Optional[int] = None


def _prime_allocator() -> None:
    """Raises glibc malloc's dynamic thresholds once per process.

    Each sample arrives in a fresh ``bytes`` object of its own size. With
    glibc's default thresholds a freed batch at the top of the heap is
    returned to the kernel (trimmed) and the next batch faults the same
    pages back in: for 100 KiB samples that is ~12 page faults and ~40 us of
    system time per sample, more than the parsing itself. Freeing one
    mmap-backed block makes glibc raise its mmap threshold to that block's
    size and its trim threshold to twice it (see mallopt(3), "dynamic mmap
    threshold"), so sample buffers stay mapped and are reused. Measured with
    ``python -m sluice.bench receive``. Harmless elsewhere: on other
    allocators it is one short-lived allocation.
    """
    global _primed_pid
    if _primed_pid != os.getpid():
        _primed_pid = os.getpid()
        bytearray(_PRIME_BYTES)  # allocated with mmap, freed at once


def parse_address(address: Address) -> Tuple[str, object]:
    """Returns ``("unix", path)`` or ``("tcp", (host, port))`` for an address.

    Accepted forms: a filesystem path (``/run/sluice.sock``, ``./s.sock``, any
    string without a ``:``), ``unix:///path``, ``tcp://host:port``,
    ``host:port``, ``[v6addr]:port``, or a ``(host, port)`` tuple.
    """
    if isinstance(address, tuple):
        host, port = address
        return "tcp", (host, _port(port, address))
    if isinstance(address, os.PathLike):
        return "unix", os.fspath(address)
    if not isinstance(address, str) or not address:
        raise ValueError(f"a stage address must be a non-empty string, path or (host, port), got {address!r}")
    if address.startswith("unix://"):
        path = address[len("unix://"):]
        if not path:
            raise ValueError(f"{address!r} names no socket path; write unix:///path/to/stage.sock")
        return "unix", path
    if address.startswith("tcp://"):
        return "tcp", _host_port(address[len("tcp://"):], address)
    if "://" in address:
        raise ValueError(f"unknown scheme in stage address {address!r}; use unix:///path or tcp://host:port")
    if address.startswith(("/", ".", "~")) or ":" not in address:
        return "unix", os.path.expanduser(address)
    return "tcp", _host_port(address, address)


def _host_port(text: str, original: str) -> Tuple[str, int]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"cannot read {original!r} as [ipv6]:port")
        port = rest[1:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"cannot read {original!r} as host:port (e.g. 127.0.0.1:7300)")
    return host, _port(port, original)


def _port(port, original) -> int:
    try:
        value = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"the port in {original!r} is not a number") from None
    if not 0 < value < 65536:
        raise ValueError(f"the port in {original!r} must be in 1..65535")
    return value


#: Clients of this process, for the fork hooks below.
_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
_held_at_fork: list = []
#: Socket files a forked child must never close (see Client.close).
_fork_orphans: list = []
#: Longest a fork waits for an exchange in progress on another thread.
FORK_WAIT_S = 10.0
#: Held from a fork's first hook to its last: forks from several threads at
#: once (two DataLoaders started from two threads) take turns, so that one
#: never releases the connection locks another took.
_fork_lock = threading.Lock()


def _before_fork() -> None:
    # Wait until no exchange is in progress, so the child's copy of every
    # connection is between frames: closing it there must take the socket
    # file's internal lock, which a thread that does not exist in the child
    # could otherwise hold forever (logging does the same for its handlers).
    _fork_lock.acquire()
    pid = os.getpid()
    for c in list(_live_clients):
        if c._pid == pid and not c._closed and c._lock.acquire(timeout=FORK_WAIT_S):
            _held_at_fork.append(c)


def _after_fork_parent() -> None:
    while _held_at_fork:
        _held_at_fork.pop()._lock.release()
    _fork_lock.release()


def _after_fork_child() -> None:
    while _held_at_fork:
        c = _held_at_fork.pop()
        c._lock.release()
        c._fork_safe = True
    _fork_lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                        after_in_child=_after_fork_child)


class Client:
    """One connection to a sluice stage.

    Args:
        address: where the stage listens (see :func:`parse_address`), or an
            already connected stream ``socket.socket``.
        job: the job this trainer belongs to (1 to 128 characters of
            ``[A-Za-z0-9._-]``); the stage keeps plans, buffers and limits per
            job.
        labels: labels of the job (operators' policies select on them).
        rank, world_size: this trainer's place in the job; a ``SHUFFLE``
            plan is sharded with them.
        timeout: seconds to wait for the stage on each socket operation
            (``None``: wait as long as it takes). A timeout closes the
            connection.
        shared_memory: take samples in shared memory (a UNIX socket to a
            stage on this node): they arrive as ``memoryview`` objects over
            the job's region, with no copy through the socket (see
            :mod:`sluice.shm` for how long a sample stays valid). ``None``
            (the default) uses it wherever the stage and the platform offer
            it, ``False`` always takes bytes in the frames.
        reconnect: seconds to keep trying to connect again when the stage
            goes away (a restart, a rolling update), with backoff from
            50 ms to 1 s; ``0`` gives up at once. Requests that read
            (``read``, ``fetch``, listing) are sent again on the new
            connection, and a plan iterator resumes at the first sample it
            has not received (see :meth:`Dataset.epoch`). Past the time,
            the failure is a :class:`sluice.ConnectionClosedError` that
            says so. :attr:`reconnects` counts the reconnections and
            :attr:`reconnect_wait_s` the time spent waiting for them.
        run: this trainer run's identity, an integer in 1..2^64-1 (``None``:
            none). A plan is the job's for ``(data set, rank, epoch)`` and
            the run that submitted it: connections of one run that submit
            the same plan share it (each entry is delivered to one of
            them), while a trainer restarted after a crash, under a new
            run, reads its epochs in full instead of meeting what its
            predecessor's processes still hold or finished. Reads by name
            (``read`` and ``fetch`` of a whole file) deliver the entries of
            this run's plans only, so another run's reads of the same files
            never take them from its epochs.
            :mod:`sluice.torch` derives one per trainer process (a
            ``DataLoader`` worker takes its parent's). A stage older than
            this feature is not told it.

    Sends ``HELLO`` on construction; the stage's answer is in
    :attr:`stage_id`, :attr:`max_request_frame`, :attr:`max_response_frame`.
    Every request/response exchange holds the client's lock, so threads may
    share it (their requests are serialised); a forked child must open its
    own.
    """

    def __init__(
        self,
        address: Union[Address, socket.socket],
        job: str,
        labels: Optional[Mapping[str, str]] = None,
        rank: int = 0,
        world_size: int = 1,
        timeout: Optional[float] = None,
        shared_memory: Optional[bool] = None,
        reconnect: float = 60.0,
        run: Optional[int] = None,
        *,
        _receipts: bool = False,
    ) -> None:
        if run is not None:
            given, run = run, p.integer(run, "run", 64)
            if run == 0:
                raise ValueError(f"run must be an integer in [1, 2^64), or None, got {given!r}")
        world_size = p.integer(world_size, "world_size")
        if world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        rank = p.integer(rank, "rank")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
        self.job = job
        self.labels = dict(labels or {})
        self.rank = rank
        self.world_size = world_size
        self.run = run
        # The run PLAN names on this connection: 0 until a stage grants RUNS.
        self._plan_run = 0
        # A run the plans name instead of ``run`` (see `_plan_apart`), and
        # the run this connection named with RUN (0: none).
        self._plans_apart = 0
        self._said_run = 0
        # Whether this client asks for TAKES (see `_hello`), and was granted it.
        self._receipts = _receipts
        self._takes = False
        self._runs = False
        self.address = address if not isinstance(address, socket.socket) else None
        # Validate HELLO's fields before connecting, so a bad job name is a
        # ValueError naming the field instead of a round trip.
        p.encode_hello(job, self.labels, rank, world_size)
        _prime_allocator()
        self._pid = os.getpid()
        # Held for each request/response exchange (and across the few
        # exchanges that must not be split, e.g. re-OPEN + request). An RLock
        # so that a held section may call _call.
        self._lock = threading.RLock()
        # Prefetch threads of this client's plan iterators, woken on close.
        self._prefetchers: "weakref.WeakSet[_Prefetcher]" = weakref.WeakSet()
        # Set in a forked child when the fork hook saw this connection idle.
        self._fork_safe = False
        self._closed = False
        self._file = None
        self._region: Optional[_shm.Region] = None
        # The data set opened on the connection, held weakly (a handle holds
        # its client: a strong reference both ways would keep a dropped
        # client's connection until the garbage collector's next full pass),
        # with what Client.read needs to make a handle again.
        self._dataset_ref: Optional["weakref.ref[Dataset]"] = None
        self._opened: Optional[tuple] = None
        self._opened_on = -1
        self._plan_generation = 0
        self._timeout = timeout
        self._want_shm = shared_memory
        self.reconnect = reconnect
        #: How many times this client connected again after losing the stage.
        self.reconnects = 0
        #: Seconds spent waiting for the stage to come back, in all.
        self.reconnect_wait_s = 0.0
        # Which connection this is (bumped by each reconnection). A region
        # of an earlier one stays mapped only while samples view it (the
        # samples refer to it; shm's registry, for samples handed over
        # from it, holds it weakly).
        self._connection = 0
        self._user_closed = False
        self._sock = address if isinstance(address, socket.socket) else _connect(address, timeout)
        try:
            if isinstance(address, socket.socket):
                self._sock.settimeout(timeout)
            self._hello(p.PROTOCOL_VERSION, shared_memory)
        except UnsupportedVersionError:
            # A stage older than protocol version 2: say HELLO again in 1.
            self._abort()
            if self.address is None:
                raise
            self._closed = False
            self._sock = _connect(self.address, timeout)
            try:
                self._hello(1, False)
            except BaseException:
                self._abort()
                raise
        except BaseException:
            self._abort()
            raise
        _live_clients.add(self)

    def _hello(self, version: int, shared_memory: Optional[bool]) -> None:
        """Says ``HELLO`` in protocol ``version``, asking for shared memory
        where ``shared_memory`` allows and this connection can take it, and
        records the stage's ``WELCOME`` (mapping the region it granted)."""
        local = self._sock.family == socket.AF_UNIX
        if shared_memory and not (local and _shm.supported()):
            raise ValueError("shared_memory=True needs a UNIX socket to the stage and a platform with "
                             "socket.recv_fds and mmap.madvise (Linux, Python 3.9+)")
        want = version >= 2 and local and _shm.supported() and shared_memory is not False
        # RUNS in any case: a plan resumed on a stage that still holds the
        # plan of the connection it replaces names a run of its own.
        runs = p.FEATURE_RUNS | (p.FEATURE_RUN_READS if self.run else 0)
        # TAKES (sluice.torch's connections, whose receiving processes say
        # what they received): samples this process hands off are in transit
        # until then, and come back if never received (batches a DataLoader
        # dropped unread).
        takes = p.FEATURE_TAKES if self._receipts else 0
        features = (p.FEATURE_SHARED_MEMORY | takes if want else 0) | runs
        hello = p.encode_hello(self.job, self.labels, self.rank, self.world_size, version, features)
        if not want:
            self._file = self._sock.makefile("rb", buffering=RECV_BUFFER)
            self._name_run(self._welcomed(self._call(hello, p.Welcome), version))
            return
        # The region's descriptor comes with WELCOME's first byte: receive
        # that frame with recvmsg, then read the rest through the file.
        try:
            self._sock.sendall(hello)
        except (BrokenPipeError, ConnectionResetError):
            # A stage that refused the connection (it holds its most, or it
            # is out of descriptors) answered before closing it: the answer
            # is read below, or that the stage closed without one.
            pass
        except socket.timeout:
            raise StageTimeoutError("the stage did not take HELLO within the client's timeout",
                                    fatal=True) from None
        except OSError as e:
            raise ConnectionClosedError(f"the connection to the stage failed: {e}", fatal=True) from None
        try:
            frame, fd = _shm.receive_with_fd(self._sock, p.MAX_RESPONSE_FRAME)
        except socket.timeout:
            raise StageTimeoutError("the stage did not answer HELLO within the client's timeout",
                                    fatal=True) from None
        except OSError as e:
            raise ConnectionClosedError(f"the connection to the stage failed: {e}", fatal=True) from None
        try:
            msg_type, payload = p.split_frame(frame, p.MAX_RESPONSE_FRAME)
            msg = p.decode_response(msg_type, payload)
        except p.FrameError as e:
            if fd is not None:
                os.close(fd)
            raise ProtocolError(f"malformed answer to HELLO: {e}", fatal=True) from None
        if type(msg) is p.Error:
            if fd is not None:
                os.close(fd)
            raise error_from_code(msg.code, msg.message, fatal=msg.fatal)
        welcome = self._welcomed(msg, version)
        if welcome.features & p.FEATURE_SHARED_MEMORY and fd is not None:
            self._region = _shm.Region(fd, welcome.region_bytes, flush=_returns_flusher(self))
            _shm.register(self._region)
        elif fd is not None:
            os.close(fd)
        self._file = self._sock.makefile("rb", buffering=RECV_BUFFER)
        self._name_run(welcome)

    def _name_run(self, welcome: p.Welcome) -> None:
        """Names this client's run to a stage that granted ``RUN_READS``:
        its reads by name (``read``, ``fetch``) then deliver only entries
        of the run's plans, never another run's (an evaluation pass, a
        restarted trainer) of the same job."""
        self._said_run = 0
        if self._runs and self.run and welcome.features & p.FEATURE_RUN_READS:
            self._sock.sendall(p.encode_run(self.run))
            self._said_run = self.run

    def _plan_apart(self, run: int) -> None:
        """Has this client's plans name ``run`` (not 0) instead of its own
        run, on this connection and after every reconnect; its reads by
        name and the samples it hands off stay its own run's. A
        ``DataLoader`` worker's plans are its loader iteration's, so that
        a new iteration of an epoch plans it anew (see
        :class:`sluice.torch.SluiceIterableDataset`)."""
        with self._lock:
            self._plans_apart = run
            self._plan_run = run if self._runs else 0

    def _welcomed(self, welcome, version: int) -> p.Welcome:
        """Checks the answer to ``HELLO`` and records what it says."""
        if type(welcome) is not p.Welcome or welcome.version != version:
            got = welcome.version if type(welcome) is p.Welcome else type(welcome).__name__
            raise ProtocolError(f"the stage answered HELLO (protocol version {version}) with {got}",
                                fatal=True)
        #: The protocol version this connection speaks (2, or 1 with an
        #: older stage).
        self.protocol_version: int = welcome.version
        self.stage_id: str = welcome.stage_id
        #: Whether a plan may name a run on this connection.
        self._runs = bool(welcome.version >= 2 and welcome.features & p.FEATURE_RUNS)
        self._takes = bool(welcome.version >= 2 and welcome.features & p.FEATURE_TAKES)
        self._plan_run = (self._plans_apart or self.run or 0) if self._runs else 0
        self.max_request_frame: int = welcome.max_request_frame
        self.max_response_frame: int = welcome.max_response_frame
        return welcome

    @property
    def shared_memory(self) -> bool:
        """Whether samples come in shared memory on this connection."""
        return self._region is not None

    def hand_off(self, owners, region: "_shm.Region") -> bool:
        """Gives samples this client received in shared memory (their owning
        objects, see :meth:`sluice.shm.Region.slot`, all from ``region``) to
        the job: another process of the job maps them and returns them
        (``HAND_OFF``). Returns False, handing nothing, when ``region`` is
        no longer this connection's (the stage went away since): the
        caller must then pass the samples' bytes instead."""
        self._check_process()
        with self._lock:
            if self._closed or self._region is not region:
                return False
            frame = p.encode_hand_off(region.hand_off(owners))
            try:
                self._sock.sendall(frame)
            except OSError:
                self._abort()
                for owner in owners:
                    owner.handed = False
                return False
        return True

    def _received(self, ident, offsets: List[int]) -> bool:
        """Says that this process received the slots at ``offsets`` of the
        job's region ``ident``, which another process of the job handed off
        (``TAKE``; on a connection granted ``TAKES`` whose region that is):
        until then the stage counts them in transit, and takes back those
        never received. Returns whether it was said."""
        region = self._region
        if self._closed or not self._takes or region is None or region.ident != ident:
            return False
        try:
            self._notify(p.encode_take(offsets))
        except ConnectionClosedError:
            return False
        return not self._closed

    def _flush_returns(self) -> None:
        """Sends the returns waiting in the region now (the client is idle)."""
        region = self._region
        if region is not None and not self._closed:
            with self._lock:
                # A reconnection may have come between: the offsets of the
                # region before mean nothing to the stage now.
                if self._closed or self._region is not region:
                    return
                back = region.returned()
                if back:
                    self._sock.sendall(p.encode_release(back))

    def _notify(self, frame: bytes) -> None:
        """Sends a frame that has no answer (between exchanges)."""
        self._check_process()
        with self._lock:
            if self._closed:
                return
            try:
                self._sock.sendall(frame)
            except OSError as e:
                self._abort()
                raise ConnectionClosedError(f"the connection to the stage failed: {e}", fatal=True) from None

    # -- public API ---------------------------------------------------------

    def dataset(self, name: str) -> "Dataset":
        """Opens dataset ``name`` on this connection and returns its handle.

        Raises :class:`sluice.NoSuchDatasetError` when the stage does not
        serve it. Opening a dataset detaches the connection from any plan
        it was reading.
        """
        self._check_process()
        with self._lock:
            opened = self._call(p.encode_open(name), p.Opened)
            self._plan_generation += 1
            ds = Dataset(self, name, opened)
            self._dataset = ds
        return ds

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Reads file ``name`` of the currently open dataset.

        See :meth:`Dataset.read`.
        """
        ds = self._dataset
        if ds is None:
            if self._opened is None:
                raise NoDatasetError("no dataset is open on this connection; call client.dataset(name) first")
            # Its handle was dropped: the connection still has it open,
            # unless it is a new one since (the handle's read opens it).
            ds = Dataset(self, *self._opened)
            if self._opened_on == self._connection:
                self._dataset = ds
        return ds.read(name, offset, length)

    @property
    def _dataset(self) -> Optional["Dataset"]:
        """The handle of the data set opened on the connection, while one
        is held (None after a reconnect, or a plan left, until a handle
        opens its data set again)."""
        ref = self._dataset_ref
        return None if ref is None else ref()

    @_dataset.setter
    def _dataset(self, ds: Optional["Dataset"]) -> None:
        self._dataset_ref = None if ds is None else weakref.ref(ds)
        if ds is not None:
            self._opened = (ds.name, ds._opened)
            self._opened_on = self._connection

    @property
    def closed(self) -> bool:
        """True once the connection is closed (by :meth:`close` or an error)."""
        return self._closed

    def close(self) -> None:
        """Says ``BYE`` and closes the connection. Calling it again does nothing.

        Waits for an exchange in progress on another thread (a plan
        iterator's prefetch thread finishing its ``NEXT``) first; iterators
        of this client then end with :class:`sluice.ConnectionClosedError`
        after the batches they already received, and their threads exit.
        """
        self._user_closed = True
        if self._closed:
            return
        if os.getpid() != self._pid:
            # A forked copy must not talk on its parent's connection (nor
            # shut it down: the parent still uses it). Its socket file is
            # closed only when the fork hook saw the connection idle: else a
            # parent thread held the file's internal lock at the fork, and
            # the file is kept (never closed) rather than deadlock on it.
            self._closed = True
            if self._fork_safe:
                self._close_socket(shutdown=False)
            else:
                _fork_orphans.append(self._file)
                self._file = None
                self._close_socket(shutdown=False)
            return
        with self._lock:
            # The samples this process holds keep their bytes: the stage
            # reuses their slots once the connection ends.
            if self._region is not None:
                self._region.close()
                # Unmapped (its memory file closed) once no sample views it.
                self._region = None
            try:
                if not self._closed:
                    # BYE is a courtesy: a stage that stopped answering
                    # (stopped, hung) is not waited on for long.
                    self._sock.settimeout(BYE_PATIENCE if self._timeout is None
                                          else min(self._timeout, BYE_PATIENCE))
                    self._call(p.encode_bye(), p.Goodbye)
            except (SluiceError, OSError):
                pass
            finally:
                self._abort()
        me = threading.current_thread()
        for pf in list(self._prefetchers):
            pf.join(timeout=10.0, unless=me)

    def __enter__(self) -> "Client":
        return self

    def __reduce__(self):
        # A connection cannot travel to another process (a spawn or
        # forkserver DataLoader worker gets its dataset pickled).
        raise TypeError("a sluice.Client cannot be pickled: each process opens its own Client (in a DataLoader "
                        "worker, in worker_init_fn or at its first use), or use sluice.torch's datasets, which "
                        "connect in each worker by themselves")

    def __del__(self) -> None:
        # Dropped without close(): the samples still held keep their bytes
        # (the stage reuses their slots once the connection goes, which is
        # when the socket is collected, after this).
        region = getattr(self, "_region", None)
        if region is not None and getattr(self, "_pid", None) == os.getpid():
            region.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"stage {self.stage_id!r}"
        return f"<sluice.Client job={self.job!r} rank={self.rank}/{self.world_size} {state}>"

    # -- one request, one response -----------------------------------------

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                "this sluice.Client was opened in another process (pid "
                f"{self._pid}); a forked process must open its own Client")

    def _call(self, frame: bytes, expect: type) -> tuple:
        """Sends one request frame and returns its answer, which must be of
        message type ``expect``; raises the stage's ``ERROR`` as a
        :class:`SluiceError`. Holds the client's lock for the exchange."""
        if self._closed:
            raise ConnectionClosedError("this sluice connection is closed; open a new Client", fatal=True)
        # Before the lock: a thread of the parent may have held it at fork().
        self._check_process()
        if len(frame) - 4 > getattr(self, "max_request_frame", p.MAX_REQUEST_FRAME):
            raise ValueError(f"the request is {len(frame) - 4} bytes, over the stage's limit of "
                             f"{self.max_request_frame}; send a shorter plan or name")
        with self._lock:
            if self._closed:  # closed while this thread waited for the lock
                raise ConnectionClosedError("this sluice connection is closed; open a new Client",
                                            fatal=True)
            region = self._region
            shared = None
            if region is not None:
                shared = region.view
                # Samples given back since the last request go with this one
                # (RELEASE has no answer).
                back = region.returned()
                if back:
                    frame = p.encode_release(back) + frame
            try:
                self._sock.sendall(frame)
                msg = p.read_response(self._file, getattr(self, "max_response_frame", p.MAX_RESPONSE_FRAME),
                                      shared)
            except SluiceError:
                # read_response's own errors (closed mid-frame, malformed).
                self._abort()
                raise
            except socket.timeout:
                self._abort()
                raise StageTimeoutError("the stage did not answer within the client's timeout",
                                        fatal=True) from None
            except (BrokenPipeError, ConnectionResetError) as e:
                # The stage may have closed after sending a fatal ERROR;
                # report that error rather than the broken pipe when we can.
                msg = self._pending_error()
                if msg is None:
                    self._abort()
                    raise ConnectionClosedError(f"the connection to the stage failed: {e}", fatal=True) from None
            except (OSError, ValueError) as e:
                # ValueError: the file was closed under us (by _abort on
                # another thread, e.g. a test's or a signal handler's).
                self._abort()
                raise ConnectionClosedError(f"the connection to the stage failed: {e}", fatal=True) from None
            except BaseException:
                # Interrupted mid-exchange (KeyboardInterrupt, a signal
                # handler's exception): the answer is unread, so the stream
                # is out of step. The next request connects again.
                self._abort()
                raise
            if type(msg) is expect:
                return msg
            if type(msg) is p.Error:
                if msg.fatal:
                    self._abort()
                raise error_from_code(msg.code, msg.message, fatal=msg.fatal)
            self._abort()
            raise ProtocolError(f"the stage answered with {type(msg).__name__.upper()} where "
                                f"{expect.__name__.upper()} was expected", fatal=True)

    def _reconnect(self, cause: BaseException, seen: int) -> None:
        """Connects again after the stage went away (``cause``), unless
        another thread already did since connection ``seen``. Says
        ``HELLO`` as before and re-opens the open dataset; raises ``cause``
        when this client may not reconnect, and a
        :class:`ConnectionClosedError` that says so when the stage did not
        come back within :attr:`reconnect` seconds."""
        if (self._user_closed or self.address is None or not self.reconnect
                or os.getpid() != self._pid):
            raise cause
        with self._lock:
            if self._connection != seen:
                return
            self._abort()
            self._region = None
            start = time.monotonic()
            last = cause
            for _ in _tries(self.reconnect):
                if self._user_closed:
                    raise cause
                try:
                    self._sock = _connect(self.address, self._timeout)
                    self._closed = False
                    self._hello(self.protocol_version, self._want_shm)
                    break
                except STAGE_AWAY as e:
                    self._abort()
                    last = e
            else:
                if isinstance(last, ClaimRefusedError):
                    # The stage is back and says no: it does not know the
                    # labels of a job that this trainer joined naming none.
                    raise ConnectionClosedError(
                        f"the stage at {self.address} went away ({cause}) and, back, refused this "
                        f"trainer's claim for {self.reconnect:g} s: {last}"
                        + ("; a trainer that joined its job naming no labels gets back in only once "
                           "one that names them has: give every trainer of the job its labels"
                           if not self.labels else ""), fatal=True) from None
                raise ConnectionClosedError(
                    f"the stage at {self.address} went away ({cause}) and did not come back "
                    f"within {self.reconnect:g} s (last attempt: {last}); start it again, or give "
                    "the client a longer reconnect time", fatal=True) from None
            self._connection += 1
            self.reconnects += 1
            self.reconnect_wait_s += time.monotonic() - start
            dataset, self._dataset = self._dataset, None
            if dataset is not None:
                dataset._reopen_if_needed()

    def _pending_error(self):
        try:
            return p.read_response(self._file)
        except (SluiceError, OSError, ValueError):
            return None

    def _abort(self) -> None:
        """Marks the client closed, closes the socket and wakes the prefetch
        threads (they report the closed connection to their iterators)."""
        self._closed = True
        # The held samples keep their bytes before the stage can see the
        # connection end (it reuses the slots then).
        region = getattr(self, "_region", None)
        if region is not None:
            region.close()
        self._close_socket(shutdown=True)
        for pf in list(getattr(self, "_prefetchers", ())):
            pf.wake()

    def _close_socket(self, shutdown: bool) -> None:
        if shutdown and self._sock is not None:
            # Wakes a thread blocked in a receive on this socket (only a
            # caller that bypassed the lock can leave one).
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for obj in (self._file, self._sock):
            if obj is not None:
                try:
                    obj.close()
                except OSError:
                    pass


def _names_of(names: Sequence[str], or_else: str = "") -> List[str]:
    """``names`` as a list; a single name (a ``str`` is a sequence of its
    characters) is refused, saying how to give it."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"names must be a sequence of file names, got the single name {names!r}: "
                        f"give [{names!r}]{or_else}")
    return list(names)


def _returns_flusher(client: "Client"):
    """The region's way to send waiting returns: through the client, held
    weakly (the region lives in the client and its samples)."""
    ref = weakref.ref(client)

    def flush() -> None:
        c = ref()
        if c is not None:
            c._flush_returns()

    return flush


#: What a try to reach a stage that is away (restarting) fails with.
#: Seconds ``close()`` waits for the stage's ``GOODBYE``.
BYE_PATIENCE = 5.0

STAGE_AWAY = (OSError, ConnectionClosedError, UnavailableError, StageTimeoutError)


def _tries(within: float) -> Iterator[None]:
    """Yields once per try to reach the stage: at once, then after a
    backoff from 50 ms to 1 s, while the next try starts within
    ``within`` seconds of the first."""
    start, delay = time.monotonic(), 0.05
    yield
    while time.monotonic() - start + delay <= within:
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
        yield


def _connect(address: Address, timeout: Optional[float]) -> socket.socket:
    kind, target = parse_address(address)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = None
    try:
        if kind == "unix":
            sock.settimeout(timeout)
            sock.connect(target)
        else:
            sock = socket.create_connection(target, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
    except FileNotFoundError:
        if sock is not None:
            sock.close()
        raise ConnectionClosedError(
            f"no stage socket at {target!r}: is sluice-stage running with --socket {target}?",
            fatal=True) from None
    except OSError as e:
        if sock is not None:
            sock.close()
        where = target if kind == "unix" else "%s:%d" % target
        raise ConnectionClosedError(f"cannot connect to the stage at {where}: {e.strerror or e}",
                                    fatal=True) from None
    return sock


class _Listing:
    """The pages of a data set's listing fetched so far, and its index by
    name once built."""

    __slots__ = ("pages", "index")

    def __init__(self) -> None:
        self.pages: dict = {}
        self.index: Optional[dict] = None


class FileList(Sequence):
    """The dataset's files as ``(name, size)`` pairs, sorted by name bytes.

    Fetched lazily from the stage with ``LIST``, one page of 65536 entries
    at a time, and cached. ``files[i]`` is the file with index ``i``.
    """

    PAGE = p.MAX_LIST_LIMIT

    def __init__(self, dataset: "Dataset", listing: "_Listing") -> None:
        self._ds = dataset
        self._pages = listing.pages
        self._listing = listing

    def __len__(self) -> int:
        return self._ds.file_count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"file index {i} out of range for {n} files")
        if i < 0:
            i += n
        page = self._pages.get(i // self.PAGE)
        if page is None:
            page = self._fetch(i // self.PAGE)
        return page[i % self.PAGE]

    def __iter__(self) -> Iterator[Tuple[str, int]]:
        for k in range((len(self) + self.PAGE - 1) // self.PAGE):
            page = self._pages.get(k) or self._fetch(k)
            yield from page

    def names(self) -> List[str]:
        """Returns every file name, in index order."""
        return [name for name, _ in self]

    def indices_of(self, names: Sequence[str]) -> List[int]:
        """Returns the indices of ``names`` (the whole listing is fetched,
        and indexed once)."""
        if self._listing.index is None:
            self._listing.index = {name: i for i, (name, _) in enumerate(self)}
        index = self._listing.index
        try:
            return [index[name] for name in names]
        except KeyError as e:
            raise error_from_code(p.ErrorCode.BAD_PLAN,
                                  f"`{e.args[0]}` is not in the listing of dataset `{self._ds.name}`") from None

    def _fetch(self, k: int) -> list:
        ds = self._ds
        files = ds._call(p.encode_list(k * self.PAGE, self.PAGE), p.Files)
        expected = min(self.PAGE, ds.file_count - k * self.PAGE)
        if files.total != ds.file_count or len(files.entries) != expected:
            raise error_from_code(
                p.ErrorCode.BAD_PLAN,
                f"the stage's listing of {ds.name!r} changed: OPEN reported {ds.file_count} files, LIST "
                f"reports {files.total} (page {k} has {len(files.entries)} entries, expected {expected}); "
                "open the dataset again")
        self._pages[k] = files.entries
        return files.entries


class Dataset:
    """A dataset opened on a :class:`Client`.

    Attributes: ``name``, ``file_count``, ``total_bytes``, ``digest`` (as
    ``OPENED`` reported them) and ``files`` (a lazily fetched
    :class:`FileList`). If another dataset was opened on the same client
    since, this handle re-opens its own before each request.
    """

    def __init__(self, client: Client, name: str, opened: p.Opened) -> None:
        self.client = client
        self.name = name
        self._opened = opened
        self.file_count: int = opened.file_count
        self.total_bytes: int = opened.total_bytes
        self.digest: int = opened.digest
        self._listing = _Listing()

    @property
    def files(self) -> "FileList":
        """The data set's files (a view on one cache of the listing: the
        handle does not hold the view, which holds the handle)."""
        return FileList(self, self._listing)

    def __len__(self) -> int:
        return self.file_count

    def __repr__(self) -> str:
        return f"<sluice.Dataset {self.name!r} files={self.file_count} bytes={self.total_bytes}>"

    def _call(self, frame: bytes, expect: type) -> tuple:
        """One request that only reads (sent again on a new connection if
        the stage went away meanwhile)."""
        return self._on_stage(lambda: self.client._call(frame, expect))

    def _on_stage(self, exchange):
        """Runs ``exchange`` (requests on this dataset) under the client's
        lock, the dataset opened on the connection first, and again on a
        new connection if the stage went away (or is stopping) meanwhile."""
        c = self.client
        c._check_process()
        while True:
            seen = c._connection
            try:
                with c._lock:  # re-OPEN and the exchange are not split by another thread
                    self._reopen_if_needed()
                    return exchange()
            except (ConnectionClosedError, UnavailableError) as e:
                c._reconnect(e, seen)

    def _reopen_if_needed(self) -> None:
        c = self.client
        if c._dataset is not self:
            opened = c._call(p.encode_open(self.name), p.Opened)
            c._plan_generation += 1
            c._dataset = self
            if (opened.file_count, opened.digest) != (self.file_count, self.digest):
                raise error_from_code(
                    p.ErrorCode.BAD_PLAN,
                    f"dataset {self.name!r} changed on the stage since it was opened "
                    f"({self.file_count} -> {opened.file_count} files); open it again")

    # -- plans --------------------------------------------------------------

    def epoch(self, epoch: int, seed: int = 0, shuffle: bool = True, batch: int = 32,
              on_error: str = "raise", prefetch: int = DEFAULT_PREFETCH) -> "PlanIterator":
        """Submits this rank's ``SHUFFLE`` plan for ``epoch`` and returns an
        iterator of ``(name, data)`` in plan order.

        The stage starts prefetching as soon as this returns. The order is
        :func:`sluice.plan.shuffle_plan` of ``(file_count, seed, epoch,
        shuffle)`` sharded by the client's rank and world size. Other
        connections of the same job and rank that submit the same plan share
        it: each entry is delivered to exactly one of them.

        ``batch`` is how many samples one ``NEXT`` asks for (1..4096).
        ``on_error``: ``"raise"`` raises a sample's :class:`SluiceError` from
        ``next()`` (iterating on continues with the next sample);
        ``"yield"`` yields ``(name, SluiceError)`` in its place.

        ``prefetch``: how many batches a background thread receives ahead of
        the caller (default 2). From the first ``next()`` on, that thread
        sends the ``NEXT`` requests and receives and parses the answers while
        the training loop computes, so the loop does not spend its own time
        receiving data the stage already holds. ``0`` receives each batch in
        the caller's ``next()`` (no thread). Errors reach the caller in plan
        order either way. Close the iterator (:meth:`PlanIterator.close`, a
        ``with`` block, or dropping it) to stop the thread early.
        """
        epoch, seed = p.integer(epoch, "epoch", 64), p.integer(seed, "seed", 64)
        count, digest = self.file_count, self.digest
        return self._submit(lambda run: p.encode_plan_shuffle(epoch, seed, shuffle, count, digest, run),
                            epoch, batch, on_error, prefetch,
                            _Resume(lambda: self.local_order(epoch, seed, shuffle),
                                    lambda rest, run: p.encode_plan_indices(epoch, rest, run)))

    def plan_indices(self, indices: Sequence[int], epoch: int, batch: int = 32,
                     on_error: str = "raise", prefetch: int = DEFAULT_PREFETCH) -> "PlanIterator":
        """Submits an explicit plan of file indices (not sharded; repeats
        allowed) and returns an iterator of ``(name, data)`` in that order.
        See :meth:`epoch` for ``batch``, ``on_error`` and ``prefetch``."""
        indices, epoch = list(indices), p.integer(epoch, "epoch", 64)

        def encode(rest, run):
            return p.encode_plan_indices(epoch, rest, run)
        return self._submit(lambda run: encode(indices, run), epoch, batch, on_error, prefetch,
                            _Resume(lambda: indices, encode))

    def plan_names(self, names: Sequence[str], epoch: int, batch: int = 32,
                   on_error: str = "raise", prefetch: int = DEFAULT_PREFETCH) -> "PlanIterator":
        """Submits an explicit plan of file names (not sharded; repeats
        allowed) and returns an iterator of ``(name, data)`` in that order.
        More names than one request carries (16 MiB of them) go as the
        files' indices in the listing, which is fetched for it once.
        See :meth:`epoch` for ``batch``, ``on_error`` and ``prefetch``."""
        names, epoch = _names_of(names), p.integer(epoch, "epoch", 64)
        if sum(2 + len(str(name).encode("utf-8", "surrogatepass")) for name in names) > \
                self.client.max_request_frame - PLAN_FRAME_SLACK:
            # More names than one request carries (ImageNet's 1.28 M are
            # 49 MB): the same plan as the files' indices, 4 bytes each.
            return self.plan_indices(self.files.indices_of(names), epoch, batch, on_error, prefetch)

        def encode(rest, run):
            return p.encode_plan_names(epoch, rest, run)
        return self._submit(lambda run: encode(names, run), epoch, batch, on_error, prefetch,
                            _Resume(lambda: names, encode))

    def local_order(self, epoch: int, seed: int = 0, shuffle: bool = True) -> List[int]:
        """Returns the file indices :meth:`epoch` delivers for this client's
        rank, derived locally (no round trip)."""
        epoch, seed = p.integer(epoch, "epoch", 64), p.integer(seed, "seed", 64)
        c = self.client
        return _plan.shuffle_plan(self.file_count, seed, epoch, shuffle, c.rank, c.world_size)

    def _submit(self, encode: Callable[[int], bytes], epoch: int, batch: int, on_error: str,
                prefetch: int, resume: "_Resume") -> "PlanIterator":
        """Submits the ``PLAN`` frame ``encode(run)`` gives for the run the
        connection names, and returns its iterator."""
        if on_error not in ("raise", "yield"):
            raise ValueError(f'on_error must be "raise" or "yield", got {on_error!r}')
        given = batch
        batch = p.integer(batch, "batch")
        if not 1 <= batch <= p.MAX_SAMPLES_PER_NEXT:
            raise ValueError(f"batch must be an integer in 1..{p.MAX_SAMPLES_PER_NEXT}, got {given!r}")
        prefetch = p.integer(prefetch, "prefetch")
        if prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0 (batches), got {prefetch!r}")
        c = self.client

        def submit() -> "PlanIterator":
            # PLAN and the new generation are one step (under the lock): a
            # prefetch thread of an older iterator must never send NEXT for
            # this plan.
            planned = c._call(encode(c._plan_run), p.Planned)
            c._plan_generation += 1
            return PlanIterator(self, epoch, planned, batch, on_error == "yield", prefetch, resume)
        return self._on_stage(submit)

    # -- random access -------------------------------------------------------

    def read(self, name: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Returns ``length`` bytes of file ``name`` from ``offset`` (``None``:
        to the end of the file).

        A whole-file read of an entry of one of the job's active plans is
        served from the stage's prefetch buffer and counts as that entry's
        delivery. A file larger than one response frame is read in ranges
        automatically. Raises :class:`sluice.NotFoundError`,
        :class:`sluice.ForbiddenPathError`, :class:`sluice.SluiceIOError`, ...
        """
        offset = p.integer(offset, "offset")
        length = None if length is None else p.integer(length, "length")
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"offset and length must be >= 0, got offset={offset} length={length}")
        wire_length = p.READ_TO_END if length is None else length
        try:
            return self._call(p.encode_read(name, offset, wire_length), p.Data).data
        except TooLargeError:
            return self._read_ranges(name, offset, length)
        except SluiceError as e:
            if e.name is None:
                e.name = name
                e.args = (e._render(),)
            raise

    def fetch(self, names: Sequence[str], on_error: str = "raise") -> List[tuple]:
        """Returns ``[(name, data), ...]``: the whole files ``names``, in that
        order, read concurrently on the stage with one round trip per batch
        (``FETCH``; batches are split to fit a response frame, by the
        listed sizes).

        Like a whole-file :meth:`read`, a name that is an undelivered entry of
        one of the job's active plans is that entry's delivery (this is how
        the map-style :class:`sluice.torch.SluiceDataset` reads a batch its
        sampler planned). ``data`` is bytes, or a ``memoryview`` over shared
        memory on a connection that has it. ``on_error``: ``"raise"`` raises
        the first failed file's :class:`SluiceError` (after the whole batch
        was read), ``"yield"`` puts it in that file's place.
        """
        if on_error not in ("raise", "yield"):
            raise ValueError(f'on_error must be "raise" or "yield", got {on_error!r}')
        names = _names_of(names, ", or read it with read()")
        if self.client.protocol_version < 2:
            out = []
            for name in names:
                try:
                    out.append((name, self.read(name)))
                except SluiceError as e:
                    if on_error == "raise":
                        raise
                    out.append((name, e))
            return out
        out: List[tuple] = []
        for group in self._fetch_groups(names):
            got = self._call(p.encode_fetch(group), p.Samples)
            if len(got.samples) != len(group):
                raise ProtocolError(f"the stage answered FETCH of {len(group)} files with "
                                    f"{len(got.samples)} samples", fatal=False)
            out.extend((s.name, self._data_of(s)) for s in sorted(got.samples, key=lambda s: s.position))
        if on_error == "raise":
            for _, data in out:
                if isinstance(data, SluiceError):
                    raise data
        return out

    def _data_of(self, s: p.Sample):
        """A received sample's data, or its error as a :class:`SluiceError`;
        a file larger than one answer (``TOO_LARGE``) is read in ranges."""
        if s.status == p.SAMPLE_OK:
            return s.data
        if s.code == p.ErrorCode.TOO_LARGE:
            try:
                return self._read_ranges(s.name, 0, None)
            except SluiceError as e:
                return e
        return error_from_code(s.code, s.message, name=s.name)

    def _fetch_groups(self, names: Sequence[str]) -> Iterator[List[str]]:
        """Splits ``names`` into ``FETCH`` requests that each fit one answer
        (at most 32 MiB of listed bytes, or one file, and 4096 names)."""
        sizes = self._sizes()
        group: List[str] = []
        total = 0
        for name in names:
            size = sizes.get(name, 0)
            if group and (total + size > FETCH_BYTES or len(group) == p.MAX_SAMPLES_PER_NEXT):
                yield group
                group, total = [], 0
            group.append(name)
            total += size
        if group:
            yield group

    def _sizes(self) -> dict:
        if getattr(self, "_size_of", None) is None:
            self._size_of = dict(self.files)
        return self._size_of

    def _read_ranges(self, name: str, offset: int, length: Optional[int]) -> bytes:
        """Reads a file too large for one answer in ranges, each ``READ``
        starting where the last ended on one connection, so the stage reads
        them all of one version of the file. A file replaced while it is
        read (the stage answers its next range with an I/O error), or a
        connection lost between ranges, starts the read over, up to
        ``RANGED_TRIES`` times in all."""
        for attempt in range(1, RANGED_TRIES + 1):
            connection = self.client._connection
            try:
                parts = self._ranges(name, offset, length)
            except SluiceIOError:
                if attempt == RANGED_TRIES:
                    raise
                continue
            if self.client._connection is connection:
                return b"".join(parts)
        raise SluiceIOError(f"{name!r} could not be read in ranges over one connection in {RANGED_TRIES} tries "
                            "(the stage kept going away)", name=name)

    def _ranges(self, name: str, offset: int, length: Optional[int]) -> List[bytes]:
        # Leave room for the frame's own fields and any slack the stage keeps.
        chunk = max(1 << 16, self.client.max_response_frame - (1 << 20))
        parts = []
        want = length
        while want is None or want > 0:
            n = chunk if want is None else min(chunk, want)
            data = self._call(p.encode_read(name, offset, n), p.Data).data
            parts.append(data)
            offset += len(data)
            if want is not None:
                want -= len(data)
            if len(data) < n:
                break
        return parts
