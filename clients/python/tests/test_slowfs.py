"""The slow-storage harness (sluice-slowfs) and a stage reading through it."""

from __future__ import annotations

import os
import signal
import threading
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


def mount_beside_a_local_data_set(stage_factory, tmp_path, name: str, fs):
    """A stage mounting the slow file system as data set ``name`` and a
    local one, ``good`` (``a.txt``: ``b"ok"``); returns the stage and the
    mount."""
    good = tmp_path / "good"
    good.mkdir()
    (good / "a.txt").write_bytes(b"ok")
    mnt = tmp_path / "stage-mnt"
    mnt.mkdir()
    stage = stage_factory({"good": str(good), name: fs.mountpoint}, "--mount", str(mnt))
    return stage, mnt


def looker(results: dict):
    """``look(key, fn)``: puts what ``fn()`` gives, or the ``OSError`` it
    raised, into ``results[key]`` (a thread's target)."""
    def look(key, fn):
        try:
            results[key] = fn()
        except OSError as e:
            results[key] = e
    return look


def test_a_data_set_whose_filer_stops_answering_holds_only_its_own_readers_in_the_mount(
        slow_mount, stage_factory, tmp_path):
    """The first look into a data set lists it; a filer that stopped
    answering holds that look, not the mount's other data sets."""
    fs, _files = slow_mount
    _stage, mnt = mount_beside_a_local_data_set(stage_factory, tmp_path, "hung", fs)
    results = {}
    look = looker(results)

    os.kill(fs.proc.pid, signal.SIGSTOP)  # the filer stops answering
    try:
        hung = threading.Thread(target=look, args=("hung", lambda: os.listdir(mnt / "hung")), daemon=True)
        hung.start()
        time.sleep(0.5)
        good_read = threading.Thread(target=look, args=("good", lambda: (mnt / "good" / "a.txt").read_bytes()),
                                     daemon=True)
        good_read.start()
        good_read.join(timeout=10)
        assert results.get("good") == b"ok", results
        assert "hung" not in results, "the hung filer's data set cannot have been listed"
    finally:
        os.kill(fs.proc.pid, signal.SIGCONT)
    hung.join(timeout=30)
    assert sorted(results["hung"]) == sorted(os.listdir(fs.mountpoint)), results


def test_a_filer_that_stops_answering_holds_only_its_own_opens_and_listings_in_the_mount(
        slow_mount, stage_factory, tmp_path):
    """A file no plan holds is opened at its source when the mount opens
    it, and a data set is listed again when a look finds its listing due:
    on a filer that does not answer, both wait, and must hold only the
    readers of that data set, not another job's reads of a local one."""
    fs, files = slow_mount
    _stage, mnt = mount_beside_a_local_data_set(stage_factory, tmp_path, "slow", fs)
    listed_at = time.monotonic()
    assert sorted(os.listdir(mnt / "@lister" / "slow")) == sorted(os.listdir(fs.mountpoint))
    name = min(files, key=lambda n: (n.count("/"), n))
    results = {}
    look = looker(results)

    def good_read_takes() -> float:
        t0 = time.monotonic()
        reader = threading.Thread(target=look, args=("good", lambda: (mnt / "@other" / "good" / "a.txt").read_bytes()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=10)
        assert results.pop("good", None) == b"ok", "a local data set's read waited for the stopped filer"
        return time.monotonic() - t0

    good_read_takes()
    waiting = []
    os.kill(fs.proc.pid, signal.SIGSTOP)
    try:
        # An open of a file of the stopped filer: the stage's open of it waits.
        opener = threading.Thread(target=look, args=("open", lambda: (mnt / "@slow" / "slow" / name).read_bytes()),
                                  daemon=True)
        opener.start()
        waiting.append(opener)
        time.sleep(0.3)
        assert good_read_takes() < 0.5
        assert "open" not in results, "the stopped filer's file cannot have been read"
        # Its listing is due again (every 5 s): the look that finds it so
        # waits up to a second for a new one, which the stopped filer holds.
        time.sleep(max(0.0, listed_at + 5.5 - time.monotonic()))
        lister = threading.Thread(target=look, args=("list", lambda: os.listdir(mnt / "@lister" / "slow")),
                                  daemon=True)
        lister.start()
        waiting.append(lister)
        time.sleep(0.2)
        assert good_read_takes() < 0.5
    finally:
        os.kill(fs.proc.pid, signal.SIGCONT)
    for thread in waiting:
        thread.join(timeout=30)
    assert results["open"] == files[name], results
    assert sorted(results["list"]) == sorted(os.listdir(fs.mountpoint)), results


def test_a_stage_stopped_while_its_filer_hangs_fails_its_mount_readers_at_once(
        slow_mount, stage_factory, tmp_path):
    """Readers opening files of a filer through the mount, the filer stops
    answering, and the stage stops: the stage's threads stuck in requests
    the filer had taken hold the mount's /dev/fuse open, and its readers
    waited as long as the filer did. The stage ends its FUSE connection
    as it goes: every reader gets an error at once."""
    fs, files = slow_mount
    stage, mnt = mount_beside_a_local_data_set(stage_factory, tmp_path, "slow", fs)
    # Not a file the kernel reads from the filer itself (passthrough, 1 MiB
    # and up): its reader waits for the filer as a direct reader does.
    names = sorted(name for name, data in files.items() if len(data) < 1 << 20)
    assert sorted(os.listdir(mnt / "slow")) == sorted(os.listdir(fs.mountpoint))
    ended = {}

    def keep_opening(k):
        i = k
        try:
            while True:
                (mnt / f"@r{k}" / "slow" / names[i % len(names)]).read_bytes()
                i += 1
        except OSError as e:
            ended[k] = e

    readers = [threading.Thread(target=keep_opening, args=(k,), daemon=True) for k in range(8)]
    for reader in readers:
        reader.start()
    time.sleep(1)
    os.kill(fs.proc.pid, signal.SIGSTOP)  # with requests of the stage's inside it
    try:
        time.sleep(0.5)
        stage.stopped = True  # as stop() marks it, without waiting for the exit
        stage.proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=10)
        assert len(ended) == len(readers), f"{len(readers) - len(ended)} readers still wait after 10 s"
    finally:
        os.kill(fs.proc.pid, signal.SIGCONT)
    # Its stuck threads back, the stage ends (0, as the fixture checks).
    stage.proc.wait(timeout=30)
    assert not os.path.ismount(mnt)


def test_files_written_before_several_readers_open_them_at_once_are_found_by_all(
        slow_mount, stage_factory, tmp_path):
    """Several readers open files a job just wrote, when the data set's
    listing is due: every look waits for the listing taken again, not
    only the one that started it (5 of 6 opens failed with ENOENT)."""
    fs, _files = slow_mount
    _stage, mnt = mount_beside_a_local_data_set(stage_factory, tmp_path, "slow", fs)
    os.listdir(mnt / "slow")
    source = tmp_path / "data"  # the ``dataset`` fixture's, behind the filer
    for attempt in range(2):
        names = [f"new-{attempt}-{k}.bin" for k in range(6)]
        for name in names:
            (source / name).write_bytes(name.encode() * 100)
        time.sleep(6.2)  # the listing is due (every 5 s)
        results = {}
        look = looker(results)
        readers = [threading.Thread(target=look, args=(name, lambda n=name: (mnt / "@many" / "slow" / n).read_bytes()))
                   for name in names]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=30)
        assert results == {name: name.encode() * 100 for name in names}, results


def test_readers_waiting_for_a_read_of_a_file_resized_since_its_listing_get_its_bytes(tmp_path, stage_factory):
    """A file replaced at another size after the stage listed it is looked
    up in the node cache under its size now, and the first reader's read is
    shared with whoever asks meanwhile. The read's bytes were checked
    against the listed size, the shared read was dropped, and every reader
    that waited for it (another job's FETCH, another job's epoch) failed
    with "the stage failed internally"."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.bin").write_bytes(os.urandom(10_000))
    try:
        fs = SlowFs.start(find_slowfs_binary(str(stage_binary().parent)), str(tmp_path / "src"),
                          str(tmp_path / "slow"), latency="800ms", threads=16)
    except SlowFsError as e:
        if in_ci() or os.geteuid() == 0:
            pytest.fail(str(e))
        pytest.skip(f"FUSE needs root here: {e}")
    try:
        stage = stage_factory({"d": fs.mountpoint}, "--memory-budget", "100MiB", "--cache-memory", "8MiB")
        with sluice.Client(stage.socket, job="lister") as c:
            assert dict(c.dataset("d").files) == {"f.bin": 10_000}
        new = os.urandom(20_000)
        (tmp_path / "src" / ".t").write_bytes(new)
        os.rename(tmp_path / "src" / ".t", tmp_path / "src" / "f.bin")
        time.sleep(1.5)  # the harness's attributes expire; the listing is younger than 5 s
        got = {}

        def fetch(job):
            try:
                with sluice.Client(stage.socket, job=job) as c:
                    got[job] = bytes(c.dataset("d").fetch(["f.bin"])[0][1])
            except sluice.SluiceError as e:
                got[job] = e

        def epoch(job):
            try:
                with sluice.Client(stage.socket, job=job) as c, c.dataset("d").epoch(0, batch=1) as it:
                    got[job] = [bytes(data) for _, data in it][0]
            except sluice.SluiceError as e:
                got[job] = e

        first = threading.Thread(target=fetch, args=("a",))
        first.start()
        time.sleep(0.5)  # while the first read waits for the harness
        others = [threading.Thread(target=fetch, args=("b",)), threading.Thread(target=epoch, args=("c",))]
        for t in others:
            t.start()
        for t in [first, *others]:
            t.join(timeout=60)
        shown = {k: v if isinstance(v, Exception) else len(v) for k, v in got.items()}
        assert got == {"a": new, "b": new, "c": new}, shown
    finally:
        assert fs.stop() == 0, fs.proc.stderr.read()

