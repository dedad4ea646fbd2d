"""Starting and stopping ``sluice-slowfs``: a read-only FUSE view of a
directory that adds a latency to every open and every read call, and can
cap bandwidth (the slow-storage harness; see ``tests/src/bin/slowfs.rs``).

Mounting needs root (or ``fusermount3``) and ``/dev/fuse``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from typing import Optional

__all__ = ["SlowFs", "SlowFsError", "find_slowfs_binary"]


class SlowFsError(RuntimeError):
    """The harness did not mount (no binary, no FUSE, no permission)."""


def find_slowfs_binary(bin_dir: str) -> str:
    path = os.path.join(bin_dir, "sluice-slowfs")
    if not os.access(path, os.X_OK):
        raise SlowFsError(f"no sluice-slowfs binary at {path}: build it with "
                          "`cargo build -p sluice-tests --bin sluice-slowfs`")
    return path


class SlowFs:
    """A mounted ``sluice-slowfs``; :meth:`stop` (or ``with``) unmounts it."""

    def __init__(self, proc: subprocess.Popen, mountpoint: str, ready: dict) -> None:
        self.proc = proc
        self.mountpoint = mountpoint
        self.ready = ready

    @classmethod
    def start(cls, binary: str, source: str, mountpoint: str, latency: str = "0ms",
              bandwidth: Optional[str] = None, threads: int = 256, timeout: float = 20.0) -> "SlowFs":
        """Mounts ``source`` at ``mountpoint`` (created if missing) and returns
        once the mount serves. Raises :class:`SlowFsError` with the harness's
        own words when it cannot mount."""
        os.makedirs(mountpoint, exist_ok=True)
        args = [binary, source, mountpoint, "--latency", latency, "--threads", str(threads)]
        if bandwidth:
            args += ["--bandwidth", bandwidth]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        line: list = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or not line[0]:
            proc.kill()
            _out, err = proc.communicate()
            raise SlowFsError(f"sluice-slowfs did not mount {mountpoint}: {err.strip() or 'no answer'}")
        return cls(proc, mountpoint, json.loads(line[0]))

    def stop(self) -> int:
        """Unmounts (SIGTERM) and returns the harness's exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "SlowFs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
