"""Fixtures: the real sluice-stage binary, started per test on a temp socket.

The binary is looked up in ``$SLUICE_BIN_DIR``, else ``<repo>/target/debug``
(build it with ``cargo build -p sluice-stage``). Without it the tests that
need it are skipped, except when ``CI=true``, where a missing binary fails
them: a silent skip in CI would hide that nothing was tested.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import re
import socket
import sys

import pytest

from sluice import protocol as p
from sluice.bench.common import wait_for as bench_wait_for
from sluice.bench.stage import StageProcess, StageStartError

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))  # fakestage, helpers

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def binary(name: str) -> pathlib.Path:
    """Returns the path of one of sluice's binaries, or skips (fails in CI)
    without it."""
    bin_dir = pathlib.Path(os.environ.get("SLUICE_BIN_DIR") or REPO / "target" / "debug")
    path = bin_dir / name
    if not os.access(path, os.X_OK):
        msg = (f"{name} not found at {path}: build it with `cargo build --workspace --bins` "
               "or point SLUICE_BIN_DIR at the directory holding it")
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def stage_binary() -> pathlib.Path:
    """Returns the stage binary's path, or skips (fails in CI) without it."""
    return binary("sluice-stage")


def start_stage(tmp_path: pathlib.Path, datasets: dict, *extra: str, tcp: bool = False,
                nofile=None) -> StageProcess:
    """Starts the stage serving ``datasets`` (name -> dir) and waits for its
    ready line; with ``nofile``, under that limit of open descriptors."""
    sock = tmp_path / f"stage-{random.randrange(1 << 30)}.sock"
    try:
        return StageProcess.start(
            str(stage_binary()), str(sock), {k: str(v) for k, v in datasets.items()}, extra,
            stderr_path=str(tmp_path / f"{sock.stem}.stderr"),
            listen="127.0.0.1:0" if tcp else None, timeout=READY_TIMEOUT, nofile=nofile)
    except StageStartError as e:
        raise AssertionError(str(e)) from None


@pytest.fixture
def stage_factory(tmp_path):
    """Returns ``start(datasets, *args, tcp=False, nofile=None) -> Stage``; stops every
    stage at teardown and asserts it exited 0 on SIGTERM."""
    started = []

    def start(datasets, *extra, tcp=False, nofile=None):
        s = start_stage(tmp_path, datasets, *extra, tcp=tcp, nofile=nofile)
        started.append(s)
        return s

    yield start
    for s in started:
        was_alive = s.alive() or s.stopped
        code = s.stop(STOP_TIMEOUT)
        assert was_alive, f"sluice-stage died during the test (exit {code}); {s.stderr_tail()}"
        assert code == 0, f"sluice-stage exited {code} on SIGTERM; {s.stderr_tail()}"


def files_of(root: pathlib.Path, count: int, size: int) -> dict:
    """Writes ``count`` random files of ``size`` bytes into a new directory
    ``root``; returns name -> bytes."""
    root.mkdir()
    files = {}
    for i in range(count):
        name = f"f{i:04d}.bin"
        files[name] = os.urandom(size)
        (root / name).write_bytes(files[name])
    return files


def replace_file(root: pathlib.Path, name: str, data: bytes) -> bytes:
    """Replaces ``root/name`` with ``data`` as a data-preparation job does:
    written beside it and renamed over it. Returns ``data``."""
    (root / ".next").write_bytes(data)
    os.rename(root / ".next", root / name)
    return data


def make_dataset(root: pathlib.Path, seed: int = 0) -> dict:
    """Writes a small tree with nested dirs and varied sizes; returns name -> bytes."""
    rng = random.Random(seed)
    files = {}
    sizes = [0, 1, 7, 4096, 4097, 65536, 100 * 1024, 1024 * 1024 + 3] + [rng.randrange(0, 50_000) for _ in range(40)]
    for i, size in enumerate(sizes):
        depth = i % 4
        parts = [f"d{(i * 7 + k) % 3}" for k in range(depth)] + [f"f{i:03d}.bin"]
        name = "/".join(parts)
        files[name] = rng.randbytes(size)
    # Names whose byte order differs from a naive str order or a locale's.
    files["B-upper.bin"] = b"upper"
    files["a-lower.bin"] = b"lower"
    files["d0/\u00e9t\u00e9.bin"] = "non-ascii".encode()
    files["d0/z.bin"] = b"z"
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


@pytest.fixture
def dataset(tmp_path):
    """A fresh dataset directory: ``(root, {name: bytes})``."""
    root = tmp_path / "data"
    root.mkdir()
    return root, make_dataset(root)


def sorted_names(files) -> list:
    return sorted(files, key=lambda n: n.encode())


def wait_for(condition, timeout=10.0, interval=0.02, what="condition"):
    """Polls ``condition()`` until truthy (the benchmarks' helper, with the
    tests' defaults)."""
    return bench_wait_for(what, condition, timeout=timeout, every=interval)


def http_get(addr: str, path: str, timeout: float = 5.0) -> str:
    """Returns the body of a plain HTTP/1.0 GET (no third-party client)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n".encode())
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    raw = b"".join(chunks).decode(errors="replace")
    head, _, body = raw.partition("\r\n\r\n")
    assert " 200 " in head.split("\r\n")[0], f"GET {path} answered {head.splitlines()[:1]}"
    return body


def stage_metric(stage, name: str) -> float:
    """The value of the stage's unlabelled series ``name``."""
    found = re.search(rf"^{name} (\S+)$", http_get(stage.metrics, "/metrics"), re.M)
    return float(found.group(1)) if found else 0.0


def job_metric(stage, name: str, job: str) -> float:
    """The value of the stage's ``name{job="<job>"}`` series (0 when absent)."""
    body = http_get(stage.metrics, "/metrics")
    found = re.search(rf'^{name}{{job="{re.escape(job)}"}} (\S+)$', body, re.M)
    return float(found.group(1)) if found else 0.0


class Raw:
    """A hand-driven connection for sending arbitrary bytes."""

    def __init__(self, path, timeout=10.0, receive_buffer=None):
        """``path``: the UNIX socket, or ``(host, port)`` over TCP; with
        ``receive_buffer`` (UNIX only), the socket's receive buffer in
        bytes, so that answers it does not read stay with the stage."""
        if isinstance(path, tuple):
            self.sock = socket.create_connection(path, timeout=timeout)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if receive_buffer is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        self.f = self.sock.makefile("rb")

    def send(self, data: bytes):
        self.sock.sendall(data)

    def recv(self):
        return p.read_response(self.f)

    def call(self, frame):
        self.send(frame)
        return self.recv()

    def hello(self, job="raw", rank=0, world_size=1):
        msg = self.call(p.encode_hello(job, {}, rank, world_size))
        assert isinstance(msg, p.Welcome), msg
        return msg

    def drain_until_closed(self, timeout=10.0) -> bytes:
        """Reads until the stage closes the connection; returns what came."""
        self.sock.settimeout(timeout)
        chunks = []
        while True:
            try:
                b = self.sock.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)

    def close(self):
        self.f.close()
        self.sock.close()


@contextlib.contextmanager
def pids_cgroup(pid: int):
    """Moves process ``pid`` (every thread of it) into a `pids` cgroup of
    its own, as a pod's limit puts a stage, and yields ``limit(n)``, which
    sets the group's limit (``None``: none) and returns how many threads
    it holds. The process goes back to its cgroup after."""
    v1, v2 = pathlib.Path("/sys/fs/cgroup/pids"), pathlib.Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists():
        base, wanted = v1, lambda line: line.split(":")[1] == "pids"
    elif "pids" in (v2 / "cgroup.controllers").read_text(errors="replace").split() if (
            v2 / "cgroup.controllers").exists() else False:
        base, wanted = v2, lambda line: line.startswith("0::")
    else:
        message = "no pids cgroup controller to limit the stage's threads with"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    was = next(line.split(":", 2)[2] for line in pathlib.Path(f"/proc/{pid}/cgroup").read_text().splitlines()
               if wanted(line))
    home = base / was.lstrip("/")
    group = base / f"sluice-test-{os.getpid()}-{random.randrange(1 << 30)}"
    if base == v2:
        (home / "cgroup.subtree_control").write_text("+pids")
    group.mkdir()

    def limit(n):
        (group / "pids.max").write_text("max" if n is None else str(n))
        return int((group / "pids.current").read_text())

    try:
        (group / "cgroup.procs").write_text(str(pid))
        yield limit
    finally:
        limit(None)
        with contextlib.suppress(OSError):
            (home / "cgroup.procs").write_text(str(pid))
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), what="the cgroup to empty")
        group.rmdir()
