"""Starting a ``sluice-stage`` process and reading its ready line.

The stage prints one JSON line on stdout once every listener is bound::

    {"event":"ready","socket":"/path","tcp":null,"metrics":"127.0.0.1:5678"}

and logs to stderr. SIGTERM stops it cleanly (exit 0). Used by the
benchmarks and by the test suite.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["StageProcess", "StageStartError", "find_stage_binary", "pid_cpu_seconds"]


class StageStartError(RuntimeError):
    """The stage did not come up (no binary, exited early, no ready line)."""


def find_stage_binary(bin_dir: str) -> str:
    """Returns ``<bin_dir>/sluice-stage`` or raises :class:`StageStartError`
    saying how to build it."""
    path = os.path.join(bin_dir, "sluice-stage")
    if not os.access(path, os.X_OK):
        profile = "--release " if os.path.basename(os.path.normpath(bin_dir)) == "release" else ""
        raise StageStartError(
            f"no sluice-stage binary at {path}: build it with `cargo build {profile}-p sluice-stage` "
            "in the repository, or give the directory that holds it with --bin-dir (or SLUICE_BIN_DIR)")
    return path


class StageProcess:
    """A started stage. Use :meth:`start`; stop it with :meth:`stop`.

    Attributes: ``proc``, ``ready`` (the parsed ready line), ``socket``,
    ``tcp``, ``metrics``, ``stderr_path``.
    """

    def __init__(self, proc: subprocess.Popen, ready: dict, stderr_path: str, args: List[str]):
        self.proc = proc
        self.ready = ready
        self.socket: str = ready.get("socket")
        self.tcp: Optional[str] = ready.get("tcp")
        self.metrics: Optional[str] = ready.get("metrics")
        self.stderr_path = stderr_path
        self.args = args
        self.stopped = False

    @classmethod
    def start(cls, binary: str, socket_path: str, datasets: Dict[str, str], extra: Sequence[str] = (),
              stderr_path: Optional[str] = None, metrics_addr: str = "127.0.0.1:0",
              listen: Optional[str] = None, timeout: float = 30.0,
              nofile: Optional[int] = None) -> "StageProcess":
        """Starts ``binary`` and returns once it printed its ready line;
        with ``nofile``, under that limit of open descriptors (soft and hard).

        Raises :class:`StageStartError` (with the stage's stderr) when it
        exits first or says nothing within ``timeout`` seconds.
        """
        args = [binary, "--socket", socket_path, "--metrics-addr", metrics_addr]
        for name, root in datasets.items():
            args += ["--dataset", f"{name}={root}"]
        if listen:
            args += ["--listen", listen]
        args += list(extra)
        stderr_path = stderr_path or socket_path + ".stderr"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                    preexec_fn=None if nofile is None else _limit_descriptors(nofile))
        lines: "queue.Queue[Optional[bytes]]" = queue.Queue()

        def pump() -> None:
            # Keeps draining stdout so the stage never blocks on a full pipe.
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="sluice-stage-stdout", daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                proc.kill()
                proc.wait()
                raise StageStartError(f"sluice-stage printed no ready line within {timeout:.0f}s\n"
                                      f"command: {' '.join(args)}\n{_tail(stderr_path)}") from None
            if line is None:
                proc.wait()
                raise StageStartError(f"sluice-stage exited with status {proc.returncode} before it was "
                                      f"ready\ncommand: {' '.join(args)}\n{_tail(stderr_path)}")
            try:
                ready = json.loads(line)
            except ValueError:
                continue  # not the ready line; the stage logs to stderr, but be lenient
            if isinstance(ready, dict) and ready.get("event") == "ready":
                return cls(proc, ready, stderr_path, args)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """Returns the stage's user + system CPU seconds so far (all threads)."""
        return pid_cpu_seconds(self.pid)

    def peak_rss_bytes(self) -> int:
        """Returns the stage's peak resident set (``VmHWM``) in bytes."""
        return rss_bytes(self.pid)[1]

    def stderr_tail(self, limit: int = 4000) -> str:
        return _tail(self.stderr_path, limit)

    def stop(self, timeout: float = 15.0) -> int:
        """Sends SIGTERM, waits, and returns the exit status; kills the stage
        and raises ``TimeoutError`` if it does not exit within ``timeout``."""
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise TimeoutError(f"sluice-stage did not exit within {timeout:.0f}s of SIGTERM\n"
                                   f"{self.stderr_tail()}") from None
        return self.proc.returncode


def pid_cpu_seconds(pid: int) -> float:
    """Returns a live process's user + system CPU seconds so far (all threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields after the command: state is [0], utime [11], stime [12].
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(pid: int, keys: Tuple[str, ...]) -> Dict[str, int]:
    """The sizes ``keys`` of a live process's ``/proc/PID/status``, in bytes."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                found[key] = int(rest.split()[0]) * 1024
    return found


def rss_bytes(pid: int) -> Tuple[int, int]:
    """Returns a live process's resident set now and at its peak, in bytes."""
    found = _status(pid, ("VmRSS", "VmHWM"))
    return found.get("VmRSS", 0), found.get("VmHWM", 0)


def private_rss_bytes(pid: int) -> int:
    """Returns a live process's resident set without the shared memory it
    maps (for a trainer: the pages of its stage's regions that its mappings
    show, which are the stage's buffers, counted in the stage's RSS)."""
    found = _status(pid, ("RssAnon", "RssFile"))
    return found.get("RssAnon", 0) + found.get("RssFile", 0)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "stderr of sluice-stage:\n" + text if text else "(sluice-stage wrote nothing to stderr)"


def _limit_descriptors(n: int):
    """A ``preexec_fn`` that caps the child's open descriptors at ``n``."""
    def limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return limit
