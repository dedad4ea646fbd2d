"""``python -m sluice.bench coordination``: its arithmetic, the files it
writes for ``sluicectl``, reading ``simulate``'s answer, and one short run
against the real binaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import binary
from sluice.bench.coordination import analysis, controller_shares, max_enforced_gap
from sluice.bench.coordination.scenario import (MiB, Phase, Simulated, SimulateError, oversubscribed,
                                                parse_simulate, phase_simulated, phase_targets, policies_yaml,
                                                scenario, scenario_yaml)
from sluice.bench.coordination.trainer import Pacer

# -- windows, convergence, errors ------------------------------------------------------


def test_window_rates_sum_buckets_into_windows():
    # 0.25 s buckets; bucket 5 is in window 1, bucket 9 in window 2 (cut: 2 windows)
    rates = analysis.window_rates({0: 100, 3: 100, 5: 50, 9: 999}, 0.25, 1.0, 2)
    assert rates == [200.0, 50.0]


def test_window_rates_refuses_a_window_that_is_not_whole_buckets():
    with pytest.raises(ValueError, match="whole number"):
        analysis.window_rates({}, 0.25, 0.3, 2)


def test_converged_at_is_the_start_of_the_last_run_within_tolerance():
    targets = {"a": 100.0, "b": 50.0}
    rates = {"a": [50, 104, 90, 101, 99, 96], "b": [50, 50, 50, 52.4, 48, 50]}
    # window 2 is out for a (90), so the stable run of single windows
    # starts at window 3
    assert analysis.converged_at(rates, targets, span=1) == 3
    # over two-window means (77, 97, 95.5, ...) it starts at window 2
    assert analysis.converged_at(rates, targets) == 2
    rates["b"][-1] = 40  # the last window out: never converged
    assert analysis.converged_at(rates, targets) is None
    assert analysis.converged_at({"a": [100, 100]}, {"a": 100.0}) == 0


def test_smoothed_is_a_moving_mean():
    assert analysis.smoothed([10, 20, 30, 50]) == [10, 15, 25, 40]
    assert analysis.smoothed([10, 20, 30], span=3) == [10, 15, 20]


def test_analyse_phase_measures_the_steady_part():
    rates = {"a": [0, 0, 100, 102, 100], "b": [0, 300, 200, 198, 198]}
    p = analysis.analyse_phase("x", rates, {"a": 100.0, "b": 200.0})
    # two-window means: a 50 then 101, b 250 then 199 -> window 3
    assert p.converge_s == 3.0 and p.steady_s == 2.0
    assert [j.measured for j in p.jobs] == [101.0, 198.0]
    assert p.jobs[0].error_pct == pytest.approx(1.0)
    assert p.jobs[1].error_pct == pytest.approx(-1.0)
    assert p.total == 299.0


def test_analyse_phase_without_convergence_uses_the_last_half():
    p = analysis.analyse_phase("x", {"a": [0, 0, 50, 70]}, {"a": 100.0})
    assert p.converge_s is None and p.steady_s == 2.0
    assert p.jobs[0].measured == 60.0 and p.jobs[0].error_pct == pytest.approx(-40.0)
    unknown = analysis.analyse_phase("x", {"a": [100, 100]}, {"a": None})
    assert unknown.converge_s is None and unknown.jobs[0].error_pct is None


def test_utilisation_weights_phases_by_their_steady_time():
    full = analysis.PhaseResult("a", 1.0, 3.0, [analysis.JobResult("j", 200.0, 200.0)])
    half = analysis.PhaseResult("b", None, 1.0, [analysis.JobResult("j", 200.0, 100.0)])
    assert analysis.utilisation([full, half], 200.0) == pytest.approx((3 * 1.0 + 1 * 0.5) / 4)
    assert analysis.utilisation([], 200.0) is None
    assert analysis.max_converge([full, half]) is None
    assert analysis.max_converge([full]) == 1.0
    assert analysis.max_abs_error([full, half]) == pytest.approx(50.0)


def test_cpu_busy_counts_idle_and_iowait_as_not_busy():
    assert analysis.cpu_busy([0] * 8, [30, 0, 10, 40, 20, 0, 0, 0]) == pytest.approx(0.4)


def test_pacer_sleeps_until_the_rate_is_kept_and_restarts_on_a_new_rate():
    pacer = Pacer()
    pacer.set_rate(None, 0.0)
    assert pacer.wait_s(10**9, 0.0) == 0.0  # greedy
    pacer.set_rate(100.0, 10.0)
    assert pacer.wait_s(50, 10.0) == pytest.approx(0.5)
    assert pacer.wait_s(50, 10.5) == pytest.approx(0.5)
    assert pacer.wait_s(50, 12.0) == 0.0  # behind: no sleep
    pacer.set_rate(200.0, 20.0)
    assert pacer.wait_s(100, 20.0) == pytest.approx(0.5)


# -- the scenario and sluicectl's files ---------------------------------------------------


def test_scenario_phases_and_oversubscription():
    jobs, phases = scenario(10, 200 * MiB)
    assert [p.start_s for p in phases] == [0, 10, 20, 30] and phases[-1].end_s == 40
    j4 = next(j for j in jobs if j.id == "j4")
    assert j4.demand_at(5) is None and j4.demand_at(10) == 20 * MiB
    assert [j.id for j in jobs if j.present(25)] == ["j1", "j3", "j4"]
    assert [j.id for j in jobs if j.present(35)] == ["j1", "j3", "j4", "j5"]
    assert all(oversubscribed(jobs, p, 200 * MiB) for p in phases)
    only_paced = [j4._replace(demand=((0.0, 20.0 * MiB),))]
    assert not oversubscribed(only_paced, phases[0], 200 * MiB)
    assert oversubscribed(only_paced, phases[0], 10 * MiB)


def test_policies_and_scenario_files():
    jobs, _ = scenario(15, 200 * MiB)
    policies = policies_yaml(jobs, 200 * MiB)
    assert "capacity: {bandwidth: 200MiB/s}" in policies
    assert policies.count("kind: JobPolicy") == 5 and "guarantee: {bandwidth: 60MiB/s}" in policies
    assert "selector: {matchLabels: {job: j3}}" in policies and "weight: 3" in policies
    text = scenario_yaml(jobs, 60.0, 1.0, memory=2**30)
    assert text.startswith("tick: 1s\nduration: 60s\nnodes:\n")
    assert "  - {name: node-a, stages: [stage-a], readers: 64, memory: 1073741824}" in text
    assert "    leave: 30s\n" in text and "    arrive: 45s\n" in text
    assert "      - {at: 15s, bandwidth: 20MiB/s}" in text
    assert "211106232B/s" in policies_yaml(jobs, 211106232)


SIMULATE_SAMPLE = {"tick_s": 1.0, "ticks": [
    {"tick": t, "time_s": float(t), "unmanaged": [], "problems": ["p"] if t == 1 else [], "jobs": [
        {"job": "j1", "pool": "bench", "policy": "j1", "wants_bytes_per_second": 1.0e7,
         "demand_bytes_per_second": 1.1e7, "bytes_per_second": 1.1e7 + t, "enforced_bytes_per_second": 3.0e7 + t,
         "rate_bytes_per_second": 1.0e7, "ops_per_second": None, "reason": "demand-limited",
         "stages": [{"stage": "stage-a", "bytes_per_second": 1.1e7, "enforced_bytes_per_second": 3.0e7}]}]}
    for t in range(4)]}


def test_parse_simulate_and_take_each_phases_last_tick():
    ticks, problems = parse_simulate(json.dumps(SIMULATE_SAMPLE))
    assert problems == ["p"]
    assert [t for t, _ in ticks] == [0.0, 1.0, 2.0, 3.0]
    phases = phase_simulated(ticks, [Phase("a", 0, 2), Phase("b", 2, 4)])
    assert phases == [{"j1": Simulated(1.1e7 + 1, 3.0e7 + 1, 1.0e7)}, {"j1": Simulated(1.1e7 + 3, 3.0e7 + 3, 1.0e7)}]
    # The target is what the job reads: its demand, under the enforced limit.
    assert phase_targets(phases) == [{"j1": 1.0e7}, {"j1": 1.0e7}]
    with pytest.raises(SimulateError, match="no tick"):
        phase_simulated(ticks, [Phase("c", 4, 6)])
    with pytest.raises(SimulateError):
        parse_simulate('{"ticks": [{"jobs": [{"job": "j1", "bytes_per_second": 1}]}]}')


def test_controller_shares_take_the_last_view_in_each_phase():
    views = [(0.5, [{"id": "j1", "allocation": {"bytes_per_second": 1.0, "enforced_bytes_per_second": 9.0}}]),
             (1.5, [{"id": "j1", "allocation": {"bytes_per_second": 2.0}}, {"id": "j2"}]),
             (2.5, [{"id": "j1", "allocation": {"bytes_per_second": 3.0}}])]
    phases = [Phase("a", 0, 2), Phase("b", 2, 3), Phase("c", 3, 4)]
    assert controller_shares(views, phases) == [{"j1": 2.0, "j2": None}, {"j1": 3.0}, {"j1": 3.0}]
    assert controller_shares(views[:1], phases[:1], "enforced_bytes_per_second") == [{"j1": 9.0}]


def test_the_enforced_gap_compares_simulation_and_controller():
    limits = [({}, {"j1": 100.0, "j2": 50.0}, {"j1": 103.0, "j2": None}),
              ({}, {"j1": 100.0}, {"j1": 96.0})]
    assert max_enforced_gap(limits) == pytest.approx(4.0)
    assert max_enforced_gap([({}, {}, {})]) is None


# -- end to end --------------------------------------------------------------------------


def _bin_dir():
    names = ("sluice-controller", "sluice-stage", "sluicectl")
    return str([binary(n) for n in names][0].parent)


def test_a_short_run_reports_every_phase(tmp_path):
    bin_dir = _bin_dir()
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "sluice.bench", "coordination", "--bin-dir", bin_dir, "--phase-s", "3",
         "--capacity", "50MiB/s", "--files", "200", "--dir", str(tmp_path / "data"), "--out-dir", str(out),
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["targets_from"] == "sluicectl simulate", done.stderr[-2000:]
    for run in (result, result["uncoordinated"]):
        assert [len(p["jobs"]) for p in run["phases"]] == [4, 4, 3, 4]
        for phase in run["phases"]:
            # (3 s phases on a busy CI machine: one job may not have read
            # in a phase's steady part yet; the phase as a whole has.)
            assert sum(job["measured_mib_s"] for job in phase["jobs"]) > 0, phase
            for job in phase["jobs"]:
                assert job["target_mib_s"] > 0 and job["measured_mib_s"] >= 0
                assert isinstance(job["error_pct"], float)
        assert run["aggregate_utilisation"] > 0
    assert [j["job"] for j in result["phases"][3]["jobs"]] == ["j1", "j3", "j4", "j5"]
    # the targets of phase a: 50 MiB/s shared 1:2:3:4
    assert [j["target_mib_s"] for j in result["phases"][0]["jobs"]] == [5.0, 10.0, 15.0, 20.0]
    # both enforced limits, side by side, and how far apart they are
    for job in result["phases"][0]["jobs"]:
        assert job["simulated_enforced_mib_s"] == job["target_mib_s"]
        assert job["controller_enforced_mib_s"] is None or job["controller_enforced_mib_s"] > 0
    assert "simulated_enforced_mib_s" not in result["uncoordinated"]["phases"][0]["jobs"][0]
    assert result["max_enforced_gap_pct"] is None or result["max_enforced_gap_pct"] >= 0
    assert (out / "policies.yaml").exists() and (out / "scenario.yaml").exists()
    assert "phase a: all greedy" in done.stdout
