"""Staging and cache policies end to end: a controller, a stage with a node
cache, `DatasetCache` policies applied with ``sluicectl``, ``sluicectl
stage`` and ``describe dataset``, preloading at job start, and pins."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

import sluice
from sluice.bench.common import Daemon, get_json

from conftest import REPO, in_ci, wait_for
from test_cache import MIB, metrics, write_files


def binaries() -> dict:
    bin_dir = os.environ.get("SLUICE_BIN_DIR") or str(REPO / "target" / "debug")
    found = {n: os.path.join(bin_dir, n) for n in ("sluice-controller", "sluice-stage", "sluicectl")}
    missing = [p for p in found.values() if not os.access(p, os.X_OK)]
    if missing:
        msg = f"{', '.join(missing)} not built: run `cargo build --workspace --bins` or set SLUICE_BIN_DIR"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    return found


POOL = """apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: nfs}
spec: {capacity: {bandwidth: 1GiB/s}}
"""


def cache_policy(name: str, dataset: str, **spec: str) -> str:
    fields = "".join(f"  {k}: {v}\n" for k, v in spec.items())
    return (f"---\napiVersion: sluice.dev/v1\nkind: DatasetCache\nmetadata: {{name: {name}}}\n"
            f"spec:\n  dataset: {dataset}\n{fields}")


class System:
    """A controller (SQLite, 200 ms tick) and one stage with a cache."""

    def __init__(self, tmp_path, datasets: dict, cache: int):
        self.bin = binaries()
        self.tmp = tmp_path
        self.daemons = []
        self.controller = self._start([
            self.bin["sluice-controller"], "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
            "--tick", "200ms", "--database-url", f"sqlite://{tmp_path}/sluice.db"], "controller")
        self.grpc, self.http = self.controller.ready["grpc"], self.controller.ready["http"]
        self.socket = str(tmp_path / "stage.sock")
        argv = [self.bin["sluice-stage"], "--socket", self.socket, "--metrics-addr", "127.0.0.1:0",
                "--stage-id", "stage-a", "--controller", f"http://{self.grpc}",
                "--memory-budget", str(cache + 64 * MIB), "--cache-memory", str(cache)]
        for name, root in datasets.items():
            argv += ["--dataset", f"{name}={root}"]
        self.stage = self._start(argv, "stage")
        self.metrics = self.stage.ready["metrics"]
        wait_for(lambda: any(s["id"] == "stage-a" for s in get_json(self.http, "/api/v1/stages")),
                 what="the stage to connect")

    def _start(self, argv, name):
        d = Daemon.start(argv, str(self.tmp / f"{name}.log"))
        self.daemons.append(d)
        return d

    def ctl(self, *args, check=True, timeout=60) -> subprocess.CompletedProcess:
        run = subprocess.run([self.bin["sluicectl"], "--server", f"http://{self.grpc}", *args],
                             capture_output=True, text=True, timeout=timeout)
        if check:
            assert run.returncode == 0, f"sluicectl {' '.join(args)}: {run.stdout}{run.stderr}"
        return run

    def apply(self, text: str) -> None:
        path = self.tmp / "policies.yaml"
        path.write_text(text)
        self.ctl("apply", "-f", str(path))

    def source_reads(self, dataset: str) -> int:
        return metrics(self, "sluice_stage_storage_reads_total", dataset=dataset)

    def cache(self, dataset: str) -> dict:
        report = get_json(self.metrics, "/api/v1/cache")
        return next(d for d in report["datasets"] if d["dataset"] == dataset)

    def stop(self) -> None:
        for d in reversed(self.daemons):
            assert d.stop() == 0, f"{d.log_path}: {open(d.log_path).read()[-2000:]}"


@pytest.fixture
def system(tmp_path):
    started = []

    def start(datasets, cache):
        s = System(tmp_path, datasets, cache)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def read_epoch(system: System, dataset: str, job: str, epoch: int) -> dict:
    with sluice.Client(system.socket, job=job) as c:
        with c.dataset(dataset).epoch(epoch, seed=3, batch=8) as it:
            return dict(it)


def test_sluicectl_stage_loads_a_data_set_so_no_epoch_reads_the_source(tmp_path, system):
    files = write_files(tmp_path / "ds", 40, 50_000)
    s = system({"ds": tmp_path / "ds"}, 8 * MIB)
    s.apply(POOL + cache_policy("ds-cache", "ds", staging="{pool: nfs, rate: 20MiB/s}"))
    staged = s.ctl("stage", "ds", "--timeout", "60")
    assert "staging round" in staged.stdout and "stage-a: round" in staged.stdout, staged.stdout
    assert ": done, 40/40 samples, 1.91 MiB read from the source" in staged.stdout, staged.stdout
    assert s.source_reads("ds") == 40
    assert s.cache("ds")["entries"] == 40
    # The staging job drew from the pool, under the DatasetCache's policy.
    jobs = {j["id"]: j for j in get_json(s.http, "/api/v1/jobs")}
    assert jobs["staging:ds"]["labels"] == {"sluice.dev/staging": "ds"}
    assert jobs["staging:ds"]["policy"] == "ds-cache" and jobs["staging:ds"]["pool"] == "nfs", jobs["staging:ds"]
    for epoch in range(2):
        assert read_epoch(s, "ds", "train", epoch) == files
    assert s.source_reads("ds") == 40, "every epoch came from the cache"
    def described_with_hits():
        # The hits reach the controller with the stage's next telemetry.
        out = s.ctl("describe", "dataset", "ds").stdout
        return out if "Hits:      80" in out else None

    described = wait_for(described_with_hits, timeout=10, what="the epochs' hits described")
    for line in ("Dataset:", "ds-cache", "stage-a (connected)", "Samples:", "40",
                 "Hits:", "80 (66.7% of lookups", "round", "done, 40/40 samples"):
        assert line in described, described
    listed = s.ctl("get", "datasets").stdout.splitlines()
    assert listed[0].split() == ["NAME", "POLICY", "STAGES", "CACHED", "SAMPLES", "HITS", "STAGING"], listed
    assert listed[1].split()[:3] == ["ds", "ds-cache", "1"] and " 40 " in listed[1], listed
    assert listed[1].endswith(" done"), listed
    # Staging again finds everything cached and reads nothing.
    again = s.ctl("stage", "ds", "--timeout", "60").stdout
    assert "done, 40/40 samples, 0 B read from the source" in again, again
    assert s.source_reads("ds") == 40


def test_staging_is_held_to_its_rate_and_its_progress_moves_as_it_goes(tmp_path, system):
    write_files(tmp_path / "ds", 30, 100_000)  # 3 MB at 1 MiB/s: about 3 s
    s = system({"ds": tmp_path / "ds"}, 8 * MIB)
    s.apply(POOL + cache_policy("ds-cache", "ds", staging="{pool: nfs, rate: 1MiB/s}"))
    started = time.monotonic()
    staging = subprocess.Popen([s.bin["sluicectl"], "--server", f"http://{s.grpc}", "stage", "ds",
                                "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()
    while staging.poll() is None:
        seen.add(metrics(s, "sluice_stage_cache_staging_samples", dataset="ds", state="done"))
        time.sleep(0.2)
    took = time.monotonic() - started
    out, err = staging.communicate()
    assert staging.returncode == 0, out + err
    assert took >= 2.3, f"3 MB staged in {took:.2f} s: faster than 1 MiB/s"
    assert s.cache("ds")["entries"] == 30
    assert len(seen - {0, 30}) >= 2, f"progress seen while staging: {sorted(seen)}"


def test_a_staging_round_or_a_capped_job_holds_back_no_other_job_reading_the_same_samples(tmp_path, system):
    """A read another job has under way is waited for, not read again; but
    a job (or a staging round) waiting for its own rate limit must not make
    others wait out that limit: it claims a read only once it may make it."""
    files = write_files(tmp_path / "ds", 40, 100_000)  # 4 MB: 4 s at 1 MiB/s
    capped_files = write_files(tmp_path / "capped", 40, 100_000, tag=b"c")
    s = system({"ds": tmp_path / "ds", "capped": tmp_path / "capped"}, 16 * MIB)
    s.apply(POOL + cache_policy("ds-cache", "ds", staging="{pool: nfs, rate: 1MiB/s}") + """---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: slow}
spec: {selector: {matchLabels: {tier: slow}}, pool: nfs, limit: {bandwidth: 1MiB/s}}
""")

    def read_alone(dataset: str, job: str) -> float:
        started = time.monotonic()
        assert read_epoch(s, dataset, job, 0) == (files if dataset == "ds" else capped_files)
        return time.monotonic() - started

    staging = subprocess.Popen([s.bin["sluicectl"], "--server", f"http://{s.grpc}", "stage", "ds",
                                "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: metrics(s, "sluice_stage_cache_staging_samples", dataset="ds", state="done") > 0,
             what="staging to start")
    took = read_alone("ds", "train")
    assert staging.poll() is None, "the staging round ended before the trainer: it must outlast it"
    assert took < 2.0, f"the trainer took {took:.1f} s for 4 MB: held to the staging round's 1 MiB/s"
    out, err = staging.communicate(timeout=60)
    assert staging.returncode == 0 and "done, 40/40 samples" in out, out + err

    # The same with a job capped by its policy reading the same samples.
    capped_done = []

    def capped():
        with sluice.Client(s.socket, job="slow", labels={"tier": "slow"}) as c:
            with c.dataset("capped").epoch(0, seed=3, batch=8) as it:
                capped_done.append(dict(it) == capped_files)

    t = threading.Thread(target=capped)
    t.start()
    wait_for(lambda: metrics(s, "sluice_stage_storage_reads_total", dataset="capped") > 0,
             what="the capped job to read")
    took = read_alone("capped", "fast")
    assert t.is_alive(), "the capped job ended before the other: it must outlast it"
    assert took < 2.0, f"the uncapped job took {took:.1f} s for 4 MB: held to the capped job's 1 MiB/s"
    t.join(60)
    assert capped_done == [True]


def test_deleting_the_data_sets_cache_policy_stops_its_staging(tmp_path, system):
    """Deleting the DatasetCache is how an operator stops staging that
    hurts: the round stops (it went on uncapped before), and a waiting
    ``sluicectl stage`` says so and fails."""
    write_files(tmp_path / "ds", 60, 100_000)  # 6 MB at 1 MiB/s: about 6 s
    s = system({"ds": tmp_path / "ds"}, 16 * MIB)
    s.apply(POOL + cache_policy("ds-cache", "ds", staging="{pool: nfs, rate: 1MiB/s}"))
    waiting = subprocess.Popen([s.bin["sluicectl"], "--server", f"http://{s.grpc}", "stage", "ds",
                                "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: s.source_reads("ds") >= 5, what="staging to read")
        s.ctl("delete", "datasetcache", "ds-cache")
        out, err = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert waiting.returncode == 1, out + err
    assert "stopped" in out and "its DatasetCache was deleted" in out, out + err
    # Reads already past the plan when it stopped end at the staging rate.
    time.sleep(3)
    stopped_at = s.source_reads("ds")
    time.sleep(1.5)
    assert s.source_reads("ds") == stopped_at < 60, "staging read on after it stopped"


def test_staging_refusals_say_what_to_fix(tmp_path, system):
    write_files(tmp_path / "ds", 4, 1_000)
    s = system({"ds": tmp_path / "ds"}, 8 * MIB)
    none = s.ctl("stage", "ds", check=False)
    assert none.returncode == 1 and "no DatasetCache policy names data set `ds`" in none.stderr, none.stderr
    s.apply(POOL + cache_policy("ds-cache", "ds"))
    unstaged = s.ctl("stage", "ds", check=False)
    assert unstaged.returncode == 1 and "has no `spec.staging`" in unstaged.stderr, unstaged.stderr
    s.apply(POOL + cache_policy("other", "elsewhere", staging="{pool: nfs}"))
    nobody = s.ctl("stage", "elsewhere", check=False)
    assert nobody.returncode == 1 and "no connected stage serves data set `elsewhere`" in nobody.stderr
    # Every data set a stage serves or a policy names is listed, alike
    # by sluicectl and the REST view.
    listed = json.loads(s.ctl("get", "datasets", "-o", "json").stdout)
    assert [(d["name"], d["policy"], len(d["stages"])) for d in listed] == [
        ("ds", "ds-cache", 1), ("elsewhere", "other", 0)], listed
    assert listed[0]["stages"][0]["stage"] == "stage-a"
    assert get_json(s.http, "/api/v1/datasets") == listed
    missing = s.ctl("describe", "dataset", "nothing", check=False)
    assert missing.returncode == 1 and "no stage serves data set `nothing`" in missing.stderr


def test_preload_stages_a_data_set_once_a_job_reads_there(tmp_path, system):
    files = write_files(tmp_path / "ds", 40, 20_000)
    s = system({"ds": tmp_path / "ds"}, 8 * MIB)
    s.apply(POOL + cache_policy("ds-cache", "ds", preload="job-start", staging="{pool: nfs}"))
    time.sleep(1)
    assert s.source_reads("ds") == 0, "nothing is preloaded before a job reads"
    with sluice.Client(s.socket, job="train") as c:
        with c.dataset("ds").epoch(0, seed=3, batch=8) as it:
            name, data = next(iter(it))
            assert data == files[name]
            wait_for(lambda: s.cache("ds")["entries"] == 40, timeout=30, what="the data set to be preloaded")
    assert s.source_reads("ds") == 40, "each sample was read once, by the trainer's plan or by staging"
    # Operators see the preload, though no one asked for a round.
    def preload_listed():
        out = s.ctl("get", "datasets").stdout
        return out if "preload done" in out else None

    wait_for(preload_listed, timeout=10, what="the preload listed")
    described = s.ctl("describe", "dataset", "ds").stdout
    assert "Staging asked: never (preloaded as a job reads it)" in described, described
    assert read_epoch(s, "ds", "train", 0) == files
    assert s.source_reads("ds") == 40


def test_a_pinned_data_set_stays_while_another_is_read(tmp_path, system):
    pinned = write_files(tmp_path / "pinned", 30, 100_000, tag=b"p")
    write_files(tmp_path / "other", 60, 100_000, tag=b"o")
    # 4 MiB of cache: the pinned 3 MB fits, the other 6 MB does not.
    s = system({"pinned": tmp_path / "pinned", "other": tmp_path / "other"}, 4 * MIB)
    s.apply(POOL + cache_policy("pinned", "pinned", pin="all", staging="{pool: nfs}"))
    s.ctl("stage", "pinned", "--timeout", "60")
    assert s.cache("pinned")["entries"] == 30
    for epoch in range(2):
        read_epoch(s, "other", "other-job", epoch)
    assert s.cache("pinned")["entries"] == 30, "the pin kept every pinned sample"
    assert s.cache("other")["entries"] > 0, "the rest of the cache went to the other data set"
    before = s.source_reads("pinned")
    assert read_epoch(s, "pinned", "train", 0) == pinned
    assert s.source_reads("pinned") == before


def test_a_job_name_taken_again_under_other_labels_reads_under_their_policy_from_its_first_byte(tmp_path, system):
    """A job ended, and a new one took its name a moment later (the stage
    keeps an idle job a minute) under other labels: it read its first
    burst under the old job's settings (a 3 MiB epoch capped at 1 MiB/s
    took 0.01 s) until the next telemetry round. It is held as a new job
    is, until the settings for its labels come."""
    write_files(tmp_path / "a", 48, 64 * 1024)
    write_files(tmp_path / "b", 48, 64 * 1024)
    s = system({"a": tmp_path / "a", "b": tmp_path / "b"}, 8 * MIB)
    policy = ("---\napiVersion: sluice.dev/v1\nkind: JobPolicy\nmetadata: {{name: {tier}}}\n"
              "spec: {{selector: {{matchLabels: {{tier: {tier}}}}}, pool: nfs, limit: {{bandwidth: {limit}}}}}\n")
    s.apply(POOL + policy.format(tier="capped", limit="1MiB/s") + policy.format(tier="fast", limit="500MiB/s"))

    def epoch(dataset: str, tier: str, run: int) -> float:
        began = time.monotonic()
        with sluice.Client(s.socket, job="reused", labels={"tier": tier}, run=run) as c:
            assert sum(len(data) for _, data in c.dataset(dataset).epoch(0, seed=1)) == 48 * 64 * 1024
        return time.monotonic() - began

    assert epoch("a", "fast", 1) < 2
    time.sleep(1)
    took = epoch("b", "capped", 2)
    # 3 MiB at 1 MiB/s, less the limiter's burst.
    assert took > 1.5, f"the capped job read 3 MiB in {took:.2f} s"
    jobs = {j["id"]: j for j in get_json(s.http, "/api/v1/jobs")}
    assert jobs["reused"]["labels"] == {"tier": "capped"}, jobs["reused"]
