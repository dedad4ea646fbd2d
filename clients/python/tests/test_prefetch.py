"""Plan iterators with a prefetch thread: order, errors, shutdown, sharing
the client with other threads (against the fake stage; the real stage is
exercised in test_stage_e2e.py)."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest

import sluice
from sluice import protocol as p

from conftest import wait_for
from fakestage import FakeStage


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "sluice-prefetch" and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    wait_for(lambda: not prefetch_threads(), timeout=5, what="prefetch threads to exit")


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    files = {}
    for i in range(40):
        name = f"{i:03d}.bin"
        files[name] = os.urandom(100 + i * 13)
        (root / name).write_bytes(files[name])
    return root, files


@pytest.fixture
def fake(tmp_path, data):
    stage = FakeStage(str(tmp_path / "fake.sock"), {"d": str(data[0])})
    yield stage
    stage.close()


def nth_next(fail_at, reply):
    """A script hook: the ``fail_at``-th NEXT (1-based) gets ``reply()``,
    the others the normal answer."""
    count = [0]

    def hook():
        count[0] += 1
        return reply() if count[0] == fail_at else None

    return hook


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_same_order_and_bytes_as_synchronous(fake, data, prefetch):
    _root, files = data
    with sluice.Client(fake.path, job=f"j{prefetch}") as c:
        ds = c.dataset("d")
        names = ds.files.names()
        it = ds.epoch(0, seed=3, batch=3, prefetch=prefetch)
        assert it.prefetch == prefetch and not prefetch_threads()  # the thread starts on next()
        got = list(it)
        assert [n for n, _ in got] == [names[i] for i in ds.local_order(0, seed=3)]
        assert all(files[n] == d for n, d in got)
        assert it.delivered == len(files)
        samples = list(ds.plan_indices([4, 4, 1], epoch=1, batch=2, prefetch=prefetch).samples())
        assert [(s.position, s.name) for s in samples] == [(0, names[4]), (1, names[4]), (2, names[1])]


def test_prefetch_is_validated(fake):
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        for bad in (-1, 1.5, True, None):
            with pytest.raises(ValueError, match="prefetch"):
                ds.epoch(0, prefetch=bad)


def test_sample_errors_keep_their_semantics(fake, data):
    root, files = data
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        names = ds.files.names()
        os.remove(root / names[2])
        it = ds.plan_indices([0, 1, 2, 3, 4], epoch=0, batch=2, prefetch=2)
        out = []
        while True:
            try:
                out.append(next(it)[0])
            except StopIteration:
                break
            except sluice.NotFoundError as e:
                out.append(("error", e.name))
        assert out == [names[0], names[1], ("error", names[2]), names[3], names[4]]
        got = list(ds.plan_indices([2, 5], epoch=1, on_error="yield", prefetch=2))
        assert isinstance(got[0][1], sluice.NotFoundError) and got[1] == (names[5], files[names[5]])


def test_a_fatal_error_arrives_after_the_batches_before_it(tmp_path, data):
    hook = nth_next(3, lambda: p.encode_error(p.ErrorCode.BAD_FRAME, "boom", True))
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, script={p.MsgType.NEXT: hook})
    try:
        c = sluice.Client(stage.path, job="j")
        it = c.dataset("d").epoch(0, batch=4, prefetch=2)
        got = []
        with pytest.raises(sluice.BadFrameError, match="boom"):
            for name, _ in it:
                got.append(name)
        assert len(got) == 8  # the two batches received before the error
        assert c.closed
        with pytest.raises(sluice.BadFrameError):  # and it stays failed
            next(it)
    finally:
        stage.close()


def test_a_non_fatal_error_ends_the_iterator_but_not_the_client(tmp_path, data):
    hook = nth_next(2, lambda: p.encode_error(p.ErrorCode.IO_ERROR, "disk on fire"))
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, script={p.MsgType.NEXT: hook})
    try:
        with sluice.Client(stage.path, job="j") as c:
            ds = c.dataset("d")
            it = ds.epoch(0, batch=5, prefetch=3)
            got = []
            with pytest.raises(sluice.SluiceIOError, match="disk on fire"):
                for name, _ in it:
                    got.append(name)
            assert len(got) == 5 and not c.closed
            assert ds.read(got[0]) is not None
    finally:
        stage.close()


def test_connection_lost_mid_epoch(tmp_path, data):
    hook = nth_next(2, lambda: (b"", True))  # the stage hangs up
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, script={p.MsgType.NEXT: hook})
    try:
        c = sluice.Client(stage.path, job="j", reconnect=0)
        it = c.dataset("d").epoch(0, batch=5)
        assert len([next(it) for _ in range(5)]) == 5
        with pytest.raises(sluice.ConnectionClosedError):
            next(it)
        assert c.closed
    finally:
        stage.close()


def test_close_break_and_garbage_collection_stop_the_thread(fake, data):
    _root, files = data
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        # close(): the thread is gone when it returns; the client works at once.
        it = ds.epoch(0, batch=2, prefetch=2)
        next(it)
        assert len(prefetch_threads()) == 1
        it.close()
        assert not prefetch_threads()
        with pytest.raises(StopIteration):
            next(it)
        name = ds.files[0][0]
        assert ds.read(name) == files[name]
        # break out of a for loop over a temporary iterator.
        for _ in ds.epoch(1, batch=2, prefetch=2):
            break
        wait_for(lambda: not prefetch_threads(), timeout=5, what="the thread after break")
        # a dropped reference, collected.
        it = ds.epoch(2, batch=1, prefetch=1)
        next(it)
        del it
        gc.collect()
        wait_for(lambda: not prefetch_threads(), timeout=5, what="the thread after gc")
        # a with block.
        with ds.epoch(3, batch=1) as it:
            next(it)
        assert not prefetch_threads()
        assert ds.read(name) == files[name]


def test_an_abandoned_iterator_stops_promptly_during_a_slow_next(tmp_path, data):
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, next_delay=0.2)
    try:
        with sluice.Client(stage.path, job="j") as c:
            ds = c.dataset("d")
            it = ds.epoch(0, batch=1, prefetch=4)
            next(it)
            t0 = time.monotonic()
            it.close()  # waits for the NEXT in flight, at most one delay
            assert time.monotonic() - t0 < 1.0
            assert not prefetch_threads()
            sent = len(stage.requests)
            time.sleep(0.3)
            assert len(stage.requests) == sent  # no NEXT after close
    finally:
        stage.close()


def test_read_from_another_thread_interleaves_with_next(tmp_path, data):
    _root, files = data
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, next_delay=0.05)
    try:
        with sluice.Client(stage.path, job="j") as c:
            ds = c.dataset("d")
            names = ds.files.names()
            it = ds.plan_indices(list(range(20)), epoch=0, batch=2, prefetch=2)
            got = [next(it)]
            # The prefetch thread is mid-NEXT or about to be; reads take turns with it.
            for i in range(20, 30):
                assert c.read(names[i]) == files[names[i]]
                got.append(next(it))
            got += list(it)
            assert got == [(names[i], files[names[i]]) for i in range(20)]
            kinds = stage.requests
            assert p.MsgType.READ in kinds and kinds.index(p.MsgType.READ) < len(kinds) - kinds[::-1].index(p.MsgType.NEXT)
    finally:
        stage.close()


def test_a_new_plan_supersedes_a_prefetching_iterator(fake, data):
    _root, files = data
    with sluice.Client(fake.path, job="j") as c:
        ds = c.dataset("d")
        old = ds.epoch(0, batch=1, prefetch=2)
        next(old)
        new = ds.epoch(1, seed=4, batch=4)  # the old thread must not NEXT this plan
        with pytest.raises(RuntimeError, match="superseded"):
            list(old)
        got = list(new)
        names = ds.files.names()
        assert [n for n, _ in got] == [names[i] for i in ds.local_order(1, seed=4)]


def test_closing_the_client_ends_its_iterators(fake):
    c = sluice.Client(fake.path, job="j")
    it = c.dataset("d").epoch(0, batch=2, prefetch=2)
    next(it)
    wait_for(lambda: len(it._prefetcher._items) == 2, what="the queue to fill")
    c.close()
    assert not prefetch_threads()
    assert len([next(it) for _ in range(5)]) == 5  # the rest of the batch and the two queued
    with pytest.raises(sluice.ConnectionClosedError):
        next(it)


def test_an_iterator_in_a_forked_child_refuses(fake):
    with sluice.Client(fake.path, job="j") as c:
        it = c.dataset("d").epoch(0, batch=2)
        next(it)
        pid = c._pid
        c._pid = -1  # as if we were a forked child
        try:
            with pytest.raises(RuntimeError, match="another process"):
                list(it)
        finally:
            c._pid = pid
        it.close()


def test_a_real_fork_while_the_thread_runs(tmp_path, data):
    stage = FakeStage(str(tmp_path / "s.sock"), {"d": str(data[0])}, next_delay=0.05)
    try:
        with sluice.Client(stage.path, job="j") as c:
            ds = c.dataset("d")
            it = ds.epoch(0, batch=1, prefetch=2)
            next(it)
            time.sleep(0.02)  # likely mid-NEXT: the lock is held at the fork
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                code = b""
                for attempt in (lambda: ds.read("000.bin"), lambda: list(it)):
                    try:
                        attempt()
                        code += b"n"
                    except RuntimeError as e:
                        code += b"y" if "another process" in str(e) else b"?"
                    except BaseException:
                        code += b"?"
                c.close()  # closes the child's copy without speaking
                os.write(w, code)
                os._exit(0)
            os.close(w)
            deadline = time.monotonic() + 10
            out = b""
            while len(out) < 2 and time.monotonic() < deadline:
                chunk = os.read(r, 2)
                if not chunk:
                    break
                out += chunk
            os.waitpid(pid, 0)
            os.close(r)
            assert out == b"yy"
            # The parent goes on undisturbed.
            assert len(list(it)) == len(data[1]) - 1
    finally:
        stage.close()
