"""Starting and stopping ``sluice-slowfs``: a read-only FUSE view of a
directory that adds a latency to every open and every read call, and can
cap bandwidth (the slow-storage harness; see ``tests/src/bin/slowfs.rs``).

Mounting needs root (or ``fusermount3``) and ``/dev/fuse``.
"""

from __future__ import annotations

import errno
import os
import subprocess
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

    def stop(self) -> int:
        """Unmounts (SIGTERM to the harness) and returns its exit status. A
        mount left behind (the harness was interrupted with files open, or
        killed) is detached lazily, so no dead mount point remains."""
        code = super().stop()
        if os.path.ismount(self.mountpoint) or _dead_mount(self.mountpoint):
            for unmount in (["fusermount3", "-u", "-z"], ["fusermount", "-u", "-z"], ["umount", "-l"]):
                try:
                    if subprocess.run([*unmount, self.mountpoint], capture_output=True).returncode == 0:
                        break
                except OSError:
                    continue
        return code


def _dead_mount(path: str) -> bool:
    """Whether ``path`` is a FUSE mount whose server is gone (its stat
    fails with ENOTCONN)."""
    try:
        os.stat(path)
        return False
    except OSError as e:
        return e.errno == errno.ENOTCONN
