"""Shared-memory delivery on the client side (protocol version 2).

A local trainer that asks for it in ``HELLO`` receives, with ``WELCOME``, a
read-only descriptor of its job's memory region on the stage; samples then
arrive as an offset and a length in that region instead of bytes in the
frame. :class:`Region` maps the region and turns each sample into a
``memoryview`` over it, with no copy.

Lifetime: a sample's memory stays valid as long as anything refers to it:
the ``memoryview``, a slice of it, or a numpy array or torch tensor made
from it (``numpy.frombuffer``, ``torch.frombuffer``). When the last
reference goes, the slot is queued for return to the stage, and the
client's next request carries the return (``RELEASE``). Keep a sample past
that only by copying it (``bytes(view)``). A connection holds at most a
bounded number of bytes of slots (64 MiB on the stage's side); beyond that
the stage sends samples as bytes, so holding samples never stalls reading.

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
from typing import Dict, List

__all__ = ["Region", "supported", "receive_with_fd"]

PAGE = mmap.PAGESIZE


def supported() -> bool:
    """Whether this platform can take shared-memory delivery."""
    return (hasattr(socket, "recv_fds") and hasattr(mmap, "MAP_PRIVATE")
            and hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED"))


def receive_with_fd(sock: socket.socket, limit: int):
    """Receives one whole frame (``u32`` length first) and the descriptor
    that came with its first byte, if any. Returns ``(frame, fd or None)``."""
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
                break
            data += more
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return data, fd


class Region:
    """A job's shared-memory region as this process maps it.

    :meth:`view` returns a sample's bytes; :meth:`returned` drains the
    offsets of samples nobody refers to any more.
    """

    def __init__(self, fd: int, size: int) -> None:
        try:
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        # Offsets of samples whose last reference went; appended from
        # whatever thread drops it (deque operations are atomic).
        self._returned: collections.deque = collections.deque()
        self._types: Dict[int, type] = {}
        self._open = True

    def view(self, offset: int, length: int) -> memoryview:
        """Returns the ``length`` bytes at ``offset`` as a read-write
        ``memoryview`` of this process's mapping, returned to the stage when
        the last reference to it (or anything made from it) goes."""
        if offset < 0 or length < 0 or offset + length > self.size or offset % PAGE:
            raise ValueError(f"the stage placed a sample at {offset}+{length}, outside its "
                             f"{self.size}-byte region or off a page boundary")
        kind = self._types.get(length)
        if kind is None:
            kind = self._slot_type(length)
        owner = kind.from_buffer(self._mm, offset)
        owner.offset = offset
        return memoryview(owner).cast("B")

    def _slot_type(self, length: int) -> type:
        """A ctypes array type of ``length`` bytes whose instances give their
        slot back when the last reference to them goes (``__del__`` is much
        cheaper per sample than a ``weakref.finalize``)."""
        if len(self._types) > 4096:
            self._types.clear()
        give_back = self._give_back

        def __del__(slot, _length=length):
            give_back(slot.offset, _length)

        kind = type(f"Slot{length}", (ctypes.c_char * length,), {"__del__": __del__})
        self._types[length] = kind
        return kind

    def _give_back(self, offset: int, length: int) -> None:
        if self._open and length:
            # Drop any page this process wrote (copy-on-write) so the slot's
            # next sample is read from the stage's pages.
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, offset, -(-length // PAGE) * PAGE)
            except (OSError, ValueError):
                pass
        self._returned.append(offset)

    def returned(self) -> List[int]:
        """Takes the offsets of the samples given back since the last call."""
        out = []
        pop = self._returned.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out

    def close(self) -> None:
        """Forgets the returns (the stage reclaims every slot when the
        connection ends). The mapping itself goes when the last sample
        viewing it does."""
        self._open = False
        self._returned.clear()
