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


def test_a_directory_holding_other_files_is_refused_and_left_alone(tmp_path):
    """--dir naming a user's own data set: the benchmark would replace and
    remove its files, so it refuses, and the files stay."""
    import pytest
    from sluice.bench.dataset import DatasetError
    mine = tmp_path / "mine"
    (mine / "data" / "images").mkdir(parents=True)
    (mine / "data" / "images" / "cat.jpg").write_bytes(b"precious")
    with pytest.raises(DatasetError, match="did not write"):
        prepare(str(mine), 5, 100, log=lambda _: None)
    assert (mine / "data" / "images" / "cat.jpg").read_bytes() == b"precious"
    assert sorted(os.listdir(mine)) == ["data"]
    with pytest.raises(DatasetError, match="not a directory"):
        prepare(str(mine / "data" / "images" / "cat.jpg"), 5, 100, log=lambda _: None)
    # A benchmark's own directory, interrupted before its manifest, is
    # still its own: written again.
    ours = tmp_path / "ours"
    prepare(str(ours), 5, 100, log=lambda _: None)
    os.remove(ours / "manifest.json")
    assert prepare(str(ours), 6, 100, log=lambda _: None).files == 6


def test_the_cache_optimum_counts_whole_samples():
    from sluice.bench.cache import _optimum_hit_ratio
    assert _optimum_hit_ratio([4096], 2048) == 0
    assert _optimum_hit_ratio([4096] * 3, 6144) == 1 / 3
    assert _optimum_hit_ratio([100, 300, 200, 400], 300) == 0.5


def test_a_terminated_benchmark_exits_as_an_interrupted_one(tmp_path):
    """SIGTERM (a scheduler, timeout(1)) unwinds the run as Ctrl-C does:
    the stage it started goes with it."""
    import signal
    import time
    bin_dir = str(stage_binary().parent)
    env = dict(os.environ, PYTHONPATH=str(REPO / "clients" / "python"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.bench", "prefetch", "--files", "2000", "--size", "4KiB",
         "--dir", str(tmp_path / "bench"), "--loaders", "sluice", "--compute-ms", "100", "--bin-dir", bin_dir],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "running sluice" not in line:
            line = proc.stderr.readline()
            assert line, "the benchmark ended before it ran"
        time.sleep(1.0)
        stages = subprocess.run(["pgrep", "-P", str(proc.pid), "sluice-stage"], capture_output=True, text=True)
        assert stages.stdout.split(), "the benchmark's stage runs"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "terminated" in err, err[-2000:]
    for pid in stages.stdout.split():
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower(), \
            f"stage {pid} outlived the benchmark"


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


# -- limiter and tuner: the pure parts ---------------------------------------------

import pytest  # noqa: E402

from sluice.bench import common, limiter, tuner  # noqa: E402
from sluice.bench.__main__ import main as bench_main  # noqa: E402


def steady(rate, until, start=0.0, size=100):
    """Arrival times of ``rate`` samples/s from ``start`` to ``until``."""
    n = int(round((until - start) * rate))
    return [start + (i + 0.5) / rate for i in range(n)], [size] * n  # off the window edges


def test_window_rate_counts_the_window_and_cuts_a_short_run():
    times, sizes = steady(100, 12.0)
    w = common.window_rate(times, sizes, 1.0, 10.0)
    assert (w.start, w.length, w.samples, w.bytes) == (1.0, 10.0, 1000, 100_000)
    assert w.samples_per_s == pytest.approx(100) and w.bytes_per_s == pytest.approx(10_000)
    short = common.window_rate(times[:500], sizes[:500], 1.0, 10.0)  # the run ended at 5 s
    assert short.length == pytest.approx(3.995) and short.samples == 400
    assert short.samples_per_s == pytest.approx(100, rel=0.01)
    assert common.window_rate(times[:50], sizes[:50], 1.0, 10.0).length == 0
    assert common.window_rate([], [], 1.0, 10.0).samples_per_s == 0
    with pytest.raises(ValueError):
        common.window_rate(times, sizes, 1.0, 0)


def test_rolling_rate_and_first_reach():
    slow, _ = steady(100, 2.0)
    fast, _ = steady(1000, 4.0, start=2.0)
    times = slow + fast
    assert common.rolling_rate(times, 1.5) == pytest.approx(100)
    assert common.rolling_rate(times, 3.0) == pytest.approx(1000)
    reached = common.first_reach(times, 900, 0.5)
    # 450 arrivals in the last 0.5 s: ~0.45 s into the fast part.
    assert 2.42 < reached < 2.47
    assert common.rolling_rate(times, reached) >= 900
    assert common.first_reach(times, 5000, 0.5) is None
    assert common.first_reach([], 1) is None


def test_rate_parsing_and_epochs():
    assert common.parse_byte_rate("200MiB/s") == 200 << 20
    assert common.parse_byte_rate("1.5GB/s") == 1_500_000_000
    assert common.parse_byte_rate("4096") == 4096
    for good, value in (("2000", 2000), ("2k", 2000), ("2k ops/s", 2000), ("2000/s", 2000), ("1.5k", 1500)):
        assert common.parse_ops_rate(good) == value
    for bad in ("fast", "0", "1.5", "-3"):
        with pytest.raises(ValueError):
            common.parse_ops_rate(bad)
    with pytest.raises(ValueError):
        common.parse_byte_rate("0MiB/s")
    assert common.epochs_for(12.0, 20000 * 102400 / (200 << 20)) == 2  # 9.8 s an epoch
    assert common.epochs_for(12.0, 20000 / 2000) == 2
    assert common.epochs_for(10.0, 10.0) == 1 and common.epochs_for(0.1, 10.0) == 1


def test_limiter_arguments_and_run_plan():
    args = limiter.parse_args([])
    assert (args.rate_bps, args.ops_ps, args.window_start, args.window, args.epochs) == \
        (200 << 20, 2000, 1.0, 10.0, "auto")
    assert args.limit_kinds == ["bytes", "ops"] and args.files == 20000 and args.prefetch == 2
    total = 20000 * 102400
    b = limiter.plan_run("bytes", args, total, 20000)
    assert b["flags"] == ["--rate-limit", f"{200 << 20}B/s"] and b["epochs"] == 2
    assert b["expected_s"] == pytest.approx(2 * total / (200 << 20))
    o = limiter.plan_run("ops", args, total, 20000)
    assert o["flags"] == ["--ops-limit", "2000"] and o["epochs"] == 2 and o["target"] == 2000
    args = limiter.parse_args(["--rate", "50MiB/s", "--ops", "5k", "--epochs", "3", "--limits", "ops",
                               "--window-start", "2", "--window", "5"])
    assert (args.rate_bps, args.ops_ps, args.epochs, args.limit_kinds) == (50 << 20, 5000, 3, ["ops"])
    assert limiter.plan_run("ops", args, total, 20000)["epochs"] == 3
    for bad in (["--limits", "iops"], ["--rate", "fast"], ["--ops", "0"], ["--window", "0"],
                ["--epochs", "0"], ["--epochs", "many"]):
        with pytest.raises(SystemExit):
            limiter.parse_args(bad)


def test_limiter_summary():
    tl = common.Timeline(t0=0.0)
    tl.times, tl.sizes = steady(2100, 12.0, size=100 * 1024)  # 5% over 2000/s
    r = limiter.summarize("ops", 2000, tl, 1.0, 10.0)
    assert r["measured_10s"] == pytest.approx(2100) and r["error_pct"] == pytest.approx(5.0)
    assert r["measured_total"] == pytest.approx(2100, rel=1e-3) and r["window_complete"]
    r = limiter.summarize("bytes", 2100 * 100 * 1024, tl, 1.0, 10.0)
    assert r["error_pct"] == pytest.approx(0.0) and r["window"] == [1.0, 11.0]
    tl.times, tl.sizes = tl.times[:1000], tl.sizes[:1000]  # ends before the window does
    r = limiter.summarize("ops", 2000, tl, 0.1, 10.0)
    assert not r["window_complete"]
    assert "window cut short" in limiter.format_table([r], 0.1, 10.0)


def test_tuner_arguments():
    args = tuner.parse_args([])
    assert args.fixed_counts == [1, 2, 4, 8, 16, 32, 64] and args.compute_ms is None
    assert args.compute_fraction == 0.25 and args.poll_ms == 100 and args.initial_readers == 1
    assert tuner.compute_ms_for(10000, 32, 0.25) == pytest.approx(12.8)
    args = tuner.parse_args(["--fixed", "2,8", "--compute-ms", "20", "--trace", "t.csv", "--plot", "p.png"])
    assert args.fixed_counts == [2, 8] and args.compute_ms == 20.0 and args.trace == "t.csv"
    assert tuner.parse_args(["--best-rate", "9000", "--fixed", ""]).best_rate == 9000
    for bad in (["--fixed", "0,4"], ["--fixed", "x"], ["--compute-ms", "slow"], ["--compute-fraction", "0"],
                ["--poll-ms", "0"], ["--best-rate", "-1"]):
        with pytest.raises(SystemExit):
            tuner.parse_args(bad)


METRICS = """\
# HELP sluice_stage_readers Reader threads the job runs (the tuner's choice).
# TYPE sluice_stage_readers gauge
sluice_stage_readers{job="tuner"} 12
sluice_stage_readers{job="other"} 3
sluice_stage_buffer_capacity_bytes{job="tuner"} 6.7108864e+07
sluice_stage_delivered_samples_total{dataset="bench",job="tuner"} 1500
sluice_stage_delivered_samples_total{dataset="more",job="tuner"} 500
sluice_stage_delivered_samples_total{dataset="bench",job="other"} 7
sluice_stage_errors_total{code="NOT_FOUND",dataset="a \\"b\\"",job="tuner"} 1
sluice_stage_connections 2
"""


def test_prometheus_parsing():
    samples = common.parse_prometheus(METRICS)
    assert ("sluice_stage_connections", {}, 2.0) in samples
    assert common.metric_value(samples, "sluice_stage_readers", job="tuner") == 12
    assert common.metric_value(samples, "sluice_stage_buffer_capacity_bytes", job="tuner") == 64 << 20
    assert common.metric_value(samples, "sluice_stage_delivered_samples_total", job="tuner") == 2000
    assert common.metric_value(samples, "sluice_stage_delivered_samples_total") == 2007
    assert common.metric_value(samples, "sluice_stage_readers", job="nobody") is None
    err = [ls for n, ls, _ in samples if n == "sluice_stage_errors_total"][0]
    assert err["dataset"] == 'a "b"'


def test_tuner_trace_arithmetic(tmp_path):
    times, _ = steady(1000, 2.0)
    rows = [{"t": 0.1 * i, "phase": "tuning" if i < 12 else "compute-bound", "readers": float(1 + i % 5),
             "buffer_bytes": float((64 - i) << 20), "buffer_used_bytes": 0.0,
             "delivered_samples": float(100 * i)} for i in range(20)]
    tuner.fill_rates(rows, times)
    assert rows[10]["samples_per_s"] == pytest.approx(1000, rel=0.01)
    assert rows[10]["stage_samples_per_s"] == pytest.approx(1000)  # 100 per 0.1 s
    assert rows[0]["stage_samples_per_s"] is None
    assert tuner.row_at(rows, 0.55)["t"] == pytest.approx(0.5)
    assert tuner.row_at(rows, -1)["t"] == 0
    s = tuner.phase_summary(rows, "compute-bound")
    assert (s["readers_start"], s["readers_end"], s["buffer_start"]) == (3.0, 5.0, float(52 << 20))
    assert tuner.phase_summary(rows, "nothing") == {}
    path = tmp_path / "trace.csv"
    tuner.write_trace(str(path), rows)
    lines = path.read_text().splitlines()
    assert lines[0].split(",")[:5] == ["t", "phase", "readers", "buffer_bytes", "samples_per_s"]
    assert len(lines) == 21 and lines[1].startswith("0,tuning,1,67108864,")


def test_subcommands_are_listed(capsys):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "limiter" in out and "tuner" in out
    assert bench_main(["nope"]) == 2


def test_the_polled_metrics_exist(stage_factory, dataset):
    """The names and labels the tuner bench polls are what the stage exports."""
    from conftest import http_get, wait_for

    import sluice

    root, _files = dataset
    stage = stage_factory({"d": root}, "--initial-readers", "1")
    with sluice.Client(stage.socket, job="tuner") as c:
        list(c.dataset("d").epoch(0))
        # The buffer gauges are set on the tuner's first tick (200 ms).
        samples = wait_for(lambda: (lambda s: common.metric_value(
            s, "sluice_stage_buffer_capacity_bytes", job="tuner") is not None and s)(
            common.parse_prometheus(http_get(stage.metrics, "/metrics"))), timeout=5, what="the gauges")
    assert common.metric_value(samples, "sluice_stage_readers", job="tuner") >= 1
    assert common.metric_value(samples, "sluice_stage_buffer_capacity_bytes", job="tuner") > 0
    assert common.metric_value(samples, "sluice_stage_delivered_samples_total", job="tuner") > 0
    assert common.metric_value(samples, "sluice_stage_storage_reads_total", job="tuner") > 0


def _bench(tmp_path, *argv):
    bin_dir = str(stage_binary().parent)
    env = dict(os.environ, PYTHONPATH=str(REPO / "clients" / "python"))
    proc = subprocess.run([sys.executable, "-m", "sluice.bench", *argv, "--bin-dir", bin_dir, "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_limiter_wiring_on_a_tiny_set(tmp_path):
    out, doc = _bench(tmp_path, "limiter", "--files", "40", "--size", "8KiB", "--dir", str(tmp_path / "b"),
                      "--rate", "2MiB/s", "--ops", "400", "--window-start", "0.1", "--window", "0.4")
    assert [r["limit"] for r in doc["results"]] == ["bytes", "ops"]
    for r in doc["results"]:
        assert {"target", "measured_10s", "measured_total", "error_pct"} <= set(r)
        assert r["samples"] == 40 * r["epochs"] and r["measured_10s"] > 0
    assert "whole run" in out


def test_tuner_wiring_on_a_tiny_set(tmp_path):
    trace = tmp_path / "t.csv"
    out, doc = _bench(tmp_path, "tuner", "--files", "60", "--size", "8KiB", "--dir", str(tmp_path / "b"),
                      "--fixed", "1,2", "--tune-seconds", "0.3", "--compute-seconds", "0.3",
                      "--poll-ms", "50", "--trace", str(trace))
    assert [f["readers"] for f in doc["fixed"]] == [1, 2] and doc["best_fixed"]["samples_per_s"] > 0
    assert "time_to_90pct_s" in doc["tuning"] and doc["compute_bound"]["compute_ms"] > 0
    assert trace.read_text().startswith("t,phase,readers,buffer_bytes,samples_per_s")
    assert "phase b" in out


def test_cache_wiring_on_a_tiny_set(tmp_path):
    _, doc = _bench(tmp_path, "cache", "--files", "40", "--size", "8KiB", "--dir", str(tmp_path / "b"),
                      "--epochs", "3")
    assert doc["stable"]["hit_ratio"] == pytest.approx(0.5, abs=0.05), doc["stable"]
    assert [r["source_reads"] for r in doc["fits"]["epochs"]] == [40, 0, 0]
    assert doc["fits"]["later_source_fraction"] == 0
    shared = doc["shared"]
    assert shared["samples"] == 2 * 3 * 40 and shared["source_reads"] == 40
    assert shared["source_bytes_per_dataset_bytes"] == pytest.approx(1.0)
    for run in (doc["stable"], doc["lru"], doc["fits"], shared):
        assert 0 < run["peak_rss_bytes"] and run["memory_budget_bytes"] > 0


def test_mount_wiring_on_a_tiny_set(tmp_path):
    out, doc = _bench(tmp_path, "mount", "--files", "64", "--size", "8KiB", "--dir", str(tmp_path / "b"),
                      "--workers", "2", "--hot-files", "64", "--latency", "1ms")
    loaders = {r["loader"]: r for r in doc["results"]}
    assert set(loaders) == {"dataloader-dir", "dataloader-mount", "dataloader-mount-sampler", "socket"}
    for r in loaders.values():
        assert r["workers"] == 2 and r["samples_per_s"] > 0 and r["mib_per_s"] > 0
    assert doc["storage"] == {"kind": "dir", "latency_ms": 1.0}
    assert doc["hot"]["mount_samples_per_s"] > 0 and doc["hot"]["socket_samples_per_s"] > 0
    assert doc["hot"]["dir_samples_per_s"] > 0
    assert "vs dataloader-dir" in out


def test_train_wiring_on_a_tiny_set(tmp_path):
    """A real training loop (a two-layer model on the CPU) fed by every
    loader, each epoch whole; the images are written once."""
    args = ("train", "--files", "40", "--side", "48", "--crop", "32", "--classes", "4", "--batch", "16",
            "--model", "small", "--device", "cpu", "--workers", "1", "--latency", "1ms",
            "--dir", str(tmp_path / "t"))
    out, doc = _bench(tmp_path, *args)
    loaders = {r["loader"]: r for r in doc["results"]}
    assert set(loaders) == {"dataloader-dir", "dataloader-mount", "dataloader-mount-sampler", "socket"}
    for r in loaders.values():
        assert r["workers"] == 1 and r["samples_per_s"] > 0 and 0 < r["au"] <= 1 and r["wait_s"] >= 0
    assert doc["dataset"]["files"] == 40 and doc["device"] == "cpu" and doc["ceiling_samples_per_s"] > 0
    assert doc["storage"] == {"kind": "dir", "latency_ms": 1.0}
    assert "ceiling (no loading)" in out
    first = tmp_path / "t" / "data-40-48-4" / "train" / "c000" / "0000000.jpg"
    written = os.path.getmtime(first)
    _bench(tmp_path, *args[:-4], "--loaders", "socket", "--dir", str(tmp_path / "t"))
    assert os.path.getmtime(first) == written
    # Another shape in the same --dir is a tree of its own.
    _bench(tmp_path, *args[:2], "30", *args[3:-4], "--loaders", "socket", "--dir", str(tmp_path / "t"))
    assert (tmp_path / "t" / "data-30-48-4").is_dir() and os.path.getmtime(first) == written


def test_median_of_rounds_keeps_each_loaders_median_run():
    from sluice.bench.prefetch import median_of_rounds

    runs = [
        {"loader": "naive", "samples_per_s": 10.0},
        {"loader": "threadpool", "threads": 4, "samples_per_s": 40.0},
        {"loader": "naive", "samples_per_s": 30.0},
        {"loader": "threadpool", "threads": 4, "samples_per_s": 20.0},
        {"loader": "naive", "samples_per_s": 20.0},
        {"loader": "threadpool", "threads": 4, "samples_per_s": 30.0},
        {"loader": "torch", "skipped": "torch does not import"},
    ]
    out = median_of_rounds(runs)
    assert [(r["loader"], r.get("samples_per_s")) for r in out] == [
        ("naive", 20.0), ("threadpool", 30.0), ("torch", None)]
    assert out[0]["runs"] == [10.0, 30.0, 20.0]


def test_dlio_runs_name_the_scaled_workload_and_refuse_without_dlio(tmp_path):
    from sluice.bench import dlio

    overrides = dlio._overrides(dlio.WORKLOADS["unet3d"], "/data/unet3d", 3, 2)
    assert overrides[0] == "workload=unet3d_a100"
    assert "++workload.dataset.data_folder=/data/unet3d" in overrides
    assert "++workload.train.epochs=3" in overrides and "++workload.reader.read_threads=2" in overrides
    # Compute per batch scaled with the record size (16 MiB of DLIO's 140 MiB).
    assert "++workload.train.computation_time=0.0728" in overrides
    table = dlio.format_table([{"workload": "unet3d", "loader": "mount", "au_percent": [31.3, 88.4],
                                "samples_per_s": [23.9, 67.4]}])
    assert table.splitlines()[2].split() == ["unet3d", "mount", "2", "88.4", "67.4"]
    with pytest.raises(SystemExit, match="scripts/dlio-env"):
        dlio.main(["--dlio", str(tmp_path / "none"), "--dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown workload"):
        dlio.main(["--workloads", "bert"])
