//! Running a scenario: at every tick, the jobs that run then and what they
//! want, built into a snapshot with the engine's own builder and
//! allocated, exactly as the controller does each tick. The result is the
//! [`Report`] that `-o json` prints as it is.

use std::collections::HashMap;

use serde::Serialize;
use sluice_policy::PolicySet;
use sluice_policy::allocation::{ObservedStage, Rates, Reason, Snapshot, allocate};

use super::scenario::{Job, Scenario};

/// Every tick of a simulation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Seconds between two ticks.
    pub tick_s: f64,
    /// One entry per tick, the first at time 0.
    pub ticks: Vec<Tick>,
}

/// The engine's answer at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tick {
    /// The tick's number, from 0.
    pub tick: u64,
    /// Seconds since the start.
    pub time_s: f64,
    /// The running jobs some policy selects, in scenario order.
    pub jobs: Vec<JobShare>,
    /// The ids of running jobs no policy selects: their stages run them on
    /// their own configuration.
    pub unmanaged: Vec<String>,
    /// What the engine could not do as the policies say.
    pub problems: Vec<String>,
}

/// One job's allocation at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobShare {
    /// The job's id.
    pub job: String,
    /// The pool it reads from.
    pub pool: String,
    /// The policy that selects it.
    pub policy: String,
    /// What it wants; `None` when greedy.
    pub demand_bytes_per_second: Option<f64>,
    /// What it gets.
    pub bytes_per_second: f64,
    /// Operations per second it gets; `None` when unlimited.
    pub ops_per_second: Option<f64>,
    /// Why it gets that much.
    pub reason: Reason,
    /// Its share on each stage, in the job's order.
    pub stages: Vec<StageShare>,
}

/// A job's share on one stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageShare {
    /// The stage's id.
    pub stage: String,
    /// Bytes per second.
    pub bytes_per_second: f64,
}

/// Runs every tick of `scenario` under `policies`.
pub fn simulate(scenario: &Scenario, policies: &PolicySet) -> Report {
    let ticks = (0..scenario.ticks)
        .map(|tick| run_tick(scenario, policies, tick))
        .collect();
    Report {
        tick_s: seconds(scenario.tick.0),
        ticks,
    }
}

/// Builds the snapshot at one tick and allocates it.
fn run_tick(scenario: &Scenario, policies: &PolicySet, tick: u64) -> Tick {
    let time = scenario.time(tick);
    let memory: HashMap<&str, u64> = scenario
        .nodes
        .iter()
        .flat_map(|n| n.stages.iter().map(|s| (s.as_str(), n.memory.bytes())))
        .collect();
    let mut snapshot = Snapshot::with_pools(policies);
    let mut managed: HashMap<&str, (&str, Option<f64>)> = HashMap::new();
    let mut unmanaged = Vec::new();
    for job in scenario.jobs.iter().filter(|j| j.runs_at(time)) {
        let demand = job.demand_at(time).bytes_per_second();
        let rates = Rates {
            bandwidth: demand,
            ops: None,
        };
        let stages = observed_stages(job, demand, &memory);
        match snapshot.add_job(policies, &job.id, &job.labels, rates, stages) {
            Some(policy) => {
                managed.insert(&job.id, (policy.name(), demand));
            }
            None => unmanaged.push(job.id.clone()),
        }
    }
    for node in &scenario.nodes {
        snapshot.add_node(
            &node.name,
            node.stages.clone(),
            node.readers,
            node.memory.bytes(),
        );
    }
    let allocation = allocate(&snapshot);
    let jobs = allocation
        .jobs
        .iter()
        .map(|a| {
            let (policy, demand) = managed.get(a.job.as_str()).copied().unwrap_or_default();
            JobShare {
                job: a.job.clone(),
                pool: a.pool.clone(),
                policy: policy.to_owned(),
                demand_bytes_per_second: demand,
                bytes_per_second: a.bandwidth.rate,
                ops_per_second: a.ops.map(|o| o.rate),
                reason: a.bandwidth.reason,
                stages: a
                    .stages
                    .iter()
                    .map(|s| StageShare {
                        stage: s.stage.clone(),
                        bytes_per_second: s.bandwidth,
                    })
                    .collect(),
            }
        })
        .collect();
    Tick {
        tick,
        time_s: seconds(time.0),
        jobs,
        unmanaged,
        problems: allocation
            .problems
            .iter()
            .map(ToString::to_string)
            .collect(),
    }
}

/// The job's stages as the controller would observe them: the demand split
/// evenly (greedy stays greedy), each stage's memory budget its node's.
fn observed_stages(
    job: &Job,
    demand: Option<f64>,
    memory: &HashMap<&str, u64>,
) -> Vec<ObservedStage> {
    let share = demand.map(|d| d / job.stages.len() as f64);
    job.stages
        .iter()
        .map(|stage| ObservedStage {
            stage: stage.clone(),
            demand: share,
            memory_budget: memory.get(stage.as_str()).copied().unwrap_or(0),
        })
        .collect()
}

fn seconds(millis: u64) -> f64 {
    millis as f64 / 1000.0
}
