"""The node cache end to end: a stage with ``--cache-memory`` serving later
epochs and other jobs from memory, never stale, never charging the
limiter for a hit."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

import sluice
from sluice.errors import NotFoundError, SluiceError
from sluice.bench.common import metric_value, parse_prometheus

from conftest import http_get, replace_file, stage_binary, wait_for

MIB = 2**20


def write_files(root, n: int, size: int, tag: bytes = b"") -> dict:
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for i in range(n):
        data = (tag + f"{i:05d}".encode()) * (size // (len(tag) + 5)) + b"x" * (size % (len(tag) + 5))
        (root / f"s{i:05d}.bin").write_bytes(data)
        files[f"s{i:05d}.bin"] = data
    return files


def metrics(stage, name: str, **labels) -> int:
    return int(metric_value(parse_prometheus(http_get(stage.metrics, "/metrics")), name, **labels) or 0)


def source_reads(stage) -> int:
    return metrics(stage, "sluice_stage_storage_reads_total", dataset="ds")


def read_epoch(stage, job: str, epoch: int, seed: int = 1, **client) -> dict:
    with sluice.Client(stage.socket, job=job, **client) as c:
        with c.dataset("ds").epoch(epoch, seed=seed, batch=8) as it:
            return dict(it)


def cache_args(cache: int, *more: str) -> tuple:
    return ("--memory-budget", str(cache + 64 * MIB), "--cache-memory", str(cache), *more)


def test_a_cached_data_set_is_not_read_again(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 40, 10_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(4 * MIB))
    assert read_epoch(stage, "a", 0) == files
    assert source_reads(stage) == 40
    assert read_epoch(stage, "a", 1) == files
    assert source_reads(stage) == 40, "the second epoch came from the cache"
    assert metrics(stage, "sluice_stage_cache_hits_total", dataset="ds") == 40
    assert metrics(stage, "sluice_stage_cache_bytes", dataset="ds") == 400_000
    assert metrics(stage, "sluice_stage_cache_entries", dataset="ds") == 40
    # A READ of a cached sample's range comes from the cache too.
    with sluice.Client(stage.socket, job="a") as c:
        assert c.dataset("ds").read("s00003.bin", offset=5, length=100) == files["s00003.bin"][5:105]
    assert source_reads(stage) == 40


def test_a_changed_sample_is_never_served_stale(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 10, 5_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(4 * MIB))
    assert read_epoch(stage, "a", 0) == files
    changed = tmp_path / "ds" / "s00004.bin"
    changed.write_bytes(b"new contents")
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    files["s00004.bin"] = b"new contents"

    def relisted():
        # The stage lists again once its listing is a few seconds old.
        got = read_epoch(stage, "a", 99)
        return got == files

    wait_for(relisted, timeout=15, interval=0.5, what="the changed sample after the listing expired")
    assert source_reads(stage) >= 11


def test_files_replaced_between_epochs_are_read_new_at_once_not_from_the_cache(tmp_path, stage_factory):
    """Every file replaced (renamed over, same size or smaller) right
    after an epoch, before the stage lists the data set again: the next
    epoch, and reads by name, get the new files, as without a cache (they
    got the cached old ones, epoch after epoch, while each began within
    the listing interval of the last listing), and the cache keeps the new
    ones."""
    root = tmp_path / "ds"
    files = write_files(root, 12, 5_000)
    stage = stage_factory({"ds": str(root)}, *cache_args(4 * MIB))
    assert read_epoch(stage, "a", 0) == files
    for epoch in (1, 2):
        for i, name in enumerate(sorted(files)):
            files[name] = os.urandom(5_000 if i % 2 else 4_000)
            replace_file(root, name, files[name])
        assert read_epoch(stage, "a", epoch) == files, f"epoch {epoch}"
        with sluice.Client(stage.socket, job="a") as c:
            assert c.dataset("ds").read("s00003.bin") == files["s00003.bin"]
    # A file replaced is a miss (it was counted as neither a hit nor a
    # miss, so the hit ratio read 100% while half an epoch came from
    # storage), read from its source and kept under its new version.
    misses = metrics(stage, "sluice_stage_cache_misses_total", dataset="ds")
    assert misses == source_reads(stage) == 36
    assert read_epoch(stage, "a", 3) == files
    assert source_reads(stage) == 36, "the replaced files' new versions were not kept"


def test_a_connection_opened_before_a_change_gets_the_new_bytes_as_without_a_cache(tmp_path, stage_factory):
    """A trainer keeps one connection for its whole run: a sample written
    again in place (same size) or deleted since its connection listed the
    data set is read as it is now, as a stage without a cache reads it,
    not answered with the bytes cached under its old version."""
    files = write_files(tmp_path / "ds", 10, 5_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(4 * MIB))
    with sluice.Client(stage.socket, job="long") as c:
        ds = c.dataset("ds")
        with ds.epoch(0, seed=1, batch=8) as it:
            assert dict(it) == files
        changed = tmp_path / "ds" / "s00004.bin"
        new = b"N" * len(files["s00004.bin"])
        changed.write_bytes(new)
        st = changed.stat()
        os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        (tmp_path / "ds" / "s00007.bin").unlink()

        def current():
            try:
                ds.read("s00007.bin")
                return False
            except NotFoundError:
                return ds.read("s00004.bin") == new

        # Seen once the stage has listed again (its listing a few seconds old).
        wait_for(current, timeout=15, interval=0.5, what="READ to see the change")
        got, errors = {}, set()
        with ds.epoch(1, seed=1, batch=8, on_error="yield") as it:
            for name, data in it:
                if isinstance(data, SluiceError):
                    errors.add(name)
                else:
                    got[name] = bytes(data)
        assert got["s00004.bin"] == new, "the plan's sample came from the cache's old version"
        assert errors == {"s00007.bin"}, errors


def test_a_full_cache_keeps_a_stable_subset(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 100, 10_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(300_000))
    read_epoch(stage, "a", 0)
    kept = metrics(stage, "sluice_stage_cache_entries", dataset="ds")
    assert 25 <= kept <= 30, kept
    for epoch in (1, 2, 3):
        hits = metrics(stage, "sluice_stage_cache_hits_total", dataset="ds")
        assert read_epoch(stage, "a", epoch) == files
        assert metrics(stage, "sluice_stage_cache_hits_total", dataset="ds") - hits == kept, \
            f"epoch {epoch}: every kept sample hits, and only those"
    assert metrics(stage, "sluice_stage_cache_entries", dataset="ds") == kept
    assert metrics(stage, "sluice_stage_cache_evictions_total", dataset="ds") == 0


def test_lru_is_there_to_compare(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 100, 10_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(300_000, "--cache-policy", "lru"))
    for epoch in range(3):
        assert read_epoch(stage, "a", epoch) == files
    assert metrics(stage, "sluice_stage_cache_evictions_total", dataset="ds") > 0


def test_two_jobs_read_each_sample_from_the_source_once(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 200, 20_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(16 * MIB))
    got = {}

    def job(name: str, seed: int) -> None:
        got[name] = read_epoch(stage, name, 0, seed=seed)

    # The same order: both jobs want every sample at the same moment, so
    # one waits on the other's read rather than reading it again.
    threads = [threading.Thread(target=job, args=(f"job-{i}", 7)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got["job-0"] == files and got["job-1"] == files
    assert source_reads(stage) == 200


def test_hits_cost_the_limiter_nothing(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 30, 1_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(4 * MIB), "--ops-limit", "30")
    assert read_epoch(stage, "a", 0) == files
    throttled = metrics(stage, "sluice_stage_throttled_seconds_total", job="a")
    assert read_epoch(stage, "a", 1) == files
    assert metrics(stage, "sluice_stage_throttled_seconds_total", job="a") == throttled


def test_hits_outside_a_plan_are_reported_as_hits_not_as_storage_demand(tmp_path, stage_factory):
    """READ and FETCH answered by the cache count as cache hits in the
    job's telemetry (the controller's demand estimate leaves them out); they
    counted as delivered from storage, so a job reading cached samples by
    name took a share of the pool it never used."""
    files = write_files(tmp_path / "ds", 10, 10_000)
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(4 * MIB))

    def job() -> dict:
        jobs = json.loads(http_get(stage.metrics, "/api/v1/jobs"))
        return next(j for j in jobs if j["job"] == "byname")

    with sluice.Client(stage.socket, job="byname") as c:
        ds = c.dataset("ds")
        for name in files:  # from storage, into the cache
            assert ds.read(name) == files[name]
        assert job()["cache_hit_bytes"] == 0
        for name in files:
            assert ds.read(name, offset=10, length=100) == files[name][10:110]
        assert job()["cache_hit_bytes"] == 10 * 100
        assert [(n, bytes(d)) for n, d in ds.fetch(sorted(files))] == sorted(files.items())
        assert job()["cache_hit_bytes"] == 10 * 100 + 10 * 10_000
    assert source_reads(stage) == 10


@pytest.mark.parametrize("args,says", [
    (("--memory-budget", "64MiB", "--cache-memory", "60MiB"), "leaves the prefetch buffers less than 16MiB"),
    (("--cache-memory", "1GiB", "--cache-policy", "fifo"), "unknown cache policy `fifo`"),
    (("--cache-dir", "/tmp/x"), "--cache-dir needs --cache-disk"),
    (("--cache-disk", "1GiB"), "--cache-disk needs --cache-dir"),
    (("--cache-dir", "/proc/no/such", "--cache-disk", "1GiB"), "opening the cache's disk tier in /proc/no/such"),
    (("--cache-dir", "/tmp/x", "--cache-disk", "200"), "--cache-disk of 200B holds next to no sample: give at "
     "least 64KiB (a size written with no unit, as `200`, is in bytes: write `200GiB` for that many GiB)"),
    (("--cache-memory", "1000"), "--cache-memory of 1kB holds next to no sample"),
])
def test_bad_cache_settings_are_refused(tmp_path, args, says):
    (tmp_path / "ds").mkdir()
    run = subprocess.run([str(stage_binary()), "--metrics-addr", "127.0.0.1:0",
                          "--dataset", f"ds={tmp_path / 'ds'}", "--socket",
                          str(tmp_path / "s.sock"), *args], capture_output=True, text=True, timeout=30)
    assert run.returncode == 64 and says in run.stderr, (run.returncode, run.stderr)


def test_the_cache_api_shows_capacity_and_use(tmp_path, stage_factory):
    write_files(tmp_path / "ds", 10, 1_000)
    config = tmp_path / "stage.yaml"
    config.write_text("cache:\n  weights: {ds: 3}\n")
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(4 * MIB), "--config", str(config))
    read_epoch(stage, "a", 0)
    report = json.loads(http_get(stage.metrics, "/api/v1/cache"))
    assert report == {"capacity_bytes": 4 * MIB, "used_bytes": 10_000, "policy": "stable",
                      "disk_capacity_bytes": 0, "disk_used_bytes": 0,
                      "datasets": [{"dataset": "ds", "bytes": 10_000, "entries": 10, "weight": 3,
                                    "tenant": "", "tenant_weight": 1, "pin_bytes": 0, "pin_all": False,
                                    "share_bytes": 4 * MIB, "hits": 0, "misses": 10,
                                    "hit_bytes": 0, "evictions": 0,
                                    "disk_bytes": 0, "disk_entries": 0}]}
    # Without a cache the answer is null.
    bare = stage_factory({"ds": str(tmp_path / "ds")})
    assert json.loads(http_get(bare.metrics, "/api/v1/cache")) is None


def test_the_disk_tier_keeps_samples_across_a_restart(tmp_path, stage_factory):
    files = write_files(tmp_path / "ds", 40, 10_000)
    disk = ("--cache-dir", str(tmp_path / "cache"), "--cache-disk", "10MiB")
    # 100 kB of memory: ten samples; the other thirty go to disk.
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(100_000, *disk))
    assert read_epoch(stage, "a", 0) == files

    def report():
        return json.loads(http_get(stage.metrics, "/api/v1/cache"))

    # A file takes whole 4 KiB blocks on disk, its header (the source and
    # the name) included: three for each 10,000-byte sample.
    on_disk = 30 * 3 * 4096
    wait_for(lambda: report()["disk_used_bytes"] == on_disk, what="30 samples on disk")
    assert report()["datasets"][0]["entries"] == 10
    stage.stop()
    stage = stage_factory({"ds": str(tmp_path / "ds")}, *cache_args(100_000, *disk))
    assert report()["disk_used_bytes"] == on_disk, "the new stage indexed the old files"
    # Held, not written: the tier's write rate shows no burst at a restart.
    assert metrics(stage, "sluice_stage_cache_entries", dataset="ds", tier="disk") == 30
    assert metrics(stage, "sluice_stage_cache_admitted_bytes_total", dataset="ds", tier="disk") == 0
    assert read_epoch(stage, "a", 1) == files
    assert source_reads(stage) == 10, "only what was in the old stage's memory is read again"
    assert metrics(stage, "sluice_stage_cache_hits_total", dataset="ds", tier="disk") == 30
    assert "has room for" not in stage.stderr_tail()


def test_a_disk_tier_larger_than_its_file_system_is_warned_about_at_start(tmp_path, stage_factory):
    write_files(tmp_path / "ds", 2, 100)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    stage = stage_factory({"ds": str(tmp_path / "ds")}, "--cache-dir", str(tmp_path / "cache"),
                          "--cache-disk", str(free + 2**40))
    tail = stage.stderr_tail()
    assert "is more than the file system of --cache-dir" in tail and "has room for" in tail, tail
