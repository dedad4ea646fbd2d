"""Iterating a submitted plan: :class:`PlanIterator`, and the background
thread that receives batches ahead of the training loop."""

from __future__ import annotations

import collections
import os
import threading
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple, Union

from . import protocol as p
from .errors import ProtocolError, SluiceError, error_from_code

if TYPE_CHECKING:
    from .client import Client, Dataset

__all__ = ["PlanIterator"]


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
                 prefetch: int = 0):
        self.dataset = dataset
        self.epoch = epoch
        self.length: int = planned.length
        self.state = p.PlanState(planned.state) if planned.state in (0, 1, 2) else planned.state
        self.delivered = 0
        self.prefetch = prefetch
        self._batch = batch
        self._yield_errors = yield_errors
        self._generation = dataset.client._plan_generation
        self._pending: List[p.Sample] = []
        self._next_pending = 0
        self._end = False
        self._failure: Optional[BaseException] = None
        self._prefetcher: Optional[_Prefetcher] = None

    def __iter__(self) -> "PlanIterator":
        return self

    def __next__(self) -> Tuple[str, Union[bytes, SluiceError]]:
        while self._next_pending >= len(self._pending):
            if self._end:
                raise StopIteration
            self._fill()
        s = self._pending[self._next_pending]
        self._next_pending += 1
        self.delivered += 1
        if s.status == 0:
            return s.name, s.data
        err = error_from_code(s.code, s.message, name=s.name)
        if self._yield_errors:
            return s.name, err
        raise err

    def samples(self) -> Iterator[p.Sample]:
        """Yields the raw :class:`sluice.protocol.Sample` records (with their
        plan positions), errors included, never raising for a sample."""
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
            try:
                got = self._prefetcher.take()
            except BaseException as e:
                self._failure = e
                raise
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
        client = self.dataset.client
        dataset = self.dataset
        generation = self._generation
        frame = p.encode_next(self._batch)

        def exchange() -> p.Samples:
            return _next_exchange(client, dataset, generation, frame)

        return exchange

    def _exchange(self) -> p.Samples:
        return _next_exchange(self.dataset.client, self.dataset, self._generation, p.encode_next(self._batch))

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

    def take(self) -> Optional[p.Samples]:
        """Returns the next answer (waiting for it), raises the failure that
        ended the thread, or returns None once stopped."""
        with self._cond:
            while not self._items:
                if self._stopped:
                    return None
                if self._done:
                    raise RuntimeError("the sluice prefetch thread ended without an answer")
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify_all()
        if type(item) is _Failed:
            raise item.error
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
