"""Shared-memory delivery on the client side (protocol version 2).

A local trainer that asks for it in ``HELLO`` receives, with ``WELCOME``, a
read-only descriptor of its job's memory region on the stage; samples then
arrive as an offset and a length in that region instead of bytes in the
frame. :class:`Region` maps the region and turns each sample into a
``memoryview`` over it, with no copy.

Lifetime: a sample's memory stays valid as long as anything refers to it:
the ``memoryview``, a slice of it, or a numpy array or torch tensor made
from it (``numpy.frombuffer``, ``torch.frombuffer``). When the last
reference goes, the slot is queued for return to the stage (``RELEASE``),
which goes with the client's next request or, when the client is idle,
from a small background thread. A job holds at most half its buffer (at
least 64 MiB) in slots; beyond that the stage sends samples as bytes, so
holding samples never stalls reading. A sample stays valid after its
connection ends: the client copies the pages of the samples it still
holds before it ends a connection, or as soon as it finds it ended
(:meth:`Region.close`), and the stage does not reuse the slots of a
connection it ended itself. A child forked while samples are alive gets
its own copy of them at the fork (:meth:`Region._forked`): its parent may
give them back while the child still refers to them.

A process may hand its samples to another process of the same job without
copying them (:meth:`Region.hand_off`): the stage then counts them as the
job's, and the process that maps them (its own connection to the same job)
returns them. ``sluice.torch`` does this to pass a ``DataLoader`` worker's
batch to the main process.

The region is mapped private and writable: writing into a sample (an
in-place transform) changes only this process's copy of those pages, never
the stage's data, and the pages are dropped when the slot is returned, so a
later sample in the same slot is read fresh.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import socket
import sys
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from .errors import ConnectionClosedError

__all__ = ["Region", "supported", "receive_with_fd", "region_of", "register"]

PAGE = mmap.PAGESIZE


def supported() -> bool:
    """Whether this platform can take shared-memory delivery."""
    return (hasattr(socket, "recv_fds") and hasattr(mmap, "MAP_PRIVATE")
            and hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED"))


def receive_with_fd(sock: socket.socket, limit: int):
    """Receives one whole frame (``u32`` length first) and the descriptor
    that came with its first byte, if any. Returns ``(frame, fd or None)``;
    raises :class:`ConnectionClosedError` when the stream ends first."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
    fd = fds[0] if fds else None
    for extra in fds[1:]:
        os.close(extra)
    try:
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
            if len(data) >= 4 and int.from_bytes(data[:4], "big") > limit:
                break
            more = sock.recv(65536)
            if not more:
                what = "before answering" if not data else "in the middle of its answer"
                raise ConnectionClosedError(f"the stage closed the connection {what}", fatal=True)
            data += more
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return data, fd


#: Bytes of returns waiting in a region before its flusher sends them
#: without waiting for the client's next request (well under the least a
#: job may hold in slots, 64 MiB). A client that keeps asking never needs
#: it: its requests carry the returns.
FLUSH_BYTES = 16 << 20
#: How long returns may wait for a request to carry them.
FLUSH_AFTER_S = 0.05


#: Slot types by size in bytes (whole pages), shared by every region of
#: the process: a type costs kilobytes, so one per sample length and region
#: would be megabytes for a data set of varied sizes.
_SLOT_TYPES: Dict[int, type] = {}


def _slot_type(size: int) -> type:
    """A ctypes array type of ``size`` bytes whose instances give their
    slot back to their region when the last reference to them goes
    (``__del__`` is much cheaper per sample than a ``weakref.finalize``)."""
    kind = _SLOT_TYPES.get(size)
    if kind is None:
        if len(_SLOT_TYPES) > 1024:
            _SLOT_TYPES.clear()
        kind = type(f"Slot{size}", (ctypes.c_char * size,), {"__del__": _give_back_slot})
        _SLOT_TYPES[size] = kind
    return kind


def _give_back_slot(slot) -> None:
    slot.region._give_back(slot.offset, slot.length, slot.handed)


class Region:
    """A job's shared-memory region as this process maps it.

    :meth:`view` returns a sample's bytes; :meth:`returned` drains the
    offsets of samples nobody refers to any more. ``flush`` (set by the
    client) sends returns that have waited too long.
    """

    def __init__(self, fd: int, size: int, flush: Optional[Callable[[], None]] = None) -> None:
        try:
            st = os.fstat(fd)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        #: Names this region among every process that maps it (the
        #: stage's memory file), so that samples handed over from another
        #: process are mapped through the same region, never another.
        self.ident: Tuple[int, int] = (st.st_dev, st.st_ino)
        # Offsets of samples whose last reference went; appended from
        # whatever thread drops it (deque operations are atomic).
        self._returned: collections.deque = collections.deque()
        # Bytes returned since the flusher was last woken (approximate:
        # updated without a lock from whichever thread drops a sample).
        self._waiting = 0
        # Samples of this region alive in this process: offset -> length.
        self._live: Dict[int, int] = {}
        self._open = True
        self._flush = flush
        self._wake = threading.Event()
        self._flusher: Optional[threading.Thread] = None
        self._pid = os.getpid()

    def view(self, offset: int, length: int) -> memoryview:
        """Returns the ``length`` bytes at ``offset`` as a read-write
        ``memoryview`` of this process's mapping, returned to the stage when
        the last reference to it (or anything made from it) goes."""
        return memoryview(self.slot(offset, length)).cast("B")[:length]

    def slot(self, offset: int, length: int):
        """Returns the object that owns the sample at ``offset`` (a ctypes
        array over its whole pages; the sample is its first ``length``
        bytes): the sample goes back when it is collected, unless it was
        handed off."""
        if offset < 0 or length < 0 or offset + length > self.size or offset % PAGE:
            raise ValueError(f"the stage placed a sample at {offset}+{length}, outside its "
                             f"{self.size}-byte region or off a page boundary")
        owner = _slot_type(min(-(-length // PAGE) * PAGE, self.size - offset)).from_buffer(self._mm, offset)
        owner.offset = offset
        owner.length = length
        owner.handed = False
        # The region the sample is in: after a reconnection the client has
        # another, and the offset means nothing there.
        owner.region = self
        self._live[offset] = length
        if not self._open:
            # Handed over from another process after this one's connection
            # ended: keep the bytes as they are now.
            self._keep(offset, length)
        return owner

    def _give_back(self, offset: int, length: int, handed: bool) -> None:
        self._live.pop(offset, None)
        if handed:
            return
        if not self._open:
            # Its slot went back with the connection: only this process's
            # pages of it are left to drop (a copy made at close, or the
            # stage's pages this mapping touched).
            self._madvise(offset, offset + -(-length // PAGE) * PAGE)
            return
        self._returned.append((offset, length))
        self._waiting += length
        if self._waiting >= FLUSH_BYTES and self._flush is not None:
            self._waiting = 0
            self._wake.set()
        # Not while the interpreter exits: a sample collected then (one a
        # script kept to its end) would start a thread that never runs,
        # and exit would wait for it for ever. The connection's end
        # returns every slot anyway.
        if (self._flusher is None and self._flush is not None and os.getpid() == self._pid
                and not sys.is_finalizing()):
            self._start_flusher()

    def _start_flusher(self) -> None:
        region = weakref.ref(self)

        def run() -> None:
            while True:
                me = region()
                if me is None or not me._open:
                    return
                wake = me._wake
                del me
                wake.wait(FLUSH_AFTER_S)
                wake.clear()
                me = region()
                if me is None or not me._open:
                    return
                if me._returned and me._flush is not None:
                    try:
                        me._flush()
                    except Exception:  # the client's own errors end it; returns are then moot
                        return
                del me

        self._flusher = threading.Thread(target=run, name="sluice-returns", daemon=True)
        self._flusher.start()

    def returned(self) -> List[int]:
        """Takes the offsets of the samples given back since the last call,
        first dropping any page of theirs this process wrote (copy-on-write),
        so that a slot's next sample is read from the stage's pages."""
        taken = []
        pop = self._returned.popleft
        try:
            while True:
                taken.append(pop())
        except IndexError:
            pass
        if taken and self._open:
            self._drop_pages(taken)
        return [offset for offset, _ in taken]

    def _drop_pages(self, slots: List[Tuple[int, int]]) -> None:
        """``MADV_DONTNEED`` over the slots, adjacent ones in one call (each
        call is a system call and a TLB flush on every core running this
        process)."""
        start = end = -1
        for offset, length in sorted(slots):
            stop = offset + -(-length // PAGE) * PAGE
            if offset <= end:
                end = max(end, stop)
                continue
            if end > start:
                self._madvise(start, end)
            start, end = offset, stop
        if end > start:
            self._madvise(start, end)

    def _madvise(self, start: int, end: int) -> None:
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    @staticmethod
    def hand_off(owners) -> List[int]:
        """Marks samples (their owning objects, from :meth:`slot`) as handed
        to another process of the job: they will not be returned from here.
        Returns their offsets, for ``HAND_OFF``."""
        offsets = []
        for owner in owners:
            owner.handed = True
            offsets.append(owner.offset)
        return offsets

    def close(self) -> None:
        """Keeps the samples still alive as they are (the stage reuses a
        slot once the connection that held it ended) and forgets the
        returns. Called before the client ends its connection, or as soon
        as it finds the connection ended. The mapping itself goes when the
        last sample viewing it does."""
        if not self._open:
            return
        self.returned()  # their slots go back with the connection; their pages go now
        self._open = False
        for offset, length in list(self._live.items()):
            self._keep(offset, length)
        self._wake.set()

    def _forked(self) -> None:
        """In a child forked while this process mapped the region: the
        connection is the parent's, and the parent gives its samples back
        whenever it drops them, after which the stage writes other samples
        into their slots. The samples alive at the fork are copied into
        the child's own memory now, so that they stay what they were."""
        self._open = False
        self._flush = None
        self._flusher = None
        self._returned.clear()
        for offset, length in list(self._live.items()):
            self._keep(offset, length)

    def _keep(self, offset: int, length: int) -> None:
        """Gives this process its own copy of a sample's pages: a write to
        each page of the private mapping copies it (copy-on-write), and
        later writes by the stage no longer show through."""
        mm = self._mm
        try:
            for page in range(offset, offset + max(length, 1), PAGE):
                mm[page] = mm[page]
        except (ValueError, IndexError):
            pass  # the mapping is closed: nothing views it any more


# -- which region a process holds for a job --------------------------------------------

#: Region identity -> the region as this process maps it. Samples handed
#: over by another process of the job are mapped through it.
_REGIONS: "weakref.WeakValueDictionary[Tuple[int, int], Region]" = weakref.WeakValueDictionary()


def register(region: Region) -> None:
    """Records ``region`` as this process's mapping of its memory file."""
    _REGIONS[region.ident] = region


def _after_fork_in_child() -> None:
    for region in list(_REGIONS.values()):
        region._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def region_of(ident: Tuple[int, int]) -> Optional[Region]:
    """Returns this process's mapping of the region ``ident``, if a client
    of this process holds it (open, or kept after its stage went away)."""
    region = _REGIONS.get(tuple(ident))
    if region is None or region._pid != os.getpid():
        return None
    return region
