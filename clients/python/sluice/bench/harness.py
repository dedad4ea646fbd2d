"""Processes of the slow-storage harness: started, waited for, stopped.

A harness process (``sluice-slowfs``, ``sluice-slowhttp``, an S3 server)
is started with :meth:`Harness.launch`, which returns once it printed its
JSON ready line (or, for servers that print none, once a port accepts
connections); :meth:`Harness.stop` (or ``with``) ends it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from typing import List, Optional

__all__ = ["Harness", "HarnessError", "free_port", "find_binary"]


class HarnessError(RuntimeError):
    """A harness process did not start (no binary, no FUSE, a bad flag)."""


def find_binary(bin_dir: str, name: str, error=None) -> str:
    """The harness binary ``name`` of the tests crate in ``bin_dir``, or
    ``error`` (default :class:`HarnessError`) saying how to build it."""
    path = os.path.join(bin_dir, name)
    if not os.access(path, os.X_OK):
        raise (error or HarnessError)(f"no {name} binary at {path}: build it with "
                                      f"`cargo build -p sluice-tests --bin {name}`")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (for servers that cannot
    be told to pick one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Harness:
    """A running harness process and what it said when ready."""

    def __init__(self, proc: subprocess.Popen, ready: dict) -> None:
        self.proc = proc
        self.ready = ready

    @staticmethod
    def launch(args: List[str], what: str, timeout: float = 20.0,
               port: Optional[int] = None) -> "tuple[subprocess.Popen, dict]":
        """Starts ``args``; returns the process and its ready line, or, with
        ``port``, ``{}`` once 127.0.0.1:``port`` accepts connections.
        Raises :class:`HarnessError` with the process's own words."""
        try:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True)
        except OSError as e:
            raise HarnessError(f"cannot start {what}: {e}") from None
        if port is not None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    return proc, {}
                except OSError:
                    time.sleep(0.05)
            line: list = []
        else:
            line = []
            reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            if line and line[0]:
                return proc, json.loads(line[0])
        proc.kill()
        _out, err = proc.communicate()
        raise HarnessError(f"{what} did not start: {err.strip() or 'no answer'}")

    def stop(self) -> int:
        """Ends the process (SIGTERM) and returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
