"""The S3 source end to end: a stage reading ``s3://`` datasets from a real
S3-compatible server (``s3s-fs``) behind ``sluice-slowhttp`` (latency and
injected failures)."""

from __future__ import annotations

import contextlib
import errno
import http.server
import os
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest

import sluice
from sluice.bench.harness import HarnessError, free_port
from sluice.bench.s3 import (ACCESS_KEY, SECRET_KEY, S3Server, SlowHttp, find_s3_server,
                             find_slowhttp_binary)

from conftest import REPO, http_get, in_ci, make_dataset, sorted_names, stage_binary, wait_for

BUCKET = "bucket"
PREFIX = "train"


@pytest.fixture
def credentials(monkeypatch, tmp_path):
    """The harness's credentials in the environment, and nothing else the
    stage could pick up (no profile files, no endpoint)."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)


@pytest.fixture
def s3(tmp_path, credentials):
    """``(server, files)``: s3s-fs serving bucket ``bucket`` with the shared
    test tree under prefix ``train/`` (and one object outside it)."""
    try:
        binary = find_s3_server(str(REPO))
    except HarnessError as e:
        if in_ci():
            pytest.fail(str(e))
        pytest.skip(str(e))
    root = tmp_path / "s3"
    data = root / BUCKET / PREFIX
    data.mkdir(parents=True)
    files = make_dataset(data)
    # Large enough to be read as parallel ranged GETs (8 MiB parts).
    files["big/large.bin"] = random.Random(5).randbytes(17 * 2**20 + 5)
    (data / "big").mkdir()
    (data / "big" / "large.bin").write_bytes(files["big/large.bin"])
    (root / BUCKET / "secret.bin").write_bytes(b"outside the prefix")
    server = S3Server.start(binary, str(root))
    yield server, files
    server.stop()


def proxy(server, **faults) -> SlowHttp:
    return SlowHttp.start(find_slowhttp_binary(str(stage_binary().parent)), server.address, **faults)


def s3_stage(stage_factory, endpoint: str, *extra: str):
    return stage_factory({"ds": f"s3://{BUCKET}/{PREFIX}"}, "--s3-endpoint", endpoint, *extra)


def metric_sum(stage, name: str, **labels) -> float:
    body = http_get(stage.metrics, "/metrics")
    total = 0.0
    for line in body.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_object_arrives_exactly_in_plan_order(s3, stage_factory):
    server, files = s3
    with proxy(server, latency="2ms") as slow:
        stage = s3_stage(stage_factory, slow.endpoint)
        with sluice.Client(stage.socket, job="s3") as c:
            ds = c.dataset("ds")
            names = ds.files.names()
            assert names == sorted_names(files), "the listing is the prefix's keys, nothing outside"
            got = list(ds.epoch(0, seed=3, batch=8))
            order = [n for n, _ in got]
            assert order == [names[i] for i in sluice.plan.permutation(len(names), 3, 0, True)]
            assert {n: bytes(d) for n, d in got} == files
            # Random access and FETCH outside any plan read the store too.
            big = max(files, key=lambda n: len(files[n]))
            assert c.dataset("ds").read(big, 5, 1000) == files[big][5:1005]
            assert bytes(ds.fetch([big])[0][1]) == files[big]
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="ok") >= len(files)


def test_reads_outside_a_plan_ask_the_store_no_more_than_they_need(s3, stage_factory):
    """The listing knows every size: a range read costs the store a HEAD
    (to clamp the range) and a GET, a whole-file FETCH one GET."""
    server, files = s3
    stage = s3_stage(stage_factory, f"http://{server.address}")
    requests = lambda: metric_sum(stage, "sluice_stage_source_requests_total")  # noqa: E731
    names = [n for n in sorted_names(files) if 2000 < len(files[n]) < 2**20]
    # The start-up check's HEAD of a key that does not exist is not counted.
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="not_found") == 0
    with sluice.Client(stage.socket, job="s3", shared_memory=False) as c:
        ds = c.dataset("ds")
        before = requests()
        assert ds.read(names[0], 1000, 10) == files[names[0]][1000:1010]
        assert requests() - before == 2
        before = requests()
        assert [(n, bytes(d)) for n, d in ds.fetch(names[1:4])] == [(n, files[n]) for n in names[1:4]]
        assert requests() - before == 3
        # An empty object read by name: its ranged GET is answered 416,
        # which is no fault of anyone's (it was counted a client error).
        empty = [n for n in sorted_names(files) if not files[n]]
        assert empty
        assert ds.read(empty[0]) == b""
        assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="client_error") == 0


def test_files_read_through_the_mount_are_kept_by_the_node_cache(s3, stage_factory, tmp_path):
    """The server lists no ETags (s3s-fs does not): a read's version is
    then taken from the object's time as the listing's is, and a file
    read whole through the mount goes into the node cache (it never did:
    the versions differed), so the next epoch asks the store nothing; the
    first asks one GET a file."""
    import json

    server, files = s3
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = s3_stage(stage_factory, f"http://{server.address}", "--mount", str(mnt),
                     "--cache-memory", "64MiB")
    small = [n for n in sorted_names(files) if 0 < len(files[n]) <= 4 << 20]

    def epoch() -> None:
        for name in small:
            with open(mnt / "@s3" / "ds" / name, "rb") as f:
                assert f.read() == files[name], name
        # The kernel's pages go, so the next epoch reaches the stage.
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")

    def cache() -> dict:
        return json.loads(http_get(stage.metrics, "/api/v1/cache"))["datasets"][0]

    # The listing's requests first.
    assert sum(len(f) for _, _, f in os.walk(mnt / "@s3" / "ds")) == len(files)
    listed = metric_sum(stage, "sluice_stage_source_requests_total")
    epoch()
    assert cache()["entries"] == len(small), cache()
    # One GET a file: its answer names the object's ETag and size (a HEAD
    # first used to double the requests).
    assert metric_sum(stage, "sluice_stage_source_requests_total") - listed == len(small)
    empty = [n for n in sorted_names(files) if not files[n]]
    for name in empty:
        with open(mnt / "@s3" / "ds" / name, "rb") as f:
            assert f.read() == b"", name
    before = metric_sum(stage, "sluice_stage_source_requests_total", outcome="ok")
    epoch()
    assert cache()["hits"] >= len(small), cache()
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="ok") == before


def test_a_folder_marker_with_nothing_beneath_is_an_empty_directory_in_the_mount(stage_factory, tmp_path,
                                                                                credentials):
    """A folder made empty by a console (an empty object `valid/`, as DLIO's
    layout has when it holds nothing) shows as an empty directory through
    the mount, as an empty local directory does; a marker above objects
    shows them, and no folder is a sample."""
    objects = {f"{PREFIX}/a.bin": b"a", f"{PREFIX}/valid/": b"", f"{PREFIX}/deep/er/": b"",
               f"{PREFIX}/full/": b"", f"{PREFIX}/full/x.bin": b"x", f"{PREFIX}/": b""}
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with object_store_of(objects) as endpoint:
        stage = s3_stage(stage_factory, endpoint, "--mount", str(mnt))
        root = mnt / "@s3" / "ds"
        assert sorted(os.listdir(root)) == ["a.bin", "deep", "full", "valid"]
        assert os.path.isdir(root / "valid") and os.listdir(root / "valid") == []
        assert os.listdir(root / "deep") == ["er"] and os.listdir(root / "deep" / "er") == []
        assert os.listdir(root / "full") == ["x.bin"]
        with sluice.Client(stage.socket, job="markers") as c:
            assert c.dataset("ds").files.names() == ["a.bin", "full/x.bin"]


def test_keys_outside_the_prefix_are_not_served(s3, stage_factory):
    server, _files = s3
    stage = s3_stage(stage_factory, f"http://{server.address}")
    with sluice.Client(stage.socket, job="s3") as c:
        ds = c.dataset("ds")
        for name in ("../secret.bin", "/secret.bin", "a/../../secret.bin", "./x"):
            with pytest.raises(sluice.SluiceError) as e:
                ds.read(name)
            assert e.value.code == sluice.ErrorCode.FORBIDDEN_PATH, (name, e.value)


def test_missing_and_denied_objects_are_their_samples_errors(s3, stage_factory):
    server, files = s3
    names = sorted_names(files)
    deleted, denied = names[3], next(n for n in names if n.startswith("d1/"))
    grown, big = names[5], names[6]
    # Listed larger than one response frame carries: a TOO_LARGE sample,
    # read in ranges, as a local file that large is.
    os.truncate(os.path.join(server.root, BUCKET, PREFIX, big), 260 << 20)
    with proxy(server, deny=f"/{PREFIX}/{denied}") as slow:
        stage = s3_stage(stage_factory, slow.endpoint)
        with sluice.Client(stage.socket, job="s3") as c:
            ds = c.dataset("ds")
            ds.files.names()
            os.remove(os.path.join(server.root, BUCKET, PREFIX, deleted))
            # Grown past what one response frame carries since it was
            # listed: its own TOO_LARGE sample, not a frame that ends the
            # connection, which the client reads in ranges instead.
            os.truncate(os.path.join(server.root, BUCKET, PREFIX, grown), 260 << 20)
            got = dict(ds.epoch(0, seed=1, batch=8, on_error="yield"))
    assert set(got) == set(names), "no silent gap"
    assert got[deleted].code == sluice.ErrorCode.NOT_FOUND and deleted in got[deleted].message
    assert got[denied].code == sluice.ErrorCode.IO_ERROR and "denied" in got[denied].message
    assert got[grown] == files[grown] + bytes((260 << 20) - len(files[grown]))
    assert got[big] == files[big] + bytes((260 << 20) - len(files[big]))
    for name in set(names) - {deleted, denied, grown, big}:
        assert bytes(got[name]) == files[name]
    assert metric_sum(stage, "sluice_stage_source_errors_total", kind="not_found") >= 1
    assert metric_sum(stage, "sluice_stage_source_errors_total", kind="denied") >= 1


def test_throttling_and_resets_are_retried(s3, stage_factory):
    server, files = s3
    with proxy(server, throttle_every=3, reset_every=7) as slow:
        stage = s3_stage(stage_factory, slow.endpoint)
        with sluice.Client(stage.socket, job="s3") as c:
            got = {n: bytes(d) for n, d in c.dataset("ds").epoch(0, seed=2, batch=8)}
    assert got == files
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="throttled") >= 1
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="connection") >= 1
    assert metric_sum(stage, "sluice_stage_source_retries_total") >= 2


def test_a_throttling_store_gets_fewer_reads_in_flight(s3, stage_factory):
    server, files = s3
    with proxy(server, throttle_every=2, latency="20ms") as slow:
        stage = s3_stage(stage_factory, slow.endpoint, "--initial-readers", "32")
        with sluice.Client(stage.socket, job="s3") as c:
            got = {n: bytes(d) for n, d in c.dataset("ds").epoch(0, seed=2, batch=8)}
    assert got == files
    assert metric_sum(stage, "sluice_stage_tuner_changes_total", reason="store_throttled") >= 1


def test_a_listing_rides_out_a_store_that_throttles_some_of_its_pages(s3, stage_factory):
    """A split listing is dozens of page requests: a spell of 503s among
    them is waited out, not the whole data set's failure."""
    server, _files = s3
    # Keys under 21 sub-prefixes: the listing asks for them a page each.
    rng = random.Random(11)
    files = {f"c{i}/sub{j}/k{k}.bin": rng.randbytes(rng.randrange(0, 3000))
             for i in range(7) for j in range(3) for k in range(4)}
    for name, data in files.items():
        path = os.path.join(server.root, BUCKET, "split", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    mnt = os.path.join(server.root, "..", "mnt")
    os.makedirs(mnt)
    with proxy(server, latency="5ms", throttle_every=5, reset_every=11, stall_body_every=13) as slow:
        stage = stage_factory({"ds": f"s3://{BUCKET}/split"}, "--s3-endpoint", slow.endpoint, "--mount", mnt)
        # The first look into the data set lists it (through the mount).
        for name in sorted(files)[:10]:
            with open(os.path.join(mnt, "@s3", "ds", name), "rb") as f:
                assert f.read() == files[name], name
        with sluice.Client(stage.socket, job="s3", timeout=60) as c:
            assert c.dataset("ds").files.names() == sorted(files)
            got = {n: bytes(d) for n, d in c.dataset("ds").epoch(0, seed=3, batch=8)}
    assert got == files


def test_keys_no_sample_name_can_carry_are_skipped_and_the_rest_served(s3, stage_factory):
    server, files = s3
    data = os.path.join(server.root, BUCKET, PREFIX)
    odd = {"plus+sign.bin": b"+", "pct%20enc.bin": b"%", "sp ace/x.bin": b" "}
    for name, body in odd.items():
        os.makedirs(os.path.dirname(os.path.join(data, name)), exist_ok=True)
        with open(os.path.join(data, name), "wb") as f:
            f.write(body)
    # A control character: a legal S3 key, but not one object_store can
    # address; it used to fail the whole listing (and so the stage's start).
    with open(os.path.join(data, "ctrl\ttab.bin"), "wb") as f:
        f.write(b"tab")
    stage = s3_stage(stage_factory, f"http://{server.address}")
    with sluice.Client(stage.socket, job="odd") as c:
        ds = c.dataset("ds")
        assert ds.files.names() == sorted_names({**files, **odd})
        got = {name: bytes(data) for name, data in ds.epoch(0, seed=2, batch=4)}
        time.sleep(5.5)  # the next OPEN lists the data set again
        assert c.dataset("ds").files.names() == sorted_names({**files, **odd})
    assert got == {**files, **odd}
    # Said once, with the key, not again at the next listing.
    said = "skipping objects whose keys are not servable names"
    assert stage.stderr_tail().count(said) == 1, stage.stderr_tail()
    assert "first=train/ctrl\ttab.bin" in stage.stderr_tail(), stage.stderr_tail()


def test_a_store_restarting_within_the_deadline_loses_no_sample(s3, stage_factory):
    server, files = s3
    stage = s3_stage(stage_factory, f"http://{server.address}")
    port = int(server.address.rsplit(":", 1)[1])
    with sluice.Client(stage.socket, job="restart") as c:
        ds = c.dataset("ds")
        server.proc.kill()
        server.proc.wait()
        revived = []

        def restart() -> None:  # refused connections for 3 s, then back
            time.sleep(3)
            revived.append(S3Server.start(server.proc.args[0], server.root, port=port))

        t = threading.Thread(target=restart)
        t.start()
        try:
            t0 = time.monotonic()
            got = {name: bytes(data) for name, data in ds.epoch(0, seed=4, batch=4)}
        finally:
            t.join()
            for s in revived:
                s.stop()
    assert got == files
    assert time.monotonic() - t0 >= 2.5
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="connection") > 0


def test_a_request_that_hangs_is_tried_again_within_the_deadline(s3, stage_factory):
    """A GET that is never answered (a stalled store, a half-open
    connection) must not use the sample's whole deadline: it is given up
    after a third of it and sent again."""
    server, files = s3
    names = [n for n in sorted_names(files) if len(files[n]) < 2**20][:20]
    with proxy(server, hang_every=5) as slow:
        stage = s3_stage(stage_factory, slow.endpoint, "--s3-deadline", "6s")
        with sluice.Client(stage.socket, job="s3", timeout=60) as c:
            got = dict(c.dataset("ds").plan_names(names, epoch=0, on_error="yield"))
    assert {n: bytes(d) if not isinstance(d, Exception) else d for n, d in got.items()} == \
        {n: files[n] for n in names}
    # Every fifth of about 25 GETs hung: each was given up, counted and retried.
    assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="connection") >= 3
    assert metric_sum(stage, "sluice_stage_source_retries_total") >= 3


def test_a_transfer_that_stalls_halfway_is_resumed_within_the_deadline(s3, stage_factory):
    """An answer whose bytes stop coming (a connection that died after
    the head) is given up after a third of the deadline without bytes, and
    the rest is asked for again."""
    server, files = s3
    names = [n for n in sorted_names(files) if 2 <= len(files[n]) < 2**20][:12]
    with proxy(server, stall_body_every=4) as slow:
        stage = s3_stage(stage_factory, slow.endpoint, "--s3-deadline", "6s")
        with sluice.Client(stage.socket, job="s3", timeout=60) as c:
            t0 = time.monotonic()
            got = dict(c.dataset("ds").plan_names(names, epoch=0, on_error="yield"))
            took = time.monotonic() - t0
    assert {n: bytes(d) if not isinstance(d, Exception) else d for n, d in got.items()} == \
        {n: files[n] for n in names}
    assert took < 20, f"{took:.1f} s"
    # Each stalled transfer was a retry (its head had counted ok).
    assert metric_sum(stage, "sluice_stage_source_retries_total") >= 2


def test_a_sample_whose_every_transfer_stalls_names_the_stall_past_its_deadline(s3, stage_factory):
    """Every answer stops halfway: each sample fails at its deadline, and
    its error says the answers stopped coming (it said "no try failed, the
    store was slow to answer", though every try had failed)."""
    server, files = s3
    names = [n for n in sorted_names(files) if 2 <= len(files[n]) < 2**20][:3]
    with proxy(server, stall_body_every=1) as slow:
        stage = s3_stage(stage_factory, slow.endpoint, "--s3-deadline", "3s")
        with sluice.Client(stage.socket, job="s3", timeout=60) as c:
            ds = c.dataset("ds")
            ok = metric_sum(stage, "sluice_stage_source_requests_total", outcome="ok")
            got = dict(ds.plan_names(names, epoch=0, on_error="yield"))
        # No transfer came whole: none is an ok request (each was counted
        # ok at its head).
        assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="ok") == ok
        assert metric_sum(stage, "sluice_stage_source_requests_total", outcome="stalled") >= len(names)
    for name in names:
        message = got[name].message
        assert "3s deadline" in message and "stopped coming" in message, message
        assert "no try failed" not in message, message


def test_a_stage_started_while_its_store_throttles_starts_once_it_answers(s3, stage_factory):
    """The store answers 503 SlowDown to everything for 6 s while the stage
    starts (stages of a fleet started at once): the stage waits for it and
    serves (it gave up after 5 s, with the store's XML as its message)."""
    server, files = s3
    busy = proxy(server, throttle_every=1)
    address = busy.endpoint.removeprefix("http://")
    calm = []

    def calm_down():
        time.sleep(6)
        busy.stop()
        calm.append(proxy(server, listen=address))

    threading.Thread(target=calm_down, daemon=True).start()
    try:
        t0 = time.monotonic()
        stage = s3_stage(stage_factory, busy.endpoint)
        took = time.monotonic() - t0
        assert took >= 5, f"started in {took:.1f} s while the store throttled every request"
        name = sorted_names(files)[0]
        with sluice.Client(stage.socket, job="s3") as c:
            assert c.dataset("ds").read(name) == files[name]
    finally:
        busy.stop()
        for p in calm:
            p.stop()


def test_a_store_too_slow_for_the_deadline_fails_the_sample_never_hangs(s3, stage_factory):
    server, files = s3
    names = sorted_names(files)[:3]
    # Listing is not bound by the sample deadline; every GET takes longer.
    with proxy(server, latency="1500ms") as slow:
        stage = s3_stage(stage_factory, slow.endpoint, "--s3-deadline", "500ms")
        with sluice.Client(stage.socket, job="s3") as c:
            t0 = time.monotonic()
            got = dict(c.dataset("ds").plan_names(names, epoch=0, on_error="yield"))
            took = time.monotonic() - t0
    assert set(got) == set(names)
    for name in names:
        assert got[name].code == sluice.ErrorCode.IO_ERROR and "deadline" in got[name].message, got[name]
    assert took < 15, f"three samples past a 0.5 s deadline took {took:.1f} s"
    assert metric_sum(stage, "sluice_stage_source_errors_total", kind="deadline") >= 3


def test_a_sample_past_its_deadline_names_why_its_tries_failed(s3, stage_factory):
    server, files = s3
    names = sorted_names(files)[:2]
    stage = s3_stage(stage_factory, f"http://{server.address}", "--s3-deadline", "2s")
    with sluice.Client(stage.socket, job="s3") as c:
        ds = c.dataset("ds")
        server.proc.kill()
        server.proc.wait()
        got = dict(ds.plan_names(names, epoch=0, on_error="yield"))
    for name in names:
        message = got[name].message
        assert "2s deadline" in message and "Connection refused" in message, message


def start_fails(tmp_path, *args: str, env=None) -> str:
    """Runs the stage with ``args`` and returns its stderr, asserting it
    exits non-zero before serving."""
    sock = tmp_path / "refused.sock"
    proc = subprocess.run([str(stage_binary()), "--socket", str(sock), "--metrics-addr", "127.0.0.1:0",
                           *args], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0, proc.stdout
    assert not proc.stdout, "no ready line"
    return proc.stderr


def test_start_up_errors_say_what_to_fix(s3, tmp_path, monkeypatch):
    server, _files = s3
    url = f"s3://{BUCKET}/{PREFIX}"
    endpoint = f"http://{server.address}"
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint,
                      env={**os.environ, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert "refused the credentials" in err and "AWS_ACCESS_KEY_ID" in err, err
    err = start_fails(tmp_path, "--dataset", "ds=s3://no-such-bucket/x", "--s3-endpoint", endpoint)
    assert "bucket `no-such-bucket` does not exist" in err, err
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", f"http://127.0.0.1:{free_port()}")
    assert "cannot reach the object store" in err or "did not answer" in err, err
    # https:// to a store that serves plain HTTP: named (it said only
    # "client error (Connect)").
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", f"https://{server.address}")
    assert "does not speak TLS" in err and "http://" in err, err
    # No keys, no profile, and no instance metadata service (a closed port
    # stands in for the unroutable address off a cloud).
    closed = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint,
                      env={**env, "AWS_METADATA_ENDPOINT": closed})
    assert "no S3 credentials" in err and "AWS_ACCESS_KEY_ID" in err, err
    assert f"no instance metadata service at {closed}" in err, err
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint,
                      env={**env, "AWS_EC2_METADATA_DISABLED": "true"})
    assert "no S3 credentials" in err and "AWS_EC2_METADATA_DISABLED is set" in err, err
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint,
                      env={**env, "AWS_WEB_IDENTITY_TOKEN_FILE": str(tmp_path / "token")})
    assert "AWS_ROLE_ARN is not" in err, err
    err = start_fails(tmp_path, "--dataset", "ds=s3://", "--s3-endpoint", endpoint)
    assert "names no bucket" in err, err
    no_secret = {k: v for k, v in os.environ.items() if k != "AWS_SECRET_ACCESS_KEY"}
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint, env=no_secret)
    assert "AWS_SECRET_ACCESS_KEY is not" in err, err
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint,
                      "--s3-anonymous", "true")
    assert "refused unsigned requests" in err and "drop --s3-anonymous" in err, err
    # Virtual-hosted addressing asks the endpoint itself for the keys.
    err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", endpoint,
                      "--s3-path-style", "false")
    assert "--s3-path-style true" in err, err
    err = start_fails(tmp_path, "--dataset", f"ds=s3:/{BUCKET}/{PREFIX}")
    assert "neither a directory nor a URL" in err and "s3://BUCKET/PREFIX" in err, err
    # A web server that is no object store answers 404 for any path: not a
    # missing bucket (which pointed at the data set URL, not the endpoint).
    with web_server_answering_404() as web:
        err = start_fails(tmp_path, "--dataset", f"ds={url}", "--s3-endpoint", web)
    assert "does not answer like an S3 object store" in err and "<html>" in err, err
    assert "does not exist" not in err, err


@contextlib.contextmanager
def web_server(answer):
    """A plain HTTP server answering each GET (and HEAD) of a path, query
    included, with ``answer(path, headers)``: ``(status, content type,
    body)``; yields its URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, kind, body = answer(self.path, self.headers)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def web_server_answering_404():
    """A web server whose every answer is a 404 page (no object store)."""
    return web_server(lambda _path, _headers: (404, "text/html", b"<html><body>404 Not Found</body></html>"))


def object_store_of(objects: dict, page: int = 1000, paging: str = "v2", seen: Optional[list] = None):
    """A minimal S3 store's listings (no checks of signatures, no ranged
    reads) of bucket ``BUCKET`` holding ``objects`` (key: bytes), keys
    ending in ``/`` (folder markers, which a console makes and ``s3s-fs``
    cannot hold) included, ``page`` keys a page. ``paging`` is how it
    pages: ``v2`` (continuation tokens), ``v1`` (the older ListObjects,
    as stores that ignore ``list-type=2`` answer: truncated pages with no
    token, the next asked for with ``marker``) or ``overlapping`` (each
    page after the first begins with the last key of the one before).
    Each request's headers are appended to ``seen``."""
    from urllib.parse import parse_qsl, quote, unquote, urlsplit
    from xml.sax.saxutils import escape

    def answer(path: str, headers):
        if seen is not None:
            seen.append(dict(headers))
        url = urlsplit(path)
        bucket, _, key = url.path.lstrip("/").partition("/")
        if bucket != BUCKET:
            return 404, "application/xml", b"<Error><Code>NoSuchBucket</Code></Error>"
        query = dict(parse_qsl(url.query))
        if key:
            body = objects.get(unquote(key))
            if body is None:
                return 404, "application/xml", b"<Error><Code>NoSuchKey</Code></Error>"
            return 200, "application/octet-stream", body
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter")
        entries = set()
        for name in (k for k in objects if k.startswith(prefix)):
            rest = name[len(prefix):]
            if delimiter and delimiter in rest:
                entries.add((prefix + rest[:rest.index(delimiter) + 1], True))
            else:
                entries.add((name, False))
        entries = sorted(entries)
        after = query.get("marker" if paging == "v1" else "start-after", "")
        start = int(query.get("continuation-token", "0"))
        if paging == "v1":
            start = sum(1 for name, _ in entries if name <= after)
        elif paging == "overlapping" and start:
            start -= 1
        else:
            start = max(start, sum(1 for name, _ in entries if name <= after))
        chunk, rest = entries[start:start + page], entries[start + page:]
        contents = "".join(
            f"<Contents><Key>{escape(name)}</Key><Size>{len(objects[name])}</Size>"
            f"<ETag>&quot;{len(objects[name])}-{quote(name, safe='')}&quot;</ETag></Contents>"
            for name, common in chunk if not common)
        common = "".join(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>"
                         for name, common in chunk if common)
        next_page = ""
        if rest and paging != "v1":
            next_page = f"<NextContinuationToken>{start + page + (paging == 'overlapping')}</NextContinuationToken>"
        xml = (f"<ListBucketResult><Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix>"
               f"<IsTruncated>{'true' if rest else 'false'}</IsTruncated>{next_page}{contents}{common}"
               "</ListBucketResult>")
        return 200, "application/xml", xml.encode()

    return web_server(answer)


@pytest.mark.parametrize("paging", ["v2", "v1", "overlapping"])
def test_every_key_is_listed_once_however_the_store_pages(stage_factory, credentials, paging):
    """2,500 keys in pages of 100: a store that answers in the older
    ListObjects style (truncated pages without a continuation token) is
    asked on from its last key, not taken as done after its first page;
    one whose pages overlap lists no key twice."""
    objects = {f"{PREFIX}/{i % 7}/k{i:05d}.bin": b"x" * (i % 5) for i in range(2500)}
    with object_store_of(objects, page=100, paging=paging) as endpoint:
        stage = s3_stage(stage_factory, endpoint)
        with sluice.Client(stage.socket, job="pages") as c:
            names = c.dataset("ds").files.names()
    assert names == sorted(k[len(PREFIX) + 1:] for k in objects), (len(names), len(set(names)))


def test_an_endpoint_from_the_environment_is_addressed_path_style(s3, monkeypatch, stage_factory):
    server, files = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{server.address}")
    stage = stage_factory({"ds": f"s3://{BUCKET}/{PREFIX}"})
    with sluice.Client(stage.socket, job="s3") as c:
        assert c.dataset("ds").files.names() == sorted_names(files)


def test_the_s3_endpoint_variable_wins_over_the_general_one(s3, monkeypatch, stage_factory):
    """AWS_ENDPOINT_URL_S3 names the object store for S3 alone; the general
    AWS_ENDPOINT_URL (here a port nothing answers on) is for other services."""
    server, files = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{server.address}")
    stage = stage_factory({"ds": f"s3://{BUCKET}/{PREFIX}"})
    with sluice.Client(stage.socket, job="s3") as c:
        assert c.dataset("ds").files.names() == sorted_names(files)


def test_a_profile_in_the_config_file_alone_names_the_store_and_its_keys(s3, tmp_path, monkeypatch,
                                                                         stage_factory):
    """Everything in ``~/.aws/config`` (as `aws configure set` writes a
    profile's endpoint_url, and as many write keys there too): no
    credentials file, no variables."""
    server, files = s3
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    config = tmp_path / "home" / ".aws" / "config"
    config.parent.mkdir(parents=True)
    config.write_text(f"[default]\nendpoint_url = http://127.0.0.1:{free_port()}\n\n"
                      f"[profile train]\nendpoint_url = http://{server.address}\n"
                      f"aws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_PROFILE", "train")
    stage = stage_factory({"ds": f"s3://{BUCKET}/{PREFIX}"})
    with sluice.Client(stage.socket, job="s3") as c:
        assert c.dataset("ds").files.names() == sorted_names(files)
    # A bad endpoint there is named with the file it is in.
    config.write_text("[profile train]\nendpoint_url = minio:9000\n")
    err = start_fails(tmp_path, "--dataset", f"ds=s3://{BUCKET}/{PREFIX}")
    assert f"endpoint_url of profile `train` in {config} `minio:9000` is not an object store's URL" in err, err


def test_a_stage_of_local_data_sets_leaves_the_aws_settings_alone(credentials, tmp_path, monkeypatch,
                                                                   stage_factory):
    """A node's AWS_ENDPOINT_URL meant for other tools, even one the stage
    could not use, does not stop a stage that reads no object store."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not-a-url")
    data = tmp_path / "local"
    data.mkdir()
    files = make_dataset(data)
    stage = stage_factory({"ds": str(data)})
    with sluice.Client(stage.socket, job="local") as c:
        assert c.dataset("ds").files.names() == sorted_names(files)


def test_credentials_come_from_the_shared_files(s3, tmp_path, monkeypatch, stage_factory):
    server, files = s3
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = x\n\n"
                     f"[train]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "train")
    stage = s3_stage(stage_factory, f"http://{server.address}")
    with sluice.Client(stage.socket, job="s3") as c:
        assert c.dataset("ds").files.names() == sorted_names(files)


def test_a_profiles_keys_are_signed_alone_in_its_region(stage_factory, credentials, tmp_path, monkeypatch):
    """Keys in the shared file, written as the AWS tools also take them (in
    capitals), beside what a shell often has left over: a session token of
    an earlier assume-role (it belongs to other keys: signed in with the
    profile's, the store refuses them) and an empty AWS_REGION (as a
    template leaves it: the profile's region counts)."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds, config = tmp_path / "credentials", tmp_path / "config"
    creds.write_text(f"[default]\nAWS_ACCESS_KEY_ID = {ACCESS_KEY}\nAWS_SECRET_ACCESS_KEY = {SECRET_KEY}\n")
    config.write_text("[default]\nregion = eu-west-3\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SESSION_TOKEN", "stale-token-of-other-keys")
    monkeypatch.setenv("AWS_REGION", "")
    seen: list = []
    with object_store_of({f"{PREFIX}/a.bin": b"a"}, seen=seen) as endpoint:
        stage = s3_stage(stage_factory, endpoint)
        with sluice.Client(stage.socket, job="profile") as c:
            assert c.dataset("ds").files.names() == ["a.bin"]
    assert seen
    for headers in seen:
        headers = {k.lower(): v for k, v in headers.items()}
        assert "x-amz-security-token" not in headers, headers
        assert f"Credential={ACCESS_KEY}/" in headers["authorization"], headers
        assert "/eu-west-3/s3/aws4_request" in headers["authorization"], headers


class FakeMetadata:
    """An instance metadata service (IMDSv2, as on EC2) on a local port,
    giving ``role``'s credentials, or no role at all with ``role=None``;
    ``asked`` lists the paths requested."""

    TOKEN = "imds-session-token"

    def __init__(self, role: Optional[str]) -> None:
        import http.server
        import json

        fake = self
        self.asked: List[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                fake.asked.append(f"PUT {self.path}")
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self.answer(200, FakeMetadata.TOKEN)
                else:
                    self.answer(400, "bad token request")

            def do_GET(self) -> None:
                fake.asked.append(f"GET {self.path}")
                base = "/latest/meta-data/iam/security-credentials/"
                if self.headers.get("X-aws-ec2-metadata-token") != FakeMetadata.TOKEN:
                    self.answer(401, "no token")
                elif role is None or not self.path.startswith(base):
                    self.answer(404, "not found")
                elif self.path == base:
                    self.answer(200, role)
                elif self.path == base + role:
                    self.answer(200, json.dumps({
                        "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": ACCESS_KEY,
                        "SecretAccessKey": SECRET_KEY, "Token": "instance-session-token",
                        "Expiration": "2099-01-01T00:00:00Z"}))
                else:
                    self.answer(404, "not found")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_credentials_come_from_the_instance_role(s3, tmp_path, monkeypatch, stage_factory):
    """No keys and no profile: the machine's role, from its metadata
    service, as the AWS tools do (an EC2 instance profile, a node's role)."""
    server, files = s3
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    metadata = FakeMetadata("trainer-role")
    try:
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", metadata.endpoint)
        stage = s3_stage(stage_factory, f"http://{server.address}")
        with sluice.Client(stage.socket, job="s3") as c:
            assert c.dataset("ds").files.names() == sorted_names(files)
            assert {n: bytes(d) for n, d in c.dataset("ds").epoch(0, seed=1, batch=8)} == files
        assert "PUT /latest/api/token" in metadata.asked, metadata.asked
        assert "GET /latest/meta-data/iam/security-credentials/trainer-role" in metadata.asked
    finally:
        metadata.close()


def test_a_metadata_service_without_a_role_is_named_at_start(s3, tmp_path):
    server, _files = s3
    metadata = FakeMetadata(None)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["AWS_METADATA_ENDPOINT"] = metadata.endpoint
        err = start_fails(tmp_path, "--dataset", f"ds=s3://{BUCKET}/{PREFIX}", "--s3-endpoint",
                          f"http://{server.address}", env=env)
    finally:
        metadata.close()
    assert "could not get S3 credentials" in err, err
    assert f"the instance metadata service at {metadata.endpoint} gave no credentials" in err, err
    assert "give the machine a role" in err, err


def test_the_harness_stores_etags_where_the_server_reads_them(s3):
    """``store_etags`` leaves the server an uploaded object's state: a GET
    answers with the stored ETag instead of hashing the object (what made
    the benchmark's server, not the loaders, the bound)."""
    import hashlib
    import http.client

    from sluice.bench.s3 import S3Reader, store_etags

    server, files = s3
    name = next(n for n in sorted(files) if files[n])
    keys = [f"{PREFIX}/{n}" for n in files]
    assert store_etags(server.root, BUCKET, keys) == len(keys)
    reader = S3Reader(f"http://{server.address}", BUCKET, PREFIX)

    def etag(key: str) -> str:
        path = f"/{BUCKET}/{key}"
        conn = http.client.HTTPConnection(server.address, timeout=30)
        conn.request("GET", path, headers=reader._headers(path))
        response = conn.getresponse()
        response.read()
        conn.close()
        assert response.status == 200, response.status
        return response.getheader("ETag").strip('"')

    assert etag(f"{PREFIX}/{name}") == hashlib.md5(files[name]).hexdigest()
    # Same size, other bytes: a server hashing the object would answer with
    # the new digest; one reading the stored ETag answers with the old.
    Path(server.root, BUCKET, PREFIX, name).write_bytes(bytes(len(files[name])))
    assert etag(f"{PREFIX}/{name}") == hashlib.md5(files[name]).hexdigest()


def test_an_object_replaced_and_listed_again_is_read_new_through_the_mount_at_once(s3, stage_factory):
    """The kernel keeps a file's attributes and pages for 60 s: an object
    replaced (at another size) and listed again by the stage was read
    through the mount whole as the old object, or failed its open's first
    read with EIO, for up to a minute after. An open goes by the latest
    listing."""
    size = 20 * 10**6
    stage, path, old, file = mounted_object(s3, stage_factory, size)
    for _ in range(2):  # two epochs read it whole: the kernel keeps its pages
        with open(file, "rb") as f:
            assert f.read() == old
    new = os.urandom(15 * 10**6)
    path.write_bytes(new)
    with sluice.Client(stage.socket, job="lister") as c:
        wait_for(lambda: dict(c.dataset("ds").files).get("big.bin") == len(new), timeout=30,
                 what="the stage to list the new object")
    with open(file, "rb") as f:
        assert os.fstat(f.fileno()).st_size == len(new)
        assert f.read() == new


def test_an_object_deleted_and_listed_again_is_gone_through_the_mount_at_once(s3, stage_factory):
    """An object is not asked at open, so the pages the kernel keeps of it
    answered an open of it with the deleted object's bytes for up to a
    minute after the stage's listing had lost it (the socket said
    NOT_FOUND, ``ls`` no longer showed it). An open goes by the latest
    listing: ENOENT."""
    stage, path, old, file = mounted_object(s3, stage_factory, 50_000)
    for _ in range(2):  # the kernel keeps its pages
        assert file.read_bytes() == old
    path.unlink()
    with sluice.Client(stage.socket, job="lister") as c:
        wait_for(lambda: "big.bin" not in dict(c.dataset("ds").files), timeout=30,
                 what="the stage to list the data set without the object")
    with pytest.raises(FileNotFoundError):
        file.read_bytes()


def test_an_object_grown_before_the_stage_lists_it_again_is_never_read_cut_short(s3, stage_factory):
    """The kernel reads a file to the size the listing gave: an object
    replaced by a larger one before the stage listed it again read through
    the mount as the new object's first bytes, cut at the old size, with
    no error. Its read fails (EIO) until the stage lists it again; then it
    reads whole."""
    stage, path, old, file = mounted_object(s3, stage_factory, 50_000)
    assert file.stat().st_size == len(old)  # listed now
    time.sleep(1.1)  # listings and reads tell versions apart by the second here
    new = os.urandom(90_000)
    path.write_bytes(new)
    try:
        got = file.read_bytes()
    except OSError as e:
        assert e.errno == errno.EIO, e
        assert "is 90000 bytes now, not 50000" in stage.stderr_tail()
    else:
        assert got in (old, new), f"{len(got)} bytes of the new object"

    def whole():
        try:
            return file.read_bytes() == new
        except OSError:
            return False

    wait_for(whole, timeout=30, interval=0.5, what="the new object to read whole")


def mounted_object(s3, stage_factory, size: int):
    """``(stage, path, bytes, file)``: an object ``big.bin`` of ``size``
    random bytes stored at ``path``, and a stage with a mount showing it as
    ``file`` (read as job ``j``)."""
    server, _files = s3
    path = Path(server.root, BUCKET, PREFIX, "big.bin")
    old = os.urandom(size)
    path.write_bytes(old)
    mnt = Path(server.root).parent / "mnt"
    mnt.mkdir()
    stage = s3_stage(stage_factory, f"http://{server.address}", "--mount", str(mnt))
    return stage, path, old, mnt / "@j" / "ds" / "big.bin"


@pytest.mark.parametrize("size", [7, 24 * 2**20])
def test_an_object_replaced_while_it_is_read_through_the_mount_fails_the_read_not_mixes(s3, stage_factory, size):
    """A file read through the mount in ranges is read of the object its
    first range read (its ETag): the rest of an object replaced meanwhile
    is an error, never the new object's bytes after the old one's."""
    stage, path, old, file = mounted_object(s3, stage_factory, size)
    fd = os.open(file, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == old[:4096]
        path.write_bytes(os.urandom(size))
        offset = size * 5 // 6
        try:
            got = os.pread(fd, 4096, offset)
        except OSError as e:
            assert e.errno == errno.EIO
        else:
            assert got == old[offset:offset + 4096], "bytes of the new object after the old one's"
    finally:
        os.close(fd)
    if size > 2**20:
        assert "was replaced while it was read" in stage.stderr_tail()


def test_an_object_replaced_between_opens_is_never_read_as_old_pages_joined_to_new_bytes(s3, stage_factory):
    """The kernel keeps an object's pages across opens (it is not asked
    again on each one): an object replaced before the stage lists it again
    is read through the mount whole as one version, or its read fails
    (`EIO`) where the kept pages end, never the old pages followed by the
    new object's bytes; an open after that reads the new object."""
    size = 12 * 2**20
    _stage, path, old, file = mounted_object(s3, stage_factory, size)
    with open(file, "rb", buffering=0) as f:  # its first 4 MiB into the kernel's pages
        assert f.read(4 * 2**20) == old[:4 * 2**20]
    # Replaced (listings and reads tell versions apart by the second here).
    time.sleep(1.1)
    new = os.urandom(size)
    path.write_bytes(new)

    def read_whole():
        with open(file, "rb", buffering=0) as f:
            return f.read()

    try:
        got = read_whole()
    except OSError as e:
        assert e.errno == errno.EIO, e
    else:
        assert got in (old, new), "old pages joined to the new object's bytes"
    deadline = time.monotonic() + 20
    while (got := read_whole()) != new:
        assert got == old, "old pages joined to the new object's bytes"
        assert time.monotonic() < deadline, "the new object never read"
        time.sleep(0.5)


def test_an_object_store_stage_at_its_thread_limit_reads_on_the_threads_it_keeps(s3, stage_factory, tmp_path):
    """At its pod's thread limit, with its blocking threads ended, a stage
    reading an object store lists and reads by name, and through the
    mount, on the two threads it keeps for this: done on a runtime worker,
    an object's read (which waits on the runtime) cannot run at all."""
    from conftest import pids_cgroup

    server, files = s3
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    stage = s3_stage(stage_factory, f"http://{server.address}", "--mount", str(mnt))
    name = sorted_names(files)[0]
    with pids_cgroup(stage.proc.pid) as limit:
        # tokio keeps an idle blocking thread 10 s; the listing is due again after 5 s.
        time.sleep(11)
        limit(limit(None))
        with sluice.Client(stage.socket, job="late", reconnect=0, timeout=30) as c:
            assert c.dataset("ds").read(name) == files[name]
        assert (mnt / "ds" / name).read_bytes() == files[name]
    log = stage.stderr_tail(200000)
    assert "panicked" not in log, log[-3000:]
    assert "the OS refused the stage a thread" in log
