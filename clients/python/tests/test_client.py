"""The client's logic against the in-process fake stage (no Rust binary)."""

import os
import signal
import socket
import struct
import threading
import time

import pytest

import sluice
from sluice import protocol as p

from fakestage import FakeStage


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    (root / "a" / "b").mkdir(parents=True)
    files = {}
    for i in range(23):
        name = f"a/b/{i:03d}.bin" if i % 3 else f"{i:03d}.bin"
        content = os.urandom(i * 37)
        (root / name).write_bytes(content)
        files[name] = content
    return root, files


@pytest.fixture
def fake(tmp_path, data):
    stage = FakeStage(str(tmp_path / "fake.sock"), {"d": str(data[0])})
    yield stage
    stage.close()


def test_hello_open_list_read(fake, data):
    root, files = data
    with sluice.Client(fake.path, job="j", labels={"team": "t"}) as c:
        assert c.stage_id == "fake" and c.max_response_frame == p.MAX_RESPONSE_FRAME
        ds = c.dataset("d")
        assert ds.file_count == len(files) and ds.total_bytes == sum(map(len, files.values()))
        names = sorted(files, key=str.encode)
        assert ds.files.names() == names
        assert ds.files[-1] == (names[-1], len(files[names[-1]]))
        assert ds.files[1:3] == [(n, len(files[n])) for n in names[1:3]]
        with pytest.raises(IndexError):
            ds.files[len(files)]
        assert ds.files[-len(files)] == ds.files[0]
        with pytest.raises(IndexError, match=rf"file index -{len(files) + 1} out of range"):
            ds.files[-len(files) - 1]
        assert ds.read(names[5]) == files[names[5]]
        assert c.read(names[5], 3, 4) == files[names[5]][3:7]
        with pytest.raises(sluice.NotFoundError) as e:
            ds.read("nope")
        assert e.value.name == "nope" and "no such file" in e.value.message
        assert not c.closed
    assert c.closed


def test_epoch_order_matches_local_derivation(fake, data):
    _root, files = data
    for rank in range(3):
        with sluice.Client(fake.path, job="j", rank=rank, world_size=3) as c:
            ds = c.dataset("d")
            it = ds.epoch(4, seed=9, batch=5)
            assert it.state == p.PlanState.CREATED and it.length == len(ds.local_order(4, seed=9))
            got = list(it)
            names = ds.files.names()
            assert [n for n, _ in got] == [names[i] for i in ds.local_order(4, seed=9)]
            assert all(files[n] == d for n, d in got)
            with pytest.warns(sluice.AlreadyReadWarning, match="already read in full"):
                again = ds.epoch(4, seed=9)
            assert again.state == sluice.PlanState.COMPLETE and list(again) == []


def test_a_run_is_named_only_to_a_stage_that_grants_runs(fake, data):
    """A stage without the RUNS feature (this fake grants none) is sent
    plans as before: it would refuse the run's bytes."""
    _root, files = data
    with sluice.Client(fake.path, job="j", run=12345) as c:
        assert c.run == 12345
        assert sorted(n for n, _ in c.dataset("d").epoch(0)) == sorted(files)
    assert fake.plan_runs == [0]


def test_sample_errors_raise_or_yield(fake, data):
    root, files = data
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        names = ds.files.names()
        os.remove(root / names[2])
        got, errors = [], []
        it = ds.plan_indices([0, 1, 2, 3], epoch=0, batch=2)
        while True:
            try:
                got.append(next(it)[0])
            except StopIteration:
                break
            except sluice.SluiceError as e:
                errors.append(e)
        assert got == [names[0], names[1], names[3]]
        assert len(errors) == 1 and errors[0].name == names[2] and errors[0].code_name == "NOT_FOUND"
        out = list(ds.plan_names([names[2], names[4]], epoch=1, on_error="yield"))
        assert isinstance(out[0][1], sluice.NotFoundError) and out[1] == (names[4], files[names[4]])


def test_superseded_iterator_and_second_dataset_handle(fake, data):
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        it = ds.epoch(0, batch=1)
        next(it)
        ds.epoch(1)
        with pytest.raises(RuntimeError, match="superseded"):
            list(it)
        other = c.dataset("d")
        # The first handle reopens its dataset before speaking.
        assert ds.read(ds.files[0][0]) == other.read(other.files[0][0])


def test_stage_errors_map_to_exceptions(fake):
    with sluice.Client(fake.path, job="j") as c:
        with pytest.raises(sluice.NoSuchDatasetError, match="no dataset named"):
            c.dataset("missing")
        with pytest.raises(sluice.NoDatasetError):
            c.read("x")
        ds = c.dataset("d")
        with pytest.raises(sluice.BadPlanError):
            ds.plan_indices([10**6], epoch=0)
        with pytest.raises(sluice.ForbiddenPathError):
            ds.read("../x")
        with pytest.raises(ValueError, match="on_error"):
            ds.epoch(0, on_error="ignore")
        with pytest.raises(ValueError, match="batch"):
            ds.epoch(0, batch=0)
        assert ds.read(ds.files[0][0]) is not None  # still usable


def test_fatal_error_closes_the_client(tmp_path, data):
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])},
                      script={p.MsgType.OPEN: lambda: p.encode_error(1, "bad frame", True)})
    try:
        c = sluice.Client(stage.path, job="j")
        with pytest.raises(sluice.BadFrameError) as e:
            c.dataset("d")
        assert e.value.fatal and c.closed
        with pytest.raises(sluice.ConnectionClosedError, match="closed"):
            c.dataset("d")
    finally:
        stage.close()


@pytest.mark.parametrize("reply,error", [
    (lambda: p.encode_planned(1, 0), sluice.ProtocolError),             # wrong answer type
    (lambda: b"\x00\x00\x00\x02\x82\x00", sluice.ProtocolError),       # OPENED payload too short
    (lambda: (b"\x00\x00\x00", True), sluice.ConnectionClosedError),   # half a header, then close
    (lambda: (b"", True), sluice.ConnectionClosedError),                # no answer, close
    (lambda: struct.pack(">IB", 2**31, 0x86), sluice.ProtocolError),    # over max_response_frame
])
def test_bad_responses_close_the_client(tmp_path, data, reply, error):
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, script={p.MsgType.OPEN: reply})
    try:
        c = sluice.Client(stage.path, job="j")
        with pytest.raises(error):
            c.dataset("d")
        assert c.closed
    finally:
        stage.close()


def test_a_client_cannot_be_pickled_and_says_what_to_do_instead(stage_factory, tmp_path):
    import pickle

    (tmp_path / "d").mkdir()
    stage = stage_factory({"d": tmp_path / "d"})
    with sluice.Client(stage.socket, job="pickled") as c:
        with pytest.raises(TypeError, match="each process opens its own Client"):
            pickle.dumps(c)


def test_close_does_not_wait_long_on_a_stage_that_stopped_answering(stage_factory, tmp_path):
    """BYE is a courtesy: `close()` (and leaving a `with` block) of a
    client without a timeout waited for `GOODBYE` from a stopped stage for
    good."""
    (tmp_path / "d").mkdir()
    stage = stage_factory({"d": tmp_path / "d"})
    c = sluice.Client(stage.socket, job="bye")
    stage.proc.send_signal(signal.SIGSTOP)
    # Let go after 20 s whatever happens, so that a close() that waits
    # fails this test rather than hangs it.
    resume = threading.Timer(20, stage.proc.send_signal, (signal.SIGCONT,))
    resume.start()
    try:
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
    finally:
        resume.cancel()
        stage.proc.send_signal(signal.SIGCONT)
    assert took < 10, f"close() took {took:.1f} s"


def test_timeout_closes_the_client(tmp_path):
    path = str(tmp_path / "silent.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    try:
        with pytest.raises(sluice.StageTimeoutError, match="timeout"):
            sluice.Client(path, job="j", timeout=0.2)
    finally:
        srv.close()


def test_threads_take_turns_and_forks_are_refused(fake):
    c = sluice.Client(fake.path, job="j")
    held = threading.Event()
    release = threading.Event()

    def hold():
        with c._lock:
            held.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    ds = c.dataset("d")  # waits for the other thread's exchange, then goes on
    assert time.monotonic() - t0 >= 0.25 and ds.file_count > 0
    t.join()
    c._pid = -1  # as if we were a forked child
    with pytest.raises(RuntimeError, match="another process"):
        c.dataset("d")
    with pytest.raises(RuntimeError, match="another process"):
        ds.read(ds.files[0][0])
    c.close()  # a forked copy closes without speaking
    assert c.closed


FORKING_THREADS = """
import os, sys, threading
import sluice
import sluice.client

# A fork that waits for a lock another thread's fork holds waits this long.
sluice.client.FORK_WAIT_S = 60.0
clients = [sluice.Client(sys.argv[1], job=f"j{i}") for i in range(4)]

def forker():
    for _ in range(150):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

def user(c):
    for _ in range(200):
        c.dataset("d").files.names()

threads = [threading.Thread(target=forker) for _ in range(6)]
threads += [threading.Thread(target=user, args=(c,)) for c in clients]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def test_forks_from_several_threads_at_once_take_turns(fake):
    """Two DataLoaders started from two threads fork at once: their forks
    take turns, so neither waits for connection locks the other's fork
    holds (each fork taking some, they waited on each other for the
    fork's whole patience), and each fork's hooks release the locks that
    fork took, never the other's (`cannot release un-acquired lock`)."""
    import subprocess
    import sys

    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", FORKING_THREADS, fake.path], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr
    assert "Exception ignored" not in run.stderr, run.stderr
    assert took < 30, f"forks waited on each other's locks: {took:.0f} s"


def test_job_name_is_validated_before_connecting(fake):
    with pytest.raises(ValueError, match="65535"):
        sluice.Client(fake.path, job="x" * 70000)
    # A bool is not a rank (True would pass for 1).
    with pytest.raises(ValueError, match="rank must be"):
        sluice.Client(fake.path, job="j", rank=True, world_size=2)


def test_fetch_of_one_name_as_a_string_says_so(fake, data):
    root, files = data
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        name = sorted(files)[0]
        with pytest.raises(TypeError, match="sequence of file names"):
            ds.fetch(name)
        assert ds.fetch([name]) == [(name, files[name])]
        # A plan of one name given as a str planned each of its characters.
        with pytest.raises(TypeError, match=r"give \['"):
            ds.plan_names(name, 0)
        assert [n for n, _ in ds.plan_names([name], 0)] == [name]


def test_integers_of_other_types_are_taken_as_integers(fake, data):
    """NumPy's integers (an epoch from ``np.arange``, a seed from
    ``np.random``) are integers: they were refused with ``epoch must be an
    integer ..., got np.int64(0)``. Booleans and floats are not."""
    np = pytest.importorskip("numpy")
    _root, files = data
    name = sorted(files)[0]
    with sluice.Client(fake.path, job="j", rank=np.int64(0), world_size=np.int32(1)) as c:
        ds = c.dataset("d")
        got = [n for n, _ in ds.epoch(np.int64(1), seed=np.uint32(7), batch=np.int64(4),
                                      prefetch=np.int8(1))]
        assert got == [ds.files[i][0] for i in ds.local_order(1, seed=7)]
        assert ds.local_order(np.uint64(1), seed=np.int64(7)) == ds.local_order(1, seed=7)
        assert ds.read(name, np.int64(1), np.int64(2)) == files[name][1:3]
        assert [n for n, _ in ds.plan_indices(np.arange(2), np.int64(2))] == ds.files.names()[:2]
        for bad in (True, 1.0, "1"):
            with pytest.raises(ValueError, match="epoch must be an integer"):
                ds.epoch(bad)


def test_big_read_falls_back_to_ranges(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    content = os.urandom(3 * 1024 * 1024 + 17)
    (root / "f").write_bytes(content)
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(root)}, max_response_frame=1 << 20)
    try:
        with sluice.Client(stage.path, job="j") as c:
            ds = c.dataset("d")
            assert ds.read("f") == content
            assert ds.read("f", 5, 2 << 20) == content[5:5 + (2 << 20)]
    finally:
        stage.close()


def test_concurrent_threads_with_own_clients(fake, data):
    _root, files = data
    errors = []

    def worker(rank):
        try:
            with sluice.Client(fake.path, job="threads", rank=rank, world_size=4) as c:
                for name, d in c.dataset("d").epoch(0):
                    assert files[name] == d
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
