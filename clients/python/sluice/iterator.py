"""Iterating a submitted plan: :class:`PlanIterator`, and the background
thread that receives batches ahead of the training loop."""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple, Union

from . import protocol as p
from .errors import ConnectionClosedError, PlanConflictError, ProtocolError, SluiceError, UnavailableError

if TYPE_CHECKING:
    from .client import Client, Dataset

__all__ = ["PlanIterator"]

#: How long a resumed plan keeps meeting the old connection's plan (on a
#: stage that did not restart, and cannot take a plan naming a run) before
#: the conflict is an error.
RESUBMIT_CONFLICT_S = 2.0

#: How many times this process is the child of a fork (of its parent's
#: count): an iterator made before a fork is its parent's.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class PlanIterator:
    """Iterates one submitted plan: ``(name, data)`` in plan order.

    ``length`` is the plan's length (all of it, also when other connections
    share it) and ``state`` how the stage took it
    (:class:`sluice.protocol.PlanState`: created, joined, or already
    complete). When other connections share the plan, this iterator yields
    only the entries it claimed. Submitting another plan or opening another
    dataset on the same client ends this iterator with an error.

    With ``prefetch`` > 0 a background thread (started by the first
    ``next()``) keeps up to ``prefetch`` batches received ahead. A failure of
    a ``NEXT`` exchange (a stage error, a lost connection, a superseded plan)
    is raised by ``next()`` after the batches received before it, and again
    by every later ``next()``. :meth:`close` (or leaving a ``with`` block, or
    dropping the iterator) stops the thread once its exchange in progress is
    done; the client stays usable. Batches received but not consumed are
    dropped, as are those of a synchronous iterator left half-read.
    """

    def __init__(self, dataset: Dataset, epoch: int, planned: p.Planned, batch: int, yield_errors: bool,
                 prefetch: int = 0, resume: Optional["_Resume"] = None):
        self.dataset = dataset
        self.epoch = epoch
        self.length: int = planned.length
        self.state = p.PlanState(planned.state) if planned.state in (0, 1, 2) else planned.state
        if self.state == p.PlanState.COMPLETE and self.length:
            # Right for a trainer of a running job that comes back to an
            # epoch its job finished (nothing is delivered twice); a
            # surprise for a new run that reuses the job's name without
            # naming itself a run.
            c = dataset.client
            by, again = ("this run", "a new epoch number") if c._plan_run else \
                ("the job", "a new run (Client(run=...)), a new epoch number")
            warnings.warn(
                f"epoch {epoch} of job {c.job!r} (shard {c.rank} of {c.world_size}) was already read in "
                f"full by {by} on this stage, so this plan delivers nothing (its iterator yields nothing, "
                f"and reads of its files are not prefetched); to read it again use {again} or a new job "
                f"name", RuntimeWarning, stacklevel=3)
        self.delivered = 0
        self.prefetch = prefetch
        self._batch = batch
        self._yield_errors = yield_errors
        self._exchanger = _Exchanger(dataset, batch, planned,
                                     resume if planned.state == p.PlanState.CREATED else None)
        self._pending: List[p.Sample] = []
        self._next_pending = 0
        self._end = False
        self._failure: Optional[BaseException] = None
        self._prefetcher: Optional[_Prefetcher] = None
        self._fork, self._pid = _forks, os.getpid()

    def __iter__(self) -> "PlanIterator":
        return self

    def __next__(self) -> Tuple[str, Union[bytes, SluiceError]]:
        if self._fork != _forks:
            self._check_process()
        while self._next_pending >= len(self._pending):
            if self._end:
                raise StopIteration
            self._fill()
        s = self._pending[self._next_pending]
        self._next_pending += 1
        self.delivered += 1
        data = self.dataset._data_of(s)
        if isinstance(data, SluiceError) and not self._yield_errors:
            raise data
        return s.name, data

    def samples(self) -> Iterator[p.Sample]:
        """Yields the raw :class:`sluice.protocol.Sample` records (with their
        plan positions), errors included, never raising for a sample."""
        self._check_process()
        while True:
            while self._next_pending < len(self._pending):
                s = self._pending[self._next_pending]
                self._next_pending += 1
                self.delivered += 1
                yield s
            if self._end:
                return
            self._fill()

    def close(self) -> None:
        """Stops iterating: later ``next()`` calls raise ``StopIteration``.

        With prefetching, stops the thread and waits for its exchange in
        progress (one ``NEXT``) to finish, so the client can be used at once.
        The entries it claimed but the caller did not take are not delivered
        again. Calling it again does nothing.
        """
        self._end = True
        self._pending = []
        self._next_pending = 0
        pf = self._prefetcher
        if pf is not None and os.getpid() == self.dataset.client._pid:
            pf.stop()
            pf.join(unless=threading.current_thread())

    def __enter__(self) -> "PlanIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Abandoned (break out of a for loop, garbage collected): let the
        # prefetch thread go. It holds no reference to this iterator.
        pf = getattr(self, "_prefetcher", None)
        if pf is not None:
            try:
                if os.getpid() == pf.pid:
                    pf.stop()
            except Exception:  # interpreter shutdown
                pass

    def _check_process(self) -> None:
        """Refuses a forked child the batches its parent received (both
        would yield them); it must open its own client."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this sluice plan iterator was made in another process (pid {self._pid}); a "
                "forked process must open its own Client and submit its own plan")

    def _fill(self) -> None:
        if self._failure is not None:
            raise self._failure
        client = self.dataset.client
        if self.prefetch <= 0:
            got = self._exchange()
        else:
            client._check_process()
            if self._prefetcher is None:
                self._prefetcher = _Prefetcher(self._exchange_fn(), self.prefetch, client)
            # An interrupt of this wait (Ctrl-C) is the caller's, not the
            # exchange's: a later next() waits again.
            got = self._prefetcher.take()
            if type(got) is _Failed:
                self._failure = got.error
                raise got.error
            if got is None:  # stopped
                self._end = True
                self._pending = []
                self._next_pending = 0
                return
        self._pending = got.samples
        self._next_pending = 0
        self._end = got.end

    def _exchange_fn(self):
        """Returns a callable doing one NEXT exchange that holds no
        reference to this iterator (the prefetch thread runs it)."""
        return self._exchanger

    def _exchange(self) -> p.Samples:
        return self._exchanger()

    @property
    def resumed(self) -> int:
        """How many times this plan was resumed on a new connection."""
        return self._exchanger.resumed

    def __repr__(self) -> str:
        mode = f"prefetch={self.prefetch}" if self.prefetch else "synchronous"
        return (f"<sluice.PlanIterator dataset={self.dataset.name!r} epoch={self.epoch} "
                f"length={self.length} delivered={self.delivered} {mode}>")


def _next_exchange(client: Client, dataset: Dataset, generation: int, frame: bytes) -> p.Samples:
    """One ``NEXT`` for the plan of ``generation``: the check that the plan
    is still the connection's and the request are one locked step."""
    client._check_process()
    with client._lock:
        if client._plan_generation != generation or client._dataset is not dataset:
            raise RuntimeError(
                "this plan iterator was superseded: another plan was submitted or another dataset "
                "opened on the same sluice.Client; use one Client per concurrent iterator")
        got = client._call(frame, p.Samples)
    if not got.samples and not got.end:
        raise ProtocolError("the stage answered NEXT with no samples and without the end flag",
                            fatal=False)
    return got


class _Resume:
    """How to submit what is left of a plan: ``order()`` gives the whole
    plan's entries (indices or names) in order, ``encode(rest, run)`` the
    ``PLAN`` frame of a tail of them for a run."""

    __slots__ = ("order", "encode")

    def __init__(self, order, encode) -> None:
        self.order = order
        self.encode = encode


class _Exchanger:
    """Does one plan's ``NEXT`` exchanges, and resumes the plan when the
    stage goes away: after the client connected again, it submits the
    entries from the first one not yet received, so that none is delivered
    twice or skipped. Only a plan this connection created and read alone
    (its positions came without gaps) resumes; any other raises the lost
    connection. Holds no reference to the iterator."""

    def __init__(self, dataset: Dataset, batch: int, planned: p.Planned, resume: Optional[_Resume]) -> None:
        self.client = dataset.client
        self.dataset = dataset
        self.generation = dataset.client._plan_generation
        self.frame = p.encode_next(batch)
        self.length = planned.length
        self.resume = resume
        # Plan position of the current submission's entry 0, and the next
        # position expected.
        self.base = 0
        self.next = 0
        self.resumed = 0

    def __call__(self) -> p.Samples:
        while True:
            seen = self.client._connection
            try:
                got = _next_exchange(self.client, self.dataset, self.generation, self.frame)
            except (ConnectionClosedError, UnavailableError) as e:
                if self.resume is None:
                    raise
                self.client._reconnect(e, seen)
                if self.next >= self.length:
                    return p.Samples(end=True, samples=[])
                self._resubmit()
                continue
            if self.resume is not None:
                self._track(got)
            return got

    def _track(self, got: p.Samples) -> None:
        base = self.base
        for s in got.samples:
            if base + s.position != self.next:
                # Another connection claims entries of this plan: resuming
                # from here could deliver theirs again.
                self.resume = None
                return
            self.next += 1

    def _resubmit(self) -> None:
        c = self.client
        rest = self.resume.order()[self.next:]
        run = c._plan_run
        # On a stage that stayed up (this client dropped the connection
        # itself: an interrupt, its timeout), the old connection's plan
        # lives until the stage sees that connection close, and the entries
        # it claimed never arrived. A plan of the same identity would meet
        # it: refused when it differs, joined when it is the same, and then
        # those entries are lost. So the rest is planned under a run of its
        # own, or (a stage that takes no runs) once the old plan is gone.
        deadline = time.monotonic() + RESUBMIT_CONFLICT_S
        while True:
            try:
                with c._lock:
                    planned = c._call(self.resume.encode(rest, run), p.Planned)
                    if planned.state != p.PlanState.CREATED:
                        self._leave_plan()
                        raise PlanConflictError(
                            "the stage still holds this plan from the connection this client dropped "
                            "(an interrupt or a timeout mid-exchange), with the samples it had claimed",
                            fatal=False)
                    c._plan_generation += 1
                    self.generation = c._plan_generation
                break
            except PlanConflictError:
                if c._runs:
                    run = int.from_bytes(os.urandom(8), "big") or 1
                    continue
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        self.base = self.next
        self.resumed += 1

    def _leave_plan(self) -> None:
        """Detaches the connection from the plan it joined (by opening the
        data set again), refusing a listing that changed meanwhile."""
        c = self.client
        c._dataset = None
        self.dataset._reopen_if_needed()


class _Failed:
    """A queue entry: the exchange failed with ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Prefetcher:
    """The background thread of a prefetching :class:`PlanIterator`.

    Runs ``exchange()`` (one ``NEXT``) whenever fewer than ``depth`` answers
    are waiting, and queues each answer (or the exception that ended it) for
    :meth:`take`. Ends after the plan's last batch, the first failure, or
    :meth:`stop`. It never holds its condition while talking to the stage,
    and holds no reference to the iterator, so an abandoned iterator is
    collected and its ``__del__`` stops the thread.
    """

    def __init__(self, exchange, depth: int, client: Client) -> None:
        self._exchange = exchange
        self._depth = depth
        self._client = client  # for client._closed only
        self.pid = os.getpid()
        # Reentrant: a garbage collection on the holding thread may run an
        # iterator's __del__, which calls stop().
        self._cond = threading.Condition(threading.RLock())
        self._items: collections.deque = collections.deque()
        self._stopped = False
        self._done = False
        client._prefetchers.add(self)
        self.thread = threading.Thread(target=self._run, name="sluice-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cond, items = self._cond, self._items
        try:
            while True:
                with cond:
                    while (not self._stopped and len(items) >= self._depth
                           and not self._client._closed):
                        cond.wait()
                    if self._stopped:
                        return
                try:
                    got = self._exchange()
                except BaseException as e:  # delivered to the consumer, in order
                    self._put(_Failed(e))
                    return
                self._put(got)
                if got.end:
                    return
        finally:
            with cond:
                self._done = True
                cond.notify_all()
            self._exchange = None  # drop the client/dataset references early

    def _put(self, item) -> None:
        with self._cond:
            if not self._stopped:
                self._items.append(item)
                self._cond.notify_all()

    def take(self) -> Union[p.Samples, _Failed, None]:
        """Returns the next answer (waiting for it), the failure that ended
        the thread, or None once stopped."""
        with self._cond:
            while not self._items:
                if self._stopped:
                    return None
                if self._done:
                    raise RuntimeError("the sluice prefetch thread ended without an answer")
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify_all()
        return item

    def wake(self) -> None:
        """Lets a thread waiting for room re-check the client (closed)."""
        if os.getpid() != self.pid:
            return
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        """Asks the thread to end (after its exchange in progress) and drops
        the queued answers."""
        with self._cond:
            self._stopped = True
            self._items.clear()
            self._cond.notify_all()

    def join(self, timeout: Optional[float] = None, unless: Optional[threading.Thread] = None) -> None:
        if self.thread is not unless and os.getpid() == self.pid:
            self.thread.join(timeout)
