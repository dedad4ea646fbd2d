"""The slow-storage harness (sluice-slowfs) and a stage reading through it."""

from __future__ import annotations

import os
import time

import pytest

import sluice
from sluice.bench.slowfs import SlowFs, SlowFsError, find_slowfs_binary

from conftest import in_ci, stage_binary

LATENCY_S = 0.02


@pytest.fixture
def slow_mount(tmp_path, dataset):
    """The ``dataset`` fixture's tree behind 20 ms per open and per read."""
    root, files = dataset
    binary = stage_binary().parent
    try:
        fs = SlowFs.start(find_slowfs_binary(str(binary)), str(root), str(tmp_path / "mnt"),
                          latency=f"{int(LATENCY_S * 1000)}ms", threads=64)
    except SlowFsError as e:
        if in_ci() or os.geteuid() == 0:
            pytest.fail(str(e))
        pytest.skip(f"FUSE needs root here: {e}")
    yield fs, files
    assert fs.stop() == 0, fs.proc.stderr.read()
    assert not os.path.ismount(fs.mountpoint)


def test_the_harness_serves_exact_bytes_and_adds_its_latency(slow_mount):
    fs, files = slow_mount
    for name, data in files.items():
        with open(os.path.join(fs.mountpoint, name), "rb") as f:
            assert f.read() == data, name
    # One open and one read each wait the latency at least.
    name = max(files, key=lambda n: len(files[n]))
    t0 = time.monotonic()
    with open(os.path.join(fs.mountpoint, name), "rb") as f:
        f.read(1)
    assert time.monotonic() - t0 >= 2 * LATENCY_S
    with pytest.raises(OSError):
        open(os.path.join(fs.mountpoint, name), "ab")


def test_a_stage_reads_a_slow_mount_exactly(slow_mount, stage_factory):
    fs, files = slow_mount
    stage = stage_factory({"ds": fs.mountpoint})
    with sluice.Client(stage.socket, job="slow") as c:
        ds = c.dataset("ds")
        got = {name: bytes(data) for name, data in ds.epoch(0, seed=1, batch=8)}
    assert got == files
