"""The benchmark driver: data set reuse, eviction, and a tiny end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, stage_binary

from sluice.bench.dataset import evict, prepare


def test_dataset_is_written_once_and_reused(tmp_path):
    logs = []
    ds = prepare(str(tmp_path / "b"), 30, 1000, 200, log=logs.append)
    assert ds.files == 30 and len(ds.sizes) == 30 and ds.names == sorted(ds.names, key=str.encode)
    assert all(os.path.getsize(p) == n for p, n in zip(ds.paths(), ds.sizes))
    assert len(set(ds.sizes)) > 1 and "writing" in logs[-1]
    again = prepare(str(tmp_path / "b"), 30, 1000, 200, log=logs.append)
    assert again == ds and "reusing" in logs[-1]
    # Another shape rewrites and leaves no stray files.
    other = prepare(str(tmp_path / "b"), 10, 500, 0, log=logs.append)
    assert "writing" in logs[-1] and set(other.sizes) == {500}
    count = sum(len(f) for _, _, f in os.walk(other.root))
    assert count == 10
    evict(other.paths())  # must not raise without root


def test_prefetch_bench_runs_and_prints_one_json_object(tmp_path):
    bin_dir = str(stage_binary().parent)
    env = dict(os.environ, PYTHONPATH=str(REPO / "clients" / "python"))
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.bench", "prefetch", "--files", "64", "--size", "8KiB",
         "--size-stdev", "1KiB", "--dir", str(tmp_path / "bench"), "--batch", "8", "--compute-ms", "auto",
         "--loaders", "naive,threadpool,sluice", "--threads", "2,4", "--bin-dir", bin_dir,
         "--stage-arg=--readers=2", "--json"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    doc = json.loads(last)
    assert doc["dataset"]["files"] == 64 and doc["dataset"]["size"] == 8192
    assert doc["compute_ms"] > 0 and doc["calibration"]["loader"] == "sluice"
    loaders = [r["loader"] for r in doc["results"]]
    assert loaders == ["naive", "threadpool", "threadpool", "sluice"]
    for r in doc["results"]:
        assert r["samples"] == 64 and r["samples_per_s"] > 0 and 0 < r["au"] <= 1
        assert r["stall_s"] >= 0 and r["cpu_s"] >= 0
    assert sum(r.get("best", False) for r in doc["results"] if r["loader"] == "threadpool") == 1
    assert doc["results"][-1]["peak_rss_bytes"] > 0
    assert "samples/s" in proc.stdout  # the table
