"""``python -m sluice.bench scale``: its arithmetic, and one short run
against the real controller and load generator."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import binary
from sluice.bench.scale import histogram, histogram_quantile, quantile, rss_bytes


def test_histogram_reads_cumulative_buckets_in_order():
    samples = [
        ("t_bucket", {"le": "+Inf"}, 10.0),
        ("t_bucket", {"le": "0.5"}, 4.0),
        ("t_sum", {}, 3.0),
        ("other_bucket", {"le": "0.5"}, 99.0),
        ("t_bucket", {"le": "0.1"}, 1.0),
    ]
    assert histogram(samples, "t") == [(0.1, 1.0), (0.5, 4.0), (math.inf, 10.0)]


def test_histogram_quantile_counts_only_what_was_observed_between_readings():
    before = [(0.1, 5.0), (0.5, 5.0), (1.0, 5.0), (math.inf, 5.0)]
    # 10 new observations: 1 under 0.1, 7 more under 0.5, 2 more under 1.0
    after = [(0.1, 6.0), (0.5, 13.0), (1.0, 15.0), (math.inf, 15.0)]
    assert histogram_quantile(before, after, 0.1) == 0.1
    assert histogram_quantile(before, after, 0.5) == 0.5
    assert histogram_quantile(before, after, 0.99) == 1.0
    # observed past the last finite bucket
    assert histogram_quantile(before, [(0.1, 5.0), (0.5, 5.0), (1.0, 5.0), (math.inf, 6.0)], 0.5) == math.inf
    # nothing observed
    assert histogram_quantile(before, before, 0.99) is None
    assert histogram_quantile([], [], 0.5) is None


def test_quantile_is_the_nearest_rank():
    assert quantile([5.0], 0.99) == 5.0
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert quantile(list(range(1, 101)), 0.99) == 99
    assert quantile(list(range(1, 101)), 1.0) == 100


def test_rss_bytes_reads_this_process():
    now, peak = rss_bytes(os.getpid())
    assert 0 < now <= peak


def test_a_short_run_reports_every_figure(tmp_path):
    bin_dir = str([binary(n) for n in ("sluice-controller", "sluicectl", "sluice-loadgen")][0].parent)
    done = subprocess.run(
        [sys.executable, "-m", "sluice.bench", "scale", "--bin-dir", bin_dir, "--stages", "40", "--applies", "3",
         "--window", "6", "--log-dir", str(tmp_path / "logs"), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stages"] == 40 and result["jobs"] == 7
    # every apply reached every stage
    assert result["applies"] == 3 and result["acks_missing"] == 0, result
    assert 0 < result["apply_ms_p50"] <= result["apply_ms_p99"] < 60_000
    assert 0 < result["controller_cpu_cores"] < 2.5
    assert result["controller_rss_bytes"] > 1 << 20
    assert result["tick_ms_p99"] is not None and result["tick_ms_p99"] > 0
    assert result["ticks_per_s"] > 0
    assert result["loadgen_sessions"] == 40 and result["loadgen_failures"] == 0, result
    assert "40 stages, 7 jobs: controller" in done.stdout
    assert (tmp_path / "logs" / "controller.log").exists()


@pytest.mark.parametrize("flag", ["--stages", "--jobs-per-stage"])
def test_refuses_zero_stages(tmp_path, flag):
    stages = ["--stages", "0"] if flag == "--stages" else ["--stages", "2", flag, "0"]
    done = subprocess.run([sys.executable, "-m", "sluice.bench", "scale", *stages, "--bin-dir", str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode != 0 and "--stages, --jobs-per-stage and --applies must be at least 1" in done.stderr
