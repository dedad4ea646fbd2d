"""Iterating a submitted plan: :class:`PlanIterator`, and the background
thread that receives batches ahead of the training loop."""

from __future__ import annotations

import _thread
import collections
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple, Union

from . import protocol as p
from .errors import (ConnectionClosedError, PlanConflictError, ProtocolError, SluiceError, StageTimeoutError,
                     UnavailableError)

if TYPE_CHECKING:
    from .client import Client, Dataset

__all__ = ["PlanIterator", "SupersededError"]

#: How long a resumed plan keeps meeting the old connection's plan (on a
#: stage that did not restart, and cannot take a plan naming a run) before
#: the conflict is an error.
RESUBMIT_CONFLICT_S = 2.0

#: The longest a prefetcher's wait lasts before it looks at its queue again
#: (a wake-up is normally prompt; this bounds one an interrupt cut short).
WAIT_RECHECK_S = 0.5

#: How many times this process is the child of a fork (of its parent's
#: count): an iterator made before a fork is its parent's.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class SupersededError(RuntimeError):
    """The iterator's plan is no longer its client's: another plan was
    submitted, or another dataset opened, on the same client."""


class AlreadyReadWarning(RuntimeWarning):
    """A plan of an epoch its job (or run) already read in full on the
    stage: it delivers nothing again (``PlanState.COMPLETE``)."""


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
                f"name (with a DataLoader: call set_epoch before each epoch)", AlreadyReadWarning,
                stacklevel=3)
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
        # The last answer taken from the prefetch thread's queue; the plan
        # position after the batches a synchronous iterator holds.
        self._taken: Optional[p.Samples] = None
        self._handed = 0
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
        data = self.dataset._data_of(s)
        failed = isinstance(data, SluiceError) and not self._yield_errors
        # The sample is the caller's from here: nothing between taking it
        # and returning it calls a function, so an interrupt (Ctrl-C, a
        # signal handler's exception), which Python raises only at calls
        # and loops, lands before it (the next call yields it) or after.
        self._next_pending += 1
        self.delivered += 1
        if failed:
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
            try:
                got = self._exchange()
            except (SluiceError, RuntimeError):
                raise
            except BaseException:
                # Interrupted (Ctrl-C, a signal handler's exception) anywhere
                # in the exchange, perhaps after its answer came: what it
                # received is not this iterator's, so the next call takes
                # the plan up again from the first entry after its batches
                # (marked without a call: an interrupt lands only at one).
                self._exchanger.rewind = self._handed
                raise
            self._pending = got.samples
            self._next_pending = 0
            self._end = got.end
            self._handed = self._exchanger.next
            return
        client._check_process()
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(self._exchange_fn(), self.prefetch, client)
        self._prefetcher.start()
        # An interrupt of this wait (Ctrl-C) is the caller's, not the
        # exchange's: a later next() waits again. The answer leaves the
        # queue only once this iterator holds it, so an interrupt between
        # the two loses nothing (the next look passes over it).
        got = self._prefetcher.peek(self._taken)
        if type(got) is _Failed:
            if isinstance(got.error, StageTimeoutError) and self._exchanger.resume is not None:
                # The timeout closed the connection, as without prefetch:
                # the next call connects again and takes the plan up from
                # the first sample not received, on a new prefetch thread
                # (this one ended at the failure; it was raised forever).
                self._prefetcher.drop(got)
                self._prefetcher = None
                self._taken = None
                raise got.error
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
        self._taken = got
        self._prefetcher.drop(got)

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
        # A closed connection (an interrupt dropped it, perhaps before its
        # data set was opened again) is no sign of another plan: the
        # request raises the lost connection, which resumes the plan.
        if not client._closed and (client._plan_generation != generation
                                   or client._dataset is not dataset):
            raise SupersededError(
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

    __slots__ = ("_make", "encode", "_made", "_done")

    def __init__(self, make, encode) -> None:
        self._make = make
        self.encode = encode
        self._made: Optional[tuple] = None
        # Held until the order is made (see order()).
        self._done: Optional[_thread.LockType] = None

    def order(self) -> list:
        """The plan's entries, made once, on a thread of their own: an
        interrupt of the caller (a signal handler that raises) while a long
        order is made does not throw the work away. Made again at each
        resume, a shuffled order of a few thousand entries took longer than
        the interval of a storm of interrupts, and the plan never got on.

        The thread is a bare one waited on with a bare lock: an interrupt
        can land anywhere in here, and one that landed inside
        ``threading.Thread.start`` (between a condition's release and the
        ``try`` that takes it back) broke the condition, which then failed
        with "release unlocked lock". An interrupt before the thread is
        noted costs a second thread making the same order; one after the
        wait ends leaves the lock held, but the order is made by then."""
        while self._made is None:
            done = self._done
            if done is None:
                done = _thread.allocate_lock()
                done.acquire()
                _thread.start_new_thread(self._run, (done,))
                self._done = done
            if done.acquire(timeout=1.0):
                done.release()
        order, error = self._made
        if error is not None:
            raise error
        return order

    def _run(self, done) -> None:
        try:
            self._made = (self._make(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._made = (None, e)
        finally:
            done.release()


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
        # The connection the plan was submitted on.
        self.connection = dataset.client._connection
        # Set once other connections were seen to read the plan too.
        self.shared = False
        self.frame = p.encode_next(batch)
        self.length = planned.length
        self.resume = resume
        # Plan position of the current submission's entry 0, and the next
        # position expected.
        self.base = 0
        self.next = 0
        self.resumed = 0
        # Set when an interrupt cut an exchange short (the stage may have
        # sent its answer, and this exchanger counted it): the plan position
        # of the first entry the iterator does not hold. The next exchange
        # connects again and submits the plan from there.
        self.rewind: Optional[int] = None

    def __call__(self) -> p.Samples:
        while True:
            seen = self.client._connection
            try:
                if self.rewind is not None:
                    raise ConnectionClosedError("an interrupt cut this plan's last exchange short",
                                                fatal=True)
                if self.resume is not None and seen != self.connection:
                    # Another call on the client (a read by name, another
                    # thread's) found the stage gone and connected again:
                    # the new connection holds no plan of this iterator's.
                    seen = self.connection
                    raise ConnectionClosedError("the client connected again since this plan's last exchange",
                                                fatal=True)
                got = _next_exchange(self.client, self.dataset, self.generation, self.frame)
            except (ConnectionClosedError, UnavailableError) as e:
                if self.resume is None and self.shared:
                    raise ConnectionClosedError(
                        f"{e.message}; this plan was read together with other connections of the job, so which of "
                        "its samples came is known to none of them and it is not resumed on a new "
                        "connection: give each connection its own share (rank and world_size, or "
                        "plan_indices), which resumes", fatal=True) from e
                if self.resume is None:
                    raise
                self.client._reconnect(e, seen)
                if self.rewind is not None:
                    self.next = min(self.next, self.rewind)
                if self.next < self.length:
                    self._resubmit()
                self.rewind = None
                if self.next >= self.length:
                    return p.Samples(end=True, samples=[])
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
                self.shared = True
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
                    # Opened again by the reconnect, unless an interrupt cut
                    # that short.
                    self.dataset._reopen_if_needed()
                    planned = c._call(self.resume.encode(rest, run), p.Planned)
                    if planned.state != p.PlanState.CREATED:
                        self._leave_plan()
                        raise PlanConflictError(
                            "the stage still holds this plan from the connection this client dropped "
                            "(an interrupt or a timeout mid-exchange), with the samples it had claimed",
                            fatal=False)
                    c._plan_generation += 1
                    self.generation = c._plan_generation
                    self.connection = c._connection
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
        # iterator's __del__, which calls stop(). Waits are not a
        # threading.Condition's: its wait() releases the lock and takes it
        # again in Python code, and an interrupt (a KeyboardInterrupt from a
        # signal handler) landing between the two left the lock released
        # inside a `with` block, whose end then failed with "cannot release
        # un-acquired lock". Here a waiter registers under the lock and
        # blocks after leaving it (see _waiter).
        self._lock = threading.RLock()
        self._waiters: List = []
        self._items: collections.deque = collections.deque()
        self._stopped = False
        self._done = False
        client._prefetchers.add(self)
        self.thread = threading.Thread(target=self._run, name="sluice-prefetch", daemon=True)

    def start(self) -> None:
        """Starts the thread unless it runs: called by every look at the
        queue, so that an interrupt between making the prefetcher and
        starting it leaves no iterator without its thread (and none with
        two)."""
        if self.thread.ident is None and not self.thread.is_alive():
            try:
                self.thread.start()
            except RuntimeError:  # started by a start an interrupt cut short
                pass

    def _waiter(self):
        """Called under the lock: a lock to block on once the lock is left,
        released by the next :meth:`_notify`. A wait ends at the latest
        after ``WAIT_RECHECK_S`` (then the caller looks again), so a notify
        an interrupt cut short delays a waiter and never strands it."""
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        return waiter

    def _notify(self) -> None:
        """Called under the lock: wakes every registered waiter once."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()

    def _run(self) -> None:
        items = self._items
        try:
            while True:
                while True:
                    with self._lock:
                        if self._stopped:
                            return
                        if len(items) < self._depth or self._client._closed:
                            break
                        waiter = self._waiter()
                    waiter.acquire(timeout=WAIT_RECHECK_S)
                try:
                    got = self._exchange()
                except BaseException as e:  # delivered to the consumer, in order
                    self._put(_Failed(e))
                    return
                self._put(got)
                if got.end:
                    return
        finally:
            with self._lock:
                self._done = True
                self._notify()
            self._exchange = None  # drop the client/dataset references early

    def _put(self, item) -> None:
        with self._lock:
            if not self._stopped:
                self._items.append(item)
                self._notify()

    def peek(self, taken=None) -> Union[p.Samples, _Failed, None]:
        """Returns the next answer (waiting for it) without taking it from
        the queue, the failure that ended the thread, or None once stopped;
        ``taken``, an answer the caller already holds, is dropped first if
        it is still queued."""
        while True:
            with self._lock:
                if self._items and self._items[0] is taken:
                    self._items.popleft()
                    self._notify()
                if self._items:
                    return self._items[0]
                if self._stopped:
                    return None
                if self._done:
                    raise RuntimeError("the sluice prefetch thread ended without an answer")
                waiter = self._waiter()
            waiter.acquire(timeout=WAIT_RECHECK_S)

    def drop(self, taken) -> None:
        """Takes answer ``taken`` (which :meth:`peek` returned) from the queue."""
        with self._lock:
            if self._items and self._items[0] is taken:
                self._items.popleft()
                self._notify()

    def wake(self) -> None:
        """Lets a thread waiting for room re-check the client (closed)."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            self._notify()

    def stop(self) -> None:
        """Asks the thread to end (after its exchange in progress) and drops
        the queued answers."""
        with self._lock:
            self._stopped = True
            self._items.clear()
            self._notify()

    def join(self, timeout: Optional[float] = None, unless: Optional[threading.Thread] = None) -> None:
        if self.thread is not unless and os.getpid() == self.pid and self.thread.ident is not None:
            self.thread.join(timeout)
