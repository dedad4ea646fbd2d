//! `sluicectl simulate`, run as the real binary on the example scenario
//! and on broken ones: the allocation each phase gives, the exit codes,
//! and the JSON a benchmark reads.

use std::fs;
use std::path::Path;

use serde_json::Value;

mod run;
use run::{Run, sluicectl};

const SCENARIOS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../policies/examples/scenarios"
);

const MIB: f64 = 1024.0 * 1024.0;

fn simulate(extra: &[&str]) -> Run {
    let mut args = vec![
        "simulate",
        "-f",
        "coordination-policies.yaml",
        "--scenario",
        "coordination.yaml",
    ];
    args.extend(extra);
    sluicectl(Path::new(SCENARIOS), &args, "")
}

/// Returns each job's allocation at `tick`, in MiB/s, with its reason.
fn shares(report: &Value, tick: usize) -> Vec<(String, f64, String)> {
    report["ticks"][tick]["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["job"].as_str().unwrap().to_owned(),
                j["bytes_per_second"].as_f64().unwrap() / MIB,
                j["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn expect(report: &Value, tick: usize, expected: &[(&str, f64, &str)]) {
    let got = shares(report, tick);
    assert_eq!(got.len(), expected.len(), "tick {tick}: {got:?}");
    for ((job, rate, reason), (want_job, want_rate, want_reason)) in got.iter().zip(expected) {
        assert_eq!((job.as_str(), reason.as_str()), (*want_job, *want_reason));
        assert!(
            (rate - want_rate).abs() < 0.005,
            "tick {tick} {job}: {rate}"
        );
    }
}

#[test]
fn the_example_scenario_shares_the_pool_phase_by_phase() {
    let run = simulate(&["-o", "json"]);
    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["tick_s"], 1.0);
    let ticks = report["ticks"].as_array().unwrap();
    assert_eq!(ticks.len(), 60, "every tick");
    for (n, tick) in ticks.iter().enumerate() {
        assert_eq!(tick["tick"], n);
        assert_eq!(tick["time_s"], n as f64);
        assert_eq!(tick["unmanaged"], Value::Array(vec![]));
        assert_eq!(tick["problems"], Value::Array(vec![]));
    }

    let greedy = "weighted-share";
    // a) all greedy: 1:2:3:4 of 200 MiB/s, exactly.
    expect(
        &report,
        0,
        &[
            ("j1", 20.0, greedy),
            ("j2", 40.0, greedy),
            ("j3", 60.0, greedy),
            ("j4", 80.0, greedy),
        ],
    );
    expect(
        &report,
        14,
        &[
            ("j1", 20.0, greedy),
            ("j2", 40.0, greedy),
            ("j3", 60.0, greedy),
            ("j4", 80.0, greedy),
        ],
    );
    // b) j4 wants 20 from 15 s. The controller sees it in the window
    // that ends at 16 s and estimates it as what it read plus 10%
    // headroom (22); the 178 left goes 1:2:3.
    let limited = "demand-limited";
    expect(
        &report,
        16,
        &[
            ("j1", 29.667, greedy),
            ("j2", 59.333, greedy),
            ("j3", 89.0, greedy),
            ("j4", 22.0, limited),
        ],
    );
    // c) j2 leaves: 1:3 of 178.
    expect(
        &report,
        30,
        &[
            ("j1", 44.5, greedy),
            ("j3", 133.5, greedy),
            ("j4", 22.0, limited),
        ],
    );
    // d) j5 arrives: held at its guarantee, 1:3 of the 120 left.
    expect(
        &report,
        59,
        &[
            ("j1", 29.5, greedy),
            ("j3", 88.5, greedy),
            ("j4", 22.0, limited),
            ("j5", 60.0, "guarantee"),
        ],
    );

    // What j4 wants, what the controller estimates, what it reads, and
    // the split over both stages.
    let j4 = &ticks[16]["jobs"][3];
    assert_eq!(j4["policy"], "j4");
    assert_eq!(j4["pool"], "bench");
    assert_eq!(j4["wants_bytes_per_second"], 20.0 * MIB);
    let mib = |v: &Value| v.as_f64().unwrap() / MIB;
    assert!((mib(&j4["demand_bytes_per_second"]) - 22.0).abs() < 1e-6);
    assert!((mib(&j4["enforced_bytes_per_second"]) - 22.0).abs() < 1e-6);
    assert_eq!(j4["rate_bytes_per_second"], 20.0 * MIB);
    assert_eq!(j4["ops_per_second"], Value::Null);
    assert_eq!(ticks[0]["jobs"][3]["demand_bytes_per_second"], Value::Null);
    let stages = j4["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2);
    assert_eq!(stages[0]["stage"], "stage-a");
    assert!((mib(&stages[1]["enforced_bytes_per_second"]) - 11.0).abs() < 1e-6);
}

#[test]
fn the_table_shows_only_the_ticks_that_change() {
    let run = simulate(&[]);
    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert!(
        lines[0].starts_with("TICK  TIME  JOB  POOL   DEMAND"),
        "{lines:?}"
    );
    // 4 + 4 + 3 + 4 rows, at ticks 0, 16, 30 and 45; no problems.
    assert_eq!(lines.len(), 1 + 15, "{}", run.stdout);
    let ticks: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(' ').next().unwrap())
        .collect();
    assert_eq!(ticks.iter().filter(|t| **t == "16").count(), 4);
    assert!(
        lines.iter().any(|l| l.starts_with("16    16s   j4   bench  22.0 MiB/s  22.0 MiB/s  22.0 MiB/s  demand-limited  stage-a 11.0 MiB/s, stage-b 11.0 MiB/s")),
        "{}",
        run.stdout
    );

    let all = simulate(&["--all-ticks"]);
    assert_eq!(all.code, 0);
    assert_eq!(
        all.stdout.lines().count(),
        1 + 15 * 4 + 15 * 4 + 15 * 3 + 15 * 4
    );
}

#[test]
fn unmanaged_jobs_and_problems_are_reported_not_errors() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("s.yaml"),
        "duration: 2s\nnodes: [{name: n, stages: [s], readers: 1}]\njobs:\n  \
         - {id: a, labels: {job: j1}, stages: [s]}\n  - {id: c, labels: {job: j3}, stages: [s]}\n  \
         - {id: b, stages: [s], arrive: 1s}\n",
    )
    .unwrap();
    let policies = format!("{SCENARIOS}/coordination-policies.yaml");
    let run = sluicectl(
        dir.path(),
        &[
            "simulate",
            "-f",
            &policies,
            "--scenario",
            "s.yaml",
            "-o",
            "json",
        ],
        "",
    );
    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["ticks"][0]["unmanaged"], Value::Array(vec![]));
    assert_eq!(report["ticks"][1]["unmanaged"][0], "b");
    assert_eq!(
        report["ticks"][1]["jobs"][0]["bytes_per_second"],
        50.0 * MIB
    );
    let problem = "node n: reader minimums add up to 2 readers > budget 1 reader; scaled";
    assert_eq!(report["ticks"][1]["problems"][0], problem);

    let table = sluicectl(
        dir.path(),
        &["simulate", "-f", &policies, "--scenario", "s.yaml"],
        "",
    );
    assert!(
        table
            .stdout
            .contains("1     1s    b    -      -       -           -           unmanaged"),
        "{}",
        table.stdout
    );
    assert!(
        table
            .stdout
            .contains(&format!("PROBLEMS\ntick 0 (0s):\n  {problem}\n")),
        "{}",
        table.stdout
    );
}

#[test]
fn a_bad_scenario_exits_1_with_its_place() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("bad.yaml"),
        "duration: 60s\njobs:\n  - id: j1\n    stages: [stage-a]\n    arrive: 20s\n    leave: 10s\n",
    )
    .unwrap();
    let policies = format!("{SCENARIOS}/coordination-policies.yaml");
    let run = sluicectl(
        dir.path(),
        &["simulate", "-f", &policies, "--scenario", "bad.yaml"],
        "",
    );
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.stdout, "");
    assert!(
        run.stderr.starts_with(
            "bad.yaml:6:12: jobs[0].leave: job j1 leaves at 10s, not after it arrives at 20s"
        ),
        "{}",
        run.stderr
    );
}

#[test]
fn scenarios_no_controller_could_see_are_refused_with_their_place() {
    let dir = tempfile::tempdir().unwrap();
    let policies = format!("{SCENARIOS}/coordination-policies.yaml");
    let cases = [
        (
            "- a\n- b\n",
            "s.yaml:1:1: a scenario must be a mapping with `duration:` and `jobs:`",
        ),
        (
            "# nothing yet\n",
            "s.yaml:1:1: a scenario must be a mapping with `duration:` and `jobs:` (and optionally `tick:` and `nodes:`), found nothing (an empty file)",
        ),
        (
            "duration: 5s\njobs:\n  - {id: \"\", stages: [a]}\n",
            "s.yaml:3:10: jobs[0].id: job id `` is not one a trainer can announce",
        ),
        (
            "duration: 5s\njobs:\n  - {id: j, labels: {\"bad key!\": x}, stages: [a]}\n",
            "s.yaml:3:21: jobs[0].labels: job j: label key `bad key!` is not valid",
        ),
        (
            "tick: 3s\nduration: 10s\njobs:\n  - {id: j, stages: [a], arrive: 4s, leave: 5s}\n",
            "jobs[0].arrive: job j is there from 4s until 5s, between two ticks (one every 3s): it never runs",
        ),
        (
            "duration: 10s\njobs:\n  - {id: j, stages: [a], arrive: 10s}\n",
            "jobs[0].arrive: job j arrives at 10s, after the last tick (9s): it never runs",
        ),
    ];
    for (text, expected) in cases {
        fs::write(dir.path().join("s.yaml"), text).unwrap();
        let run = sluicectl(
            dir.path(),
            &["simulate", "-f", &policies, "--scenario", "s.yaml"],
            "",
        );
        assert_eq!(run.code, 1, "{text}: {run:?}");
        assert!(run.stderr.contains(expected), "{text}: {}", run.stderr);
    }
}

#[test]
fn a_large_scenario_runs_and_its_names_are_shown_whole() {
    let dir = tempfile::tempdir().unwrap();
    // 10,000 jobs of 10 nodes each: more than a policy file may hold.
    let mut text = String::from("duration: 2s\njobs:\n");
    for i in 0..10_000 {
        text.push_str(&format!(
            "  - {{id: training-job-{i:05}, labels: {{job: j1}}, stages: [stage-node-{}]}}\n",
            i % 7
        ));
    }
    fs::write(dir.path().join("s.yaml"), text).unwrap();
    let policies = format!("{SCENARIOS}/coordination-policies.yaml");
    let run = sluicectl(
        dir.path(),
        &["simulate", "-f", &policies, "--scenario", "s.yaml"],
        "",
    );
    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    assert!(
        run.stdout.contains("training-job-09999  bench"),
        "{}",
        &run.stdout[..2000.min(run.stdout.len())]
    );
}

#[test]
fn bad_policies_exit_1_and_missing_files_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("p.yaml"),
        "apiVersion: sluice.dev/v1\nkind: Pool\n",
    )
    .unwrap();
    let scenario = format!("{SCENARIOS}/coordination.yaml");
    let run = sluicectl(
        dir.path(),
        &["simulate", "-f", "p.yaml", "--scenario", &scenario],
        "",
    );
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.starts_with("p.yaml:2:"), "{}", run.stderr);

    let run = sluicectl(
        dir.path(),
        &["simulate", "-f", "p.yaml", "--scenario", "missing.yaml"],
        "",
    );
    assert_eq!(run.code, 2, "{run:?}");
    assert_eq!(
        run.stderr,
        "sluicectl: cannot read missing.yaml: No such file or directory\n"
    );
}
