use super::*;
use crate::allocation::Reason;

const MIB: f64 = 1024.0 * 1024.0;

const POLICIES: &str = include_str!("../../examples/scenarios/coordination-policies.yaml");
const EXAMPLE: &str = include_str!("../../examples/scenarios/coordination.yaml");

fn policies(text: &str) -> PolicySet {
    PolicySet::from_documents(crate::parse_documents("p.yaml", text).unwrap()).unwrap()
}

fn run(scenario: &str) -> Report {
    let scenario = Scenario::parse("s.yaml", scenario).unwrap();
    simulate(&scenario, &policies(POLICIES))
}

/// Returns each job's (id, allocated MiB/s, enforced MiB/s, reason) at a
/// tick, rounded to hundredths.
fn shares(report: &Report, tick: usize) -> Vec<(String, f64, f64, Reason)> {
    let round = |b: f64| (b / MIB * 100.0).round() / 100.0;
    report.ticks[tick]
        .jobs
        .iter()
        .map(|j| {
            let s = &j.share;
            (
                j.job.clone(),
                round(s.bytes_per_second),
                round(s.enforced_bytes_per_second),
                s.reason,
            )
        })
        .collect()
}

fn ids_and_rates(report: &Report, tick: usize) -> Vec<(String, f64)> {
    shares(report, tick)
        .into_iter()
        .map(|(id, rate, _, _)| (id, rate))
        .collect()
}

fn expect(report: &Report, tick: usize, expected: &[(&str, f64)]) {
    let got = ids_and_rates(report, tick);
    let want: Vec<(String, f64)> = expected.iter().map(|&(j, r)| (j.to_owned(), r)).collect();
    assert_eq!(got, want, "tick {tick}");
}

#[test]
fn the_example_runs_through_the_controllers_estimates() {
    let report = run(EXAMPLE);
    assert_eq!(report.ticks.len(), 60);
    assert!(report.ticks.iter().all(|t| t.problems.is_empty()));
    // a) All greedy from the first tick: 1:2:3:4 of 200 MiB/s.
    let a = [("j1", 20.0), ("j2", 40.0), ("j3", 60.0), ("j4", 80.0)];
    expect(&report, 0, &a);
    expect(&report, 14, &a);
    // b) j4 wants 20 from 15 s. At 15 s its stages still report the
    // tick before, when it read all it was allowed: still greedy. From
    // 16 s its demand is what it read plus the headroom (22), and the
    // 178 left goes 1:2:3.
    expect(&report, 15, &a);
    let b = [("j1", 29.67), ("j2", 59.33), ("j3", 89.0), ("j4", 22.0)];
    expect(&report, 16, &b);
    expect(&report, 29, &b);
    let j4 = &report.ticks[16].jobs[3];
    assert_eq!(j4.share.reason, Reason::DemandLimited);
    assert_eq!(j4.wants_bytes_per_second, Some(20.0 * MIB));
    assert_eq!(j4.rate_bytes_per_second, 20.0 * MIB);
    // c) j2 leaves at 30 s: the controller recomputes at once.
    expect(&report, 30, &[("j1", 44.5), ("j3", 133.5), ("j4", 22.0)]);
    // d) j5 arrives at 45 s, unknown (greedy), held at its guarantee.
    let d = [("j1", 29.5), ("j3", 88.5), ("j4", 22.0), ("j5", 60.0)];
    expect(&report, 45, &d);
    expect(&report, 59, &d);
    assert_eq!(report.ticks[59].jobs[3].share.reason, Reason::Guarantee);
}

#[test]
fn unwanted_capacity_is_lent_and_enforced() {
    // Alone, j4 wants 20 MiB/s of a 200 MiB/s pool: allocated its demand
    // (22 with the headroom), enforced the whole pool.
    let report = run(
        "duration: 3s\njobs:\n  - id: j4\n    labels: {job: j4}\n    stages: [a, b]\n    \
         demand: [{at: 0s, bandwidth: 20MiB/s}]\n",
    );
    assert_eq!(
        shares(&report, 2),
        [("j4".to_owned(), 22.0, 200.0, Reason::DemandLimited)]
    );
    let stages = &report.ticks[2].jobs[0].share.stages;
    assert_eq!(stages.len(), 2);
    assert!(
        stages
            .iter()
            .all(|s| s.enforced_bytes_per_second == 100.0 * MIB)
    );
    assert_eq!(report.ticks[2].jobs[0].rate_bytes_per_second, 20.0 * MIB);
}

#[test]
fn observed_telemetry_is_taken_as_reported() {
    // j1 is seen from 1 s reading 10 MiB/s unthrottled: its first window
    // there is a warm-up (still greedy, 1:3), then its demand is 11 and j3
    // greedy gets the rest. From 3 s it is seen throttled: held at its
    // demand, it must press twice before it counts as greedy again.
    let report = run(
        "duration: 5s\njobs:\n  - id: j1\n    labels: {job: j1}\n    stages: [a]\n    \
         observed: [{at: 1s, bandwidth: 10MiB/s}, {at: 3s, bandwidth: 11MiB/s, throttled: true}]\n  \
         - {id: j3, labels: {job: j3}, stages: [a]}\n",
    );
    let greedy = [("j1", 50.0), ("j3", 150.0)];
    let held = [("j1", 11.0), ("j3", 189.0)];
    for (tick, expected) in [greedy, greedy, held, held, greedy].iter().enumerate() {
        expect(&report, tick, expected);
    }
    assert_eq!(report.ticks[2].jobs[0].rate_bytes_per_second, 10.0 * MIB);
}

#[test]
fn unmanaged_jobs_and_nodes_are_reported() {
    let report = run(
        "duration: 1s\nnodes: [{name: n, stages: [a], memory: 64MiB}]\njobs:\n  \
         - {id: x, stages: [a]}\n  - {id: j1, labels: {job: j1}, stages: [a]}\n",
    );
    assert_eq!(report.ticks[0].unmanaged, ["x"]);
    expect(&report, 0, &[("j1", 200.0)]);
}
