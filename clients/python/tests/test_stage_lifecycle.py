"""The stage's process as an operator runs it: output pipes that close, a
start that is refused, a stage that replaces one still draining, and data
set entries it may not examine."""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

import sluice

from conftest import STOP_TIMEOUT, binary, pids_cgroup, stage_binary, wait_for


def _popen(sock, data, *extra, stderr=subprocess.PIPE, preexec_fn=None):
    args = [str(stage_binary()), "--socket", str(sock), "--metrics-addr", "127.0.0.1:0",
            "--dataset", f"d={data}", *extra]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                            preexec_fn=preexec_fn)


def _serving(sock) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
            return True
        except OSError:
            return False


def _read_all(sock, files):
    with sluice.Client(str(sock), job="ops", reconnect=0) as c:
        ds = c.dataset("d")
        assert {name: ds.read(name) for name in files} == files


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    return proc.wait(STOP_TIMEOUT)


def test_a_stage_whose_output_pipes_close_keeps_serving(tmp_path, dataset):
    root, files = dataset
    sock = tmp_path / "s.sock"
    # Both pipes' readers are gone before the stage writes its ready line
    # and its first log lines (a log shipper that restarted, `| head -1`).
    proc = _popen(sock, root)
    proc.stdout.close()
    proc.stderr.close()
    try:
        wait_for(lambda: _serving(sock) or proc.poll() is not None, what="the stage to listen")
        assert proc.poll() is None, f"the stage exited {proc.returncode}"
        _read_all(sock, files)  # logs that a job started
        time.sleep(0.3)
        assert proc.poll() is None, f"the stage exited {proc.returncode} when it logged"
        _read_all(sock, files)
    finally:
        code = _stop(proc)
    assert code == 0


def test_a_stage_refused_at_start_leaves_no_socket(tmp_path, dataset):
    root, files = dataset
    cache = ("--cache-dir", str(tmp_path / "cache"), "--cache-disk", "10MiB")
    first = _popen(tmp_path / "a.sock", root, *cache, stderr=subprocess.DEVNULL)
    try:
        first.stdout.readline()
        second_sock = tmp_path / "b.sock"
        second = _popen(second_sock, root, *cache)
        out, err = second.communicate(timeout=30)
        assert second.returncode != 0
        assert b"is in use by another sluice-stage" in err, err
        # A trainer pointed at it is told no stage is there, not refused.
        assert not second_sock.exists()
        _read_all(tmp_path / "a.sock", files)
    finally:
        assert _stop(first) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_stage_the_os_refuses_its_threads_at_start_exits_and_says_why(tmp_path, dataset, threads):
    """Started under a pod's `pids` limit of one or two threads (its
    runtime needs three): the runtime's panic over a refused worker
    thread, once another was started, waited on that thread for good (no
    ready line, no exit); with one it exited 101 with a panic's
    backtrace."""
    root, _ = dataset
    # A shell moved into the limited cgroup first, which then becomes the stage.
    holder = subprocess.Popen(["sh", "-c", 'read go && exec "$@"', "sh", stage_binary(),
                               "--socket", str(tmp_path / "s.sock"), "--dataset", f"ds={root}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with pids_cgroup(holder.pid) as limit:
            limit(threads)
            out, err = holder.communicate(b"go\n", timeout=20)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert holder.returncode == 1, (holder.returncode, err[-2000:])
    assert b"cannot start its threads" in err and b"pids limit" in err, err[-2000:]
    assert b"panicked" not in err, err[-2000:]
    assert b"ready" not in out


def test_a_stopping_stage_leaves_the_socket_of_the_stage_that_replaced_it(tmp_path, dataset):
    root, files = dataset
    sock = tmp_path / "s.sock"
    old = _popen(sock, root, stderr=subprocess.DEVNULL)
    try:
        old.stdout.readline()
        # What a stage started while this one drains does: the path is
        # taken over by a socket of another stage (here stands in a
        # listener of the test's).
        os.unlink(sock)
        replacement = socket.socket(socket.AF_UNIX)
        replacement.bind(str(sock))
        replacement.listen()
    finally:
        assert _stop(old) == 0
    try:
        assert sock.exists(), "the stopping stage removed the socket of the one that replaced it"
        assert _serving(sock)
    finally:
        replacement.close()
    # Its own socket it removes.
    os.unlink(sock)
    again = _popen(sock, root, stderr=subprocess.DEVNULL)
    again.stdout.readline()
    _read_all(sock, files)
    assert _stop(again) == 0
    assert not sock.exists()


def test_a_removed_socket_file_is_bound_again(tmp_path, dataset):
    """A socket file removed under a running stage (a cleanup script, a
    mistaken rm) left a stage that answered its health checks and that no
    new trainer could reach: it binds its socket again, its trainers
    connected meanwhile go on, and it removes the new file when it stops."""
    root, files = dataset
    sock = tmp_path / "s.sock"
    proc = _popen(sock, root)
    try:
        proc.stdout.readline()
        with sluice.Client(str(sock), job="kept") as kept:
            os.unlink(sock)
            wait_for(lambda: _serving(sock), timeout=10, what="the socket bound again")
            _read_all(sock, files)
            assert dict(kept.dataset("d").epoch(0)) == files
    finally:
        assert _stop(proc) == 0
    assert not sock.exists()
    assert b"bound it again" in proc.stderr.read()


def test_symlinks_left_out_of_a_listing_are_warned_of(tmp_path, dataset):
    """Links leaving the data set's directory (a Hugging Face cache's
    snapshot links into its blobs) and links that dangle or loop are not
    listed, and the operator is told so, once per kind."""
    root, files = dataset
    outside = tmp_path / "blobs"
    outside.mkdir()
    for i in range(3):
        (outside / f"b{i}").write_bytes(b"blob")
        (root / f"linked-{i}.bin").symlink_to(outside / f"b{i}")
    (root / "dangling.bin").symlink_to(root / "gone")
    (root / "loop.bin").symlink_to(root / "loop.bin")
    proc = _popen(tmp_path / "s.sock", root)
    try:
        assert b"ready" in proc.stdout.readline()
        with sluice.Client(str(tmp_path / "s.sock"), job="ops", reconnect=0) as c:
            assert sorted(name for name, _ in c.dataset("d").files) == sorted(files)
    finally:
        assert _stop(proc) == 0
    log = proc.stderr.read().decode()
    lines = [line for line in log.splitlines() if "left symlinks out" in line]
    assert len(lines) == 2, log
    away = next(line for line in lines if "outside the data set" in line)
    assert "skipped=3" in away and "/linked-" in away and str(outside) in away, away
    broken = next(line for line in lines if "lead nowhere" in line)
    assert "skipped=2" in broken, broken


@contextlib.contextmanager
def _as_nobody(root, tmp_path):
    """``(root, sock, preexec)``: the data set, a socket path and a
    ``preexec_fn`` for a stage run as a user the file modes apply to:
    ``nobody`` when the tests run as root (who passes every mode), serving a
    copy of the data set from a directory ``nobody`` may enter (the tests'
    tmp_path is private to root); else the user the tests run as."""
    if os.geteuid() != 0:
        yield root, tmp_path / "s.sock", None
        return
    nobody = pwd.getpwnam("nobody")
    top = pathlib.Path(tempfile.mkdtemp(prefix="sluice-nobody-"))
    try:
        top.chmod(0o755)
        shutil.copytree(root, top / "data", symlinks=True)
        (top / "run").mkdir()
        os.chown(top / "run", nobody.pw_uid, nobody.pw_gid)

        def preexec():
            os.setgid(nobody.pw_gid)
            os.setgroups([])
            os.setuid(nobody.pw_uid)

        yield top / "data", top / "run" / "s.sock", preexec
    finally:
        shutil.rmtree(top)


def test_entries_the_stage_cannot_examine_are_left_out_not_the_data_set(tmp_path, dataset):
    """A directory that may be read but not searched (mode 0644) lists its
    names, but its files cannot be examined: the listing leaves them out
    with a warning instead of failing the data set."""
    root, files = dataset
    blocked = root / "blocked"
    blocked.mkdir()
    (blocked / "x.bin").write_bytes(b"x")
    with _as_nobody(root, tmp_path) as (root, sock, preexec):
        (root / "blocked").chmod(0o644)
        try:
            proc = _popen(sock, root, preexec_fn=preexec)
            try:
                assert b"ready" in proc.stdout.readline()
                with sluice.Client(str(sock), job="ops", reconnect=0) as c:
                    ds = c.dataset("d")
                    assert sorted(name for name, _ in ds.files) == sorted(files)
                    assert ds.read(sorted(files)[0]) == files[sorted(files)[0]]
            finally:
                assert _stop(proc) == 0
        finally:
            (root / "blocked").chmod(0o755)
    log = proc.stderr.read().decode()
    assert "left entries out of the listing that could not be examined" in log, log
    assert "blocked/x.bin" in log, log


def test_a_data_set_the_stage_cannot_read_is_refused_at_start(tmp_path, dataset):
    """A data set directory the stage's user may not list (mode 0000, or
    another user's 0700) was accepted: the stage said it was ready, its
    readiness check answered 200, and every trainer's listing failed with
    "Permission denied". It is refused at start, naming the data set."""
    root, _ = dataset
    with _as_nobody(root, tmp_path) as (root, sock, preexec):
        root.chmod(0o000)
        try:
            proc = _popen(sock, root, preexec_fn=preexec)
            out, err = proc.communicate(timeout=30)
        finally:
            root.chmod(0o755)
    assert proc.returncode == 64, err  # an invalid configuration
    assert b"dataset `d` root" in err and b"cannot be read by the user the stage runs as" in err, err
    assert b"ready" not in out
    assert not sock.exists()


@pytest.mark.parametrize("value", ["warning", "inf", "", "info,sluice_stage=verbose"])
@pytest.mark.parametrize("name", ["sluice-stage", "sluice-controller"])
def test_a_log_filter_that_names_no_level_is_refused(tmp_path, dataset, name, value):
    """The log filter took a word it did not know for a module's name, so
    a misspelt level (`SLUICE_LOG=warning`) or an empty one turned every
    log line off, warnings and errors too, and nothing said so."""
    root, _ = dataset
    args = {
        "sluice-stage": ["--socket", str(tmp_path / "s.sock"), "--metrics-addr", "127.0.0.1:0",
                         "--dataset", f"d={root}"],
        "sluice-controller": ["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
                              "--database-url", f"sqlite://{tmp_path / 'c.db'}"],
    }[name]
    run = subprocess.run([str(binary(name)), *args], env={**os.environ, "SLUICE_LOG": value},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 64, run.stderr
    assert f"{name}: invalid configuration: SLUICE_LOG: " in run.stderr, run.stderr
    assert "write a level" in run.stderr, run.stderr
    assert not (tmp_path / "s.sock").exists() and not (tmp_path / "c.db").exists()


def test_a_socket_path_too_long_is_refused_with_the_limit(tmp_path, dataset):
    root, _ = dataset
    sock = tmp_path / ("s" * (120 - len(str(tmp_path))) + ".sock")
    proc = _popen(sock, root)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 64, err  # an invalid configuration, refused before anything starts
    assert b"a UNIX socket path must be at most 107 bytes" in err, err
    assert not sock.exists()


def test_a_controller_address_that_is_not_grpc_is_said_to_be_so(stage_factory, dataset):
    """`--controller` given an HTTP port (the controller's REST port is an
    easy slip for its gRPC one): the stage says the server there does not
    speak gRPC and which address to give, and never that a session is up."""
    root, files = dataset
    http_only = stage_factory({"d": root})
    stage = stage_factory({"d": root}, "--controller", f"http://{http_only.metrics}")
    wait_for(lambda: "does not speak gRPC" in stage.stderr_tail(), timeout=15,
             what="the stage to say the address is not a controller's")
    log = stage.stderr_tail(20000)
    assert "give the controller's gRPC address (its --grpc-addr" in log, log
    assert "controller session up" not in log, log
    with sluice.Client(stage.socket, job="alone") as c:  # it serves on its own meanwhile
        assert dict(c.dataset("d").epoch(0)) == files
