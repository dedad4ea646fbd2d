"""The read-only mount (``--mount DIR``) end to end: plain file reads of
every data set through a real FUSE mount of the stage, attributed to jobs
by path, exactly once with a job's plan, and refused writes."""

from __future__ import annotations

import errno
import json
import mmap
import random
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import sluice
from sluice.bench.common import metric_value, parse_prometheus
from sluice.bench.stage import StageProcess, StageStartError

from conftest import http_get, pids_cgroup, replace_file, stage_binary, stage_metric, start_stage, wait_for


def walk(root) -> dict:
    """Every file under ``root``: relative name -> bytes, read with open()."""
    found = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def job_metric(stage, name: str, job: str) -> int:
    """The stage's ``name`` series of ``job`` (over data set ``ds``)."""
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    return int(metric_value(samples, name, job=job) or 0)


def job_delivered(stage, job: str) -> int:
    return job_metric(stage, "sluice_stage_delivered_bytes_total", job)


@pytest.fixture
def mount_stage(tmp_path, stage_factory):
    """Starts a stage serving ``root`` as data set ``ds``, mounted at
    ``tmp_path/mnt`` (with ``extra`` flags); returns ``(stage, mnt)``."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def start(root, *extra):
        return stage_factory({"ds": root}, "--mount", str(mnt), *extra), mnt
    return start


@pytest.fixture
def mounted(mount_stage, dataset):
    root, files = dataset
    stage, mnt = mount_stage(root)
    assert stage.ready["mount"] == str(mnt)
    return stage, mnt, files


def numbered_files(tmp_path, count: int, size: int) -> tuple:
    """A data set directory of ``count`` random files of ``size`` bytes
    (``000.bin``, ...): the directory and name -> bytes."""
    root = tmp_path / "data"
    root.mkdir()
    files = {f"{i:03d}.bin": os.urandom(size) for i in range(count)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


def files_of_sizes(tmp_path, sizes: dict[str, int]):
    """A data set directory of random files of the given sizes."""
    root = tmp_path / "data"
    root.mkdir()
    for name, size in sizes.items():
        (root / name).write_bytes(os.urandom(size))
    return root


def test_every_file_reads_exactly_with_its_tree_and_size(mounted):
    stage, mnt, files = mounted
    assert os.listdir(mnt) == ["ds"]
    assert walk(mnt / "ds") == files
    for name, data in files.items():
        st = os.stat(mnt / "ds" / name)
        assert st.st_size == len(data) and st.st_mode & 0o777 == 0o444, name
        # A local file system's block size: programs size their buffers by it.
        assert st.st_blksize == 4096, name
    # Reads at any offset and size.
    big = max(files, key=lambda n: len(files[n]))
    with open(mnt / "ds" / big, "rb", buffering=0) as f:
        f.seek(1_000_003)
        assert f.read(7) == files[big][1_000_003:1_000_010]
        f.seek(len(files[big]) - 2)
        assert f.read(100) == files[big][-2:]
    # os.pread at odd offsets and sizes, and mmap, of every file.
    for name, data in files.items():
        fd = os.open(mnt / "ds" / name, os.O_RDONLY)
        try:
            for offset, size in ((0, 1), (3, 4093), (4095, 2), (len(data) // 3, 65537), (len(data), 9)):
                assert os.pread(fd, size, offset) == data[offset:offset + size], (name, offset, size)
            if data:
                with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
                    assert m[:] == data, name
        finally:
            os.close(fd)
    assert job_delivered(stage, "mount") > 0, "reads that name no job belong to the default job"


def test_empty_directories_are_shown_as_they_are(tmp_path, mount_stage):
    # DLIO, for one, lists a data set's `valid/` even when it holds nothing.
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    (root / "train" / "a.bin").write_bytes(b"a")
    (root / "valid").mkdir()
    (root / "deep" / "er").mkdir(parents=True)
    _stage, mnt = mount_stage(root)
    assert sorted(os.listdir(mnt / "ds")) == ["deep", "train", "valid"]
    assert os.listdir(mnt / "ds" / "valid") == [] and os.path.isdir(mnt / "ds" / "valid")
    assert os.listdir(mnt / "ds" / "deep") == ["er"] and os.listdir(mnt / "ds" / "deep" / "er") == []
    assert os.listdir(mnt / "ds" / "train") == ["a.bin"]
    # Link counts as a local directory's: two more than the directories it
    # holds (`find -links 2` lists the leaves; every directory showed 2).
    for path in ["", "train", "valid", "deep", "deep/er"]:
        assert os.stat(mnt / "ds" / path).st_nlink == os.stat(root / path).st_nlink, path
    assert os.stat(mnt).st_nlink == 3, "the mount's root holds one data set"


def test_symlinks_that_leave_the_data_set_are_not_followed_out_of_it(tmp_path, mount_stage):
    root, outside = tmp_path / "data", tmp_path / "secret"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "key.bin").write_bytes(b"secret")
    (root / "sub" / "real.bin").write_bytes(b"inside")
    os.symlink("sub/real.bin", root / "alias.bin")  # stays beneath the root
    os.symlink(outside / "key.bin", root / "escape.bin")  # leaves it
    os.symlink(outside, root / "escape-dir")
    _, mnt = mount_stage(root)
    assert walk(mnt / "ds") == {"sub/real.bin": b"inside", "alias.bin": b"inside"}
    for name in ("escape.bin", "escape-dir/key.bin"):
        with pytest.raises(FileNotFoundError):
            open(mnt / "ds" / name, "rb")


def test_symlinks_into_the_stages_own_mount_are_left_out_and_the_mount_goes_on(tmp_path, mount_stage):
    """The stage answers the mount itself: a symlink of the data set into it
    resolved by the kernel asked the stage while it listed, and the mount hung."""
    root, via = tmp_path / "data", tmp_path / "via"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f.bin").write_bytes(b"real")
    mnt = tmp_path / "mnt"
    os.symlink(mnt / "ds" / "a" / "f.bin", root / "direct.bin")
    os.symlink(mnt, root / "whole-mount")
    os.symlink(mnt / "ds", via)
    os.symlink(via / "a" / "f.bin", root / "chain.bin")  # into it through another link
    stage, mnt = mount_stage(root)
    # In a child with a deadline: a hung mount must fail the test, not hang it.
    listing = subprocess.run([sys.executable, "-c", (
        "import os, sys\n"
        "for d, _, names in os.walk(sys.argv[1]):\n"
        "    for n in names:\n"
        "        print(os.path.relpath(os.path.join(d, n), sys.argv[1]), open(os.path.join(d, n), 'rb').read())\n"),
        str(mnt / "ds")], capture_output=True, text=True, timeout=20)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.split("\n") == ["a/f.bin b'real'", ""]
    assert "inside the stage's own mount" in wait_for(
        lambda: next((l for l in stage.stderr_tail(10**6).splitlines() if "own mount" in l), None), 10)
    with sluice.Client(stage.socket, job="links") as c:
        ds = c.dataset("ds")
        assert list(ds.files.names()) == ["a/f.bin"]
        for name in ("direct.bin", "chain.bin", "whole-mount/ds/a/f.bin"):
            with pytest.raises(sluice.ForbiddenPathError, match="own mount"):
                ds.read(name)
        assert ds.read("a/f.bin") == b"real"


def test_a_reader_killed_mid_file_leaves_the_mount_serving_the_others(mounted):
    stage, mnt, files = mounted
    big = max(files, key=lambda n: len(files[n]))
    reader = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "f = open(sys.argv[1], 'rb', buffering=0)\n"
        "f.read(300000)\n"
        "print('reading', flush=True)\n"
        "time.sleep(60)\n"), str(mnt / "@killed" / "ds" / big)], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "reading"
    reader.kill()
    reader.wait(timeout=10)
    assert walk(mnt / "ds") == files
    assert stage.proc.poll() is None


def test_a_reader_inside_the_mount_gets_an_error_not_a_hang_when_the_stage_stops(tmp_path, mount_stage, dataset):
    root, files = dataset
    stage, mnt = mount_stage(root)
    big = max(files, key=lambda n: len(files[n]))
    reader = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "os.pread(fd, 10, 0)\n"
        "print('open', flush=True)\n"
        "sys.stdin.readline()\n"
        "try:\n"
        "    os.pread(fd, 100, 1_000_000)\n"
        "    os.listdir(sys.argv[2])\n"
        "    print('read')\n"
        "except OSError as e:\n"
        "    print('error', e.errno)\n"), str(mnt / "ds" / big), str(mnt / "ds")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "open"
    stage.stop()
    out, _ = reader.communicate("go\n", timeout=30)
    assert out.startswith("error"), f"the reader got {out!r} after the stage stopped"
    # The next stage takes the mount point over whatever the first left.
    again, _ = mount_stage(root)
    assert walk(mnt / "ds") == files
    again.stop()


def test_writes_of_every_kind_are_refused(mounted):
    _stage, mnt, files = mounted
    name = next(iter(files))
    attempts = [
        lambda: open(mnt / "ds" / name, "r+b"),
        lambda: open(mnt / "ds" / "new.bin", "wb"),
        lambda: os.mkdir(mnt / "ds" / "newdir"),
        lambda: os.rename(mnt / "ds" / name, mnt / "ds" / "moved"),
        lambda: os.unlink(mnt / "ds" / name),
        lambda: os.chmod(mnt / "ds" / name, 0o777),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM), e.value
    assert walk(mnt / "ds") == files, "nothing changed"
    with pytest.raises(FileNotFoundError):
        open(mnt / "nothing")
    with pytest.raises(FileNotFoundError):
        open(mnt / "@bad job" / "ds" / name)


def test_df_shows_the_data_sets_size_and_nothing_free(mounted):
    stage, mnt, files = mounted
    walk(mnt / "ds")  # listed
    st = os.statvfs(mnt)
    assert st.f_blocks * st.f_frsize >= sum(len(d) for d in files.values())
    assert st.f_files >= len(files)
    assert (st.f_bfree, st.f_bavail, st.f_ffree) == (0, 0, 0)
    assert st.f_namemax == 255


def test_a_path_names_the_job_its_reads_belong_to(mounted):
    stage, mnt, files = mounted
    with sluice.Client(stage.socket, job="tagged", labels={"team": "vision"}) as c:
        assert walk(mnt / "@tagged" / "ds") == files
        total = sum(len(d) for d in files.values())
        assert job_delivered(stage, "tagged") == total
        jobs = json.loads(http_get(stage.metrics, "/api/v1/jobs"))
        tagged = next(j for j in jobs if j["job"] == "tagged")
        assert tagged["labels"] == {"team": "vision"}, "the mount keeps the labels trainers declared"
        del c


def test_files_read_with_no_order_fill_the_node_cache_for_later_readers(mount_stage, dataset):
    root, files = dataset
    stage, mnt = mount_stage(root, "--cache-memory", "64MiB", "--mount-passthrough", "false")
    reads = lambda job: job_metric(stage, "sluice_stage_storage_reads_total", job)  # noqa: E731
    assert walk(mnt / "@first" / "ds") == files
    assert reads("first") == sum(1 for data in files.values() if data), "an empty file is not read"
    # Another job's paths are other inodes: its reads reach the stage,
    # which has every file in memory.
    assert walk(mnt / "@second" / "ds") == files
    assert reads("second") == 0


def test_a_data_set_replaced_whole_is_never_read_old_from_the_node_cache_once_opened(tmp_path, mount_stage):
    """A new version published by renaming the data set's directory away
    and putting a new one in its place (same names, same sizes), read
    through the mount of a stage with a node cache: an open that finds a
    file changed reads the file as it is, not the cached old sample (the
    stage's listing, by which the cache is looked up, shows the old file
    for up to 5 s), so the kernel's pages it fills, which later opens
    keep, are the new file's."""
    base = tmp_path / "published"
    root = base / "data"

    def publish(tag: bytes) -> dict:
        root.mkdir(parents=True)
        files = {f"f{i:02d}.bin": tag + os.urandom(3000) for i in range(20)}
        for name, data in files.items():
            (root / name).write_bytes(data)
        return files

    old = publish(b"old")
    stage, mnt = mount_stage(root, "--cache-memory", "64MiB")
    for _ in range(2):
        assert walk(mnt / "ds") == old
    os.rename(root, base / "data.old")
    new = publish(b"new")
    assert walk(mnt / "ds") == new, "an open finds the file changed"
    time.sleep(5.5)
    assert walk(mnt / "ds") == new, "the pages kept are the new file's"


def test_a_file_on_the_disk_cache_read_in_windows_costs_its_size_once(tmp_path, mount_stage):
    """A file the mount reads in windows, from the node cache's disk tier:
    each window reads its own bytes from the disk file, not the whole file
    (16 MiB read in 1 MiB windows read 256 MiB, and took seconds)."""
    root, cache = tmp_path / "data", tmp_path / "cache"
    root.mkdir()
    cache.mkdir()
    data = os.urandom(16 << 20)
    (root / "big.bin").write_bytes(data)
    stage, mnt = mount_stage(root, "--cache-memory", "0", "--cache-dir", str(cache),
                             "--cache-disk", "64MiB", "--mount-passthrough", "false")
    with sluice.Client(stage.socket, job="fill") as c:
        assert dict(c.dataset("ds").epoch(0)) == {"big.bin": data}

    def disk_hit_bytes() -> int:
        samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
        return int(metric_value(samples, "sluice_stage_cache_hit_bytes_total", tier="disk") or 0)

    wait_for(lambda: metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")),
                                  "sluice_stage_cache_entries", tier="disk") == 1,
             what="the file on the disk tier")
    before = disk_hit_bytes()
    with open(mnt / "@reader" / "ds" / "big.bin", "rb") as f:
        got = b"".join(iter(lambda: f.read(1 << 20), b""))
    assert got == data
    assert job_metric(stage, "sluice_stage_storage_reads_total", "reader") == 0, "served by the cache"
    read = disk_hit_bytes() - before
    assert len(data) <= read <= 2 * len(data), f"{read} bytes read from the disk tier for {len(data)}"


def test_planned_files_opened_out_of_order_come_from_the_node_cache(tmp_path, mount_stage):
    """A planned file opened before a reader reached it is read at once;
    with the node cache holding it, from there, not from storage."""
    pytest.importorskip("torch")
    from sluice.torch import MountSampler
    root, files = numbered_files(tmp_path, 120, 20_000)
    stage, mnt = mount_stage(root, "--cache-memory", "64MiB", "--readers", "1",
                             "--min-buffer", "1MiB", "--max-buffer", "1MiB", "--initial-buffer", "1MiB")
    paths = [str(mnt / "@cached" / "ds" / name) for name in sorted(files)]
    sampler = MountSampler(paths, stage.socket, seed=1)
    import numpy as np
    # Epochs counted with NumPy integers: torch's manual_seed refused them.
    for epoch in np.arange(2):
        sampler.set_epoch(epoch)
        order = list(iter(sampler))
        if epoch == 1:
            order.reverse()  # opened in another order than the sampler's
        for i in order:
            with open(paths[i], "rb") as f:
                assert f.read() == files[os.path.basename(paths[i])]
    sampler.close()
    assert job_metric(stage, "sluice_stage_storage_reads_total", "cached") == len(files)


def test_a_mount_sampler_under_a_loader_without_batching_reads_each_file_once(tmp_path, mount_stage):
    """DataLoader(num_workers=2, batch_size=None) makes two iterators of the
    sampler an epoch and throws the first away unread: it plans nothing,
    and the epoch reads each file from storage once."""
    import torch
    from sluice.torch import MountSampler
    root, files = numbered_files(tmp_path, 150, 20_000)
    stage, mnt = mount_stage(root)
    paths = [str(mnt / "@unbatched" / "ds" / name) for name in sorted(files)]

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            with open(paths[i], "rb") as f:
                return os.path.basename(paths[i]), f.read()

    sampler = MountSampler(paths, stage.socket, seed=1)
    loader = torch.utils.data.DataLoader(Files(), sampler=sampler, batch_size=None, num_workers=2)
    got = dict(loader)
    sampler.close()
    assert got == files
    assert job_metric(stage, "sluice_stage_storage_reads_total", "unbatched") == len(files)


def test_a_mount_sampler_iterated_without_being_kept_keeps_its_plan(tmp_path, mount_stage):
    """`for i in MountSampler(...)` keeps no other reference to the sampler:
    its iterator keeps it, and with it the connection that holds the
    epoch's plan, so every open is the plan's delivery (each file read
    from storage once)."""
    pytest.importorskip("torch")
    from sluice.torch import MountSampler
    root, files = numbered_files(tmp_path, 200, 8_000)
    stage, mnt = mount_stage(root)
    paths = [str(mnt / "@unkept" / "ds" / name) for name in sorted(files)]
    for n, i in enumerate(MountSampler(paths, stage.socket, seed=1)):
        if n == 0:
            assert stage_metric(stage, "sluice_stage_connections") == 1, "the plan's connection went"
        with open(paths[i], "rb") as f:
            assert f.read() == files[os.path.basename(paths[i])]
    assert job_metric(stage, "sluice_stage_storage_reads_total", "unkept") == len(files)


def test_opens_of_a_planned_epoch_are_its_deliveries_exactly_once(mounted):
    stage, mnt, files = mounted
    names = sorted(files)
    with sluice.Client(stage.socket, job="planned") as c:
        with c.dataset("ds").epoch(0, seed=4, batch=4) as it:
            # Half the files are opened through the mount while the plan
            # is active: each is that entry's delivery.
            opened = {}
            for name in names[::2]:
                with open(mnt / "@planned" / "ds" / name, "rb") as f:
                    opened[name] = f.read()
            streamed = dict(it)
    assert all(opened[n] == files[n] for n in opened)
    assert all(streamed[n] == files[n] for n in streamed)
    assert not set(opened) & set(streamed), "a sample was delivered twice"
    assert set(opened) | set(streamed) == set(files)


def test_a_planned_files_bytes_are_in_the_page_cache_when_its_open_returns(mounted):
    """Reading a planned file sends the stage no read request: its open put
    the bytes into the kernel's page cache. An unplanned file's read is a
    request."""
    stage, mnt, files = mounted
    names = sorted(files)

    def metric(name: str, **labels) -> int:
        return int(metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")), name, **labels) or 0)

    def requests(op: str) -> int:
        return metric("sluice_stage_mount_requests_total", op=op)

    reads = requests("read")
    with open(mnt / "@free" / "ds" / names[0], "rb") as f:
        assert f.read() == files[names[0]]
    assert requests("read") > reads, "an unplanned file is read through requests"

    planned = names[1:]
    with sluice.Client(stage.socket, job="stored") as c:
        plan = c.dataset("ds").plan_names(planned, 0, prefetch=0)  # as a MountSampler does
        reads, opens = requests("read"), requests("open")
        stored = metric("sluice_stage_mount_stored_bytes_total")
        for name in planned:
            with open(mnt / "@stored" / "ds" / name, "rb") as f:
                assert f.read() == files[name], name
        assert requests("open") == opens + len(planned)
        assert requests("read") == reads, "a planned file's bytes came from the page cache"
        assert metric("sluice_stage_mount_stored_bytes_total") == stored + sum(len(files[n]) for n in planned)
        del plan


def test_a_large_directory_lists_whole_across_pages(tmp_path, mount_stage):
    root = tmp_path / "data"
    flat = root / "flat"
    flat.mkdir(parents=True)
    names = sorted(f"{i:06d}-{'x' * (i % 40)}.bin" for i in range(6000))
    for name in names:
        (flat / name).write_bytes(name.encode())
    _, mnt = mount_stage(root)
    with os.scandir(mnt / "ds" / "flat") as it:
        listed = [(e.name, e.is_file()) for e in it]
    assert [n for n, _ in listed] == names, "every name once, in order, across readdir pages"
    assert all(is_file for _, is_file in listed)
    assert (mnt / "ds" / "flat" / names[-1]).read_bytes() == names[-1].encode()


def _getdents_pages(fd: int, size: int = 64):
    """Yields the names of each ``getdents64`` answer on directory ``fd``
    read ``size`` bytes at a time (a page or two of the mount's each)."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(size)
    while True:
        n = libc.syscall(217, fd, buf, size)  # SYS_getdents64 on x86-64
        assert n >= 0, os.strerror(ctypes.get_errno())
        if n == 0:
            return
        raw, names, at = buf.raw[:n], [], 0
        while at < n:
            reclen = struct.unpack_from("<H", raw, at + 16)[0]
            names.append(raw[at + 19:at + reclen].split(b"\0")[0].decode())
            at += reclen
        yield names


def test_files_added_and_removed_show_in_the_mount_as_soon_as_a_plan_sees_them(tmp_path, mount_stage):
    """The mount lists a data set again as often as a socket reader's open
    does (after 5 s), at the look that finds it due, so a file list made by
    walking the mount (an
    ``ImageFolder`` built for the next epoch) names the files a plan of the
    stage's listing has: none removed, none added left out."""
    pytest.importorskip("torch")
    from sluice.torch import MountSampler
    root = tmp_path / "data"
    (root / "c0").mkdir(parents=True)
    files = {f"c0/{i:03d}.bin": os.urandom(1000) for i in range(40)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage, mnt = mount_stage(root)
    top = mnt / "@walk" / "ds"

    def walked():
        return sorted(os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs)

    assert walked() == sorted(files)
    for name in sorted(files)[:5]:
        (root / name).unlink()
        del files[name]
    (root / "c1").mkdir()
    for i in range(3):
        files[f"c1/{i}.bin"] = os.urandom(10)
        (root / f"c1/{i}.bin").write_bytes(files[f"c1/{i}.bin"])
    time.sleep(5.5)
    # The first look after 5 s lists the data set again and shows it (it
    # asked for it in the background, so a glob right after a job wrote
    # its shards found none, and an open of one failed with ENOENT).
    assert open(top / "c1" / "2.bin", "rb").read() == files["c1/2.bin"]
    assert walked() == sorted(files)
    paths = [str(top / name) for name in walked()]
    sampler = MountSampler(paths, stage.socket, seed=2)
    read = {os.path.relpath(paths[i], top): open(paths[i], "rb").read() for i in sampler}
    sampler.close()
    assert read == files


def test_a_listing_in_progress_is_not_shifted_by_a_new_listing(tmp_path, mount_stage):
    """A directory read in small pieces while the data set is listed again
    (files added before where it is) reads the listing it began with: no
    name twice, none left out."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the raw getdents64 call number is x86-64's")
    root = tmp_path / "data"
    flat = root / "flat"
    flat.mkdir(parents=True)
    names = [f"n{i:05d}" for i in range(1500)]
    for name in names:
        (flat / name).write_bytes(b"x")
    stage, mnt = mount_stage(root)
    fd = os.open(mnt / "ds" / "flat", os.O_RDONLY | os.O_DIRECTORY)
    try:
        pages = _getdents_pages(fd)
        seen = [n for _ in range(100) for n in next(pages)]
        assert 0 < len(seen) < 1000, len(seen)
        # Names that sort before everything read so far, then a new listing
        # (a connection opening the data set lists it again after 5 s).
        for i in range(300):
            (flat / f"a{i:05d}").write_bytes(b"x")
        time.sleep(5.5)
        with sluice.Client(stage.socket, job="relist") as c:
            assert c.dataset("ds").file_count == 1800
        assert "a00000" in os.listdir(mnt / "ds" / "flat"), "a new handle reads the new listing"
        for page in pages:
            seen += page
    finally:
        os.close(fd)
    stable = [n for n in seen if n.startswith("n")]
    assert len(stable) == len(set(stable)), f"{len(stable) - len(set(stable))} names twice"
    assert sorted(stable) == names


def mount_inodes(stage) -> int:
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    return int(metric_value(samples, "sluice_stage_mount_inodes") or 0)


def test_the_stage_keeps_only_the_inodes_the_kernel_holds(tmp_path, mount_stage):
    root = tmp_path / "data"
    flat = root / "flat"
    flat.mkdir(parents=True)
    names = [f"{i:05d}.bin" for i in range(3000)]
    for name in names:
        (flat / name).write_bytes(name.encode())
    stage, mnt = mount_stage(root)
    with os.scandir(mnt / "ds" / "flat") as it:
        listed = {e.name: e.inode() for e in it}
    assert mount_inodes(stage) < 10, "a listing alone keeps nothing"
    for name in names:
        assert os.stat(mnt / "ds" / "flat" / name).st_ino == listed[name], "listing and lookup agree"
    assert mount_inodes(stage) >= len(names)
    # The kernel drops its unused dentries and inodes and forgets them.
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")
    wait_for(lambda: mount_inodes(stage) < len(names) // 10, timeout=10,
             what="the stage to drop the inodes the kernel forgot")
    # Looked up again: the same numbers, the same bytes.
    for name in names[::100]:
        path = mnt / "ds" / "flat" / name
        assert os.stat(path).st_ino == listed[name]
        assert path.read_bytes() == name.encode()


def write_order(path, lines) -> None:
    """Writes an order file as a framework should: elsewhere, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.rename(tmp, path)


def test_an_order_file_is_prefetched_in_its_order_and_each_open_is_served_once(tmp_path, mount_stage, dataset):
    root, files = dataset
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    names = sorted(files, reverse=True)
    reads = lambda: job_metric(stage, "sluice_stage_storage_reads_total", "tf")  # noqa: E731
    # Names relative to the data set or paths under the mount; comments skipped.
    write_order(orders / "tf" / "ds", ["# epoch 1", str(mnt / "@tf" / "ds" / names[0]), *names[1:]])
    wait_for(lambda: reads() == len(names), what="the order prefetched before any open")
    for name in names:
        with open(mnt / "@tf" / "ds" / name, "rb") as f:
            assert f.read() == files[name], name
    assert reads() == len(names), "each file read from storage once"
    assert job_metric(stage, "sluice_stage_delivered_samples_total", "tf") == len(names)

    # A bad order changes nothing and says why beside it; a good one clears that.
    write_order(orders / "tf" / "ds", [names[0], "no-such-file.bin"])
    error = orders / "tf" / "ds.error"
    wait_for(error.exists, what="the error file")
    assert "line 2" in error.read_text() and "no-such-file.bin" in error.read_text()
    write_order(orders / "tf" / "ds", names[:2])
    wait_for(lambda: not error.exists(), what="the error file removed")
    wait_for(lambda: reads() == len(names) + 2, what="the second epoch prefetched")
    write_order(orders / "tf" / "other", names[:1])
    wait_for((orders / "tf" / "other.error").exists, what="an unknown data set refused")
    assert "not a data set of this stage" in (orders / "tf" / "other.error").read_text()


def test_a_trainers_plan_beside_an_order_file_of_its_job_and_data_set_is_refused(tmp_path, mount_stage, dataset):
    """The reverse of an order file refused beside a sampler's plan: a
    socket trainer's epoch of a job and data set an order file orders was
    taken beside it, every file was read twice, and the mount's opens took
    entries of either plan, so the trainer's epoch ended short (96 of 240
    samples in 4 of 8 jobs), silently."""
    root, files = dataset
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    names = sorted(files)
    write_order(orders / "both" / "ds", names)
    wait_for(lambda: job_metric(stage, "sluice_stage_storage_reads_total", "both") == len(names),
             what="the order prefetched")
    with sluice.Client(stage.socket, job="both") as c:
        with pytest.raises(sluice.PlanConflictError, match="order of an order file"):
            next(iter(c.dataset("ds").epoch(0, seed=1)))
        # Another job of the same trainer reads on; the order's opens too.
        with sluice.Client(stage.socket, job="apart") as other:
            assert dict(other.dataset("ds").epoch(0, seed=1)) == files
    for name in names:
        assert (mnt / "@both" / "ds" / name).read_bytes() == files[name]
    assert job_metric(stage, "sluice_stage_storage_reads_total", "both") == len(names)


def test_an_order_read_to_its_end_lets_its_job_go_and_one_left_from_before_waits_for_a_change(
        tmp_path, mount_stage, dataset):
    """An order file's plan holds its job only while it is read: left in
    place after its epoch (as a framework that never removes it does), it
    held the job for good, and 256 such files made the stage refuse every
    new job. One older than the stage (left from before a restart) is not
    taken up, to prefetch for nobody, until it is written again."""
    root, files = dataset
    names = sorted(files)
    orders = tmp_path / "orders"
    write_order(orders / "old" / "ds", names)
    long_ago = time.time() - 600
    os.utime(orders / "old" / "ds", (long_ago, long_ago))
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    connections = lambda job: job_metric(stage, "sluice_stage_job_connections", job)  # noqa: E731
    reads = lambda job: job_metric(stage, "sluice_stage_storage_reads_total", job)  # noqa: E731
    write_order(orders / "tf" / "ds", names)
    wait_for(lambda: reads("tf") == len(names), what="the order prefetched")
    # The gauge is published at the job's next tick.
    wait_for(lambda: connections("tf") == 1, what="the job held by its order")
    for name in names:
        assert (mnt / "@tf" / "ds" / name).read_bytes() == files[name]
    # The mount's readers hold the job 10 s after their last close (swept every 5 s).
    wait_for(lambda: connections("tf") == 0, timeout=40, what="the job let go once its order was read")
    assert (orders / "tf" / "ds").exists() and not (orders / "tf" / "ds.error").exists()
    time.sleep(1)
    assert reads("tf") == len(names), "the order file, unchanged, was not taken up again"
    assert reads("old") == 0 and connections("old") == 0, "a file left from before the stage was taken up"
    write_order(orders / "old" / "ds", names)
    wait_for(lambda: reads("old") == len(names), what="the old job's order taken up once written again")
    # One made long ago and moved in now (a move keeps its time) is new.
    made = tmp_path / "made-earlier"
    write_order(made, names[:3])
    os.utime(made, (long_ago, long_ago))
    (orders / "moved").mkdir()
    os.rename(made, orders / "moved" / "ds")
    wait_for(lambda: reads("moved") == 3, what="an order moved in after the start taken up")


def test_a_planned_file_that_grew_since_the_kernel_took_its_size_reads_whole(tmp_path, mount_stage):
    """The kernel keeps a file's attributes 60 s; a planned open of a file
    that grew since (the stage listed it again) reads the whole new file,
    not the new bytes cut at the old size."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "grows.bin").write_bytes(os.urandom(10_000))
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    path = mnt / "@grow" / "ds" / "grows.bin"
    assert os.stat(path).st_size == 10_000
    grown = os.urandom(15_000)
    tmp = root / ".grows.tmp"
    tmp.write_bytes(grown)
    os.rename(tmp, root / "grows.bin")
    time.sleep(5.5)  # the stage lists the data set again after 5 s
    reads = job_metric(stage, "sluice_stage_storage_reads_total", "grow")
    write_order(orders / "grow" / "ds", ["grows.bin"])
    wait_for(lambda: job_metric(stage, "sluice_stage_storage_reads_total", "grow") > reads,
             what="the order prefetched")
    with open(path, "rb") as f:
        assert f.read() == grown
    assert os.stat(path).st_size == 15_000


def test_files_a_mount_sampler_plans_after_they_grew_read_whole(tmp_path, mount_stage):
    """A sampler's epoch after its files were replaced with larger ones
    (and nothing listed the data set meanwhile: the trainer was idle): the
    sampler's plan names them by its connection's listing, older than the
    files, and the kernel took their sizes from it; every open reads the
    whole new file (the first one opened was cut at its old size), both a
    file that still fits what its buffer reserved and one that does not."""
    pytest.importorskip("torch")
    from sluice.torch import MountSampler
    sizes = {"small.bin": (1_000, 3_000), "large.bin": (100_000, 300_000)}
    root = files_of_sizes(tmp_path, {name: before for name, (before, _) in sizes.items()})
    stage, mnt = mount_stage(root)
    paths = [str(mnt / "@grown" / "ds" / name) for name in sorted(sizes)]
    sampler = MountSampler(paths, stage.socket, seed=1)
    for epoch in range(2):
        if epoch == 1:
            for name, (_, after) in sizes.items():
                replace_file(root, name, os.urandom(after))
            time.sleep(5.5)  # older than the listing interval (5 s)
        sampler.set_epoch(epoch)
        for i in sampler:
            with open(paths[i], "rb") as f:
                got = f.read()
            want = (root / os.path.basename(paths[i])).read_bytes()
            assert got == want, f"epoch {epoch}: {paths[i]}: {len(got)} bytes, the file has {len(want)}"
    sampler.close()


def test_an_order_file_counts_as_its_owner_claiming_the_job(tmp_path, mount_stage, dataset):
    """With `trainers:` rules, an order file is its owner's claim of the job
    it orders for: a user who may write into the orders directory cannot
    make the stage run a job the rules keep from them."""
    root, files = dataset
    orders = tmp_path / "orders"
    config = tmp_path / "stage.yaml"
    config.write_text("trainers:\n"
                      f"  - uids: [{os.getuid()}]\n    jobs: ['mine-*']\n"
                      "  - uids: [65534]\n    jobs: ['team-*']\n"
                      "  - gids: [4242]\n    jobs: ['*']\n")
    stage, mnt = mount_stage(root, "--mount-orders", str(orders), "--config", str(config))
    names = sorted(files)
    reads = lambda job: job_metric(stage, "sluice_stage_storage_reads_total", job)  # noqa: E731
    write_order(orders / "other" / "ds", names)
    error = orders / "other" / "ds.error"
    wait_for(error.exists, what="the order refused")
    assert "its owner may not order for job `other`" in error.read_text()
    assert reads("other") == 0
    write_order(orders / "mine-1" / "ds", names)
    wait_for(lambda: reads("mine-1") == len(names), what="the owner's own job prefetched")
    if os.geteuid() == 0:
        # Another user's file, for a job that user may claim, and for one it may not.
        for job in ("team-b", "mine-2"):
            (orders / job).mkdir()
            tmp = orders / job / ".ds.tmp"
            tmp.write_text("".join(f"{name}\n" for name in names[:3]))
            os.chown(tmp, 65534, 65534)
            os.rename(tmp, orders / job / "ds")
        wait_for(lambda: reads("team-b") == 3, what="the other user's own job prefetched")
        wait_for((orders / "mine-2" / "ds.error").exists, what="the other user's order refused")
        assert reads("mine-2") == 0
        # A file's group proves nothing of its writer's (a set-group-id
        # directory or chgrp gives it one): group 4242's rule does not let
        # user 65534's file order for job mine-3 (it did).
        (orders / "mine-3").mkdir()
        tmp = orders / "mine-3" / ".ds.tmp"
        tmp.write_text("".join(f"{name}\n" for name in names[:3]))
        os.chown(tmp, 65534, 4242)
        os.rename(tmp, orders / "mine-3" / "ds")
        error = orders / "mine-3" / "ds.error"
        wait_for(error.exists, what="the order of a file of group 4242 refused")
        assert "uid 65534 (an order file's owner) may not claim job `mine-3`" in error.read_text()
        assert reads("mine-3") == 0


def stage_io_threads(stage) -> int:
    """The stage's threads for blocking work (the runtime's pool)."""
    tasks = f"/proc/{stage.proc.pid}/task"
    count = 0
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as f:
                count += f.read().strip() == "stage-io"
        except FileNotFoundError:
            pass  # ended meanwhile
    return count


def test_taking_order_files_keeps_no_idle_threads_alive(tmp_path, mount_stage, dataset):
    """Threads a burst of reads starts end once the stage is idle, also
    while it looks for order files five times a second (that look ran on
    the blocking pool and woke its idle threads in turn, so none ended)."""
    root, files = dataset
    stage, mnt = mount_stage(root, "--mount-orders", str(tmp_path / "orders"))
    names = sorted(files)

    def reads(i: int) -> None:
        with sluice.Client(stage.socket, job=f"burst{i}") as c:
            ds = c.dataset("ds")
            end = time.monotonic() + 1.5
            k = i
            while time.monotonic() < end:
                ds.read(names[k % len(names)], 0, 16)
                k += 7

    burst = [threading.Thread(target=reads, args=(i,)) for i in range(24)]
    for t in burst:
        t.start()
    for t in burst:
        t.join()
    assert stage_io_threads(stage) > 8, "the burst should have started blocking threads"
    # The runtime ends a blocking thread idle for 10 s.
    wait_for(lambda: stage_io_threads(stage) <= 4, timeout=25, interval=0.5,
             what="the burst's idle threads to end")


def test_order_lines_may_name_files_by_the_mount_path_given_or_the_resolved_one(tmp_path, stage_factory, dataset):
    root, files = dataset
    (tmp_path / "mnt").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "mnt")
    orders = tmp_path / "orders"
    stage = stage_factory({"ds": root}, "--mount", str(tmp_path / "via"), "--mount-orders", str(orders))
    names = sorted(files)[:2]
    write_order(orders / "tf" / "ds", [str(tmp_path / "via" / "@tf" / "ds" / names[0]),
                                       str(tmp_path / "mnt" / "@tf" / "ds" / names[1])])
    reads = lambda: job_metric(stage, "sluice_stage_storage_reads_total", "tf")  # noqa: E731
    wait_for(lambda: reads() == 2 or (orders / "tf" / "ds.error").exists(), what="the order taken")
    assert not (orders / "tf" / "ds.error").exists(), (orders / "tf" / "ds.error").read_text()


def test_order_files_that_are_not_plain_files_or_run_away_are_refused(tmp_path, mount_stage, dataset):
    """A FIFO must not stop the scan of every job's orders, a link is not
    followed (its target's lines would be echoed into the error file), and a
    file of endless lines is cut off, not read into memory."""
    root, files = dataset
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    names = sorted(files)
    (orders / "fifo").mkdir(parents=True)
    os.mkfifo(orders / "fifo" / "ds")
    secret = tmp_path / "secret.txt"
    secret.write_text("root-only line\n")
    (orders / "link").mkdir()
    os.symlink(secret, orders / "link" / "ds")
    (orders / "long").mkdir()
    (orders / "long" / "ds").write_bytes(b"x" * 100_000)
    write_order(orders / "many" / "ds", names * (1100 // len(names) + 1))
    # A job directory that is a link is not followed: the stage would read
    # the files of wherever it points, and write its error files there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "ds").write_text("root-only line\n")
    os.symlink(elsewhere, orders / "linked-job")
    # Nor is an error file that is a link: it would be written through.
    (orders / "bad-error").mkdir()
    (orders / "bad-error" / "ds").write_text("no-such-file\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    os.symlink(victim, orders / "bad-error" / "ds.error")
    (orders / "not a job").mkdir()
    write_order(orders / "not a job" / "ds", names[:1])
    for job, reason in [("fifo", "not a regular file"), ("link", "symbolic link"),
                        ("long", "longer than 4096 bytes"), ("many", "more than")]:
        error = orders / job / "ds.error"
        wait_for(error.exists, what=f"{job}'s order refused")
        text = error.read_text()
        assert reason in text, text
        assert "root-only" not in text and len(text) < 1000, text
    wait_for(lambda: "linked-job" in stage.stderr_tail() and "not a job" in stage.stderr_tail(),
             what="the link and the bad name named in the log")
    assert "symbolic link" in stage.stderr_tail()
    assert sorted(os.listdir(elsewhere)) == ["ds"], "nothing written through the linked job directory"
    assert "root-only" not in stage.stderr_tail()
    assert victim.read_text() == "untouched\n"
    # The scan goes on: a good order of another job is taken up.
    reads = lambda: job_metric(stage, "sluice_stage_storage_reads_total", "ok")  # noqa: E731
    write_order(orders / "ok" / "ds", names[:3])
    wait_for(lambda: reads() == 3, what="a later order file taken up")
    with open(mnt / "@ok" / "ds" / names[0], "rb") as f:
        assert f.read() == files[names[0]]


def test_a_file_replaced_between_reads_opens_as_one_version(tmp_path, mount_stage):
    """A file replaced in the source (written beside it and renamed over,
    as between epochs) after a reader read part of it through the mount:
    the next open reads one version whole, never the kernel's cached pages
    of the old file joined to the new one's read through the stage."""
    root = tmp_path / "data"
    root.mkdir()
    versions = [os.urandom(500_000) for _ in range(3)]
    (root / "f.bin").write_bytes(versions[0])
    stage, mnt = mount_stage(root)
    path = mnt / "ds" / "f.bin"
    for old, new in zip(versions, versions[1:]):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == old[:4096]  # some of its pages cached
        finally:
            os.close(fd)
        (root / ".f.tmp").write_bytes(new)
        os.rename(root / ".f.tmp", root / "f.bin")
        got = path.read_bytes()
        assert got in (old, new), "bytes of two versions of the file"
        assert got == new, "the replaced file read as it was (its size is the same, so no listing hides it)"


def test_a_file_replaced_by_one_of_another_size_reads_whole_before_the_stage_lists_it(tmp_path, mount_stage):
    """Files read through the mount with no order, then replaced by larger
    and smaller ones and opened again at once (before the stage lists the
    data set again, while the kernel holds their old sizes): each reads
    the new file whole, and shows its size (they were cut at, or padded to,
    the old size: a prefix of the new file), and still does once the
    listing has them."""
    sizes = {"grows.bin": (10_000, 30_000), "shrinks.bin": (30_000, 10_000), "big.bin": (200_000, 900_000)}
    root = files_of_sizes(tmp_path, {name: before for name, (before, _) in sizes.items()})
    stage, mnt = mount_stage(root)
    for name in sizes:
        assert (mnt / "ds" / name).read_bytes() == (root / name).read_bytes()
    for name, (_, after) in sizes.items():
        replace_file(root, name, os.urandom(after))
    for round_ in ("before the listing", "after it"):
        for name, (_, after) in sizes.items():
            with open(mnt / "ds" / name, "rb") as f:
                got = f.read()
                assert os.fstat(f.fileno()).st_size == after, (round_, name)
            assert got == (root / name).read_bytes(), f"{round_}: {name}: {len(got)} bytes, the file has {after}"
        time.sleep(5.5)  # the stage lists the data set again after 5 s


def test_a_passed_through_file_replaced_by_one_of_another_size_shows_its_size(tmp_path, mount_stage):
    """Large files (passed through: the kernel reads the source file
    itself) replaced by larger and smaller ones and opened again before the
    stage lists the data set: ``fstat``, ``stat`` and ``mmap`` give the new
    size, as ``read`` does (they kept the old one for the kernel's 60 s)."""
    sizes = {"grows.bin": (2_000_000, 3_000_000), "shrinks.bin": (3_000_000, 1_500_000)}
    root = files_of_sizes(tmp_path, {name: before for name, (before, _) in sizes.items()})
    stage, mnt = mount_stage(root)

    def reads() -> int:
        scraped = parse_prometheus(http_get(stage.metrics, "/metrics"))
        return int(metric_value(scraped, "sluice_stage_mount_requests_total", op="read") or 0)

    before = reads()
    for name in sizes:
        assert (mnt / "ds" / name).read_bytes() == (root / name).read_bytes()
    assert reads() == before, "the files were read through the stage, not passed through"
    for name, (_, after) in sizes.items():
        replace_file(root, name, os.urandom(after))
    for name, (_, after) in sizes.items():
        want = (root / name).read_bytes()
        with open(mnt / "ds" / name, "rb") as f:
            assert os.fstat(f.fileno()).st_size == after, name
            assert os.stat(mnt / "ds" / name).st_size == after, name
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                assert m[:] == want, f"{name}: mapped {len(m)} bytes, the file has {after}"
            assert f.read() == want, name


def test_a_file_replaced_again_after_an_open_listed_it_anew_reads_whole_at_its_size(tmp_path, mount_stage):
    """Files replaced by same-size ones, opened once the listing was due
    (the open lists the data set again and reads the new files), then
    replaced at once by files of other sizes while that listing is fresh:
    the next open reads the newest files whole and ``fstat`` gives their
    size (the size shown was the kernel's inode's first version's, so it
    cut them at the old size), through the page cache and passed through."""
    sizes = {"small.bin": 200_000, "large.bin": 3_000_000}
    root = files_of_sizes(tmp_path, sizes)
    stage, mnt = mount_stage(root)

    for name in sizes:
        assert (mnt / "ds" / name).read_bytes() == (root / name).read_bytes()
    same = {name: replace_file(root, name, os.urandom(size)) for name, size in sizes.items()}
    time.sleep(5.5)  # the stage lists the data set again after 5 s
    for name in sizes:
        assert (mnt / "ds" / name).read_bytes() == same[name], f"{name}: the same-size replacement"
    for round_, grow in (("larger", 7), ("smaller", -100_000)):
        for name, size in sizes.items():
            want = replace_file(root, name, os.urandom(size + grow))
            with open(mnt / "ds" / name, "rb") as f:
                shown = os.fstat(f.fileno()).st_size
                got = f.read()
            assert (shown, len(got)) == (size + grow, size + grow), (round_, name)
            assert got == want, (round_, name)


def test_an_open_reads_the_file_it_opened_whatever_is_renamed_over_it_before_its_first_read(tmp_path,
                                                                                         mount_stage):
    """A file opened, then replaced before the opener's first read, reads
    whole as the file opened, as on a local directory (a file read before
    failed that first read with EIO, "was replaced while it was read"; one
    never read read whatever was there at the first read); and a file
    replaced by one of another size since the stage listed it, opened for
    the first time, reads whole at its size (it was cut at the listed
    size)."""
    sizes = {"read-before.bin": 5000, "never-read.bin": 5000, "grown.bin": 3000, "shrunk.bin": 9000}
    root = files_of_sizes(tmp_path, sizes)
    stage, mnt = mount_stage(root)
    assert sorted(os.listdir(mnt / "ds")) == sorted(sizes)  # listed
    assert (mnt / "ds" / "read-before.bin").read_bytes() == (root / "read-before.bin").read_bytes()
    for name in ("read-before.bin", "never-read.bin"):
        opened = os.urandom(9000)
        replace_file(root, name, opened)
        fd = os.open(mnt / "ds" / name, os.O_RDONLY)
        try:
            replace_file(root, name, os.urandom(7000))
            got = os.read(fd, 1 << 20)
            shown = os.fstat(fd).st_size
        finally:
            os.close(fd)
        assert (len(got), shown) == (9000, 9000), name
        assert got == opened, f"{name}: not the file opened"
    for name, size in (("grown.bin", 8000), ("shrunk.bin", 2000)):
        want = os.urandom(size)
        replace_file(root, name, want)
        with open(mnt / "ds" / name, "rb") as f:
            got, shown = f.read(), os.fstat(f.fileno()).st_size
        assert (len(got), shown) == (size, size), name
        assert got == want, name


def test_two_readers_opening_a_file_as_it_is_replaced_each_read_one_version(tmp_path, mount_stage):
    """Two readers open and read a file the mount listed and nobody read,
    while it is replaced by a rename: each reads one version whole (one
    read in 30 returned the old file's first 128 KiB joined to the new
    file's bytes, and about as many failed with EIO)."""
    root = tmp_path / "data"
    root.mkdir()
    old, new = os.urandom(300_000), os.urandom(300_000)
    trials = 60
    for n in range(trials):
        (root / f"f{n}").write_bytes(old)
    stage, mnt = mount_stage(root)
    assert len(os.listdir(mnt / "ds")) == trials
    seen = {"old": 0, "new": 0}
    for n in range(trials):
        path = mnt / "ds" / f"f{n}"
        got = []
        readers = [threading.Thread(target=lambda: got.append(path.read_bytes())) for _ in range(2)]
        for r in readers:
            r.start()
        time.sleep(random.random() * 0.003)
        replace_file(root, f"f{n}", new)
        for r in readers:
            r.join(30)
        assert len(got) == 2, f"f{n}: a reader failed"
        for data in got:
            assert data in (old, new), f"f{n}: {len(data)} bytes of neither version whole"
            seen["old" if data == old else "new"] += 1
    assert sum(seen.values()) == 2 * trials, seen


def test_a_file_that_grew_or_shrank_across_the_passthrough_size_opens_twice_at_once(tmp_path, mount_stage):
    """Files read while under 1 MiB (or over it), then replaced by ones
    over (or under) it: two opens of each at once read it whole (the
    second failed with EIO: the first had gone the way of the old size,
    the second the other way, and the kernel reads an inode one way)."""
    sizes = {"grew.bin": (900_000, 2 << 20), "grew-just.bin": (3004, (1 << 20) + 5),
             "shrank.bin": (2 << 20, 5000)}
    root = files_of_sizes(tmp_path, {name: before for name, (before, _) in sizes.items()})
    stage, mnt = mount_stage(root)
    for name in sizes:
        assert (mnt / "ds" / name).read_bytes() == (root / name).read_bytes()
    for name, (_, after) in sizes.items():
        want = os.urandom(after)
        replace_file(root, name, want)
        with open(mnt / "ds" / name, "rb") as first:
            assert first.read() == want, name
            with open(mnt / "ds" / name, "rb") as second:
                assert second.read() == want, name


def test_a_file_deleted_after_it_was_read_no_longer_opens(tmp_path, mount_stage):
    """A file read through the mount, then deleted from the source: a new
    open fails with ENOENT (it opened and read the deleted file's bytes,
    for as long as the kernel kept its name), whether or not a reader
    still holds it open; the holder reads on."""
    root = files_of_sizes(tmp_path, {"gone.bin": 4000, "held.bin": 4000})
    stage, mnt = mount_stage(root)
    held_bytes = (root / "held.bin").read_bytes()
    for name in ("gone.bin", "held.bin"):
        assert (mnt / "ds" / name).read_bytes() == (root / name).read_bytes()
    holder = open(mnt / "ds" / "held.bin", "rb")
    try:
        for name in ("gone.bin", "held.bin"):
            os.unlink(root / name)
            with pytest.raises(FileNotFoundError):
                open(mnt / "ds" / name, "rb").close()
        assert holder.read() == held_bytes
    finally:
        holder.close()


def test_a_file_replaced_while_another_reader_holds_it_reads_as_each_opened_it(tmp_path, mount_stage):
    """Reader A opened the file and read part of it; the source is replaced
    by a rename; reader B opens and reads the new file; A reads on. As on a
    local directory, A reads the old file whole, at its size, and B the
    new one: B's reads do not fill the pages A reads from (they did: A got
    4 KiB of the old file, then the new one, cut to the new size). Once A
    closed, an open reads the new file."""
    root = tmp_path / "data"
    root.mkdir()
    old, new = os.urandom(100_000), os.urandom(60_000)
    (root / "f.bin").write_bytes(old)
    stage, mnt = mount_stage(root)
    path = mnt / "ds" / "f.bin"
    a = os.open(path, os.O_RDONLY)
    try:
        first = os.pread(a, 4096, 0)
        (root / ".f.tmp").write_bytes(new)
        os.rename(root / ".f.tmp", root / "f.bin")
        assert path.read_bytes()[:len(new)] == new, "reader B"
        rest = os.pread(a, 200_000, 4096)
    finally:
        os.close(a)
    assert first + rest == old, "reader A: bytes of the new file, or cut to its size"
    assert path.read_bytes()[:len(new)] == new, "an open after A closed"


def test_a_planned_file_too_large_to_buffer_opens_all_the_same(tmp_path, mount_stage):
    """An order may list files larger than one buffered sample may be (a
    300 MiB shard): its open delivers it, and it is read as an unplanned
    file is, not refused."""
    root = tmp_path / "shards"
    root.mkdir()
    big = root / "big.tfrecord"
    with open(big, "wb") as f:
        f.truncate(300 * 2**20)
        f.seek(299 * 2**20)
        f.write(b"the end of the shard")
    (root / "small.tfrecord").write_bytes(b"small")
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    write_order(orders / "tf" / "ds", ["big.tfrecord", "small.tfrecord"])
    wait_for(lambda: job_metric(stage, "sluice_stage_storage_reads_total", "tf") >= 1,
             what="the order taken up")
    with open(mnt / "@tf" / "ds" / "big.tfrecord", "rb") as f:
        assert f.read(4096) == bytes(4096)
        assert os.pread(f.fileno(), 20, 299 * 2**20) == b"the end of the shard"
    assert (mnt / "@tf" / "ds" / "small.tfrecord").read_bytes() == b"small"


def test_large_planned_files_held_open_at_once_stay_within_the_budget(tmp_path, mount_stage):
    """Readers that hold several large planned files open at once (a data
    set that keeps its files open) read those no reader had fetched in
    windows, as unplanned files are, instead of each holding its whole
    file in the stage's memory; each is still its plan entry's delivery."""
    root = tmp_path / "volumes"
    root.mkdir()
    size = 64 * 2**20
    files = {f"v{i}.npy": os.urandom(4096) * (size // 4096) for i in range(6)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage, mnt = mount_stage(root, "--memory-budget", "16MiB", "--mount-passthrough", "false")
    with sluice.Client(stage.socket, job="vol") as c:
        plan = c.dataset("ds").plan_names(sorted(files), epoch=0, prefetch=0)
        held = [open(mnt / "@vol" / "ds" / name, "rb") for name in sorted(files)]
        try:
            for f, name in zip(held, sorted(files)):
                assert f.read(4096) == files[name][:4096], name
            with open(f"/proc/{stage.proc.pid}/status") as status:
                peak = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))
            # Before: each open file's whole 64 MiB (404 MiB); now about 100.
            assert peak <= 200 * 2**20, f"the stage's RSS peaked at {peak / 2**20:.0f} MiB"
            for f, name in zip(held, sorted(files)):
                assert f.read() == files[name][4096:], name
        finally:
            for f in held:
                f.close()
        # Every entry was delivered by its open: the plan has nothing left.
        assert list(plan) == []


def test_unplanned_files_held_open_at_once_stay_within_the_budget(tmp_path, mount_stage):
    """The windows a file read through the mount keeps count in the node
    budget: a reader holding many files open cannot take the stage past it
    (where the budget has no room, a read takes its range straight from
    the source), and every byte still comes right."""
    root = tmp_path / "shards"
    root.mkdir()
    files = {f"s{i:02d}.tar": os.urandom(8 * 2**20) for i in range(24)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage, mnt = mount_stage(root, "--memory-budget", "32MiB", "--mount-passthrough", "false")
    held = [open(mnt / "@shards" / "ds" / name, "rb", buffering=0) for name in sorted(files)]
    try:
        for f, name in zip(held, sorted(files)):
            # In order from the start: read in windows, the next ones ahead.
            assert f.read(2 * 2**20) == files[name][:2 * 2**20], name
        with open(f"/proc/{stage.proc.pid}/status") as status:
            peak = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))
        # Before: each open file's windows outside the budget (24 x 8 MiB).
        assert peak <= 120 * 2**20, f"the stage's RSS peaked at {peak / 2**20:.0f} MiB"
        for f, name in zip(reversed(held), reversed(sorted(files))):
            assert f.read() == files[name][2 * 2**20:], name
            f.seek(5 * 2**20 + 7)
            assert f.read(100_000) == files[name][5 * 2**20 + 7:5 * 2**20 + 100_007], name
    finally:
        for f in held:
            f.close()


def test_a_reader_killed_while_the_limiter_holds_its_open_goes_at_once(tmp_path, mount_stage):
    """The kernel waits for the stage's answer to an open even when the
    opener is killed: an open the job's limiter holds (here behind a large
    file's whole-file charge) must end when its opener is killed, not when
    the limiter lets it through."""
    root = tmp_path / "big"
    root.mkdir()
    for name in ("a.bin", "b.bin"):
        with open(root / name, "wb") as f:
            f.truncate(256 * 2**20)
    stage, mnt = mount_stage(root, "--rate-limit", "16MiB/s")
    with open(mnt / "@slow" / "ds" / "a.bin", "rb") as f:  # charges 16 s of the limiter
        f.read(10)
    reader = subprocess.Popen([sys.executable, "-c", f"open({str(mnt / '@slow' / 'ds' / 'b.bin')!r}, 'rb')"])
    time.sleep(1)
    assert reader.poll() is None, "the second open waits for the limiter"
    start = time.monotonic()
    reader.kill()
    reader.wait(timeout=10)
    assert time.monotonic() - start < 3, "a killed reader was held until the limiter let its open through"
    # The stage goes on serving.
    with open(mnt / "ds" / "a.bin", "rb") as f:
        assert f.read(4) == bytes(4)


TF_READER = r"""
import json, sys
import tensorflow as tf
paths = json.load(sys.stdin)
# The usual file pipeline: paths -> tf.io.read_file in parallel, in order.
ds = tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file, num_parallel_calls=4, deterministic=True)
sys.stdout.buffer.write(b"".join(len(t.numpy()).to_bytes(8, "big") + t.numpy() for t in ds))
"""


def test_a_tf_data_pipeline_reads_exact_bytes_through_the_mount_in_an_order_files_order(tmp_path, mount_stage,
                                                                                        dataset):
    root, files = dataset
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    order = sorted(files, key=lambda n: (len(files[n]), n))
    write_order(orders / "tf" / "ds", order)
    reads = lambda: job_metric(stage, "sluice_stage_storage_reads_total", "tf")  # noqa: E731
    wait_for(lambda: reads() == len(order), what="the order prefetched")
    paths = [str(mnt / "@tf" / "ds" / name) for name in order]
    run = subprocess.run([sys.executable, "-c", TF_READER], input=json.dumps(paths).encode(),
                         capture_output=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    out, got = run.stdout, []
    while out:
        n = int.from_bytes(out[:8], "big")
        got.append(out[8:8 + n])
        out = out[8 + n:]
    assert got == [files[name] for name in order], "tf.data read every file's exact bytes"
    assert reads() == len(order), "each file read from storage once, ahead of tf.data"
    assert job_metric(stage, "sluice_stage_delivered_samples_total", "tf") == len(order)


def test_order_files_need_a_mount(tmp_path, dataset):
    root, _ = dataset
    run = subprocess.run([str(stage_binary()), "--metrics-addr", "127.0.0.1:0",
                          "--dataset", f"ds={root}", "--socket", str(tmp_path / "s.sock"),
                          "--mount-orders", str(tmp_path / "orders")], capture_output=True, text=True, timeout=30)
    assert run.returncode != 0
    assert "--mount-orders needs --mount" in run.stderr


def test_a_stale_mount_is_recovered_at_the_next_start(tmp_path, mount_stage, dataset):
    root, files = dataset
    mnt = tmp_path / "mnt"  # made by mount_stage
    crashed = start_stage(tmp_path, {"ds": root}, "--mount", str(mnt))
    crashed.proc.send_signal(signal.SIGKILL)
    crashed.proc.wait()
    with pytest.raises(OSError) as e:
        os.listdir(mnt)
    assert e.value.errno == errno.ENOTCONN
    again, _ = mount_stage(root)
    assert walk(mnt / "ds") == files
    assert "stale mount" in again.stderr_tail()
    again.stop()
    assert os.listdir(mnt) == [], "SIGTERM unmounts"


def test_a_mount_unmounted_from_outside_stops_the_stage_with_an_error(tmp_path, mount_stage, dataset):
    """`umount` of a running stage's mount (a node's cleanup script, an
    operator) left its readers an empty directory while the stage went on
    as if nothing happened: no log line, `/readyz` ready. The stage now
    stops with an error, so that its supervisor starts it again, mounted;
    a SIGTERM's own unmount still exits 0."""
    root, files = dataset
    mnt = tmp_path / "mnt"  # made by mount_stage
    stage = start_stage(tmp_path, {"ds": root}, "--mount", str(mnt))
    assert walk(mnt / "ds") == files
    subprocess.run(["umount", str(mnt)], check=True, timeout=30)
    assert stage.proc.wait(timeout=20) == 1
    assert f"the mount at {mnt} ended while the stage ran" in stage.stderr_tail()
    again, _ = mount_stage(root)
    assert walk(mnt / "ds") == files
    assert again.stop() == 0


def test_a_missing_mount_directory_is_a_clear_error(tmp_path, dataset):
    """A `--mount` directory that is missing, or a file, is an invalid
    configuration (64) that names the flag: it exited 1 with "is not a
    directory" after the stage had begun to start."""
    root, _ = dataset
    (tmp_path / "afile").write_bytes(b"")
    for path, says in [("nowhere", "does not exist"), ("afile", "is not a directory")]:
        run = subprocess.run([str(stage_binary()), "--metrics-addr", "127.0.0.1:0",
                              "--dataset", f"ds={root}", "--socket", str(tmp_path / "s.sock"),
                              "--mount", str(tmp_path / path)], capture_output=True, text=True, timeout=30)
        assert run.returncode == 64, run.stderr
        assert f"--mount {tmp_path / path} {says}" in run.stderr, run.stderr
        assert not (tmp_path / "s.sock").exists()


class FileDataset:
    """An ordinary map-style dataset that opens files (as torchvision's
    ``ImageFolder`` does): index -> (relative name, bytes)."""

    def __init__(self, root, names):
        self.root = root
        self.names = names
        self.paths = [os.path.join(root, n) for n in names]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return self.names[i], f.read()


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_a_mount_sampler_makes_a_file_reading_dataloader_read_ahead_exactly_once(tmp_path, mount_stage,
                                                                                 workers):
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    import sluice.torch as st

    root = tmp_path / "data"
    files = {f"c{i % 3}/img{i:03d}.bin": os.urandom(1000 + i) for i in range(60)}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    stage, mnt = mount_stage(root)
    ds = FileDataset(mnt / "@vision" / "ds", sorted(files))
    counts = {}
    for rank in range(2):  # two ranks of one job, one after the other
        sampler = st.MountSampler(ds.paths, stage.socket, seed=3, rank=rank, world_size=2)
        assert (sampler.job, sampler.dataset_name) == ("vision", "ds")
        loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=workers,
                            collate_fn=lambda batch: batch)
        for batch in loader:
            for name, data in batch:
                assert data == files[name], name
                counts[name] = counts.get(name, 0) + 1
        sampler.close()
    assert counts == {n: 1 for n in files}
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    reads = metric_value(samples, "sluice_stage_storage_reads_total", job="vision")
    assert reads == len(files), "each file was read from the source once, by the plan's readers"


def test_a_mount_sampler_refuses_paths_outside_a_job_directory(tmp_path):
    pytest.importorskip("torch")
    import sluice.torch as st

    with pytest.raises(ValueError, match="MOUNT/@<job>/<dataset>/<file>"):
        st.MountSampler([str(tmp_path / "ds" / "a.bin")], "/nowhere.sock")
    with pytest.raises(ValueError, match="one data set of one job"):
        st.MountSampler(["/m/@a/ds/x", "/m/@b/ds/y"], "/nowhere.sock")


@pytest.mark.parametrize("even", [None, "pad", "drop"])
def test_a_mount_samplers_even_shares_are_distributed_samplers(even):
    pytest.importorskip("torch")
    import torch
    from torch.utils.data import DistributedSampler

    import sluice.torch as st

    paths = [f"/m/@j/ds/f{i}" for i in range(23)]
    world, seen = 4, []
    for rank in range(world):
        sampler = st.MountSampler(paths, "/nowhere.sock", seed=4, rank=rank, world_size=world, even=even)
        sampler.set_epoch(1)
        generator = torch.Generator()
        generator.manual_seed(5)
        everything = torch.randperm(len(paths), generator=generator).tolist()
        if even is None:
            expected = everything[rank::world]
        else:
            shares = DistributedSampler(everything, num_replicas=world, rank=rank, shuffle=False,
                                        drop_last=even == "drop")
            expected = [everything[i] for i in shares]
        assert sampler.order() == expected
        assert len(sampler) == len(expected)
        seen += expected
    assert sorted(set(seen)) == (list(range(23)) if even != "drop" else sorted(everything[:20]))


def test_a_mount_sampler_takes_the_job_directory_under_the_mount_point(tmp_path, stage_factory):
    """A data set's own directories may start with `@`, and so may the
    mount point's path."""
    pytest.importorskip("torch")
    import sluice.torch as st
    root = tmp_path / "data"
    (root / "@2024" / "cls").mkdir(parents=True)
    (root / "@2024" / "cls" / "x.jpg").write_bytes(b"x")
    (root / "@home").mkdir()
    (root / "@home" / "y").write_bytes(b"y")
    mnt = tmp_path / "@mnt"
    mnt.mkdir()
    stage_factory({"ds": root}, "--mount", str(mnt))
    paths = [str(mnt / "@j" / "ds" / "@2024" / "cls" / "x.jpg"), str(mnt / "@j" / "ds" / "@home" / "y")]
    assert st._mount_names(paths) == ("j", "ds", ["@2024/cls/x.jpg", "@home/y"])
    # With no mount to go by: the first component that starts with `@`.
    assert st._mount_names(["/m/@j/ds/@2024/x"]) == ("j", "ds", ["@2024/x"])


def windowed(tmp_path, mount_stage, size: int):
    """A stage reading one ``size``-byte file ``big.bin`` through windows
    (as from an object store: passthrough off); ``(stage, mnt, bytes)``."""
    root = tmp_path / "data"
    root.mkdir()
    big = os.urandom(size)
    (root / "big.bin").write_bytes(big)
    stage, mnt = mount_stage(root, "--mount-passthrough", "false")
    return stage, mnt, big


def test_large_files_are_read_in_windows_ahead_of_the_reader(tmp_path, mount_stage):
    # Through the stage (as from an object store): passthrough turned off.
    stage, mnt, big = windowed(tmp_path, mount_stage, 10 * 2**20 + 12345)  # three 4 MiB windows
    with open(mnt / "@seq" / "ds" / "big.bin", "rb") as f:
        assert f.read() == big
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    assert metric_value(samples, "sluice_stage_storage_reads_total", job="seq") == 3
    # Reads across window boundaries, at odd offsets and sizes.
    with open(mnt / "@random" / "ds" / "big.bin", "rb", buffering=0) as f:
        for offset, size in [(4 * 2**20 - 5, 10), (9, 3 * 2**20), (len(big) - 7, 100), (8 * 2**20 - 1, 2)]:
            f.seek(offset)
            assert f.read(size) == big[offset:offset + size], (offset, size)


def test_random_reads_of_a_large_file_read_what_they_ask_for(tmp_path, mount_stage):
    """Windows and read-ahead serve a reader going through a file in order;
    a random reader's small reads fetch what they ask for, and what it gets
    is what is counted delivered."""
    stage, mnt, big = windowed(tmp_path, mount_stage, 12 * 2**20)
    rng = random.Random(3)
    fd = os.open(mnt / "@random" / "ds" / "big.bin", os.O_RDONLY)
    try:
        for _ in range(40):
            offset = rng.randrange(4096, len(big) - 4096)
            assert os.pread(fd, 4096, offset) == big[offset:offset + 4096], offset
    finally:
        os.close(fd)
    read = job_metric(stage, "sluice_stage_storage_read_bytes_total", "random")
    delivered = job_metric(stage, "sluice_stage_delivered_bytes_total", "random")
    assert read < len(big) // 2, f"{read} bytes read from storage for 40 reads of 4 KiB"
    assert 40 * 4096 <= delivered <= read, (delivered, read)
    assert job_metric(stage, "sluice_stage_delivered_samples_total", "random") == 1, "one file"


def test_a_file_replaced_while_it_is_read_in_windows_reads_as_the_one_opened(tmp_path, mount_stage):
    """Every window of an open file is read from the file it opened, as a
    local reader's reads are: one replaced by a rename meanwhile does not
    give the reader the rest of the new one after the start of the old."""
    # Past the windows read ahead of the first read.
    stage, mnt, old = windowed(tmp_path, mount_stage, 24 * 2**20)
    root, new = tmp_path / "data", os.urandom(len(old))
    fd = os.open(mnt / "@j" / "ds" / "big.bin", os.O_RDONLY)
    local = os.open(root / "big.bin", os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == old[:4096]
        (root / "next.bin").write_bytes(new)
        os.rename(root / "next.bin", root / "big.bin")
        for offset in (20 * 2**20 + 7, 17 * 2**20, 5 * 2**20):
            assert os.pread(local, 4096, offset) == old[offset:offset + 4096], "the local reader"
            assert os.pread(fd, 4096, offset) == old[offset:offset + 4096], offset
    finally:
        os.close(fd)
        os.close(local)


def test_a_reader_that_jumps_and_reads_a_header_and_what_follows_gets_what_it_reads(tmp_path, mount_stage):
    """Zip members, HDF5 chunks, tar indexes: a jump, then a small read and
    the one right after it. The second read goes on in order, but is not a
    reader going through the file: it fetches no windows ahead (it cost
    12 MiB of storage reads a jump)."""
    stage, mnt, big = windowed(tmp_path, mount_stage, 24 * 2**20)
    rng = random.Random(5)
    fd = os.open(mnt / "@jumps" / "ds" / "big.bin", os.O_RDONLY)
    try:
        for _ in range(30):
            offset = rng.randrange(4096, len(big) - 2**20)
            for at in (offset, offset + 4096, offset + 8192):
                assert os.pread(fd, 4096, at) == big[at:at + 4096], at
    finally:
        os.close(fd)
    read = job_metric(stage, "sluice_stage_storage_read_bytes_total", "jumps")
    assert read <= 30 * 3 * 128 * 1024, f"{read} bytes read from storage for 90 reads of 4 KiB"


def test_large_files_are_passed_through_to_the_kernel_and_charged_to_the_job_whole(tmp_path, mount_stage):
    root = tmp_path / "data"
    root.mkdir()
    big = os.urandom(6 * 2**20 + 5)
    (root / "big.bin").write_bytes(big)
    (root / "small.bin").write_bytes(b"s" * 1000)
    stage, mnt = mount_stage(root, "--rate-limit", "4MiB/s")
    path = mnt / "@pt" / "ds" / "big.bin"
    with open(path, "rb", buffering=0) as f:
        assert f.read() == big
    t0 = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        opened = time.monotonic() - t0
        assert f.read() == big
        f.seek(3 * 2**20 + 1)
        assert f.read(10) == big[3 * 2**20 + 1:3 * 2**20 + 11]
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert m[-5:] == big[-5:]
    # Charged whole when opened: the second open waits until the job's
    # limiter has paid for the first 6 MiB at 4 MiB/s.
    assert opened >= 1.0, opened
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    assert metric_value(samples, "sluice_stage_storage_reads_total", job="pt") == 2
    assert metric_value(samples, "sluice_stage_storage_read_bytes_total", job="pt") == 2 * len(big)
    assert metric_value(samples, "sluice_stage_delivered_bytes_total", job="pt") == 2 * len(big)
    # A small file still goes through the stage.
    assert (mnt / "@pt" / "ds" / "small.bin").read_bytes() == b"s" * 1000
    samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
    assert metric_value(samples, "sluice_stage_storage_reads_total", job="pt") == 3


def test_a_large_file_opens_many_times_at_once(tmp_path, mount_stage):
    """Every open of a passed-through file shares the inode's one backing
    file: a second registration of the inode would fail the open (EIO)."""
    root = tmp_path / "data"
    root.mkdir()
    big = os.urandom(3 * 2**20 + 7)
    (root / "big.bin").write_bytes(big)
    stage, mnt = mount_stage(root)
    path = mnt / "ds" / "big.bin"
    held = os.open(path, os.O_RDONLY)
    try:
        failures = []

        def read() -> None:
            for _ in range(5):
                try:
                    if path.read_bytes() != big:
                        failures.append("wrong bytes")
                except OSError as e:
                    failures.append(e)
        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert os.pread(held, 10, 3 * 2**20) == big[3 * 2**20:3 * 2**20 + 7]
    finally:
        os.close(held)


def test_a_large_file_open_through_the_stage_and_through_passthrough_at_once(tmp_path, mount_stage):
    """The kernel reads one inode either from its pages or from a backing
    file, and fails an open of the other kind while one is open (EIO): a
    second open of a large planned file (numpy's ``mmap_mode``, which opens
    twice) reads as the first does, and so does a planned open of a file
    already passed through."""
    root = tmp_path / "data"
    root.mkdir()
    header = b"\x93NUMPY\x01\x00v\x00{'descr': '|u1', 'fortran_order': False, 'shape': (3145728,), }"
    header += b" " * (127 - len(header)) + b"\n"
    arrays = {f"a{i}.npy": header + os.urandom(3 * 2**20) for i in range(3)}
    for name, data in arrays.items():
        (root / name).write_bytes(data)
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    job = mnt / "@np" / "ds"

    # Planned first (read through the stage), then opened again while open.
    write_order(orders / "np" / "ds", ["a0.npy", "a1.npy"])
    wait_for(lambda: job_metric(stage, "sluice_stage_storage_reads_total", "np") >= 1,
             what="the order taken up")
    for name in ["a0.npy", "a1.npy"]:
        with open(job / name, "rb") as first:
            assert first.read(128) == arrays[name][:128]
            with open(job / name, "rb") as second, \
                    mmap.mmap(second.fileno(), 0, prot=mmap.PROT_READ) as m:
                assert m[:] == arrays[name], name
            assert first.read() == arrays[name][128:]

    # Passed through first (no plan holds it), then planned and opened.
    held = open(job / "a2.npy", "rb")
    try:
        assert held.read(10) == arrays["a2.npy"][:10]
        delivered = job_metric(stage, "sluice_stage_delivered_samples_total", "np")
        reads = job_metric(stage, "sluice_stage_storage_reads_total", "np")
        write_order(orders / "np" / "ds", ["a2.npy"])
        wait_for(lambda: job_metric(stage, "sluice_stage_storage_reads_total", "np") > reads,
                 what="the second order taken up")
        assert (job / "a2.npy").read_bytes() == arrays["a2.npy"]
        assert job_metric(stage, "sluice_stage_delivered_samples_total", "np") == delivered + 1
        assert held.read() == arrays["a2.npy"][10:]
    finally:
        held.close()
    # With every open closed, a new one is passed through again.
    assert (job / "a0.npy").read_bytes() == arrays["a0.npy"]


@pytest.mark.parametrize("passthrough", ["true", "false"])
def test_a_planned_file_another_reader_holds_open_can_be_mapped(tmp_path, mount_stage, passthrough):
    """A data set that keeps a handle to each file (to read a header) and
    then maps the files its sampler's plan names: the planned open shares
    the kernel's pages with the held one, so it can be mapped (an open that
    reads past the page cache cannot: ENODEV)."""
    root = tmp_path / "data"
    root.mkdir()
    files = {"small.bin": os.urandom(100 * 1024), "large.bin": os.urandom(3 * 2**20 + 5)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders), "--mount-passthrough", passthrough)
    job = mnt / "@mm" / "ds"
    held = {name: open(job / name, "rb") for name in files}
    try:
        for name, f in held.items():
            assert f.read(100) == files[name][:100]
        reads = job_metric(stage, "sluice_stage_storage_reads_total", "mm")
        write_order(orders / "mm" / "ds", sorted(files))
        wait_for(lambda: job_metric(stage, "sluice_stage_storage_reads_total", "mm") >= reads + len(files),
                 what="the order prefetched")
        for name, data in files.items():
            fd = os.open(job / name, os.O_RDONLY)
            try:
                with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
                    assert m[:] == data, name
            finally:
                os.close(fd)
            assert held[name].read() == data[100:], name
    finally:
        for f in held.values():
            f.close()


def test_files_show_the_sources_modes_owner_and_times_and_the_kernel_enforces_them(tmp_path, stage_factory):
    root = tmp_path / "data"
    (root / "closed").mkdir(parents=True)
    (root / "open.bin").write_bytes(b"readable")
    (root / "secret.bin").write_bytes(b"secret")
    (root / "closed" / "inner.bin").write_bytes(b"inner")
    # Symlinks in an open directory to a readable file and a readable
    # directory in the closed one: locally only the owner reaches them.
    (root / "closed" / "sub").mkdir()
    (root / "closed" / "sub" / "deep.bin").write_bytes(b"deep")
    (root / "closed" / "linked.bin").write_bytes(b"linked")
    (root / "links").mkdir()
    (root / "links" / "file").symlink_to("../closed/linked.bin")
    (root / "links" / "dir").symlink_to("../closed/sub")
    os.chmod(root / "closed" / "linked.bin", 0o644)
    os.chmod(root / "open.bin", 0o644)
    os.chmod(root / "secret.bin", 0o600)
    os.chmod(root / "closed", 0o700)
    os.utime(root / "open.bin", (1_000_000_000, 1_000_000_000))
    # Dated before 1970 (as archives keep some): shown as 1970 before.
    os.utime(root / "secret.bin", ns=(-315_360_000_000_000_005, -315_360_000_000_000_005))
    # A mount point other users can reach (pytest's own directories are
    # the owner's alone).
    shared = tempfile.mkdtemp(prefix="sluice-mount-")
    try:
        os.chmod(shared, 0o755)
        mnt = os.path.join(shared, "mnt")
        os.mkdir(mnt)
        config = tmp_path / "stage.yaml"
        config.write_text("trainers:\n"
                          "  - uids: [0]\n    jobs: ['*']\n"
                          "  - uids: [65534]\n    jobs: ['team-*']\n"
                      "  - gids: [4242]\n    jobs: ['*']\n")
        stage = stage_factory({"ds": str(root)}, "--mount", mnt, "--config", str(config))
        seen = os.stat(os.path.join(mnt, "ds", "open.bin"))
        assert seen.st_mtime == 1_000_000_000
        assert os.stat(os.path.join(mnt, "ds", "secret.bin")).st_mtime_ns == -315_360_000_000_000_005
        assert stat.S_IMODE(seen.st_mode) == 0o444
        assert stat.S_IMODE(os.stat(os.path.join(mnt, "ds", "secret.bin")).st_mode) == 0o400
        # Through a symlink, what the directories above its target allow.
        assert stat.S_IMODE(os.stat(os.path.join(mnt, "ds", "links", "file")).st_mode) == 0o400
        assert stat.S_IMODE(os.stat(os.path.join(mnt, "ds", "links", "dir")).st_mode) == 0o500
        if os.geteuid() == 0:
            # Another user reads what the source lets it read, and nothing else.
            def cat(path: str) -> int:
                return subprocess.run(["cat", os.path.join(mnt, path)], user=65534, group=65534,
                                      capture_output=True, timeout=30).returncode
            assert cat("@team-a/ds/open.bin") == 0
            assert cat("@team-a/ds/secret.bin") != 0
            assert cat("@team-a/ds/closed/inner.bin") != 0
            assert cat("@team-a/ds/links/file") != 0
            assert cat("@team-a/ds/links/dir/deep.bin") != 0
            # The `trainers:` rules: not a job this user may claim.
            assert cat("@other/ds/open.bin") != 0
            assert cat("ds/open.bin") != 0, "the default job is not one of team-*"
            assert "a read through the mount was refused" in stage.stderr_tail()
        stage.stop()
    finally:
        subprocess.run(["umount", "-l", os.path.join(shared, "mnt")], capture_output=True)
        shutil.rmtree(shared, ignore_errors=True)


def test_a_second_stage_on_a_live_mount_is_refused(tmp_path, mount_stage, dataset):
    root, files = dataset
    stage, mnt = mount_stage(root)
    with pytest.raises(StageStartError) as e:
        StageProcess.start(str(stage_binary()), str(tmp_path / "second.sock"), {"other": str(root)},
                           ["--mount", str(mnt)])
    assert "already served by a running sluice stage" in str(e.value)
    assert walk(mnt / "ds") == files, "the first stage's mount is untouched"


def test_a_stage_started_on_the_mount_of_a_stage_that_does_not_answer_gives_up(tmp_path, mount_stage, dataset):
    """The mount's first stage stopped (SIGSTOP: hung): a second one
    started on its directory says so within seconds instead of waiting in
    its `stat` for as long as the first stays stopped."""
    root, files = dataset
    stage, mnt = mount_stage(root)
    os.kill(stage.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(StageStartError) as e:
            StageProcess.start(str(stage_binary()), str(tmp_path / "second.sock"), {"other": str(root)},
                               ["--mount", str(mnt)], timeout=30)
        assert time.monotonic() - t0 < 20
        assert "does not answer within 5 s" in str(e.value) and "umount -l" in str(e.value)
    finally:
        os.kill(stage.proc.pid, signal.SIGCONT)
    assert walk(mnt / "ds") == files, "the first stage's mount is untouched"


def test_a_stage_stopped_while_a_reader_holds_a_file_leaves_no_mount(tmp_path, mount_stage, dataset):
    root, files = dataset
    stage, mnt = mount_stage(root)
    name = min(files)
    reader = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "os.chdir(os.path.dirname(sys.argv[1]))\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "print('open', flush=True)\n"
        "sys.stdin.readline()\n"), str(mnt / "ds" / name)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "open"
        assert stage.stop() == 0
        assert not os.path.ismount(mnt), "the mount outlived its stage"
        assert os.listdir(mnt) == []
    finally:
        reader.communicate("done\n", timeout=30)


def test_a_second_signal_while_the_stage_drains_leaves_no_mount(tmp_path, dataset):
    """Ctrl-C in a shell script that then stops the stage itself is two
    signals, the second while trainers are drained: the stage exits at
    once, and the mount goes with it (it was left dead)."""
    root, _files = dataset
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = start_stage(tmp_path, {"ds": root}, "--mount", str(mnt))
    try:
        with sluice.Client(stage.socket, job="draining"):
            stage.proc.send_signal(signal.SIGINT)
            stage.proc.send_signal(signal.SIGTERM)
            assert stage.proc.wait(10) in (0, 130)
        assert not os.path.ismount(mnt), "the mount outlived its stage"
        assert os.listdir(mnt) == []
    finally:
        stage.stop()
        subprocess.run(["umount", "-l", str(mnt)], stderr=subprocess.DEVNULL)


def test_an_order_file_beside_a_samplers_plan_for_the_same_job_is_refused(tmp_path, mount_stage, dataset):
    """One order per job and data set: a sampler gives it, so an order
    file for the same job and data set would read every file again."""
    pytest.importorskip("torch")
    from sluice.torch import MountSampler
    root, files = dataset
    orders = tmp_path / "orders"
    stage, mnt = mount_stage(root, "--mount-orders", str(orders))
    names = sorted(files)
    paths = [str(mnt / "@both" / "ds" / name) for name in names]
    sampler = MountSampler(paths, stage.socket, seed=1)
    sampler.set_epoch(0)
    order = list(iter(sampler))
    write_order(orders / "both" / "ds", sorted(files, reverse=True))
    error = orders / "both" / "ds.error"
    wait_for(error.exists, what="the second order refused")
    assert "one order per job and data set" in error.read_text()
    for i in order:
        with open(paths[i], "rb") as f:
            assert f.read() == files[names[i]], names[i]
    sampler.close()
    reads = job_metric(stage, "sluice_stage_storage_reads_total", "both")
    assert reads <= len(files), f"{reads} storage reads for {len(files)} files"


def test_a_stage_at_its_thread_limit_answers_on_the_threads_it_has(mounted):
    """A stage whose pod's `pids` limit is met (every job's reader threads
    count against it) and whose blocking threads have ended answers on the
    threads it has, slower but correctly: the mount's looks and reads
    (tokio's hand-over panicked on the mount's thread and ended the mount
    for every reader) and a trainer opening a data set and reading by name
    (its connection was dropped with no answer). A plan started then,
    whose job the OS refuses every reader thread, is read by a stand-in on
    a thread the stage keeps for this (its trainer waited for good, until
    the limit lifted); the limit is named in the log, and nothing panics."""
    stage, mnt, files = mounted
    name, data = sorted(files.items())[0]
    before = sluice.Client(stage.socket, job="before", reconnect=0, timeout=60)
    with pids_cgroup(stage.proc.pid) as limit, before:
        ds = before.dataset("ds")
        # tokio keeps an idle blocking thread 10 s: the limit is set at the
        # count left after, when the listings are due again too (5 s).
        time.sleep(11)
        limit(limit(None))
        assert sorted(os.listdir(mnt / "ds")) == sorted({n.split("/")[0] for n in files})
        assert (mnt / "ds" / name).read_bytes() == data
        with sluice.Client(stage.socket, job="late", reconnect=0, timeout=30) as late:
            assert late.dataset("ds").read(name) == data
        assert dict(ds.epoch(0)) == files
        reader_threads = [t for t in os.listdir(f"/proc/{stage.proc.pid}/task")
                          if open(f"/proc/{stage.proc.pid}/task/{t}/comm").read().startswith("reader-")]
        assert not reader_threads, "the OS gave the job a reader thread: the limit did not hold"
    assert stage.alive()
    log = stage.stderr_tail(200000)
    assert "panicked" not in log, log[-3000:]
    assert "the OS refused the stage a thread" in log
    with sluice.Client(stage.socket, job="after", reconnect=0) as after:
        assert dict(after.dataset("ds").epoch(0)) == files


def test_readers_of_a_file_replaced_at_its_size_over_and_over_read_one_version_each_open(mount_stage, tmp_path):
    """A fixed-size shard replaced by rename every 2 ms while two readers
    open, read and close it through the mount: an open that had the kernel
    drop the file's pages was answered before the kernel dropped them, and
    an open of the new file meanwhile kept them: its bytes were pages of
    two versions (found within 2 s before)."""
    import hashlib
    import struct

    root = tmp_path / "data"
    root.mkdir()
    size = 300_000

    def version(v: int) -> bytes:
        block = struct.pack("<Q", v) * 512
        return (block * (size // len(block) + 1))[:size]

    known = set()

    def put(v: int) -> None:
        data = version(v)
        known.add(hashlib.sha1(data).digest())
        (root / f".t{v}").write_bytes(data)
        os.rename(root / f".t{v}", root / "shard.bin")

    put(0)
    _stage, mnt = mount_stage(root)
    stop, mixed, reads = threading.Event(), [], [0]

    def writer() -> None:
        v = 1
        while not stop.is_set():
            put(v)
            v += 1
            time.sleep(0.002)

    def reader(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            with open(mnt / "ds" / "shard.bin", "rb") as f:
                data = b""
                while chunk := f.read(r.choice([4096, 65536, 1 << 20])):
                    data += chunk
                    if r.random() < 0.05:
                        time.sleep(0.01)
            reads[0] += 1
            if hashlib.sha1(data).digest() not in known:
                found = sorted({struct.unpack_from("<Q", data, o)[0] for o in range(0, len(data) - 8, 4096)})
                mixed.append((len(data), found[:6]))
                stop.set()

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    stop.wait(15)
    stop.set()
    for t in threads:
        t.join()
    assert not mixed, f"after {reads[0]} opens, one read {mixed[0][0]} bytes of versions {mixed[0][1]}"
    assert reads[0] > 100
