"""End to end against the real sluice-stage binary (see conftest.py)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import sluice
from sluice import plan as splan
from sluice import protocol as p

from sluice.bench.common import metric_value, parse_prometheus

from conftest import Raw, files_of, http_get, make_dataset, sorted_names, stage_metric, wait_for


def fnv1a_digest(entries):
    """The listing digest as docs/protocol.md defines it."""
    h = 0xCBF29CE484222325
    for name, size in entries:
        for b in name.encode() + b"\x00" + struct.pack(">Q", size):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def expect_error_then_close(raw: Raw, code: int):
    data = raw.drain_until_closed()
    assert data, "the stage closed without an ERROR frame"
    t, payload = p.split_frame(data, p.MAX_RESPONSE_FRAME)
    msg = p.decode_response(t, payload)
    assert isinstance(msg, p.Error) and msg.code == code and msg.fatal, msg
    return msg


# -- listing, bytes, digest ---------------------------------------------------


def test_listing_bytes_and_digest(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="listing") as c:
        assert c.max_request_frame == p.MAX_REQUEST_FRAME
        assert c.max_response_frame == p.MAX_RESPONSE_FRAME
        ds = c.dataset("d")
        names = sorted_names(files)
        assert ds.files.names() == names
        assert list(ds.files) == [(n, len(files[n])) for n in names]
        assert ds.file_count == len(files) and ds.total_bytes == sum(map(len, files.values()))
        assert ds.digest == fnv1a_digest(list(ds.files))
        for name in names:
            assert ds.read(name) == files[name], name
        # LIST paging with small limits, straight on the wire.
        got = []
        for off in range(0, len(names), 7):
            page = ds._call(p.encode_list(off, 7), p.Files)
            assert page.total == len(names)
            got += [n for n, _ in page.entries]
        assert got == names


def test_epoch_order_and_bytes_match_the_local_plan(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    for world in (1, 3):
        for rank in range(world):
            with sluice.Client(stage.socket, job="order", rank=rank, world_size=world) as c:
                ds = c.dataset("d")
                for epoch, shuffle in ((0, True), (1, True), (2, False)):
                    it = ds.epoch(epoch, seed=77, shuffle=shuffle, batch=5)
                    expected = [names[i] for i in splan.shuffle_plan(len(names), 77, epoch, shuffle, rank, world)]
                    assert it.length == len(expected) and it.state == p.PlanState.CREATED
                    positions = []
                    got = []
                    for s in it.samples():
                        positions.append(s.position)
                        got.append(s.name)
                        assert s.status == 0 and s.data == files[s.name], s.name
                    assert got == expected
                    assert positions == list(range(len(expected)))


def test_explicit_plans(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    with sluice.Client(stage.socket, job="explicit") as c:
        ds = c.dataset("d")
        idx = [5, 0, 5, len(names) - 1, 3]
        assert [(n, d) for n, d in ds.plan_indices(idx, epoch=0, batch=2)] == [(names[i], files[names[i]]) for i in idx]
        pick = [names[9], names[2], names[9]]
        assert list(ds.plan_names(pick, epoch=1)) == [(n, files[n]) for n in pick]
        assert list(ds.plan_indices([], epoch=2)) == []
        with pytest.raises(sluice.BadPlanError):
            ds.plan_indices([len(names)], epoch=3)
        # A name plan naming a file that is not listed is refused, or (the
        # protocol allows either) delivers that entry as an error.
        try:
            out = list(ds.plan_names([names[0], "no/such.bin"], epoch=4, on_error="yield"))
        except sluice.BadPlanError as e:
            assert "no/such.bin" in e.message
        else:
            assert out[0] == (names[0], files[names[0]])
            assert isinstance(out[1][1], sluice.SluiceError) and out[1][0] == "no/such.bin"


def test_a_plan_of_more_names_than_one_request_carries_is_planned(stage_factory, tmp_path):
    """A plan by names went in one request, so one whose names passed the
    16 MiB request limit could not be made (ImageNet's 1.28 M names, 49 MB,
    through MountSampler on one rank). It now goes as the files' indices."""
    root = tmp_path / "long"
    (root / "cls").mkdir(parents=True)
    names = [f"cls/{i:06d}_" + "x" * 230 + ".jpg" for i in range(70_000)]
    for name in names:
        (root / name).touch()
    files = {name: os.urandom(100) for name in names[::7000]}
    for name, data in files.items():
        (root / name).write_bytes(data)
    assert sum(2 + len(n) for n in names) > 16 << 20
    stage = stage_factory({"d": root})
    order = names[1::2] + names[::2]
    with sluice.Client(stage.socket, job="long-names") as c:
        got = [(name, bytes(data)) for name, data in c.dataset("d").plan_names(order, epoch=0, batch=4096)]
    assert [name for name, _ in got] == order
    assert {name: data for name, data in got if name in files} == files
    with sluice.Client(stage.socket, job="long-names") as c:
        with pytest.raises(sluice.BadPlanError, match="`cls/none` is not in the listing"):
            c.dataset("d").plan_names(order + ["cls/none"], epoch=1)


def test_big_sample_is_sent_alone(stage_factory, tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    files = {"a.bin": os.urandom(1000), "big.bin": os.urandom(33 * 1024 * 1024 + 5), "c.bin": b"c"}
    for n, d in files.items():
        (root / n).write_bytes(d)
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="big") as c:
        ds = c.dataset("d")
        got = dict(ds.plan_names(["a.bin", "big.bin", "c.bin"], epoch=0, batch=3))
        assert got == files
        assert ds.read("big.bin", 33 * 1024 * 1024, 100) == files["big.bin"][33 * 1024 * 1024:][:100]


def test_a_sample_larger_than_one_answer_is_read_in_ranges(stage_factory, tmp_path):
    """A file over the 256 MiB answer limit comes whole through an epoch and
    FETCH (the client reads it in ranges), on the socket and with shared
    memory."""
    root = tmp_path / "huge"
    root.mkdir()
    size = p.MAX_RESPONSE_FRAME + 4096
    marks = {0: b"head", size // 2: b"middle", size - 4: b"tail"}
    with open(root / "volume.npy", "wb") as f:  # sparse: only the marks take disk
        f.truncate(size)
        for offset, mark in marks.items():
            f.seek(offset)
            f.write(mark)
    (root / "small.bin").write_bytes(b"small")
    stage = stage_factory({"d": root}, "--memory-budget", "64MiB")

    def check(name, data):
        if name == "small.bin":
            assert bytes(data) == b"small"
            return
        assert len(data) == size
        view = memoryview(data)
        for offset, mark in marks.items():
            assert bytes(view[offset:offset + len(mark)]) == mark
        del view

    for shared in (True, False):
        with sluice.Client(stage.socket, job=f"huge-{shared}", shared_memory=shared) as c:
            ds = c.dataset("d")
            got = 0
            for name, data in ds.epoch(0, batch=2):
                check(name, data)
                got += 1
                del data
            assert got == 2
            for name, data in ds.fetch(["volume.npy", "small.bin"]):
                check(name, data)
                del data


# -- errors -----------------------------------------------------------------------


def test_per_sample_errors_do_not_stop_the_epoch(stage_factory, dataset, tmp_path):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    deleted, to_dir, to_link = names[3], names[10], names[20]
    with sluice.Client(stage.socket, job="errors") as c:
        ds = c.dataset("d")
        ds.files.names()
        os.remove(root / deleted)
        os.remove(root / to_dir)
        os.mkdir(root / to_dir)
        os.remove(root / to_link)
        os.symlink(tmp_path / "nowhere", root / to_link)
        got = {}
        for name, value in ds.epoch(0, seed=1, batch=8, on_error="yield"):
            assert name not in got
            got[name] = value
        assert set(got) == set(names)
        for bad in (deleted, to_dir, to_link):
            err = got[bad]
            assert isinstance(err, sluice.SluiceError), (bad, err)
            assert err.name == bad and err.message and not err.fatal
            assert err.code in (sluice.ErrorCode.NOT_FOUND, sluice.ErrorCode.IO_ERROR,
                                sluice.ErrorCode.FORBIDDEN_PATH), err
        assert got[deleted].code == sluice.ErrorCode.NOT_FOUND
        for name in set(names) - {deleted, to_dir, to_link}:
            assert got[name] == files[name]
        # With on_error="raise" the error surfaces from next() and iteration goes on.
        it = ds.plan_names([names[0], deleted, names[1]], epoch=1)
        assert next(it) == (names[0], files[names[0]])
        with pytest.raises(sluice.NotFoundError) as e:
            next(it)
        assert e.value.name == deleted
        assert next(it) == (names[1], files[names[1]])
        # A read by name that fails is counted as a failed read of the job
        # too, as one in a plan is.
        def not_found():
            samples = parse_prometheus(http_get(stage.metrics, "/metrics"))
            return metric_value(samples, "sluice_stage_errors_total", job="errors", code="not_found") or 0

        before = not_found()
        for read in (lambda: ds.read(deleted), lambda: ds.read(deleted, 10, 10)):
            with pytest.raises(sluice.NotFoundError):
                read()
        assert not_found() == before + 2


def test_a_file_changed_while_read_in_ranges_comes_whole_of_one_version(stage_factory, tmp_path):
    """The ranges of a file too large for one answer are read of the version
    the first one read: a file replaced (renamed over) after the first range
    comes back whole as it was, and one shrunk in place is read again, whole
    as it is now; never the bytes of two versions joined."""
    root = tmp_path / "ds"
    root.mkdir()
    size = p.MAX_RESPONSE_FRAME + 4096

    def sparse(path, fill, length):  # only the marks take disk
        with open(path, "wb") as f:
            f.truncate(length)
            for offset in (0, length // 2, length - 4):
                f.seek(offset)
                f.write(fill)

    stage = stage_factory({"d": root}, "--memory-budget", "64MiB")
    with sluice.Client(stage.socket, job="torn") as c:
        for change in ("replace", "shrink"):
            sparse(root / "big.bin", b"AAAA", size)
            sparse(tmp_path / "new.bin", b"BBBB", size)
            ds = c.dataset("d")
            calls = []
            call = ds._call

            def changing_after_the_first_range(frame, expect, change=change):
                out = call(frame, expect)
                calls.append(len(out.data))
                if len(calls) == 1 and change == "replace":
                    os.rename(tmp_path / "new.bin", root / "big.bin")
                elif len(calls) == 1:
                    os.truncate(root / "big.bin", size - 2048)
                return out

            ds._call = changing_after_the_first_range
            data = ds.read("big.bin")
            marks = {bytes(data[o:o + 4]) for o in (0, len(data) // 2, len(data) - 4)}
            if change == "replace":
                assert len(data) == size and marks == {b"AAAA"}, (len(data), marks)
                assert len(calls) == 2
            else:
                # The shrunk file is read again from its start.
                assert len(data) == size - 2048 and data[:4] == b"AAAA", (len(data), data[:4])
                assert len(calls) == 3  # two ranges, the second refused; then two again
            del data


def test_read_ranges(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    name = max(files, key=lambda n: len(files[n]))
    data = files[name]
    with sluice.Client(stage.socket, job="ranges") as c:
        ds = c.dataset("d")
        assert ds.read(name, 0, 10) == data[:10]
        assert ds.read(name, 1000) == data[1000:]
        assert ds.read(name, 12345, 777) == data[12345:12345 + 777]
        assert ds.read(name, len(data) - 5, 100) == data[-5:]
        assert ds.read(name, len(data)) == b""
        assert ds.read(name, 0, 0) == b""
        empty = next(n for n in files if not files[n])
        assert ds.read(empty) == b""
        with pytest.raises(sluice.NotFoundError):
            ds.read("missing.bin")
        with pytest.raises((sluice.NotFoundError, sluice.SluiceIOError)):
            ds.read("d0")  # a directory is not a file of the dataset


@pytest.mark.parametrize("name", [
    "../x", "/etc/passwd", "a/../../b", "d0/../../etc/passwd", "./f000.bin", "d0//f.bin", "..", "escape",
    "escape-dir/passwd",
])
def test_forbidden_paths(stage_factory, dataset, tmp_path, name):
    root, _files = dataset
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(b"secret")
    (root / "escape").symlink_to(outside / "passwd")
    (root / "escape-dir").symlink_to(outside)
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="paths") as c:
        ds = c.dataset("d")
        assert "escape" not in ds.files.names()
        assert not any(n.startswith("escape-dir/") for n in ds.files.names())
        with pytest.raises(sluice.ForbiddenPathError) as e:
            ds.read(name)
        assert e.value.code_name == "FORBIDDEN_PATH" and not e.value.fatal
        [(_, fetched)] = ds.fetch([name], on_error="yield")
        assert isinstance(fetched, sluice.ForbiddenPathError), fetched
        # Both refusals count as the job's failed reads, whichever check
        # refused them (the name itself, or where its symlinks lead).
        errors = re.search(r'^sluice_stage_errors_total{code="forbidden_path",dataset="d",job="paths"} (\S+)$',
                           http_get(stage.metrics, "/metrics"), re.M)
        assert errors and float(errors.group(1)) == 2, errors
        with pytest.raises(sluice.SluiceError) as e:
            list(ds.plan_names([name], epoch=0, on_error="raise"))
        assert e.value.code in (sluice.ErrorCode.FORBIDDEN_PATH, sluice.ErrorCode.BAD_PLAN)
        assert ds.read(ds.files[0][0]) is not None  # the connection goes on


def test_symlink_inside_the_root_is_served(stage_factory, dataset):
    root, files = dataset
    target = sorted_names(files)[5]
    (root / "inner-link.bin").symlink_to(root / target)
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="links") as c:
        ds = c.dataset("d")
        assert "inner-link.bin" in ds.files.names()
        assert ds.read("inner-link.bin") == files[target]


def test_request_errors(stage_factory, dataset):
    root, _files = dataset
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="reqerr") as c:
        with pytest.raises(sluice.NoSuchDatasetError) as e:
            c.dataset("nope")
        assert "nope" in e.value.message and not e.value.fatal
        with pytest.raises(sluice.NoDatasetError):
            c._call(p.encode_list(0, 1), p.Files)
        ds = c.dataset("d")
        with pytest.raises(sluice.NoPlanError):
            c._call(p.encode_next(1), p.Samples)
        with pytest.raises(sluice.InvalidArgumentError):
            c._call(p.encode_list(0, 0), p.Files)
        with pytest.raises(sluice.InvalidArgumentError):
            c._call(p.encode_next(0), p.Samples)
        with pytest.raises(sluice.BadPlanError):
            c._call(p.encode_plan_shuffle(0, 1, True, ds.file_count + 1, ds.digest), p.Planned)
        with pytest.raises(sluice.BadPlanError):
            c._call(p.encode_plan_shuffle(0, 1, True, ds.file_count, ds.digest ^ 1), p.Planned)
        # A shuffle flag other than 0 or 1 is an impossible value, not a
        # broken frame: the connection goes on.
        flag2 = p.encode_frame(p.MsgType.PLAN, struct.pack(
            ">QBQBIQ", 0, p.PlanKind.SHUFFLE, 1, 2, ds.file_count, ds.digest))
        with pytest.raises(sluice.InvalidArgumentError) as e:
            c._call(flag2, p.Planned)
        assert not e.value.fatal
        # A directory is no file of the data set.
        with pytest.raises(sluice.NotFoundError):
            ds.read("d1")
        list(ds.epoch(5, seed=1, batch=1))  # still fine
        ds.epoch(6, seed=1)
    with sluice.Client(stage.socket, job="reqerr") as c2:
        # While a plan is active, a different plan under the same
        # (job, rank, epoch) is refused.
        ds2 = c2.dataset("d")
        it = ds2.epoch(7, seed=1)
        with sluice.Client(stage.socket, job="reqerr") as c3:
            with pytest.raises(sluice.PlanConflictError):
                c3.dataset("d").epoch(7, seed=2)
        assert len(list(it)) == ds2.file_count


def test_hello_rules(stage_factory, dataset):
    root, _files = dataset
    stage = stage_factory({"d": root})
    # A request before HELLO.
    raw = Raw(stage.socket)
    raw.send(p.encode_open("d"))
    expect_error_then_close(raw, p.ErrorCode.OUT_OF_ORDER)
    raw.close()
    # A second HELLO.
    raw = Raw(stage.socket)
    raw.hello()
    raw.send(p.encode_hello("raw"))
    expect_error_then_close(raw, p.ErrorCode.OUT_OF_ORDER)
    raw.close()
    # An unsupported version.
    raw = Raw(stage.socket)
    raw.send(p.encode_hello("raw", version=3))
    expect_error_then_close(raw, p.ErrorCode.UNSUPPORTED_VERSION)
    raw.close()
    # Whatever a newer version's HELLO holds after the version field.
    for rest in (b"", struct.pack(">I", 7) + b"future fields"):
        raw = Raw(stage.socket)
        raw.send(p.encode_frame(p.MsgType.HELLO, struct.pack(">H", 3) + rest))
        expect_error_then_close(raw, p.ErrorCode.UNSUPPORTED_VERSION)
        raw.close()
    # Impossible fields are refused without closing.
    for frame in (p.encode_hello("bad job!"), p.encode_hello("j", rank=2, world_size=2),
                  p.encode_hello("j", world_size=0), p.encode_hello("x" * 129), p.encode_hello(".."),
                  p.encode_hello(".")):
        raw = Raw(stage.socket)
        msg = raw.call(frame)
        assert isinstance(msg, p.Error) and msg.code == p.ErrorCode.INVALID_ARGUMENT and not msg.fatal, msg
        raw.close()
    with pytest.raises(sluice.InvalidArgumentError):
        sluice.Client(stage.socket, job="no spaces")
    # Labels that no policy could select on (the controller would take no
    # report of such a job, so it would run under no policy): refused,
    # saying which and what a label may be, its control characters escaped.
    for labels, said in (({"cost center": "x"}, "label key `cost center` is not valid"),
                         ({"équipe": "x"}, "label key `équipe` is not valid"),
                         ({"team": "nlp\x1b[0m"}, "label value `nlp\\u{1b}[0m` is not valid"),
                         ({"team": "a\nb"}, "label value `a\\nb` is not valid"),
                         ({"team": "v" * 257}, "use at most 256 bytes")):
        with pytest.raises(sluice.InvalidArgumentError, match=re.escape(said)):
            sluice.Client(stage.socket, job="labelled", labels=labels)
    with sluice.Client(stage.socket, job="labelled", labels={"example.com/team": "v" * 256}):
        pass
    # BYE is answered with GOODBYE and the stage closes.
    raw = Raw(stage.socket)
    raw.hello()
    assert isinstance(raw.call(p.encode_bye()), p.Goodbye)
    assert raw.drain_until_closed() == b""
    raw.close()


# -- robustness ---------------------------------------------------------------------


def _good_client_epoch(stage, files, job, result):
    try:
        with sluice.Client(stage.socket, job=job, timeout=60) as c:
            got = {}
            for name, data in c.dataset("d").epoch(0, seed=3, batch=4):
                got[name] = data
            result["ok"] = got == files
    except Exception as e:  # reported by the test
        result["error"] = e


def test_garbage_clients_do_not_disturb_others(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    result = {}
    good = threading.Thread(target=_good_client_epoch, args=(stage, files, "good", result))
    good.start()

    # A huge length prefix: FRAME_TOO_LARGE before any body is read.
    raw = Raw(stage.socket)
    raw.send(struct.pack(">IB", 0xFFFFFFF0, 1))
    expect_error_then_close(raw, p.ErrorCode.FRAME_TOO_LARGE)
    raw.close()
    raw = Raw(stage.socket)
    raw.hello()
    raw.send(struct.pack(">IB", p.MAX_REQUEST_FRAME + 1, p.MsgType.READ))
    expect_error_then_close(raw, p.ErrorCode.FRAME_TOO_LARGE)
    raw.close()
    # Random bytes: an ERROR or a plain close, never a hang or a crash.
    rng = __import__("random").Random(5)
    for i in range(20):
        raw = Raw(stage.socket)
        if i % 2:
            raw.hello()
        raw.send(rng.randbytes(rng.randrange(1, 2000)))
        raw.sock.shutdown(socket.SHUT_WR)
        data = raw.drain_until_closed()
        if data:
            # Whatever came back must be well-formed frames, the last an ERROR.
            frames = []
            while data:
                (n,) = struct.unpack(">I", data[:4])
                frames.append(p.decode_response(data[4], data[5:4 + n]))
                data = data[4 + n:]
            assert isinstance(frames[-1], p.Error), frames
        raw.close()
    # Malformed payloads that the stage must refuse as BAD_FRAME.
    for frame in (
        p.encode_frame(0x42, b""),                                 # unknown type
        p.encode_frame(p.MsgType.OPEN, b"\x00\x05ab"),             # str past the end
        p.encode_frame(p.MsgType.NEXT, b"\x00\x00\x00\x01\x00"),   # leftover byte
        p.encode_frame(p.MsgType.OPEN, b"\x00\x02\xff\xfe"),       # bad UTF-8
        b"\x00\x00\x00\x00",                                       # length 0
    ):
        raw = Raw(stage.socket)
        raw.hello()
        raw.send(frame)
        msg = expect_error_then_close(raw, p.ErrorCode.BAD_FRAME)
        assert msg.message
        raw.close()
    # A truncated frame, then close.
    raw = Raw(stage.socket)
    raw.hello()
    raw.send(p.encode_read("f000.bin")[:-3])
    raw.close()
    # A client that connects and vanishes mid-plan.
    c = sluice.Client(stage.socket, job="vanish")
    it = c.dataset("d").epoch(0)
    next(it)
    c._abort()

    good.join(120)
    assert not good.is_alive(), "the well-behaved client did not finish its epoch"
    assert result.get("ok"), result
    assert stage.alive()
    with sluice.Client(stage.socket, job="after") as c:
        ds = c.dataset("d")
        assert dict(ds.epoch(0)) == files


# -- sharing ----------------------------------------------------------------------


def test_connections_of_one_job_share_a_plan(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    for rank in range(2):
        clients = [sluice.Client(stage.socket, job="shared", rank=rank, world_size=2) for _ in range(3)]
        try:
            its = [c.dataset("d").epoch(0, seed=11, batch=3) for c in clients]
            assert its[0].state == p.PlanState.CREATED
            assert all(it.state in (p.PlanState.JOINED, p.PlanState.COMPLETE) for it in its[1:])
            expected = [names[i] for i in splan.shuffle_plan(len(names), 11, 0, True, rank, 2)]
            gens = [it.samples() for it in its]
            seen = {}
            live = list(range(3))
            while live:  # round robin over the three connections
                for k in list(live):
                    try:
                        s = next(gens[k])
                    except StopIteration:
                        live.remove(k)
                        continue
                    assert s.position not in seen
                    seen[s.position] = s
                    assert s.name == expected[s.position] and s.data == files[s.name]
            assert sorted(seen) == list(range(len(expected)))
            # A latecomer joins the finished plan and gets nothing.
            with sluice.Client(stage.socket, job="shared", rank=rank, world_size=2) as late:
                it = late.dataset("d").epoch(0, seed=11)
                assert it.state == p.PlanState.COMPLETE and list(it) == []
        finally:
            for c in clients:
                c.close()


def test_ranks_cutting_their_shares_from_different_orders_are_warned_about(stage_factory, dataset):
    """Ranks of one job with different seeds (or world sizes) get shares
    that overlap and leave samples out; the stage says so, naming both."""
    root, _files = dataset
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="agreed", rank=0, world_size=2) as a, \
            sluice.Client(stage.socket, job="agreed", rank=1, world_size=2) as b:
        with a.dataset("d").epoch(0, seed=5), b.dataset("d").epoch(0, seed=5):
            pass
    # Shares of a larger world that nest in the others' (the two workers of
    # rank 1 of 2, as SluiceIterableDataset plans them: shares 1 and 3 of 4)
    # are apart from rank 0's.
    with sluice.Client(stage.socket, job="nested", rank=0, world_size=2) as a, \
            sluice.Client(stage.socket, job="nested", rank=1, world_size=4) as b, \
            sluice.Client(stage.socket, job="nested", rank=3, world_size=4) as c:
        with a.dataset("d").epoch(0, seed=5), b.dataset("d").epoch(0, seed=5), c.dataset("d").epoch(0, seed=5):
            pass
    assert "their shares overlap" not in stage.stderr_tail()
    with sluice.Client(stage.socket, job="nested-twice", rank=0, world_size=2) as a, \
            sluice.Client(stage.socket, job="nested-twice", rank=2, world_size=4) as b:
        with a.dataset("d").epoch(0, seed=5), b.dataset("d").epoch(0, seed=5):
            pass
    assert ("job `nested-twice`: rank 2 plans epoch 0 of data set `d` with seed 5 (shuffled) over 4 ranks, "
            "but rank 0 reads that epoch with seed 5 (shuffled) over 2 ranks: their shares overlap") in stage.stderr_tail()
    with sluice.Client(stage.socket, job="split", rank=0, world_size=2) as a, \
            sluice.Client(stage.socket, job="split", rank=1, world_size=2) as b, \
            sluice.Client(stage.socket, job="split", rank=2, world_size=3) as c:
        with a.dataset("d").epoch(0, seed=1), b.dataset("d").epoch(0, seed=2), c.dataset("d").epoch(1, seed=1):
            # Another epoch is no conflict; another world size is.
            assert "epoch 1" not in stage.stderr_tail()
            with c.dataset("d").epoch(0, seed=1):
                pass
    tail = stage.stderr_tail()
    assert ("job `split`: rank 1 plans epoch 0 of data set `d` with seed 2 (shuffled) over 2 ranks, "
            "but rank 0 reads that epoch with seed 1 (shuffled) over 2 ranks: their shares overlap") in tail, tail
    assert re.search(r"rank 2 plans epoch 0 of data set `d` with seed 1 \(shuffled\) over 3 ranks, but rank [01] "
                     r"reads that epoch with seed [12] \(shuffled\) over 2 ranks", tail), tail


def test_each_run_of_a_job_has_plans_of_its_own(stage_factory, dataset):
    """Connections naming one run share its plan; another run of the same
    job, data set, rank and epoch (a trainer restarted after a crash)
    reads the epoch in full while the first still holds its plan, and
    does not meet the first run's finished plan either."""
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    expected = [names[i] for i in splan.shuffle_plan(len(names), 4, 0, True, 0, 1)]

    def client(run):
        return sluice.Client(stage.socket, job="runs", run=run)

    with client(7) as old, client(7) as old_too, client(8) as new, client(None) as plain:
        assert old.dataset("d").client._plan_run == 7
        first = old.dataset("d").epoch(0, seed=4, batch=5, prefetch=0)
        assert first.state == p.PlanState.CREATED
        held = [next(first) for _ in range(5)]
        joined = old_too.dataset("d").epoch(0, seed=4, batch=5, prefetch=0)
        assert joined.state == p.PlanState.JOINED
        again = new.dataset("d").epoch(0, seed=4, batch=5)
        assert again.state == p.PlanState.CREATED
        assert [(n, bytes(d)) for n, d in again] == [(n, files[n]) for n in expected]
        # A connection naming no run is a plan of its own too.
        assert plain.dataset("d").epoch(0, seed=4).state == p.PlanState.CREATED
        rest = [(n, bytes(d)) for n, d in joined]
        assert sorted([n for n, _ in held] + [n for n, _ in rest]) == sorted(expected)
        assert all(files[n] == d for n, d in rest)
        with client(7) as late:
            assert late.dataset("d").epoch(0, seed=4).state == p.PlanState.COMPLETE
        with client(9) as later:
            assert later.dataset("d").epoch(0, seed=4).state == p.PlanState.CREATED
    # A run named on a connection not granted RUNS is refused, as a stage
    # without the feature refuses the flagged kind.
    for version in (1, 2):
        raw = Raw(stage.socket)
        try:
            welcome = raw.call(p.encode_hello("runs", {}, 0, 1, version=version))
            assert welcome.version == version and welcome.features == 0
            assert isinstance(raw.call(p.encode_open("d")), p.Opened)
            refused = raw.call(p.encode_plan_indices(0, [0], run=5))
            assert refused.code == p.ErrorCode.BAD_PLAN and not refused.fatal, refused
            assert "not granted the RUNS feature" in refused.message
            assert isinstance(raw.call(p.encode_plan_indices(0, [0])), p.Planned)
        finally:
            raw.close()
    with pytest.raises(ValueError, match="run must be"):
        client(0)
    with pytest.raises(ValueError, match="run must be"):
        client(1 << 64)


def test_reads_by_name_deliver_only_their_own_runs_plan_entries(stage_factory, dataset):
    """A whole-file read by name of a connection that named its run (RUN)
    delivers entries of that run's plans only: another run of the job
    reading every file (an evaluation pass, a restarted trainer) leaves a
    running epoch whole. A connection that named no run claims from any
    of the job's plans, as before the feature (the mount's opens do)."""
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    expected = [names[i] for i in splan.shuffle_plan(len(names), 4, 0, True, 0, 1)]
    with sluice.Client(stage.socket, job="eval", run=1) as trainer, \
            sluice.Client(stage.socket, job="eval", run=2) as other:
        epoch = trainer.dataset("d").epoch(0, seed=4, batch=1, prefetch=0)
        got = [next(epoch)]
        ds = other.dataset("d")
        assert dict(ds.fetch(names)) == files
        assert all(ds.read(n) == files[n] for n in names[:5])
        got += list(epoch)
        assert [n for n, _ in got] == expected
        assert all(files[n] == bytes(d) for n, d in got)
        # Its own run's reads by name do deliver the plan's entries.
        planned = trainer.dataset("d").epoch(1, seed=4, batch=1, prefetch=0)
        with sluice.Client(stage.socket, job="eval", run=1) as worker:
            assert dict(worker.dataset("d").fetch(names)) == files
        assert list(planned) == []
    with sluice.Client(stage.socket, job="compat", run=1) as trainer, \
            sluice.Client(stage.socket, job="compat") as plain:
        epoch = trainer.dataset("d").epoch(0, seed=4, batch=1, prefetch=0)
        assert dict(plain.dataset("d").fetch(names)) == files
        assert list(epoch) == []
    # RUN needs the feature: a connection not granted it is refused (fatal).
    raw = Raw(stage.socket)
    try:
        welcome = raw.call(p.encode_hello("eval", {}, 0, 1, features=p.FEATURE_RUNS))
        assert welcome.features == p.FEATURE_RUNS
        refused = raw.call(p.encode_run(3))
        assert refused.code == p.ErrorCode.OUT_OF_ORDER and refused.fatal, refused
        assert "not granted RUN_READS" in refused.message
    finally:
        raw.close()


def test_workers_in_threads_share_a_plan(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    got, errors = [], []
    lock = threading.Lock()

    def worker():
        try:
            with sluice.Client(stage.socket, job="threads") as c:
                for name, data in c.dataset("d").epoch(3, seed=2, batch=2):
                    with lock:
                        got.append((name, data))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(n for n, _ in got) == sorted(files)
    assert all(files[n] == d for n, d in got)


def test_two_jobs_at_once(stage_factory, dataset, tmp_path):
    root, files = dataset
    root2 = tmp_path / "data2"
    root2.mkdir()
    files2 = make_dataset(root2, seed=9)
    stage = stage_factory({"d": root, "e": root2})
    results = {}

    def job(name, ds_name, expected):
        try:
            with sluice.Client(stage.socket, job=name) as c:
                ds = c.dataset(ds_name)
                for epoch in range(2):
                    assert dict(ds.epoch(epoch, seed=4)) == expected
            results[name] = True
        except Exception as e:
            results[name] = e

    threads = [threading.Thread(target=job, args=("job-a", "d", files)),
               threading.Thread(target=job, args=("job-b", "d", files)),
               threading.Thread(target=job, args=("job-c", "e", files2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {"job-a": True, "job-b": True, "job-c": True}


def test_whole_file_read_delivers_a_planned_entry(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    with sluice.Client(stage.socket, job="mapstyle") as planner, \
            sluice.Client(stage.socket, job="mapstyle") as reader:
        ds = planner.dataset("d")
        it = ds.plan_indices([0, 1, 2, 3], epoch=0)
        rd = reader.dataset("d")
        assert rd.read(names[1]) == files[names[1]]
        assert rd.read(names[2], 0, 3) == files[names[2]][:3]  # a range read delivers nothing
        assert [n for n, _ in it] == [names[0], names[2], names[3]]


def test_tcp_listener_and_metrics(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root}, tcp=True)
    assert stage.tcp, stage.ready
    with sluice.Client(f"tcp://{stage.tcp}", job="tcp") as c:
        assert dict(c.dataset("d").epoch(0)) == files
    with sluice.Client(stage.tcp, job="tcp2") as c:
        name = sorted_names(files)[7]
        assert c.dataset("d").read(name) == files[name]
    body = http_get(stage.metrics, "/metrics")
    assert "sluice_stage_" in body


def test_socket_is_not_world_writable(stage_factory, dataset):
    root, _files = dataset
    stage = stage_factory({"d": root})
    mode = os.stat(stage.socket).st_mode & 0o777
    assert mode & 0o002 == 0, oct(mode)


def test_sigterm_with_connected_clients(stage_factory, dataset):
    root, _files = dataset
    stage = stage_factory({"d": root})
    c = sluice.Client(stage.socket, job="term")
    it = c.dataset("d").epoch(0, batch=1)
    next(it)
    t = time.monotonic()
    assert stage.stop() == 0
    assert time.monotonic() - t < 10
    with pytest.raises(sluice.SluiceError):
        list(it)


def test_limits_and_the_samples_frame_budget(stage_factory, tmp_path):
    root = tmp_path / "mb"
    root.mkdir()
    for i in range(40):
        (root / f"f{i:02d}.bin").write_bytes(bytes([i]) * (1 << 20))
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="limits") as c:
        ds = c.dataset("d")
        with pytest.raises(sluice.InvalidArgumentError):
            c._call(p.encode_list(0, p.MAX_LIST_LIMIT + 1), p.Files)
        assert c._call(p.encode_list(1000, 5), p.Files) == p.Files(40, [])
        ds.plan_indices(list(range(40)), epoch=0)
        with pytest.raises(sluice.InvalidArgumentError):
            c._call(p.encode_next(p.MAX_SAMPLES_PER_NEXT + 1), p.Samples)
        got = []
        while True:
            answer = c._call(p.encode_next(40), p.Samples)
            assert sum(len(s.data) for s in answer.samples) <= 32 << 20
            got += answer.samples
            if answer.end:
                break
        assert [s.position for s in got] == list(range(40))
        assert all(s.data == bytes([s.position]) * (1 << 20) for s in got)
    raw = Raw(stage.socket)
    for labels in ({f"k{i}": "v" for i in range(65)}, {"": "v"}, {"k" * 64: "v"}, {"k": "v" * 257}):
        msg = raw.call(p.encode_hello("j", labels))
        assert isinstance(msg, p.Error) and msg.code == p.ErrorCode.INVALID_ARGUMENT and not msg.fatal
    raw.hello("j" * 128)
    raw.close()


def test_waits_on_the_limit_count_as_throttled_and_stalled_while_they_last(stage_factory, tmp_path):
    # A job held far below one sample per second (a controller squeezing a
    # greedy job to its floor): its reader waits on the token bucket for a
    # minute, and its trainer for the sample. Both waits must show in the
    # job's throttled and stall seconds as they go, or the job looks
    # unthrottled and fed, and is taken for one that wants no more than it
    # reads.
    root = tmp_path / "slow"
    root.mkdir()
    for name in ("a.bin", "b.bin"):  # the first goes on a full bucket
        (root / name).write_bytes(b"x" * (64 << 10))
    stage = stage_factory({"d": root}, "--rate-limit", "1KiB/s")

    def seconds(name: str) -> float:
        return metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")), name, job="squeezed") or 0.0

    with sluice.Client(stage.socket, job="squeezed") as c:
        it = iter(c.dataset("d").epoch(0, shuffle=False, batch=1))
        assert next(it)[1] == b"x" * (64 << 10)
        came = []

        def wait_for_the_second():
            try:
                came.append(next(it, None))
            except sluice.SluiceError as e:  # the stage stops below
                came.append(e)

        waiting = threading.Thread(target=wait_for_the_second, daemon=True)
        waiting.start()
        wait_for(lambda: seconds("sluice_stage_throttled_seconds_total") >= 1.0, timeout=10,
                 what="a second of throttling counted mid-wait")
        wait_for(lambda: seconds("sluice_stage_consumer_stall_seconds_total") >= 1.0, timeout=10,
                 what="a second of stall counted mid-wait")
        assert waiting.is_alive(), f"the wait for the second sample ended early: {came!r:.300}"
        # Closing waits for the NEXT in flight: the stage's stop ends it.
        assert stage.stop() == 0


def test_reads_by_name_held_by_the_limiter_count_as_the_trainers_stall(stage_factory, tmp_path):
    """READ and FETCH have no plan read ahead: a trainer waits on the
    limiter itself, and that wait is its stall (it counted none, so the
    controller took a throttled random reader for one that wanted no more
    and raised its share a tenth a tick)."""
    root = tmp_path / "named"
    root.mkdir()
    for i in range(8):
        (root / f"s{i}.bin").write_bytes(bytes([i]) * (128 << 10))
    stage = stage_factory({"d": root}, "--rate-limit", "256KiB/s", "--burst-ms", "10")

    def seconds(name: str) -> float:
        return metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")), name, job="named") or 0.0

    with sluice.Client(stage.socket, job="named") as c:
        ds = c.dataset("d")
        for i in range(4):
            assert ds.read(f"s{i}.bin") == bytes([i]) * (128 << 10)
        assert [bytes(d) for _, d in ds.fetch(["s4.bin", "s5.bin"])] == [bytes([4]) * (128 << 10),
                                                                          bytes([5]) * (128 << 10)]
    throttled = seconds("sluice_stage_throttled_seconds_total")
    assert throttled >= 1.0, throttled
    assert seconds("sluice_stage_consumer_stall_seconds_total") >= 0.9 * throttled


def test_a_batch_filled_one_sample_at_a_time_counts_as_stall_as_it_fills(stage_factory, tmp_path):
    # A throttled job's batch of 32 fills over seconds, a sample each
    # sixteenth of a second: the trainer's wait must show in the stall
    # counter while it lasts, not in one jump when the batch is whole (the
    # controller saw stall in every other window and took the job for one
    # that wants no more than it gets).
    root = tmp_path / "slow"
    root.mkdir()
    for i in range(64):
        (root / f"s{i:02d}.bin").write_bytes(bytes([i]) * (64 << 10))
    stage = stage_factory({"d": root}, "--rate-limit", "1MiB/s", "--burst-ms", "10")

    def stall() -> float:
        return metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")),
                            "sluice_stage_consumer_stall_seconds_total", job="trickle") or 0.0

    with sluice.Client(stage.socket, job="trickle") as c:
        done = []
        reading = threading.Thread(
            target=lambda: done.extend(c.dataset("d").epoch(0, shuffle=False, batch=32, prefetch=0)),
            daemon=True)
        reading.start()
        wait_for(lambda: stall() > 0.0, timeout=10, what="the trainer to stall")
        # Sampled every 0.25 s for 1.5 s, while the second batch fills: the
        # counter moves in nearly every sample.
        samples = []
        for _ in range(7):
            samples.append(stall())
            time.sleep(0.25)
        reading.join(timeout=30)
    moved = sum(1 for a, b in zip(samples, samples[1:]) if b > a)
    assert moved >= 4, f"stall seconds sampled every 0.25 s: {samples}"
    assert len(done) == 64


def test_a_killed_trainers_pending_next_is_no_stall(stage_factory, tmp_path):
    # A trainer killed while it waits in NEXT for a batch the limit lets
    # through slowly: the stage answers the request all the same (it holds
    # claimed entries), but nobody waits for it any more.
    root = tmp_path / "slow"
    root.mkdir()
    for i in range(32):
        (root / f"s{i:02d}.bin").write_bytes(bytes([i]) * (256 << 10))
    stage = stage_factory({"d": root}, "--rate-limit", "256KiB/s", "--readers", "2")

    def stall() -> float:
        return metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")),
                            "sluice_stage_consumer_stall_seconds_total", job="killed") or 0.0

    code = ("import sluice\n"
            f"c = sluice.Client({stage.socket!r}, job='killed')\n"
            "for _ in c.dataset('d').epoch(0, batch=16, prefetch=0): pass\n")
    trainer = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        wait_for(lambda: stall() >= 1.0, timeout=10, what="the trainer to stall")
    finally:
        trainer.kill()
        trainer.wait()
    time.sleep(0.5)
    before = stall()
    time.sleep(3)
    assert stall() - before < 0.5, "a dead trainer's wait was counted as stall"


def test_plan_ends_when_its_connections_are_gone(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    first = sluice.Client(stage.socket, job="gone")
    it = first.dataset("d").epoch(0, batch=1)
    next(it)
    first.close()

    def resubmitted():
        with sluice.Client(stage.socket, job="gone") as c:
            again = c.dataset("d").epoch(0)
            # Joining a still-active plan must not consume it: leave at once.
            return again.state == p.PlanState.CREATED and len(list(again)) == len(files)

    wait_for(resubmitted, what="the abandoned plan to be dropped")


def _megabyte_files(root, count: int) -> list:
    names = []
    for i in range(count):
        name = f"m{i:03d}.bin"
        (root / name).write_bytes(bytes([i]) * 2**20)
        names.append(name)
    return names


def test_a_client_dropped_without_close_gives_its_connection_back_at_once(stage_factory, dataset):
    """A notebook cell that makes a client, opens a data set, lists it,
    reads and starts an epoch, and is run again drops the old objects: the
    connection goes with them, not at the cycle collector's next full pass
    (a client and its data set handle held each other)."""
    import gc

    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)

    def cell(i):
        c = sluice.Client(stage.socket, job=f"cell{i}")
        ds = c.dataset("d")
        assert ds.files[0][0] == names[0] and ds.files.indices_of([names[1]]) == [1]
        assert ds.read(names[2]) == files[names[2]]
        next(iter(ds.epoch(0, batch=2)))

    gc.disable()
    try:
        for i in range(3):
            cell(i)
        wait_for(lambda: stage_metric(stage, "sluice_stage_connections") == 0, timeout=5,
                 what="the dropped clients' connections to close")
        # A client whose data set handle was dropped reads from the data set
        # its connection still has open.
        with sluice.Client(stage.socket, job="handle") as c:
            c.dataset("d")
            gc.collect()
            assert c.read(names[3]) == files[names[3]]
    finally:
        gc.enable()


def test_a_read_waiting_on_a_dropped_plan_reads_the_file_itself(stage_factory, tmp_path):
    """A map-style worker's whole-file reads wait for the plan's readers;
    when the sampler's plan goes meanwhile (next epoch, sampler closed),
    they must be answered, not left waiting for entries no reader fetches."""
    root = tmp_path / "m"
    root.mkdir()
    _megabyte_files(root, 24)
    stage = stage_factory({"m": root}, "--rate-limit", "4MiB/s", "--readers", "4")
    with sluice.Client(stage.socket, job="dropped") as sampler, \
            sluice.Client(stage.socket, job="dropped", timeout=30) as worker:
        ds = sampler.dataset("m")
        ds.epoch(0, seed=1, prefetch=0)
        order = [ds.files[i][0] for i in ds.local_order(0, seed=1)]
        got = {}

        def fetch():
            try:
                got["samples"] = worker.dataset("m").fetch(order[:4])
            except Exception as e:  # reported below
                got["error"] = e

        t = threading.Thread(target=fetch)
        t.start()
        time.sleep(0.3)  # the readers have started the first entries, at 4 MiB/s
        ds.epoch(1, seed=1, prefetch=0)  # epoch 0's plan loses its only connection
        t.join(25)
        assert not t.is_alive(), "the FETCH waited on a plan that was dropped"
        assert "error" not in got, got.get("error")
        assert [(n, set(bytes(d))) for n, d in got["samples"]] == \
            [(n, {int(n[1:4])}) for n in order[:4]]


def test_an_interrupted_request_leaves_the_client_usable(stage_factory, tmp_path):
    """Ctrl-C while the stage answers: the answer is unread, so the client
    must not read it as the next request's (it connects again)."""
    import signal
    root = tmp_path / "m"
    root.mkdir()
    names = _megabyte_files(root, 16)
    stage = stage_factory({"m": root}, "--rate-limit", "8MiB/s")
    # A run started in the background by a shell ignores SIGINT, and
    # Python then raises no KeyboardInterrupt: make it raise one.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with sluice.Client(stage.socket, job="interrupted", timeout=30) as c:
        ds = c.dataset("m")
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                ds.fetch(names[:4])  # half a second at 8 MiB/s
        finally:
            timer.join()
            signal.signal(signal.SIGINT, before)
        for k in range(2):
            want = names[8 + 4 * k:12 + 4 * k]
            assert [n for n, _ in ds.fetch(want)] == want
        assert ds.read(names[0]) == bytes([0]) * 2**20


def test_fetch_answers_in_request_order_when_some_names_are_planned(stage_factory, dataset):
    root, files = dataset
    stage = stage_factory({"d": root})
    names = sorted_names(files)
    with sluice.Client(stage.socket, job="mixed") as planner, sluice.Client(stage.socket, job="mixed") as worker:
        it = planner.dataset("d").plan_indices([5, 6, 7], epoch=0)
        want = [names[0], names[7], names[1], names[5], names[2]]
        got = worker.dataset("d").fetch(want)
        assert [(n, bytes(d)) for n, d in got] == [(n, files[n]) for n in want]
        assert [n for n, _ in it] == [names[6]]


def test_one_job_plans_the_same_epoch_over_two_data_sets(stage_factory, dataset, tmp_path):
    """Training and validation loaders of one job, each at epoch 0, mid-epoch
    at once: two plans, not a conflict."""
    root, files = dataset
    val_root = tmp_path / "val"
    val_root.mkdir()
    val_files = make_dataset(val_root, seed=9)
    stage = stage_factory({"train": root, "val": val_root})
    with sluice.Client(stage.socket, job="resnet") as a, sluice.Client(stage.socket, job="resnet") as b:
        train = a.dataset("train").epoch(0, seed=1, batch=4)
        first = [next(train) for _ in range(5)]
        val = list(b.dataset("val").epoch(0, seed=1, batch=4))
        assert {n: bytes(d) for n, d in val} == val_files
        rest = first + list(train)
        assert {n: bytes(d) for n, d in rest} == files


def test_a_socket_path_naming_another_file_is_refused_and_the_file_kept(tmp_path, dataset):
    import subprocess

    from conftest import stage_binary
    root, _ = dataset
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    proc = subprocess.run([str(stage_binary()), "--socket", str(victim), "--metrics-addr", "127.0.0.1:0",
                           "--dataset", f"d={root}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "is not a socket" in proc.stderr, proc.stderr
    assert victim.read_text() == "keep me"


def test_idle_http_clients_cannot_take_the_stages_descriptors(stage_factory, dataset):
    """Connections to the metrics port that send nothing are bounded and
    do not keep trainers out."""
    root, files = dataset
    stage = stage_factory({"d": root})
    host, port = stage.metrics.rsplit(":", 1)
    held = []
    for _ in range(300):
        s = socket.socket()
        s.connect((host, int(port)))
        held.append(s)
    try:
        time.sleep(0.5)
        fds = os.listdir(f"/proc/{stage.proc.pid}/fd")
        assert len(fds) < 250, f"the stage holds {len(fds)} descriptors for 300 idle HTTP clients"
        name = sorted_names(files)[0]
        with sluice.Client(stage.socket, job="beside") as c:
            assert c.dataset("d").read(name) == files[name]
        # Nor do they keep a client that speaks out of the port: the
        # oldest silent one gives it its place.
        assert http_get(stage.metrics, "/healthz") == "ok\n"
    finally:
        for s in held:
            s.close()

    def served():
        # The server may take a moment to see 128 connections close.
        try:
            return http_get(stage.metrics, "/healthz") == "ok\n"
        except OSError:
            return False

    wait_for(served, timeout=5, what="the metrics port serving again once they left")


def test_the_metrics_port_says_what_it_serves(stage_factory, dataset):
    """A path the stage's HTTP port does not serve is a 404 that lists what
    it does, and a method a path does not take a 405 (both were empty)."""
    root, _files = dataset
    stage = stage_factory({"d": root})

    def ask(method: str, path: str) -> str:
        host, port = stage.metrics.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(f"{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
            return b"".join(iter(lambda: s.recv(65536), b"")).decode()

    missing = ask("GET", "/api/v1/job")
    assert missing.startswith("HTTP/1.0 404") and "this stage serves GET /metrics" in missing, missing
    wrong = ask("POST", "/metrics")
    assert wrong.startswith("HTTP/1.0 405") and "no POST /metrics here" in wrong, wrong


def test_trainers_that_stop_reading_their_answers_do_not_starve_other_jobs(stage_factory, tmp_path):
    """Connections that ask for samples and never read the answers (hung
    or stopped trainers) hold the memory of what they were answered for
    30 s at most (before, such answers held a small node's whole budget
    for good), and their claims hold at most half the budget meanwhile:
    another job reads its epoch without waiting for them to be closed."""
    root = tmp_path / "d"
    files = files_of(root, 200, 64 << 10)
    stage = stage_factory({"d": root}, "--memory-budget", "32MiB")
    stuck = []
    for _ in range(4):
        raw = Raw(stage.socket)
        raw.hello("hung")
        assert isinstance(raw.call(p.encode_open("d")), p.Opened)
        assert isinstance(raw.call(p.encode_plan_indices(0, [j % 200 for j in range(8000)])), p.Planned)
        raw.send(p.encode_next(4096))  # and never reads the answer
        stuck.append(raw)
    try:
        time.sleep(2)
        t0 = time.monotonic()
        with sluice.Client(stage.socket, job="innocent", timeout=90) as c:
            got = {name: bytes(data) for name, data in c.dataset("d").epoch(0, batch=64)}
        assert got == files
        assert time.monotonic() - t0 < 20, "the epoch waited for the hung trainers to be cut"
        wait_for(lambda: "did not take its answer within 30 s" in stage.stderr_tail(), timeout=45,
                 what="the hung trainers closed")
    finally:
        for raw in stuck:
            raw.close()


def test_a_client_naming_job_after_job_cannot_make_the_stage_keep_them_all(stage_factory, dataset):
    """Each job with nothing attached is kept a minute (its trainers may
    come back), but at most 128 of them: a client that connects as one new
    job after another, with shared memory (a region, a descriptor, each),
    cannot make the stage keep them all, and the jobs attached are kept."""
    root, files = dataset
    stage = stage_factory({"d": root})
    with sluice.Client(stage.socket, job="attached") as kept:
        for i in range(300):
            raw = Raw(stage.socket)
            welcome = raw.call(p.encode_hello(f"churn-{i}", version=2, features=p.FEATURE_SHARED_MEMORY))
            assert isinstance(welcome, p.Welcome), welcome
            assert isinstance(raw.call(p.encode_bye()), p.Goodbye)
            raw.close()
        jobs = stage_metric(stage, "sluice_stage_jobs")
        assert jobs <= 130, f"{jobs} jobs kept"
        fds = len(os.listdir(f"/proc/{stage.proc.pid}/fd"))
        assert fds < 200, f"the stage holds {fds} descriptors"
        assert dict(kept.dataset("d").epoch(0)) == files


def test_idle_tcp_peers_cannot_take_the_stages_descriptors(stage_factory, dataset):
    """Peers that connect to the TCP listener and say nothing (a port
    scanner, a client leaking sockets) are held to their listener's share of
    a quarter of the stage's descriptor limit and closed after 10 s without HELLO: every job's reads
    go on beside them."""
    root, files = dataset
    stage = stage_factory({"d": root}, tcp=True, nofile=256)  # 32 connections a listener
    host, port = stage.tcp.rsplit(":", 1)
    first = Raw((host, int(port)), timeout=20)
    held = [socket.create_connection((host, int(port))) for _ in range(200)]
    try:
        wait_for(lambda: stage_metric(stage, "sluice_stage_connections_refused_total") >= 200 - 31,
                 what="connections past the listener's most refused")
        fds = os.listdir(f"/proc/{stage.proc.pid}/fd")
        assert len(fds) < 128, f"the stage holds {len(fds)} descriptors for 200 idle TCP peers"
        with sluice.Client(stage.socket, job="beside") as c:
            assert dict(c.dataset("d").epoch(0)) == files
        msg = expect_error_then_close(first, p.ErrorCode.OUT_OF_ORDER)
        assert "no HELLO within 10 s" in msg.message, msg
    finally:
        first.close()
        for s in held:
            s.close()
    with sluice.Client(f"tcp://{stage.tcp}", job="after") as c:
        assert dict(c.dataset("d").epoch(0)) == files


def test_jobs_reading_at_once_under_a_low_descriptor_limit_lose_no_sample(stage_factory, tmp_path):
    """Each job reads with many threads at once, each holding a file open:
    under a low descriptor limit, the readers of jobs reading at once find
    none free now and then. Such a read waits for one (they come back as
    other reads finish) instead of failing its sample with `EMFILE`."""
    files = small_files(tmp_path / "d", 1000, sizes=(4 << 10, 8 << 10))
    stage = stage_factory({"d": tmp_path / "d"}, nofile=128)
    results = {}

    def epoch(i):
        try:
            with sluice.Client(stage.socket, job=f"j{i}", timeout=60, reconnect=0) as c:
                results[i] = dict(c.dataset("d").epoch(0, seed=i))
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=epoch, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = {i: r for i, r in results.items() if not isinstance(r, dict)}
    assert not failed, f"{len(failed)} of 24 jobs failed, e.g. {next(iter(failed.values()))}"
    assert all(r == files for r in results.values())
    assert "reads waited for a free file descriptor" in stage.stderr_tail(20000)


def test_trainers_a_stage_under_a_low_descriptor_limit_takes_read_their_epochs(stage_factory, tmp_path):
    """Under a low descriptor limit, the connections a listener takes are
    a quarter of the descriptors the stage has left once started, not of
    its whole limit: of twelve trainers connecting at once to a stage
    with six descriptors left (20 of its limit), the five taken (with a
    region each) held them all, and every one failed to list its data set
    after 10 s
    ("no free file descriptor"). Those taken now read their epochs; the
    others are told the stage holds its most connections."""
    files = small_files(tmp_path / "d", 100, sizes=(20_000,))
    # Six descriptors beyond those a stage holds once started.
    idle = stage_factory({"d": tmp_path / "d"})
    held = len(os.listdir(f"/proc/{idle.proc.pid}/fd"))
    idle.stop()
    stage = stage_factory({"d": tmp_path / "d"}, nofile=held + 6)
    results = {}
    everyone = threading.Barrier(12, timeout=30)

    def trainer(i):
        try:
            try:
                c = sluice.Client(stage.socket, job=f"low-{i}", timeout=60, reconnect=0)
            finally:
                everyone.wait()  # all connected (or refused) before any lists
            with c:
                results[i] = dict(c.dataset("d").epoch(0, seed=i))
        except sluice.UnavailableError as e:
            results[i] = e
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = ("failed", e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    failed = [r for r in results.values() if isinstance(r, tuple)]
    assert not failed, f"{len(failed)} trainers taken failed, e.g. {failed[0][1]}"
    read = [r for r in results.values() if isinstance(r, dict)]
    assert read and all(r == files for r in read), f"{len(read)} of 12 read their epochs"
    refused = [r for r in results.values() if isinstance(r, sluice.UnavailableError)]
    assert all("holds its most trainer connections" in str(e) for e in refused), refused[:1]


def test_a_stage_out_of_descriptors_refuses_a_new_trainer_at_once_and_says_why(stage_factory, dataset):
    """A stage out of descriptors answers a trainer that connects with
    `UNAVAILABLE` saying so (the connection waited in the backlog until its
    `HELLO` timed out); once one closes, the next trainer is taken, the job
    kept idle gives its region's descriptor back and reads that find no
    descriptor free wait for one."""
    import resource

    root, files = dataset
    stage = stage_factory({"d": root})
    fds = f"/proc/{stage.proc.pid}/fd"
    first = sluice.Client(stage.socket, job="first", reconnect=0)
    others = []
    try:
        first.dataset("d")
        # The stage's limit lowered to just above the descriptors it holds.
        held = [int(fd) for fd in os.listdir(fds)]
        top = max(held) + 1
        hard = resource.prlimit(stage.proc.pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(stage.proc.pid, resource.RLIMIT_NOFILE, (top, hard))
        refusal = None
        for i in range(top - len(held) + 1):  # the free ones beneath it taken, then out
            t0 = time.monotonic()
            try:
                others.append(sluice.Client(stage.socket, job=f"other-{i}", timeout=10, reconnect=0))
            except sluice.UnavailableError as e:
                refusal, took = e, time.monotonic() - t0
                break
        assert refusal is not None and "the stage is out of file descriptors" in str(refusal), refusal
        assert took < 5, f"the refusal took {took:.1f} s"
        full = len(os.listdir(fds))
    finally:
        first.close()
        for c in others:
            c.close()
    wait_for(lambda: len(os.listdir(fds)) < full, what="the stage to see `first` close")
    assert stage_metric(stage, "sluice_stage_connections_refused_total") == 1
    assert "trainer connections were refused: the stage is out of file descriptors" in stage.stderr_tail(20000)
    # The next trainer is taken (the idle job's descriptors go back), and
    # its reads wait for descriptors where none is free.
    deadline = time.monotonic() + 10
    while True:
        try:
            after = sluice.Client(stage.socket, job="after", reconnect=0, timeout=30)
            break
        except sluice.UnavailableError:
            assert time.monotonic() < deadline, "no trainer taken 10 s after `first` closed"
            time.sleep(0.2)
    with after:
        assert dict(after.dataset("d").epoch(0)) == files
    # Once descriptors are plenty again, jobs get shared memory again (a
    # region refused for want of a descriptor turned it off for good).
    resource.prlimit(stage.proc.pid, resource.RLIMIT_NOFILE, (min(hard, 1024), hard))
    with sluice.Client(stage.socket, job="later", reconnect=0) as later:
        assert later.shared_memory
        assert dict(later.dataset("d").epoch(0)) == files


def test_jobs_without_a_plan_hold_no_reader_threads(stage_factory, dataset):
    """A job kept idle (a minute after its trainers leave) or between
    epochs holds no reader threads: a node with many such jobs kept 16
    each, and reached its process's thread limit. Its next plan starts
    them again."""
    root, files = dataset
    stage = stage_factory({"d": root})

    def readers():
        tasks = f"/proc/{stage.proc.pid}/task"
        names = []
        for t in os.listdir(tasks):
            try:
                with open(f"{tasks}/{t}/comm") as f:
                    names.append(f.read().strip())
            except (FileNotFoundError, ProcessLookupError):
                pass  # the thread exited meanwhile
        return sum(n.startswith("reader-") for n in names)

    for i in range(10):
        with sluice.Client(stage.socket, job=f"epoch-{i}") as c:
            assert dict(c.dataset("d").epoch(0)) == files
    wait_for(lambda: readers() == 0, what="the idle jobs' reader threads to stop")
    assert stage_metric(stage, "sluice_stage_jobs") == 10
    with sluice.Client(stage.socket, job="epoch-0") as c:
        assert dict(c.dataset("d").epoch(1)) == files


def small_files(root, n: int, sizes=(16 << 10, 22 << 10)) -> dict:
    root.mkdir()
    rng = random.Random(n)
    files = {f"{i:05d}.bin": rng.randbytes(rng.randrange(*sizes)) for i in range(n)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def test_a_job_that_planned_and_went_quiet_leaves_room_for_the_next(stage_factory, tmp_path):
    """A job alone prefetches into the whole budget; once another job's
    consumer waits, the quiet job's read-ahead beyond its share makes way."""
    files = small_files(tmp_path / "d", 1500)
    names = sorted(files)
    stage = stage_factory({"d": tmp_path / "d"}, "--memory-budget", "8MiB")
    quiet = Raw(stage.socket)
    quiet.hello("quiet")
    quiet.call(p.encode_open("d"))
    quiet.call(p.encode_plan_indices(0, list(range(len(names)))))  # and never NEXT
    wait_for(lambda: stage_metric(stage, "sluice_stage_memory_used_bytes") > 6 << 20,
             what="the quiet job to prefetch most of the budget")
    busy = Raw(stage.socket, timeout=20)
    busy.hello("busy")
    busy.call(p.encode_open("d"))
    busy.call(p.encode_plan_indices(0, [7]))
    got = busy.call(p.encode_next(1))
    assert [(s.name, s.data) for s in got.samples] == [(names[7], files[names[7]])]
    quiet.sock.close()


def test_jobs_with_large_claims_on_a_small_budget_all_finish(stage_factory, tmp_path):
    """Each job's NEXT claims up to half its share of the budget; read-ahead
    nobody claimed makes way for claims, so no job waits for ever on
    memory the others hold."""
    files = small_files(tmp_path / "d", 1200)
    stage = stage_factory({"d": tmp_path / "d"}, "--memory-budget", "16MiB")
    results = {}

    def job(k):
        got = 0
        try:
            r = Raw(stage.socket, timeout=30)
            r.hello(f"job{k}")
            r.call(p.encode_open("d"))
            r.call(p.encode_plan_indices(0, list(range(len(files)))))
            while True:
                answer = r.call(p.encode_next(1024))
                got += len(answer.samples)
                if answer.end:
                    break
            results[k] = got
        except Exception as e:  # a hang shows as the socket's timeout
            results[k] = f"stopped after {got}: {e!r}"

    threads = [threading.Thread(target=job, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {k: len(files) for k in range(3)}
