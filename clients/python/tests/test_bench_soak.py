"""``python -m sluice.bench soak``: its memory verdict, its data set, and a
short run with faults against the real binaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

from conftest import binary
from sluice.bench.soak import flatness, make_dataset

MiB = 2**20


def test_flatness_compares_mature_samples_of_the_first_and_last_quarter():
    duration = 400.0
    samples = []
    for t in range(0, 400, 10):
        samples.append((float(t), "stage", float(t), (100 if t < 300 else 105) * MiB))
        samples.append((float(t), "leaky", float(t), (100 + t) * MiB))
        # a process that ends smaller did not leak
        samples.append((float(t), "shrinking", float(t), (100 if t < 200 else 60) * MiB))
        # restarted at t=200: its quarters are two processes, so no verdict;
        # its young samples are left out of the peaks
        age = t if t < 200 else t - 200
        samples.append((float(t), "restarted", float(age), (100 if t < 200 else 130 + (age < 60) * 500) * MiB))
    verdict = flatness(samples, duration)
    assert verdict["stage"] == {"first_mib": 100.0, "last_mib": 105.0, "change_pct": 5.0, "flat": True}
    assert verdict["leaky"]["flat"] is False and verdict["leaky"]["change_pct"] > 10
    assert verdict["shrinking"]["flat"] is True and verdict["shrinking"]["change_pct"] == -40.0
    assert verdict["restarted"]["flat"] is None
    assert verdict["restarted"]["restarted"] == 1
    assert verdict["restarted"]["peak_mib_range"] == [100.0, 130.0]
    # no mature sample in the first quarter: no verdict rather than a guess
    assert flatness([(350.0, "x", 100.0, MiB)], duration)["x"]["flat"] is None


def test_make_dataset_returns_each_sample_checksum(tmp_path):
    crcs = make_dataset(str(tmp_path), 20, 1024, seed=3)
    assert len(crcs) == 20
    for name, crc in crcs.items():
        data = (tmp_path / name).read_bytes()
        assert 256 <= len(data) <= 1024 and zlib.crc32(data) == crc
    assert make_dataset(str(tmp_path / "again"), 20, 1024, seed=3) == crcs


def test_a_short_soak_loses_nothing_across_faults(tmp_path):
    bin_dir = str([binary(n) for n in ("sluice-controller", "sluice-stage", "sluicectl")][0].parent)
    done = subprocess.run(
        [sys.executable, "-m", "sluice.bench", "soak", "--bin-dir", bin_dir, "--minutes", "0.75",
         "--fault-every", "8", "--files", "200", "--size", "4096", "--dir", str(tmp_path / "run"), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["epochs"] > 0 and result["samples"] >= 200 * result["epochs"] // 2, result
    assert (result["lost"], result["duplicated"], result["corrupt"]) == (0, 0, 0), result
    assert sum(result["faults"].values()) >= 2, result
    assert result["fault_errors"] == [] and result["unexplained_errors"] == 0, result
    assert result["settled_at_end"], result
    # 45 s is too short for a memory verdict: none is claimed
    assert all(m["flat"] is None for m in result["memory"].values() if m["first_mib"] is None)
    assert "epochs" in done.stdout and "trainer errors" in done.stdout
    assert done.returncode == 0, "nothing went wrong, and memory was not judged"

