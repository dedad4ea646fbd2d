"""Trainers and mount readers that hold what they take (answers they never
read, jobs they never use, files they never close) against the stage's
bounds: the other jobs keep reading."""

from __future__ import annotations

import errno
import hashlib
import os
import time

import pytest
from conftest import Raw, files_of, job_metric, stage_metric, wait_for

import sluice
from sluice import protocol as p


def raw(stage, job: str) -> Raw:
    """A connection that said HELLO as ``job``, with a small receive buffer
    so that answers it does not read stay with the stage."""
    r = Raw(stage.socket, receive_buffer=4096)
    r.hello(job)
    return r


def test_trainers_that_claim_and_never_read_their_answers_do_not_stop_other_jobs(stage_factory, tmp_path):
    """Each NEXT's claim was cut from the jobs of its moment, so the claims of
    trainers arriving one after another, never read, held more than the
    whole budget and another job got nothing until the stage's write
    timeout (30 s) cut them. Unanswered claims now hold at most half the
    budget (beyond one entry each)."""
    files = files_of(tmp_path / "data", 200, 100 * 1024)
    stage = stage_factory({"ds": str(tmp_path / "data")}, "--memory-budget", "256MiB")
    hogs = []
    for j in range(16):
        r = raw(stage, f"hog-{j}")
        r.call(p.encode_open("ds"))
        r.call(p.encode_plan_indices(0, list(range(200)) * 20))
        r.send(p.encode_next(4096))  # and never reads the answer
        hogs.append(r)
        time.sleep(0.1)
    time.sleep(1)
    start = time.monotonic()
    with sluice.Client(stage.socket, job="good", timeout=60) as c:
        # As a training loop does, each sample is let go once used.
        got = {name: hashlib.sha256(data).digest() for name, data in c.dataset("ds").epoch(0, seed=1)}
    took = time.monotonic() - start
    assert got == {name: hashlib.sha256(data).digest() for name, data in files.items()}
    assert took < 15, f"an epoch of 200 samples took {took:.1f} s beside trainers that do not read"
    assert stage.alive()
    for r in hogs:
        r.close()


def test_the_stage_holds_at_most_256_jobs_and_says_so(stage_factory, tmp_path):
    """Every job that reads takes reader threads: a client naming job after
    job took a stage to 16,000 threads and an abort at about 1,000 jobs."""
    files_of(tmp_path / "data", 4, 1000)
    stage = stage_factory({"ds": str(tmp_path / "data")})
    held = [raw(stage, f"held-{j}") for j in range(256)]
    with pytest.raises(sluice.UnavailableError, match=r"serves 256 jobs, the most it holds at once"):
        sluice.Client(stage.socket, job="one-too-many", reconnect=0)
    # A job whose trainers left makes room for a new one.
    for r in held[:3]:
        r.close()
    with sluice.Client(stage.socket, job="newcomer") as c:
        assert c.dataset("ds").read("f0000.bin") == (tmp_path / "data" / "f0000.bin").read_bytes()
    assert stage.alive()
    for r in held[3:]:
        r.close()


def test_jobs_that_only_said_hello_take_no_share_of_the_budget(stage_factory, tmp_path):
    """The budget was split among every job, so 1,000 connections that
    only said HELLO cut a reading job's buffer to a thousandth of it."""
    files_of(tmp_path / "data", 50, 10_000)
    stage = stage_factory({"ds": str(tmp_path / "data")}, "--memory-budget", "64MiB")
    idle = [raw(stage, f"idle-{j}") for j in range(100)]
    with sluice.Client(stage.socket, job="reader") as c:
        with c.dataset("ds").epoch(0, seed=1) as it:
            next(it)
            capacity = job_metric(stage, "sluice_stage_buffer_capacity_bytes", "reader")
            assert capacity >= 32 * 2**20, f"the reading job's buffer is {capacity:.0f} bytes"
            for _ in it:
                pass
    for r in idle:
        r.close()


def test_plans_of_idle_connections_are_bounded(stage_factory, tmp_path):
    """A plan's bookkeeping (about 10 bytes an entry) is held outside the
    budget: forty idle connections with a plan of 4 Mi entries each took a
    stage with a 256 MiB budget to 1.2 GiB. Every job's plans together now
    hold at most a quarter of the budget's bytes in entries (8 Mi at least):
    a plan past that is refused, saying why, and fits once others end."""
    files_of(tmp_path / "data", 4, 1000)
    stage = stage_factory({"ds": str(tmp_path / "data")}, "--memory-budget", "256MiB")
    indices = [3] * ((16 * 2**20 - 32) // 4)
    held = []
    for j in range(3):
        r = raw(stage, f"plans-{j}")
        r.call(p.encode_open("ds"))
        held.append((r, r.call(p.encode_plan_indices(0, indices))))
    assert [type(a).__name__ for _, a in held] == ["Planned", "Planned", "Error"], held
    refused = held[2][1]
    assert refused.code == sluice.ErrorCode.TOO_LARGE, refused
    assert "the stage's plans hold 8388592 entries, and its memory budget allows 8388608" in refused.message
    held[0][0].close()
    r = held[2][0]
    wait_for(lambda: isinstance(r.call(p.encode_plan_indices(1, indices)), p.Planned),
             timeout=5, what="the plan fits once another connection's ended")
    for r, _ in held[1:]:
        r.close()


def test_files_held_open_through_the_mount_leave_the_stage_its_descriptors(stage_factory, tmp_path):
    """Each file open through the mount may hold a descriptor of the stage:
    with no bound, a reader holding files open took every one, and socket
    trainers' reads failed with "Too many open files". Opens past a quarter
    of the limit fail with ENFILE instead, and one job holds at most half
    of those, so other jobs' readers of the mount still open files."""
    files = files_of(tmp_path / "data", 120, 1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = stage_factory({"ds": str(tmp_path / "data")}, "--mount", str(mnt), nofile=256)

    def hold(job: str) -> tuple[list, OSError]:
        held = []
        for name in sorted(files):
            try:
                held.append(open(mnt / f"@{job}" / "ds" / name, "rb"))
            except OSError as e:
                return held, e
        return held, None

    first, refused = hold("first")
    assert refused is not None and refused.errno == errno.ENFILE, refused
    # Half of a quarter of the descriptors left once the stage started (it
    # holds a few dozen at most).
    assert 24 <= len(first) <= 31, f"{len(first)} files of one job open before the first refusal"
    second, refused = hold("second")
    assert len(second) == len(first) and refused.errno == errno.ENFILE, (len(second), refused)
    third, refused = hold("third")
    assert len(third) <= 1 and refused.errno == errno.ENFILE, "the mount's share of the descriptors is held"
    with sluice.Client(stage.socket, job="socket") as c:
        got = {name: data for name, data in c.dataset("ds").epoch(0, seed=2)}
    assert got == files, "socket trainers read on"
    for f in first + second:
        f.close()
    with open(mnt / "@third" / "ds" / "f0119.bin", "rb") as f:
        assert f.read() == files["f0119.bin"]


def test_many_job_names_read_through_the_mount_are_not_all_kept(stage_factory, tmp_path):
    """Each `@<job>` name read through the mount stayed attached for 10 s
    after its file closed: a reader naming job after job made thousands of
    jobs (a descriptor and a share of the budget each)."""
    files_of(tmp_path / "data", 2, 1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = stage_factory({"ds": str(tmp_path / "data")}, "--mount", str(mnt))
    for j in range(300):
        with open(mnt / f"@name-{j}" / "ds" / "f0000.bin", "rb") as f:
            f.read()

    def jobs():
        from conftest import http_get
        line = next(line for line in http_get(stage.metrics, "/metrics").splitlines()
                    if line.startswith("sluice_stage_jobs "))
        return float(line.split()[1])
    wait_for(lambda: jobs() <= 128 + 16, timeout=3, what="the jobs kept to 128 idle and 16 attached")
    assert stage.alive()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def peak_rss(stage) -> int:
    with open(f"/proc/{stage.proc.pid}/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))


def test_reads_by_name_never_taken_hold_a_bounded_part_of_the_node(stage_factory, tmp_path):
    """A whole-file READ was not counted in the budget at all, and FETCHes
    of a file larger than the budget went over it together after 2 s: six
    connections each reading a 150 MiB file and never taking the answer
    held 900 MiB of a stage with a 128 MiB budget. Answers to reads by name
    now hold at most half the budget, or one larger answer alone, until
    their trainers take them; other reads by name go on beside them."""
    root = tmp_path / "data"
    files = files_of(root, 20, 100 * 1024)
    big = os.urandom(48 * 2**20)
    (root / "big.bin").write_bytes(big)
    stage = stage_factory({"ds": str(root)}, "--memory-budget", "32MiB")
    hogs = []
    for j in range(8):
        r = raw(stage, f"hog-{j}")
        r.call(p.encode_open("ds"))
        r.send(p.encode_read("big.bin") if j % 2 else p.encode_fetch(["big.bin"]))  # never read
        hogs.append(r)
    time.sleep(3)  # past the 2 s a read waits before it may go over the budget
    # The answer on its way is counted in the budget.
    assert stage_metric(stage, "sluice_stage_memory_used_bytes") >= len(big)
    start = time.monotonic()
    with sluice.Client(stage.socket, job="good", timeout=60) as c:
        ds = c.dataset("ds")
        for name, data in files.items():
            assert ds.read(name) == data, name
        assert [(n, bytes(d)) for n, d in ds.fetch(sorted(files))] == sorted(files.items())
        # As a map-style loader asks: a FETCH per batch (each waited 2 s
        # while the answers nobody takes held the budget over).
        names = sorted(files)
        for batch in range(0, len(names), 2):
            got = [(n, bytes(d)) for n, d in ds.fetch(names[batch:batch + 2])]
            assert got == [(n, files[n]) for n in names[batch:batch + 2]]
    took = time.monotonic() - start
    assert took < 10, f"reads by name of 4 MiB took {took:.1f} s beside answers nobody takes"
    peak = peak_rss(stage)
    # Before: every hog's 48 MiB at once (more than 400 MiB).
    assert peak <= 32 * 2**20 + len(big) + 80 * 2**20, f"the stage's RSS peaked at {peak / 2**20:.0f} MiB"
    for r in hogs:
        r.close()
    # With the hogs gone, the big file is read whole again.
    with sluice.Client(stage.socket, job="good", timeout=60) as c:
        assert c.dataset("ds").read("big.bin") == big
    assert stage.alive()
