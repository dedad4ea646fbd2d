use super::*;

const GOOD: &str = "
tick: 500ms
duration: 3s
nodes:
  - {name: n1, stages: [stage-a], readers: 8, memory: 1GiB}
jobs:
  - id: j1
    labels: {job: j1}
    stages: [stage-a, stage-b]
    leave: 2s
    demand:
      - {at: 0s, bandwidth: greedy}
      - {at: 1s, bandwidth: 20MiB/s}
  - id: j2
    stages: [stage-b]
    arrive: 1s
  - id: j3
    stages: [stage-b]
    observed:
      - {at: 0s, bandwidth: 10MiB/s, throttled: true}
      - {at: 2s, bandwidth: 4MiB/s}
";

fn error(text: &str) -> String {
    Scenario::parse("s.yaml", text).unwrap_err().to_string()
}

#[test]
fn a_scenario_reads_with_policy_units_and_defaults() {
    let s = Scenario::parse("s.yaml", GOOD).unwrap();
    assert_eq!((s.tick, s.ticks), (Millis(500), 6));
    assert_eq!(s.nodes[0].memory, ByteSize(1 << 30));
    let j1 = &s.jobs[0];
    assert_eq!(j1.labels["job"], "j1");
    assert_eq!(j1.demand_at(Millis(999)), Want::Greedy);
    assert_eq!(j1.demand_at(Millis(1000)), Want::Rate(ByteRate(20 << 20)));
    assert!(j1.runs_at(Millis(1500)) && !j1.runs_at(Millis(2000)));
    let j2 = &s.jobs[1];
    assert_eq!((j2.leave, j2.demand_at(Millis(0))), (None, Want::Greedy));
    assert!(!j2.runs_at(Millis(500)) && j2.runs_at(Millis(1000)));
    let j3 = &s.jobs[2];
    let seen = j3.observed_at(Millis(2500)).unwrap();
    assert_eq!((seen.bandwidth, seen.throttled), (ByteRate(4 << 20), false));
    assert!(j3.observed_at(Millis(0)).unwrap().throttled);

    let minimal = Scenario::parse("m.yaml", "duration: 2s\njobs: [{id: a, stages: [s]}]").unwrap();
    assert_eq!((minimal.tick, minimal.ticks), (Millis(1000), 2));
}

#[test]
fn shape_errors_are_located_as_in_policies() {
    assert_eq!(
        error("duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    leve: 2s\n"),
        "s.yaml:5:5: unknown field `leve` in jobs[0]: did you mean `leave`? the fields here are \
         `id`, `labels`, `stages`, `arrive`, `leave`, `demand` or `observed`"
    );
    let e = error(
        "duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    demand: [{at: 1s, bandwidth: 20MiBps}]\n",
    );
    assert!(
        e.starts_with("s.yaml:5:34: jobs[0].demand[0].bandwidth: invalid byte rate `20MiBps`"),
        "{e}"
    );
    let e = error("duration: 3\njobs: [{id: a, stages: [s]}]\n");
    assert!(e.starts_with("s.yaml:1:11: duration: "), "{e}");
    assert!(e.contains("write a unit"), "{e}");
    let e = error("jobs: [{id: a, stages: [s]}]\n");
    assert!(e.starts_with("s.yaml:1:1: missing field `duration`"), "{e}");
    let e = error("duration: 3s\njobs: [{id: a, stages: [s]}\n");
    assert!(e.starts_with("s.yaml:3:1: "), "{e}");
    assert!(e.contains("invalid YAML"), "{e}");
}

#[test]
fn impossible_values_are_located() {
    let cases = [
        (
            "tick: 0s\nduration: 3s\njobs: [{id: a, stages: [s]}]\n",
            "s.yaml:1:7: tick: must be longer than 0ms",
        ),
        (
            "duration: 0s\njobs: [{id: a, stages: [s]}]\n",
            "s.yaml:1:11: duration: must be longer than 0ms",
        ),
        (
            "duration: 3s\njobs: []\n",
            "s.yaml:2:7: jobs: there must be at least one job",
        ),
        (
            "duration: 3s\njobs:\n  - {id: a, stages: [s]}\n  - {id: a, stages: [s]}\n",
            "s.yaml:4:10: jobs[1].id: job id `a` is used twice",
        ),
        (
            "duration: 3s\njobs:\n  - {id: a, stages: [s], arrive: 2s, leave: 1s}\n",
            "s.yaml:3:45: jobs[0].leave: job a leaves at 1s, not after it arrives at 2s",
        ),
        (
            "duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    demand: [{at: 2s, bandwidth: 1MiB/s}, {at: 2s, bandwidth: greedy}]\n",
            "s.yaml:5:13: jobs[0].demand: steps must be in time order: `at: 2s` follows `at: 2s`",
        ),
        (
            "duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    demand: [{at: 1s, bandwidth: 1MiB/s}]\n    observed: [{at: 1s, bandwidth: 1MiB/s}]\n",
            "s.yaml:6:15: jobs[0].observed: job a has both `demand` and `observed`",
        ),
        (
            "duration: 3s\njobs: [{id: a, stages: [s, s]}]\n",
            "s.yaml:2:24: jobs[0].stages: job a lists stage s twice",
        ),
        (
            "duration: 3s\nnodes: [{name: n, stages: [t]}]\njobs: [{id: a, stages: [s]}]\n",
            "s.yaml:2:27: nodes[0].stages: node n lists stage t, which no job uses: known stages are s",
        ),
        (
            "duration: 3s\nnodes: [{name: n, stages: [s]}, {name: m, stages: [s]}]\njobs: [{id: a, stages: [s]}]\n",
            "s.yaml:2:51: nodes[1].stages: stage s is on both node n and node m",
        ),
        (
            "tick: 1ms\nduration: 100000s\njobs: [{id: a, stages: [s]}]\n",
            "s.yaml:2:11: duration: 100000s at one tick every 1ms is 100000000 ticks; at most 86400 run",
        ),
    ];
    for (text, says) in cases {
        let e = error(text);
        assert!(e.starts_with(says), "{text}\n=> {e}\nnot {says}");
    }
}
