"""Shared-memory delivery (protocol version 2) against the real stage:
exact bytes, slots that come back however a trainer ends, one region per
job, the socket fallback, and the cap on what a job's trainers may hold."""

from __future__ import annotations

import gc
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import sluice
from sluice import protocol as p
from sluice import shm

from conftest import http_get, job_metric, sorted_names, wait_for

pytestmark = pytest.mark.skipif(not shm.supported(), reason="no shared-memory delivery on this platform")

MiB = 1 << 20


def lent(stage, job: str) -> float:
    return job_metric(stage, "sluice_stage_shared_lent_bytes", job)


def connections(stage) -> float:
    body = http_get(stage.metrics, "/metrics")
    return float(re.search(r"^sluice_stage_connections (\S+)$", body, re.M).group(1))


def test_samples_arrive_in_shared_memory_byte_for_byte(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="exact") as c:
        assert c.protocol_version == 2
        assert c.shared_memory
        ds = c.dataset("d")
        got = {}
        with ds.epoch(0, seed=3, batch=5) as it:
            for name, data in it:
                got[name] = bytes(data)
        assert got == files
        # Whole-file reads and FETCH come the same way.
        names = sorted_names(files)
        for name, data in ds.fetch(names):
            assert bytes(data) == files[name], name
        assert ds.read(names[-1]) == files[names[-1]]
    # Every non-empty sample of the plan and of FETCH went by slot.
    non_empty = sum(1 for d in files.values() if d)
    assert job_metric(stage, "sluice_stage_shared_samples_total", "exact") >= 2 * non_empty
    wait_for(lambda: lent(stage, "exact") == 0, what="the job's slots to come back")


def regions_mapped() -> int:
    """This process's descriptors of stage regions (Python's mmap keeps one
    per mapping)."""
    fds = f"/proc/{os.getpid()}/fd"
    count = 0
    for fd in os.listdir(fds):
        try:
            count += os.readlink(f"{fds}/{fd}").startswith("/memfd:sluice")
        except OSError:
            pass
    return count


def test_a_closed_client_whose_samples_are_gone_unmaps_its_region(stage_factory, dataset):
    """`close()` (and a reconnection) kept the region mapped, with its
    memory file open, for as long as the Client object lived, where no
    sample viewed it any more: after a stage's rolling update, the old
    stage's whole buffer stayed allocated for the trainer's life."""
    root, files = dataset
    stage = stage_factory({"d": root})
    gc.collect()  # earlier tests' clients
    before = regions_mapped()
    c = sluice.Client(stage.socket, job="unmapped")
    held = next(iter(c.dataset("d").epoch(0, seed=1)))[1]
    assert isinstance(held, memoryview) and regions_mapped() == before + 1
    c.close()
    gc.collect()
    assert regions_mapped() == before + 1, "a sample still views it"
    del held
    gc.collect()
    assert regions_mapped() == before, "unmapped with its last sample, the client alive"


def test_writing_into_a_sample_changes_only_this_process(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    name = max(files, key=lambda n: len(files[n]))
    with sluice.Client(stage.socket, job="cow") as c:
        ds = c.dataset("d")
        (_, first), = ds.fetch([name])
        assert isinstance(first, memoryview) and not first.readonly
        first[:4] = b"XXXX"  # an in-place transform
        del first
        for _ in range(3):  # the slot is reused: its next sample is the stage's bytes
            (_, again), = ds.fetch([name])
            assert bytes(again) == files[name]
            del again


HOLDER = textwrap.dedent("""
    import sys, time, sluice
    c = sluice.Client(sys.argv[1], job=sys.argv[2])
    assert c.shared_memory
    held = []
    it = c.dataset("d").epoch(0, seed=1, batch=4)
    for _ in range(int(sys.argv[3])):
        held.append(next(it))
    print("holding", len(held), flush=True)
    time.sleep(600)
""")


def test_a_killed_trainers_slots_come_back_and_the_job_goes_on(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    # Another trainer of the job stays connected: the killed one's slots
    # must come back on their own, not because the job ended.
    with sluice.Client(stage.socket, job="killed") as other:
        other.dataset("d")
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(stage.socket), "killed", "20"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().startswith("holding 20")
            held = wait_for(lambda: lent(stage, "killed"), what="the holder's slots")
            assert held > 0
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        wait_for(lambda: lent(stage, "killed") == 0, what="the killed trainer's slots to come back")
        # The next trainer of the job reads a whole epoch, exactly.
        with sluice.Client(stage.socket, job="killed") as c:
            got = {n: bytes(d) for n, d in c.dataset("d").epoch(1, seed=2)}
        assert got == files


HANDING_TRAINER = textwrap.dedent("""
    import sys, time
    from torch.utils.data import DataLoader
    from sluice.torch import SluiceDataset, SluiceSampler, collate
    ds = SluiceDataset(sys.argv[1], "d", job=sys.argv[2])
    loader = DataLoader(ds, batch_size=8, sampler=SluiceSampler(ds, seed=1), num_workers=2, collate_fn=collate)
    for i, batch in enumerate(loader):
        if i == 2:
            print("holding", flush=True)  # the workers' next batches wait, handed off, in the queue
            time.sleep(600)
""")


def test_batches_handed_off_to_a_killed_trainer_come_back_once_its_run_is_gone(stage_factory, tmp_path):
    """A DataLoader worker hands its batch's slots over for the main process
    to map; a trainer killed with such batches still queued never returns
    them. They are its run's, and come back once the run's last connection
    (its workers') has ended, while another trainer keeps the job alive."""
    pytest.importorskip("torch")
    root = tmp_path / "even"
    root.mkdir()
    for i in range(400):
        (root / f"s{i:03d}").write_bytes(os.urandom(64 * 1024))
    stage = stage_factory({"d": root})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with sluice.Client(stage.socket, job="handed") as other:
        other.dataset("d")
        for _ in range(2):  # a trainer killed, then the one restarted in its place
            proc = subprocess.Popen([sys.executable, "-c", HANDING_TRAINER, str(stage.socket), "handed"],
                                    stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
            try:
                assert proc.stdout.readline() == "holding\n"
                wait_for(lambda: lent(stage, "handed") > 0, what="batches handed off in the queue")
            finally:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # Before: each kill left its queued batches lent (4.8 MiB)
            # until the job's last connection ended.
            wait_for(lambda: lent(stage, "handed") == 0, timeout=15,
                     what="the killed trainer's handed-off slots to come back")


@pytest.mark.parametrize("kind", ["iterable", "map"])
def test_batches_a_loader_stopped_early_dropped_unread_come_back(stage_factory, tmp_path, kind):
    """A loop that stops its DataLoader early each epoch (Lightning's
    limit_train_batches, islice, a break) drops the batches its workers had
    handed off and the main process never took. They stayed lent to the
    trainer's run for as long as the trainer lived: about 1 MB more every
    epoch, up to half the job's buffer. The main process now says which it
    received (TAKE); the rest come back once their workers are gone."""
    pytest.importorskip("torch")
    import itertools

    from torch.utils.data import DataLoader

    import sluice.torch as st

    root = tmp_path / "ds"
    root.mkdir()
    rng = random.Random(1)
    files = {f"s{i:04d}": os.urandom(rng.randrange(20_000, 40_000)) for i in range(600)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage = stage_factory({"d": root})
    job = f"early-{kind}"
    if kind == "iterable":
        ds = epochs = st.SluiceIterableDataset(stage.socket, "d", job=job, seed=3)
        loader = DataLoader(ds, batch_size=16, num_workers=2, collate_fn=st.collate)
    else:
        ds = st.SluiceDataset(stage.socket, "d", job=job)
        epochs = st.SluiceSampler(ds, seed=3)
        loader = DataLoader(ds, batch_size=16, num_workers=2, sampler=epochs, collate_fn=st.collate)
    for epoch in range(6):
        epochs.set_epoch(epoch)
        for names, samples in itertools.islice(loader, 2):
            assert [bytes(s.numpy()) for s in samples] == [files[n] for n in names]
        del names, samples
    gc.collect()
    dropped = lent(stage, job)
    assert dropped > 0, "the early stops dropped no handed-off batch: the test shows nothing"
    # They come back once the stage's grace for receipts after a worker
    # ends (10 s) is over, whether or not the job reads on.
    wait_for(lambda: lent(stage, job) == 0, timeout=20,
             what=f"the dropped batches' slots ({dropped / MiB:.1f} MiB) to come back unasked")
    epochs.set_epoch(6)
    got = {n: bytes(s.numpy()) for names, samples in loader for n, s in zip(names, samples)}
    assert got == files
    del got
    gc.collect()
    wait_for(lambda: lent(stage, job) == 0, timeout=10,
             what=f"the dropped batches' slots ({dropped / MiB:.1f} MiB) to come back")


def test_each_job_maps_only_its_own_region(stage_factory, tmp_path):
    secret = b"JOB-A-ONLY-" * 400
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for i in range(8):
        (a / f"{i}.bin").write_bytes(secret + bytes([i]))
        (b / f"{i}.bin").write_bytes(os.urandom(len(secret)))
    stage = stage_factory({"a": a, "b": b})
    with sluice.Client(stage.socket, job="job-a") as ca, sluice.Client(stage.socket, job="job-b") as cb:
        assert ca.shared_memory and cb.shared_memory
        held_a = [d for _, d in ca.dataset("a").epoch(0)]
        assert all(bytes(d).startswith(secret) for d in held_a)
        # Job b reads too, even the same data set's names; its region holds
        # none of job a's bytes.
        held_b = [d for _, d in cb.dataset("b").epoch(0)]
        assert len(held_b) == 8
        region_b = cb._region
        assert region_b is not ca._region
        assert bytes(region_b._mm[:]).find(secret[:64]) < 0
        # Offsets name slots of the connection's own job's region only: a
        # RELEASE of one job b was never lent ends b's connection, and
        # changes nothing for job a.
        lent_a = wait_for(lambda: lent(stage, "job-a"), what="job a's slots")
        offset = max(d.obj.offset for d in held_a + held_b) + 64 * shm.PAGE
        cb._notify(p.encode_release([offset]))
        with pytest.raises(sluice.BadReleaseError):
            cb.dataset("b").fetch(["0.bin"])
        # Job a is untouched and still holds its slots.
        assert bytes(held_a[0]).startswith(secret)
        assert lent(stage, "job-a") == lent_a
        assert bytes(ca.dataset("a").read("0.bin")) == secret + bytes([0])


def test_a_trainer_cannot_write_or_resize_the_region_it_is_handed(stage_factory, dataset):
    """The descriptor a trainer receives is read-only, and opening it again
    through /proc must not give more: the region is readable by the
    stage's user alone and sealed against resizing. A trainer that cut it
    short made the stage's next copy into it a SIGBUS, every job's end."""
    import socket as socketlib
    from sluice.shm import receive_with_fd
    root, files = dataset
    stage = stage_factory({"d": root})
    sock = socketlib.socket(socketlib.AF_UNIX)
    sock.connect(stage.socket)
    sock.sendall(p.encode_hello("sealed", version=2, features=p.FEATURE_SHARED_MEMORY))
    _, fd = receive_with_fd(sock, 1 << 20)
    assert fd is not None, "no region was handed over"
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o400
        if os.geteuid() == 0:
            # Another user's trainer cannot open it for writing at all.
            child = os.fork()
            if child == 0:  # pragma: no cover - the child's outcome is its status
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                    os._exit(1)
                except PermissionError:
                    os._exit(0)
                except BaseException:
                    os._exit(2)
            _, status = os.waitpid(child, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "another user opened the region for writing"
        # One that may (root, or the stage's own user) still cannot resize it.
        try:
            again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        except PermissionError:
            again = None
        if again is not None:
            try:
                with pytest.raises(PermissionError):
                    os.ftruncate(again, 0)
            finally:
                os.close(again)
    finally:
        os.close(fd)
        sock.close()
    with sluice.Client(stage.socket, job="sealed") as c:
        assert dict(c.dataset("d").epoch(0)) == files


def test_a_release_naming_a_slot_twice_returns_none_and_says_so(stage_factory, tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(4):
        (root / f"{i}.bin").write_bytes(bytes([i]) * 9000)
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="twice") as c:
        held = [d for _, d in c.dataset("d").epoch(0)]
        offset = held[0].obj.offset
        c._notify(p.encode_release([offset, offset]))
        with pytest.raises(sluice.BadReleaseError, match=f"offset {offset} more than once .*; none of its slots was returned"):
            c.dataset("d").fetch(["0.bin"])


@pytest.mark.parametrize("how", ["stage-off", "client-off", "tcp"])
def test_the_socket_path_when_shared_memory_is_not_used(stage_factory, dataset, how):
    root, files = dataset
    args = ("--shared-memory", "false") if how == "stage-off" else ()
    stage = stage_factory({"d": root}, *args, tcp=(how == "tcp"))
    address = f"tcp://{stage.tcp}" if how == "tcp" else stage.socket
    with sluice.Client(address, job="sock", shared_memory=False if how == "client-off" else None) as c:
        assert c.protocol_version == 2
        assert not c.shared_memory
        ds = c.dataset("d")
        got = {}
        for name, data in ds.epoch(0, seed=4, batch=3):
            assert isinstance(data, bytes)
            got[name] = data
        assert got == files
        assert {n: d for n, d in ds.fetch(sorted_names(files))} == files
    assert job_metric(stage, "sluice_stage_shared_samples_total", "sock") == 0


def test_a_trainer_that_keeps_its_samples_gets_the_rest_through_the_socket(stage_factory, tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    files = {f"{i:03d}.bin": os.urandom(MiB) for i in range(72)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    # A 16 MiB buffer: the job may hold 64 MiB (the floor) of slots.
    stage = stage_factory({"d": root}, "--max-buffer", "16MiB", "--initial-buffer", "16MiB")
    with sluice.Client(stage.socket, job="hoard") as c:
        kept = list(c.dataset("d").epoch(0, batch=4))
        assert {n: bytes(d) for n, d in kept} == files
        in_slots = sum(isinstance(d, memoryview) for _, d in kept)
        assert 0 < in_slots < len(files)
        assert lent(stage, "hoard") <= 64 * MiB
        del kept
        wait_for(lambda: lent(stage, "hoard") == 0, what="the hoarded slots to come back")
        # With its slots back the job delivers in shared memory again.
        kinds = set()
        for name, data in c.dataset("d").epoch(1, batch=4):
            kinds.add(type(data))
            assert bytes(data) == files[name]
        assert kinds == {memoryview}


def test_jobs_that_all_keep_their_samples_leave_the_readers_room(stage_factory, tmp_path):
    """Each job may hold half the budget in slots; held together they may
    not take all of it, or no job's readers could fetch anything more."""
    root = tmp_path / "small"
    root.mkdir()
    files = {f"{i:04d}.bin": os.urandom(8192) for i in range(1500)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage = stage_factory({"d": root}, "--memory-budget", "8MiB")
    kept = {}
    clients = [sluice.Client(stage.socket, job=job, timeout=30) for job in ("a", "b", "c")]
    try:
        for c in clients:
            kept[c.job] = list(c.dataset("d").epoch(0, prefetch=0))
            assert {n: bytes(d) for n, d in kept[c.job]} == files, c.job
        assert sum(lent(stage, job) for job in kept) <= 4 * MiB
    finally:
        kept.clear()
        for c in clients:
            c.close()


def shmem_mib(stage) -> float:
    """The stage's resident shared memory (its jobs' regions), in MiB."""
    with open(f"/proc/{stage.proc.pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))
    return kib / 1024


def test_idle_jobs_regions_keep_little_beyond_the_budget(stage_factory, tmp_path):
    """A job's freed slots stay resident for reuse (within the budget's
    unreserved room and an allowance beyond it), and a job that hands out
    nothing for a few seconds gives them back: jobs that read an epoch and
    wait do not each keep what they read."""
    root = tmp_path / "twelve"
    root.mkdir()
    files = {f"{i:03d}.bin": os.urandom(128 * 1024) for i in range(96)}  # 12 MiB
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage = stage_factory({"d": root}, "--memory-budget", "64MiB")
    clients = []
    try:
        for job in ("a", "b", "c", "d"):
            c = sluice.Client(stage.socket, job=job, timeout=30)
            clients.append(c)
            got = 0
            for name, data in c.dataset("d").epoch(0):
                assert data == files[name]
                got += 1
            assert got == len(files)
            if job == "a":
                # Its region keeps the freed slots it may reuse, and says so.
                wait_for(lambda: job_metric(stage, "sluice_stage_shared_kept_bytes", "a") > 0,
                         timeout=4, what="the kept bytes shown")
        del data
        wait_for(lambda: all(lent(stage, c.job) == 0 for c in clients), what="every slot returned")
        # Before: each region kept the 12 MiB its job read (48 MiB), for good.
        wait_for(lambda: shmem_mib(stage) < 4, timeout=15, interval=0.5,
                 what="the idle jobs' regions to give their free pages back")
        # What the regions keep is shown per job.
        wait_for(lambda: all(job_metric(stage, "sluice_stage_shared_kept_bytes", c.job) == 0
                             for c in clients), what="the kept bytes shown as given back")
    finally:
        for c in clients:
            c.close()


class PeakUsed:
    """Watches the stage's ``sluice_stage_memory_used_bytes`` from a thread
    while in its ``with`` block; ``peak`` is the most it showed."""

    def __init__(self, stage) -> None:
        self.stage = stage
        self.peak = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            body = http_get(self.stage.metrics, "/metrics")
            used = re.search(r"^sluice_stage_memory_used_bytes (\S+)$", body, re.M)
            self.peak = max(self.peak, float(used.group(1)))
            time.sleep(0.005)

    def __enter__(self) -> "PeakUsed":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def test_samples_near_the_budget_go_over_it_one_at_a_time(stage_factory, tmp_path):
    """Four ranks of a job reading samples the budget holds one of at a
    time: the node is over its budget by one sample at most, not by one
    per waiting consumer (they stacked up while on their way out)."""
    root = tmp_path / "volumes"
    root.mkdir()
    size = 24 * MiB
    files = {f"v{i}.bin": os.urandom(1024) * (size // 1024) for i in range(8)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    budget = 32 * MiB
    stage = stage_factory({"d": root}, "--memory-budget", "32MiB")

    def rank(r, errors):
        try:
            with sluice.Client(stage.socket, job="volumes", rank=r, world_size=4,
                               shared_memory=False, timeout=60) as c:
                for name, data in c.dataset("d").epoch(0, batch=1):
                    if data != files[name]:
                        errors.append(name)
                    time.sleep(0.05)
        except Exception as e:  # reported below
            errors.append(repr(e))

    errors = []
    with PeakUsed(stage) as used:
        ranks = [threading.Thread(target=rank, args=(r, errors)) for r in range(4)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(120)
    assert not errors, errors
    assert used.peak <= budget + size + MiB, f"{used.peak / MiB:.0f} MiB used on a 32 MiB budget"


def test_files_that_grow_after_they_are_listed_keep_to_the_budget(stage_factory, tmp_path):
    """Files still being written when a trainer opens the data set (listed
    empty, then filled): prefetch reserves by the listed size, and a file
    found larger is not read into the buffer past that; the client reads
    it in ranges, so the node keeps to its budget, give or take the one
    range in flight (before, every reader's file went into the buffer at
    once: 176 MiB on a 64 MiB budget), and every byte is the file's."""
    root = tmp_path / "growing"
    root.mkdir()
    size = 4 * MiB
    names = [f"f{i:02d}.bin" for i in range(24)]
    for name in names:
        (root / name).write_bytes(b"")
    budget = 32 * MiB
    stage = stage_factory({"d": root}, "--memory-budget", "32MiB")
    with sluice.Client(stage.socket, job="growing", timeout=60) as c, PeakUsed(stage) as used:
        ds = c.dataset("d")
        assert ds.total_bytes == 0
        files = {}
        for name in names:  # the writer fills them
            files[name] = os.urandom(size)
            (root / name).write_bytes(files[name])
        got = 0
        for name, data in ds.epoch(0, batch=1, prefetch=0):
            if got == 0:
                time.sleep(1)  # a slow first step: the readers run ahead
            assert data == files[name], name
            got += 1
            del data
            time.sleep(0.02)
    assert got == len(names)
    assert used.peak <= budget + size + MiB, f"{used.peak / MiB:.0f} MiB used on a 32 MiB budget"


def test_a_sample_larger_than_what_held_slots_leave_is_read_all_the_same(stage_factory, tmp_path):
    """Slots a trainer holds stay out of the budget until it lets them go;
    a sample waited for that the rest cannot hold is read over the budget
    rather than never."""
    root = tmp_path / "mixed"
    root.mkdir()
    sizes = [MiB, MiB, 3 * MiB, MiB]
    files = {f"f{i}.bin": os.urandom(size) for i, size in enumerate(sizes)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage = stage_factory({"d": root}, "--memory-budget", "4MiB")
    with sluice.Client(stage.socket, job="keeps", timeout=30) as c:
        kept = list(c.dataset("d").epoch(0, shuffle=False, batch=1))
        assert [(n, bytes(d)) for n, d in kept] == sorted(files.items())
        del kept


def test_a_script_that_keeps_its_samples_to_the_end_exits(stage_factory, dataset):
    """Samples collected as the interpreter exits go back with the
    connection, without a thread that could never start."""
    root, _files = dataset
    stage = stage_factory({"d": root})
    script = ("import sluice\n"
              f"c = sluice.Client({str(stage.socket)!r}, job='kept')\n"
              "held = list(c.dataset('d').epoch(0))\n"
              "assert any(isinstance(d, memoryview) for _, d in held)\n"
              "print('done', flush=True)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0 and run.stdout == "done\n", run.stderr


def test_a_sample_handed_to_another_connection_is_returned_there(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    name = max(files, key=lambda n: len(files[n]))
    with sluice.Client(stage.socket, job="hand") as worker, sluice.Client(stage.socket, job="hand") as main:
        (_, data), = worker.dataset("d").fetch([name])
        owner = data.obj
        assert worker.hand_off([owner], worker._region)
        main.dataset("d")
        view = main._region.view(owner.offset, len(data))
        assert bytes(view) == files[name]
        del data, owner
        worker.close()  # the worker going does not take the handed slot back
        assert lent(stage, "hand") > 0
        assert bytes(view) == files[name]
        del view  # the process it was handed to returns it
        main.dataset("d").fetch([name])
        wait_for(lambda: lent(stage, "hand") == 0, what="the handed slot to come back")


def test_a_receipt_that_reaches_the_stage_before_its_hand_off_keeps_the_slot(stage_factory, dataset):
    """The worker's HAND_OFF and the main process's TAKE travel on two
    connections, so the receipt may come first. It was then ignored (the
    slot was not in transit yet), the late hand-off put the slot in
    transit for good, and 10 s after the worker ended the stage took back a
    slot the main process still read: held samples changed under it."""
    root, files = dataset
    stage = stage_factory({"d": root})
    name = max(files, key=lambda n: len(files[n]))
    with sluice.Client(stage.socket, job="receipt", _receipts=True) as worker, \
            sluice.Client(stage.socket, job="receipt", _receipts=True) as main:
        (_, data), = worker.dataset("d").fetch([name])
        owner = data.obj
        main.dataset("d")
        assert main._received(worker._region.ident, [owner.offset])
        view = main._region.view(owner.offset, len(data))
        assert worker.hand_off([owner], worker._region)
        del data, owner
        worker.close()
        held = lent(stage, "receipt")
        assert held > 0
        time.sleep(11)  # past the grace for receipts, then a delivery sweeps
        others = [n for n in files if n != name and files[n]]
        assert dict(main.dataset("d").fetch(others[:4])) == {n: files[n] for n in others[:4]}
        assert lent(stage, "receipt") >= held, "the slot the main process received was taken back"
        assert bytes(view) == files[name]
        del view
        main.dataset("d").fetch([name])
        wait_for(lambda: lent(stage, "receipt") == 0, what="the received slot to come back once released")


@pytest.fixture
def even_files(tmp_path):
    """64 samples of 64 KiB: one slot size, so a freed slot is the next one
    taken."""
    root = tmp_path / "even"
    root.mkdir()
    files = {f"{i:03d}.bin": os.urandom(64 * 1024) for i in range(64)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


def hold(client, count: int, seed: int = 1):
    """The first ``count`` samples of an epoch, held as received."""
    held = []
    with client.dataset("d").epoch(0, seed=seed, batch=16) as it:
        for name, data in it:
            assert isinstance(data, memoryview)
            held.append((name, data))
            if len(held) == count:
                break
    return held


def read_on_and_check_held(stage, job: str, files, held) -> None:
    """Another trainer of ``job`` reads three epochs (the slots the held
    samples' connection had go back and are filled with other samples);
    then every held sample must still be its file."""
    with sluice.Client(stage.socket, job=job) as other:
        for epoch in range(3):
            for name, data in other.dataset("d").epoch(epoch, seed=epoch + 7, batch=16):
                assert bytes(data) == files[name]
    for name, data in held:
        assert bytes(data) == files[name], f"{name} changed after its connection ended"


def test_samples_held_after_close_keep_their_bytes(stage_factory, even_files):
    root, files = even_files
    stage = stage_factory({"d": root})
    c = sluice.Client(stage.socket, job="after-close")
    held = hold(c, 16)
    c.close()
    read_on_and_check_held(stage, "after-close", files, held)


def test_samples_a_forked_child_inherits_keep_their_bytes_when_the_parent_drops_them(stage_factory, even_files):
    """The parent gives back what it drops and reads on, and the stage
    reuses those slots; a child forked while the samples were alive still
    refers to them, and must keep seeing its files."""
    root, files = even_files
    stage = stage_factory({"d": root})
    c = sluice.Client(stage.socket, job="forked")
    held = hold(c, 16)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r), os.close(done_w)
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        changed = sum(bytes(data) != files[name] for name, data in held)
        os._exit(10 + changed if changed else 0)
    os.close(ready_w), os.close(done_r)
    os.read(ready_r, 1)
    del held
    gc.collect()
    for epoch in range(1, 4):
        for name, data in c.dataset("d").epoch(epoch, seed=epoch, batch=16):
            assert bytes(data) == files[name]
    del data
    c.close()
    os.write(done_w, b"x")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"{os.waitstatus_to_exitcode(status) - 10} of 16 samples changed"


def test_samples_held_after_their_client_is_dropped_keep_their_bytes(stage_factory, even_files):
    """No close(): the client goes with the function that opened it, and
    its samples outlive it."""
    root, files = even_files
    stage = stage_factory({"d": root})

    def held_from_a_dropped_client():
        return hold(sluice.Client(stage.socket, job="dropped"), 16)

    held = held_from_a_dropped_client()
    gc.collect()
    read_on_and_check_held(stage, "dropped", files, held)


def test_samples_held_through_a_graceful_stop_keep_their_bytes(stage_factory, even_files):
    root, files = even_files
    # 1 MiB/s: the other trainer's batch of 64 samples takes seconds, so
    # the stage drains it (reading on) after the holder's connection ended.
    stage = stage_factory({"d": root}, "--rate-limit", "1MiB/s", "--burst-ms", "1000")
    holder = sluice.Client(stage.socket, job="drain", reconnect=0)
    held = hold(holder, 16)
    reading = sluice.Client(stage.socket, job="drain", reconnect=0)
    done = threading.Event()

    def read_on():
        try:
            for _ in reading.dataset("d").epoch(1, seed=5, batch=64):
                pass
        except sluice.SluiceError:
            pass  # the stage stopped
        finally:
            done.set()

    threading.Thread(target=read_on, daemon=True).start()
    time.sleep(1.0)
    assert not done.is_set(), "the other trainer's batch came before the stage was stopped"
    assert stage.stop() == 0, stage.stderr_tail()
    done.wait(10)
    for name, data in held:
        assert bytes(data) == files[name], f"{name} changed while the stage drained"
    holder.close()
    reading.close()


def test_samples_held_when_the_stage_ends_the_connection_keep_their_bytes(stage_factory, even_files):
    root, files = even_files
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="ended", reconnect=0) as other:
        holder = sluice.Client(stage.socket, job="ended", reconnect=0)
        held = hold(holder, 16)
        # A frame far over the request limit: the stage answers with an
        # error and ends the connection, whose trainer still holds samples.
        holder._sock.sendall((1 << 30).to_bytes(4, "big") + b"\0" * 8)
        wait_for(lambda: connections(stage) == 1, what="the stage to end the connection")
        assert lent(stage, "ended") >= 16 * 64 * 1024, "the ended connection's slots stay the job's"
        for epoch in range(3):
            for name, data in other.dataset("d").epoch(epoch, seed=epoch + 7, batch=16):
                assert bytes(data) == files[name]
        for name, data in held:
            assert bytes(data) == files[name], f"{name} changed after the stage ended its connection"
        holder.close()
    # The job's last connection gone, its slots come back.
    wait_for(lambda: lent(stage, "ended") == 0, what="the job's slots to come back")


@pytest.mark.parametrize("shared", [True, False])
def test_a_small_budget_never_leaves_a_request_waiting(stage_factory, tmp_path, shared):
    """A budget of a few samples: a request asks for more than it holds at
    once, the trainer keeps every sample, and one file is larger than the
    whole budget. Every request is answered (fewer samples each), none waits
    for room that never comes."""
    root = tmp_path / "tight"
    root.mkdir()
    files = {f"{i:03d}.bin": os.urandom(MiB) for i in range(40)}
    files["empty.bin"] = b""
    files["huge.bin"] = os.urandom(12 * MiB)
    for name, data in files.items():
        (root / name).write_bytes(data)
    stage = stage_factory({"d": root}, "--memory-budget", "8MiB", "--shared-memory", str(shared).lower())
    with sluice.Client(stage.socket, job="tight", timeout=60) as c:
        ds = c.dataset("d")
        kept = list(ds.epoch(0, seed=2, batch=32))
        assert {n: bytes(d) for n, d in kept} == files
        assert lent(stage, "tight") <= 4 * MiB, "trainers hold at most half a small budget"
        del kept
        # Not kept: the loop variable alone holds a slot while the next asks.
        got = {}
        for name, data in ds.epoch(1, seed=2, batch=4, prefetch=0):
            got[name] = bytes(data)
        assert got == files
