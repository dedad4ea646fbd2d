"""Starting and stopping ``sluice-slowfs``: a read-only FUSE view of a
directory that adds a latency to every open and every read call, and can
cap bandwidth (the slow-storage harness; see ``tests/src/bin/slowfs.rs``).

Mounting needs root (or ``fusermount3``) and ``/dev/fuse``.
"""

from __future__ import annotations

import os
from typing import Optional

from .harness import Harness, HarnessError, find_binary

__all__ = ["SlowFs", "SlowFsError", "find_slowfs_binary"]


class SlowFsError(HarnessError):
    """The harness did not mount (no binary, no FUSE, no permission)."""


def find_slowfs_binary(bin_dir: str) -> str:
    return find_binary(bin_dir, "sluice-slowfs", SlowFsError)


class SlowFs(Harness):
    """A mounted ``sluice-slowfs``; :meth:`stop` (or ``with``) unmounts it."""

    def __init__(self, proc, mountpoint: str, ready: dict) -> None:
        super().__init__(proc, ready)
        self.mountpoint = mountpoint

    @classmethod
    def start(cls, binary: str, source: str, mountpoint: str, latency: str = "0ms",
              bandwidth: Optional[str] = None, threads: int = 32, timeout: float = 20.0) -> "SlowFs":
        """Mounts ``source`` at ``mountpoint`` (created if missing) and returns
        once the mount serves. Raises :class:`SlowFsError` with the harness's
        own words when it cannot mount."""
        os.makedirs(mountpoint, exist_ok=True)
        args = [binary, source, mountpoint, "--latency", latency, "--threads", str(threads)]
        if bandwidth:
            args += ["--bandwidth", bandwidth]
        try:
            proc, ready = Harness.launch(args, f"sluice-slowfs (mounting {mountpoint})", timeout)
        except HarnessError as e:
            raise SlowFsError(str(e)) from None
        return cls(proc, mountpoint, ready)
