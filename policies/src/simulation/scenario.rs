//! The scenario file of `sluicectl simulate`: which jobs run when, on which
//! stages, wanting how much (or observed reading how much), and the nodes
//! the stages run on. Read with the policy language's positioned YAML, so
//! every error reads `FILE:LINE:COLUMN: path: message` as a policy's does,
//! and units are the policy language's own (`20MiB/s` means here what it
//! means in a policy). Parsed into raw structs, then checked into a
//! [`Scenario`] that cannot be invalid.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::de::from_node;
use crate::error::{ErrorKind, Location, PolicyError, PolicyErrors};
use crate::yaml::{self, MAX_SCENARIO_NODES, parse_stream_within};
use crate::{ByteRate, ByteSize, Millis};

/// The most ticks one simulation runs: a day at one tick a second.
pub const MAX_TICKS: u64 = 86_400;

/// A checked scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// Time between two allocations.
    pub tick: Millis,
    /// How many ticks run: the first at 0, the last before the duration.
    pub ticks: u64,
    /// Nodes and the budgets their stages share.
    pub nodes: Vec<Node>,
    /// Jobs, in file order (the engine's order too).
    pub jobs: Vec<Job>,
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

/// A job: when it runs, where, and what it wants or is seen to read.
#[derive(Debug, Clone, PartialEq)]
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
    /// Its demand over time, `at` strictly increasing; empty when it is
    /// described by what was observed instead.
    pub demand: Vec<Step>,
    /// What its stages reported over time, `at` strictly increasing.
    pub observed: Vec<Observed>,
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

/// From `at` on, until the next one, the job's stages report that it read
/// `bandwidth` (all stages together), and whether its readers waited for
/// their limit while its trainers waited for data.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Observed {
    /// Time since the start of the simulation.
    pub at: Millis,
    /// What it read and delivered.
    pub bandwidth: ByteRate,
    /// Whether the limit held it back (default false).
    #[serde(default)]
    pub throttled: bool,
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
    /// Returns bytes per second, `None` for greedy.
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
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Want, E> {
                if v.trim() == "greedy" {
                    return Ok(Want::Greedy);
                }
                ByteRate::parse(v).map(Want::Rate).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Want, E> {
                Err(E::custom(
                    "a byte rate needs a unit: write for example `20MiB/s`, or `greedy`",
                ))
            }
        }
        d.deserialize_any(V)
    }
}

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    /// Time between two allocations (default `1s`).
    #[serde(default = "one_second")]
    tick: Millis,
    /// How long to simulate.
    duration: Millis,
    /// Nodes with budgets; a stage on no node gets its job's own bounds.
    #[serde(default)]
    nodes: Vec<Node>,
    /// The jobs, at least one.
    jobs: Vec<RawJob>,
}

fn one_second() -> Millis {
    Millis(1000)
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
    demand: Vec<Step>,
    /// Piecewise constant telemetry, instead of a demand.
    #[serde(default)]
    observed: Vec<Observed>,
}

/// A check that failed: the path of the node it concerns (as the field
/// path an operator reads, and as steps to find the node) and why.
struct Invalid {
    steps: Vec<String>,
    message: String,
}

impl Invalid {
    fn at(steps: &[&str], message: String) -> Self {
        Invalid {
            steps: steps.iter().map(|s| (*s).to_owned()).collect(),
            message,
        }
    }

    /// Returns the error placed at the node it concerns.
    fn locate(self, root: &yaml::Node, source: &Arc<str>) -> PolicyError {
        let steps: Vec<&str> = self.steps.iter().map(String::as_str).collect();
        let mut path = String::new();
        for step in &steps {
            match step.parse::<usize>() {
                Ok(_) => path.push_str(&format!("[{step}]")),
                Err(_) if path.is_empty() => path.push_str(step),
                Err(_) => path.push_str(&format!(".{step}")),
            }
        }
        if path.is_empty() {
            path = "the scenario".to_owned();
        }
        PolicyError {
            location: Location::new(source, root.locate(&steps)),
            kind: ErrorKind::InvalidValue {
                path,
                message: self.message,
            },
        }
    }
}

impl Scenario {
    /// Parses and checks a scenario; `source` names the text in errors
    /// (the file as the user wrote it). Returns the first error found.
    pub fn parse(source: &str, text: &str) -> Result<Self, PolicyErrors> {
        let source: Arc<str> = Arc::from(source);
        let one = |e: PolicyError| PolicyErrors(vec![e]);
        let syntax = |at, reason| {
            one(PolicyError {
                location: Location::new(&source, at),
                kind: ErrorKind::Syntax { reason },
            })
        };
        let mut nodes =
            parse_stream_within(text, MAX_SCENARIO_NODES).map_err(|e| syntax(e.at, e.reason))?;
        // The whole document when it is not a scenario's shape at all.
        let not_a_scenario = |at, found: &str| {
            one(PolicyError {
                location: Location::new(&source, at),
                kind: ErrorKind::WrongType {
                    path: "a scenario".into(),
                    expected: "a mapping with `duration:` and `jobs:` (and optionally `tick:` \
                               and `nodes:`)"
                        .into(),
                    found: found.into(),
                },
            })
        };
        match nodes.len() {
            0 => {
                let start = yaml::Pos { line: 1, column: 1 };
                return Err(not_a_scenario(start, "nothing (an empty file)"));
            }
            1 => {}
            found => {
                return Err(syntax(
                    nodes[1].at,
                    format!("a scenario is one document, found {found}"),
                ));
            }
        }
        let root = nodes.remove(0);
        match &root.value {
            yaml::Value::Map(_) => {}
            yaml::Value::Seq(_) => return Err(not_a_scenario(root.at, "a list")),
            yaml::Value::Scalar { .. } => return Err(not_a_scenario(root.at, "a single value")),
        }
        let raw: RawScenario =
            from_node(&root, "").map_err(|e| one(e.into_policy_error(&source)))?;
        raw.check().map_err(|e| one(e.locate(&root, &source)))
    }

    /// Returns the time of tick `tick`.
    pub fn time(&self, tick: u64) -> Millis {
        Millis(tick * self.tick.0)
    }
}

impl RawScenario {
    fn check(self) -> Result<Scenario, Invalid> {
        for (field, value) in [("tick", self.tick), ("duration", self.duration)] {
            if value.0 == 0 {
                let message = "must be longer than 0ms, for example `1s`".to_owned();
                return Err(Invalid::at(&[field], message));
            }
        }
        let ticks = self.duration.0.div_ceil(self.tick.0);
        if ticks > MAX_TICKS {
            let message = format!(
                "{} at one tick every {} is {ticks} ticks; at most {MAX_TICKS} run: \
                 shorten the duration or lengthen the tick",
                self.duration, self.tick
            );
            return Err(Invalid::at(&["duration"], message));
        }
        let jobs = check_jobs(self.jobs)?;
        check_runs(&jobs, self.tick, ticks)?;
        check_nodes(&self.nodes, &jobs)?;
        Ok(Scenario {
            tick: self.tick,
            ticks,
            nodes: self.nodes,
            jobs,
        })
    }
}

/// At least one job, ids unique, each job sound.
fn check_jobs(raw: Vec<RawJob>) -> Result<Vec<Job>, Invalid> {
    if raw.is_empty() {
        let message = "there must be at least one job".to_owned();
        return Err(Invalid::at(&["jobs"], message));
    }
    let mut seen = HashSet::new();
    let mut jobs = Vec::with_capacity(raw.len());
    for (n, job) in raw.into_iter().enumerate() {
        let index = n.to_string();
        let at = |field: &str, message: String| Invalid::at(&["jobs", &index, field], message);
        if !seen.insert(job.id.clone()) {
            let message = format!("job id `{}` is used twice: ids are unique", job.id);
            return Err(at("id", message));
        }
        jobs.push(job.check().map_err(|(field, message)| at(field, message))?);
    }
    Ok(jobs)
}

impl RawJob {
    /// Returns the checked job, or the field that is wrong and why.
    fn check(self) -> Result<Job, (&'static str, String)> {
        let id = &self.id;
        if !crate::valid_job_id(id) {
            return Err((
                "id",
                format!(
                    "job id `{}` is not one a trainer can announce: use 1 to {} letters, digits, `.`, `_` or `-` (not `.` or `..`)",
                    id.escape_debug(),
                    crate::MAX_JOB_ID_BYTES
                ),
            ));
        }
        for (key, value) in &self.labels {
            crate::check_label(key, value).map_err(|e| ("labels", format!("job {id}: {e}")))?;
        }
        if self.stages.is_empty() {
            return Err((
                "stages",
                format!("job {id} has no stages: list at least one"),
            ));
        }
        let mut seen = HashSet::new();
        if let Some(stage) = self.stages.iter().find(|s| !seen.insert(s.as_str())) {
            return Err(("stages", format!("job {id} lists stage {stage} twice")));
        }
        if let Some(leave) = self.leave
            && leave <= self.arrive
        {
            let message = format!(
                "job {id} leaves at {leave}, not after it arrives at {}: \
                 `leave` must be later than `arrive`",
                self.arrive
            );
            return Err(("leave", message));
        }
        if !self.demand.is_empty() && !self.observed.is_empty() {
            let message = format!(
                "job {id} has both `demand` and `observed`: describe it by what it \
                 wants or by what its stages reported, not both"
            );
            return Err(("observed", message));
        }
        in_time_order(self.demand.iter().map(|s| s.at)).map_err(|m| ("demand", m))?;
        in_time_order(self.observed.iter().map(|o| o.at)).map_err(|m| ("observed", m))?;
        Ok(Job {
            id: self.id,
            labels: self.labels,
            stages: self.stages,
            arrive: self.arrive,
            leave: self.leave,
            demand: self.demand,
            observed: self.observed,
        })
    }
}

/// Every job is there at some tick: one that arrives after the last, or
/// leaves before the next tick after it arrives, would never run (and
/// not show in the report).
fn check_runs(jobs: &[Job], tick: Millis, ticks: u64) -> Result<(), Invalid> {
    for (n, job) in jobs.iter().enumerate() {
        let first = job.arrive.0.div_ceil(tick.0) * tick.0;
        let last = (ticks - 1) * tick.0;
        let message = if first > last {
            format!(
                "job {} arrives at {}, after the last tick ({}): it never runs; lengthen `duration`",
                job.id,
                job.arrive,
                Millis(last)
            )
        } else if job.leave.is_some_and(|leave| leave.0 <= first) {
            format!(
                "job {} is there from {} until {}, between two ticks (one every {tick}): it never runs; shorten `tick` or stay longer",
                job.id,
                job.arrive,
                job.leave.unwrap_or_default()
            )
        } else {
            continue;
        };
        return Err(Invalid::at(&["jobs", &n.to_string(), "arrive"], message));
    }
    Ok(())
}

fn in_time_order(times: impl Iterator<Item = Millis>) -> Result<(), String> {
    let mut before: Option<Millis> = None;
    for at in times {
        if let Some(b) = before
            && at <= b
        {
            return Err(format!(
                "steps must be in time order: `at: {at}` follows `at: {b}`"
            ));
        }
        before = Some(at);
    }
    Ok(())
}

/// Every node is named once, and every stage it lists is a job's stage on
/// no other node.
fn check_nodes(nodes: &[Node], jobs: &[Job]) -> Result<(), Invalid> {
    let used: HashSet<&str> = jobs
        .iter()
        .flat_map(|j| &j.stages)
        .map(String::as_str)
        .collect();
    let mut names = HashSet::new();
    let mut placed = BTreeMap::new();
    for (n, node) in nodes.iter().enumerate() {
        let index = n.to_string();
        let at = |field: &str, message: String| Invalid::at(&["nodes", &index, field], message);
        if !names.insert(node.name.as_str()) {
            return Err(at("name", format!("node {} is listed twice", node.name)));
        }
        for stage in &node.stages {
            if !used.contains(stage.as_str()) {
                let message = format!(
                    "node {} lists stage {stage}, which no job uses: known stages are {}",
                    node.name,
                    sorted(&used)
                );
                return Err(at("stages", message));
            }
            if let Some(other) = placed.insert(stage.as_str(), node.name.as_str()) {
                let message = format!(
                    "stage {stage} is on both node {other} and node {}: a stage runs on one node",
                    node.name
                );
                return Err(at("stages", message));
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

    /// Returns what its stages reported at `time`: the last observation at
    /// or before it; `None` before the first.
    pub fn observed_at(&self, time: Millis) -> Option<Observed> {
        self.observed
            .iter()
            .take_while(|o| o.at <= time)
            .last()
            .copied()
    }
}

#[cfg(test)]
mod tests;
