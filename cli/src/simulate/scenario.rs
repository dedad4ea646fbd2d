//! The scenario file of `sluicectl simulate`: which jobs run when, on which
//! stages, wanting how much, and the nodes the stages run on. Parsed with
//! serde into raw structs, then checked into a [`Scenario`] that cannot be
//! invalid. Units are the policy language's own (`ByteRate`, `ByteSize`,
//! `Millis`), so `20MiB/s` means here what it means in a policy.
//!
//! Every error reads `FILE:LINE:COLUMN: message`. Checks that need a whole
//! job, list or file run as part of deserializing it, so the YAML parser
//! locates them at the start of that job, list or file.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use sluice_policy::{ByteRate, ByteSize, Millis};

/// The most ticks one simulation runs: a day at one tick a second.
pub const MAX_TICKS: u64 = 86_400;

/// A checked scenario.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawScenario")]
pub struct Scenario {
    /// Time between two allocations.
    pub tick: Millis,
    /// How many ticks run: the first at 0, the last before `duration`.
    pub ticks: u64,
    /// Nodes and the budgets their stages share.
    pub nodes: Vec<Node>,
    /// Jobs, in file order (the engine's order too).
    pub jobs: Vec<Job>,
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    /// Time between two allocations (default `1s`).
    #[serde(default = "one_second")]
    tick: Positive,
    /// How long to simulate.
    duration: Positive,
    /// Nodes with budgets; a stage on no node gets its job's own bounds.
    #[serde(default)]
    nodes: Vec<Node>,
    /// The jobs.
    jobs: Jobs,
}

fn one_second() -> Positive {
    Positive(Millis(1000))
}

/// A node, its stages and the budgets they share.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// The node's name.
    pub name: String,
    /// The stages running on it (each on one node at most).
    pub stages: Vec<String>,
    /// Reader threads for all jobs together (default 0: the sum of the
    /// jobs' maxima).
    #[serde(default)]
    pub readers: u32,
    /// Buffer memory for all jobs together, and each stage's memory budget
    /// (default 0: not limited).
    #[serde(default)]
    pub memory: ByteSize,
}

/// A job: when it runs, where, and what it wants.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawJob")]
pub struct Job {
    /// The job's id.
    pub id: String,
    /// Its labels, which the policies' selectors match.
    pub labels: BTreeMap<String, String>,
    /// The stages serving it; its demand is split evenly among them.
    pub stages: Vec<String>,
    /// When it starts.
    pub arrive: Millis,
    /// When it ends; `None` for never.
    pub leave: Option<Millis>,
    /// Its demand over time, `at` strictly increasing.
    pub demand: Vec<Step>,
}

/// A job as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    /// The job's id, unique in the file.
    id: String,
    /// Labels the policies' selectors match.
    #[serde(default)]
    labels: BTreeMap<String, String>,
    /// At least one stage.
    stages: Vec<String>,
    /// When it starts (default `0s`).
    #[serde(default)]
    arrive: Millis,
    /// When it ends (default: never).
    #[serde(default)]
    leave: Option<Millis>,
    /// Piecewise constant demand (default: greedy the whole time).
    #[serde(default)]
    demand: Steps,
}

/// From `at` on, until the next step, the job wants `bandwidth`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// Time since the start of the simulation (not of the job).
    pub at: Millis,
    /// What the job wants.
    pub bandwidth: Want,
}

/// A job's demand: as much as it can get, or a rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// `greedy`: as much as the policies allow.
    Greedy,
    /// A byte rate such as `20MiB/s`.
    Rate(ByteRate),
}

impl Want {
    /// Returns bytes per second, `None` for greedy (the engine's unknown
    /// demand).
    pub fn bytes_per_second(self) -> Option<f64> {
        match self {
            Want::Greedy => None,
            Want::Rate(rate) => Some(rate.bytes_per_second() as f64),
        }
    }
}

impl<'de> Deserialize<'de> for Want {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Want;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`greedy` or a byte rate such as 20MiB/s")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Want, E> {
                Ok(Want::Rate(ByteRate(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Want, E> {
                if v.trim() == "greedy" {
                    return Ok(Want::Greedy);
                }
                ByteRate::parse(v).map(Want::Rate).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration longer than zero (the tick, the whole simulation), checked
/// inside the visitor so that the parser places the error at the value.
#[derive(Debug, Clone, Copy)]
struct Positive(Millis);

impl<'de> Deserialize<'de> for Positive {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Positive;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as 1s")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Positive, E> {
                match Millis::parse(v).map_err(E::custom)? {
                    Millis(0) => Err(E::custom("must be longer than 0ms, for example `1s`")),
                    positive => Ok(Positive(positive)),
                }
            }
        }
        d.deserialize_str(V)
    }
}

/// A list checked as a whole inside the visitor, so that the parser places
/// an error at the list rather than at what holds it.
struct CheckedList<T, U> {
    expecting: &'static str,
    check: fn(Vec<T>) -> Result<U, String>,
}

impl<'de, T: Deserialize<'de>, U> Visitor<'de> for CheckedList<T, U> {
    type Value = U;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<U, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        (self.check)(items).map_err(de::Error::custom)
    }
}

/// Demand steps, in time order.
#[derive(Debug, Default)]
struct Steps(Vec<Step>);

impl<'de> Deserialize<'de> for Steps {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(CheckedList {
            expecting: "a list of demand steps",
            check: Steps::check,
        })
    }
}

impl Steps {
    fn check(steps: Vec<Step>) -> Result<Self, String> {
        for pair in steps.windows(2) {
            if pair[1].at <= pair[0].at {
                return Err(format!(
                    "demand steps must be in time order: `at: {}` follows `at: {}`",
                    pair[1].at, pair[0].at
                ));
            }
        }
        Ok(Steps(steps))
    }
}

/// The jobs, at least one, ids unique.
#[derive(Debug)]
struct Jobs(Vec<Job>);

impl<'de> Deserialize<'de> for Jobs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(CheckedList {
            expecting: "a list of jobs",
            check: Jobs::check,
        })
    }
}

impl Jobs {
    fn check(jobs: Vec<Job>) -> Result<Self, String> {
        if jobs.is_empty() {
            return Err("there must be at least one job".to_owned());
        }
        let mut seen = HashSet::new();
        for job in &jobs {
            if !seen.insert(job.id.as_str()) {
                return Err(format!("job id `{}` is used twice: ids are unique", job.id));
            }
        }
        Ok(Jobs(jobs))
    }
}

impl TryFrom<RawJob> for Job {
    type Error = String;
    fn try_from(raw: RawJob) -> Result<Self, String> {
        let id = &raw.id;
        if raw.stages.is_empty() {
            return Err(format!("job {id} has no stages: list at least one"));
        }
        let mut seen = HashSet::new();
        if let Some(stage) = raw.stages.iter().find(|s| !seen.insert(s.as_str())) {
            return Err(format!("job {id} lists stage {stage} twice"));
        }
        if let Some(leave) = raw.leave
            && leave <= raw.arrive
        {
            return Err(format!(
                "job {id} leaves at {leave}, not after it arrives at {}: \
                 `leave` must be later than `arrive`",
                raw.arrive
            ));
        }
        Ok(Job {
            id: raw.id,
            labels: raw.labels,
            stages: raw.stages,
            arrive: raw.arrive,
            leave: raw.leave,
            demand: raw.demand.0,
        })
    }
}

impl TryFrom<RawScenario> for Scenario {
    type Error = String;
    fn try_from(raw: RawScenario) -> Result<Self, String> {
        let (tick, duration) = (raw.tick.0, raw.duration.0);
        let ticks = duration.0.div_ceil(tick.0);
        if ticks > MAX_TICKS {
            return Err(format!(
                "{} at one tick every {tick} is {ticks} ticks; at most {MAX_TICKS} \
                 run: shorten the duration or lengthen the tick",
                duration
            ));
        }
        check_nodes(&raw.nodes, &raw.jobs.0)?;
        Ok(Scenario {
            tick,
            ticks,
            nodes: raw.nodes,
            jobs: raw.jobs.0,
        })
    }
}

/// Every node is named once, and every stage it lists is a job's stage on
/// no other node.
fn check_nodes(nodes: &[Node], jobs: &[Job]) -> Result<(), String> {
    let used: HashSet<&str> = jobs
        .iter()
        .flat_map(|j| &j.stages)
        .map(String::as_str)
        .collect();
    let mut names = HashSet::new();
    let mut placed = BTreeMap::new();
    for (n, node) in nodes.iter().enumerate() {
        if !names.insert(node.name.as_str()) {
            return Err(format!("nodes[{n}]: node {} is listed twice", node.name));
        }
        for stage in &node.stages {
            if !used.contains(stage.as_str()) {
                return Err(format!(
                    "nodes[{n}]: node {} lists stage {stage}, which no job uses: \
                     known stages are {}",
                    node.name,
                    sorted(&used)
                ));
            }
            if let Some(other) = placed.insert(stage.as_str(), node.name.as_str()) {
                return Err(format!(
                    "nodes[{n}]: stage {stage} is on both node {other} and node {}: \
                     a stage runs on one node",
                    node.name
                ));
            }
        }
    }
    Ok(())
}

fn sorted(names: &HashSet<&str>) -> String {
    let mut names: Vec<&str> = names.iter().copied().collect();
    names.sort_unstable();
    names.join(", ")
}

impl Scenario {
    /// Parses and checks a scenario; `name` is the file as the user wrote
    /// it. Returns the error as `FILE:LINE:COLUMN: message` (`FILE: message`
    /// where the parser gives no place).
    pub fn parse(name: &str, text: &str) -> Result<Self, String> {
        serde_yaml_ng::from_str(text).map_err(|e| located(name, &e))
    }

    /// Returns the time of tick `tick`.
    pub fn time(&self, tick: u64) -> Millis {
        Millis(tick * self.tick.0)
    }
}

impl Job {
    /// Returns whether the job runs at `time`.
    pub fn runs_at(&self, time: Millis) -> bool {
        self.arrive <= time && self.leave.is_none_or(|leave| time < leave)
    }

    /// Returns the job's demand at `time`: the last step at or before it,
    /// greedy before the first.
    pub fn demand_at(&self, time: Millis) -> Want {
        self.demand
            .iter()
            .take_while(|step| step.at <= time)
            .last()
            .map_or(Want::Greedy, |step| step.bandwidth)
    }
}

/// Returns `FILE:LINE:COLUMN: message`, the message without the parser's
/// own ` at line L column C`.
fn located(name: &str, error: &serde_yaml_ng::Error) -> String {
    let text = error.to_string();
    match error.location() {
        Some(at) => {
            let suffix = format!(" at line {} column {}", at.line(), at.column());
            let message = text.replacen(&suffix, "", 1);
            format!("{name}:{}:{}: {message}", at.line(), at.column())
        }
        None => format!("{name}: {text}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
tick: 500ms
duration: 3s
nodes:
  - {name: node-a, stages: [stage-a], readers: 64, memory: 1GiB}
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
";

    fn error(text: &str) -> String {
        Scenario::parse("s.yaml", text).unwrap_err()
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

        let minimal =
            Scenario::parse("m.yaml", "duration: 2s\njobs: [{id: a, stages: [s]}]").unwrap();
        assert_eq!((minimal.tick, minimal.ticks), (Millis(1000), 2));
    }

    #[test]
    fn shape_errors_are_located() {
        let e = error("duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    leve: 2s\n");
        assert!(
            e.starts_with("s.yaml:5:5: jobs[0]: unknown field `leve`"),
            "{e}"
        );
        let e = error(
            "duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    demand: [{at: 1s, bandwidth: 20MiBps}]\n",
        );
        assert!(e.starts_with("s.yaml:5:"), "{e}");
        assert!(e.contains("invalid byte rate `20MiBps`"), "{e}");
        let e = error("duration: 3\njobs: [{id: a, stages: [s]}]\n");
        assert!(e.starts_with("s.yaml:1:11: "), "{e}");
        assert!(e.contains("write a unit"), "{e}");
    }

    #[test]
    fn impossible_values_are_located() {
        let cases = [
            (
                "tick: 0s\nduration: 3s\njobs: [{id: a, stages: [s]}]\n",
                "s.yaml:1:7: ",
                "tick: must be longer than 0ms",
            ),
            (
                "duration: 0s\njobs: [{id: a, stages: [s]}]\n",
                "s.yaml:1:11: ",
                "duration: must be longer than 0ms",
            ),
            (
                "duration: 3s\njobs: []\n",
                "s.yaml:2:7: ",
                "at least one job",
            ),
            (
                "duration: 3s\njobs:\n  - {id: a, stages: [s]}\n  - {id: a, stages: [s]}\n",
                "s.yaml:3:3: ",
                "`a` is used twice",
            ),
            (
                "duration: 3s\njobs:\n  - {id: a, stages: [s], arrive: 2s, leave: 1s}\n",
                "s.yaml:3:3: ",
                "`leave` must be later than `arrive`",
            ),
            (
                "duration: 3s\njobs:\n  - id: a\n    stages: [s]\n    demand: [{at: 2s, bandwidth: 1MiB/s}, {at: 2s, bandwidth: greedy}]\n",
                "s.yaml:5:13: ",
                "`at: 2s` follows `at: 2s`",
            ),
            (
                "duration: 3s\njobs: [{id: a, stages: [s, s]}]\n",
                "s.yaml:2:7: ",
                "stage s twice",
            ),
            (
                "duration: 3s\nnodes: [{name: n, stages: [t]}]\njobs: [{id: a, stages: [s]}]\n",
                "s.yaml: nodes[0]: ",
                "node n lists stage t, which no job uses: known stages are s",
            ),
            (
                "duration: 3s\nnodes: [{name: n, stages: [s]}, {name: m, stages: [s]}]\njobs: [{id: a, stages: [s]}]\n",
                "s.yaml: nodes[1]: ",
                "stage s is on both node n and node m",
            ),
            (
                "tick: 1ms\nduration: 100000s\njobs: [{id: a, stages: [s]}]\n",
                "s.yaml: ",
                "at most 86400 run",
            ),
        ];
        for (text, at, says) in cases {
            let e = error(text);
            assert!(e.starts_with(at) && e.contains(says), "{text}\n=> {e}");
        }
    }
}
