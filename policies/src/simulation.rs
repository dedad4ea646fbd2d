//! Running a [`Scenario`] through the controller's own decision: at every
//! tick, each job's stages report what it did since the tick before (a
//! window, as a stage's telemetry gives it), a [`Coordinator`] estimates
//! demand, allocates, lends and decides what to push, and what each stage
//! would then enforce bounds what each job reads until the next tick.
//! Nothing here is a second model of the controller: the estimates, the
//! loans and the hysteresis are the ones it runs, so `sluicectl simulate`
//! prints what the controller would enforce.
//!
//! How a job behaves between ticks: one described by its `demand` reads
//! `min(what it wants, what its stage enforces)` on each stage (its want
//! split evenly among them), and counts as throttled and stalled while it
//! wants more than it is allowed, as a real trainer would; one described
//! by what its stages `observed` reports exactly that. A job is unknown
//! (greedy) at the tick it arrives, as it is to the controller, which
//! computes at once when a stage reports a new job.

pub mod scenario;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::coordination::demand::Window;
use crate::coordination::{
    Coordinator, JobReport, JobShare, StageAssignment, StageReport, to_push,
};
use crate::{Millis, PolicySet};
pub use scenario::{Job, Node, Observed, Scenario, Step, Want};

/// Every tick of a simulation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Seconds between two ticks.
    pub tick_s: f64,
    /// One entry per tick, the first at time 0.
    pub ticks: Vec<Tick>,
}

/// The decision at one tick.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tick {
    /// The tick's number, from 0.
    pub tick: u64,
    /// Seconds since the start.
    pub time_s: f64,
    /// The running jobs some policy selects, in scenario order.
    pub jobs: Vec<JobTick>,
    /// The ids of running jobs no policy selects: their stages run them on
    /// their own configuration.
    pub unmanaged: Vec<String>,
    /// What the engine could not do as the policies say.
    pub problems: Vec<String>,
}

/// One job at one tick: its share as the controller computes it, what it
/// wants and what it then reads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobTick {
    /// The job's id.
    pub job: String,
    /// What the scenario says it wants; `None` when greedy or described
    /// by observations.
    pub wants_bytes_per_second: Option<f64>,
    /// Its share: allocated (`bytes_per_second`), why (`reason`), its
    /// estimated demand, what its stages enforce, per stage.
    #[serde(flatten)]
    pub share: JobShare,
    /// What it reads until the next tick, all stages together, under the
    /// settings its stages then run.
    pub rate_bytes_per_second: f64,
}

/// What a job did on one stage over one tick.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Activity {
    bytes_per_second: f64,
    pressed: bool,
}

/// What the simulation carries from tick to tick, as the controller and
/// its stages would.
struct Run<'s> {
    scenario: &'s Scenario,
    policies: &'s PolicySet,
    coordinator: Coordinator,
    /// What each stage enforces (the last assignment pushed to it).
    in_force: BTreeMap<String, StageAssignment>,
    /// What each (job, stage) did since the last tick.
    activity: BTreeMap<(String, String), Activity>,
}

/// Runs every tick of `scenario` under `policies`.
pub fn simulate(scenario: &Scenario, policies: &PolicySet) -> Report {
    let mut run = Run {
        scenario,
        policies,
        coordinator: Coordinator::new(),
        in_force: BTreeMap::new(),
        activity: BTreeMap::new(),
    };
    let ticks = (0..scenario.ticks).map(|tick| run.tick(tick)).collect();
    Report {
        tick_s: seconds(scenario.tick),
        ticks,
    }
}

impl Run<'_> {
    /// Decides at one tick, pushes what changed, and lets the jobs read
    /// until the next.
    fn tick(&mut self, tick: u64) -> Tick {
        let time = self.scenario.time(tick);
        let running: Vec<&Job> = self
            .scenario
            .jobs
            .iter()
            .filter(|j| j.runs_at(time))
            .collect();
        let windows = self.windows(&running, time);
        let reports = reports(self.scenario, &running, &windows);
        let decision = self.coordinator.decide(self.policies, &reports);
        for (stage, next) in decision.assignments {
            let pushed = to_push(self.in_force.get(&stage), next, false);
            if let Some(assignment) = pushed {
                self.in_force.insert(stage, assignment);
            }
        }
        let mut jobs = Vec::new();
        let mut unmanaged = Vec::new();
        for job in &running {
            let rate = self.read_until_next(job, time);
            match decision.shares.jobs.get(&job.id) {
                Some(share) => jobs.push(JobTick {
                    job: job.id.clone(),
                    wants_bytes_per_second: job.demand_at(time).bytes_per_second(),
                    share: share.clone(),
                    rate_bytes_per_second: rate,
                }),
                None => unmanaged.push(job.id.clone()),
            }
        }
        Tick {
            tick,
            time_s: seconds(time),
            jobs,
            unmanaged,
            problems: decision.shares.problems,
        }
    }

    /// Returns each running job's window on each of its stages, by job
    /// index in `running`: what its stages report at `time`.
    fn windows(&self, running: &[&Job], time: Millis) -> Vec<Vec<Option<Window>>> {
        running
            .iter()
            .map(|job| {
                let per_stage = job.stages.len() as f64;
                let observed = job.observed_at(time);
                job.stages
                    .iter()
                    .map(|stage| {
                        let activity = if job.observed.is_empty() {
                            let key = (job.id.clone(), stage.clone());
                            self.activity.get(&key).copied()
                        } else {
                            observed.map(|o| Activity {
                                bytes_per_second: o.bandwidth.bytes_per_second() as f64 / per_stage,
                                pressed: o.throttled,
                            })
                        };
                        activity.map(|a| window(a, time))
                    })
                    .collect()
            })
            .collect()
    }

    /// Records what `job` reads on each stage until the next tick under
    /// the settings in force, and returns its total.
    fn read_until_next(&mut self, job: &Job, time: Millis) -> f64 {
        if !job.observed.is_empty() {
            let observed = job.observed_at(time);
            return observed.map_or(0.0, |o| o.bandwidth.bytes_per_second() as f64);
        }
        let per_stage = job.stages.len() as f64;
        let wants = job
            .demand_at(time)
            .bytes_per_second()
            .map(|w| w / per_stage);
        let mut total = 0.0;
        for stage in &job.stages {
            let limit = self
                .in_force
                .get(stage)
                .and_then(|a| a.jobs.get(&job.id))
                .and_then(|j| j.bytes_per_second)
                .map(|b| b as f64);
            let key = (job.id.clone(), stage.clone());
            let activity = match (wants, limit) {
                (Some(w), Some(l)) => Some(Activity {
                    bytes_per_second: w.min(l),
                    pressed: w > l,
                }),
                (None, Some(l)) => Some(Activity {
                    bytes_per_second: l,
                    pressed: true,
                }),
                (Some(w), None) => Some(Activity {
                    bytes_per_second: w,
                    pressed: false,
                }),
                // Greedy and unlimited: nothing bounds what it would read.
                (None, None) => None,
            };
            match activity {
                Some(a) => {
                    total += a.bytes_per_second;
                    self.activity.insert(key, a);
                }
                None => {
                    self.activity.remove(&key);
                }
            }
        }
        total
    }
}

/// Returns every stage's report: the scenario's nodes' stages and the
/// running jobs' stages, with the jobs on each.
fn reports<'a>(
    scenario: &'a Scenario,
    running: &[&'a Job],
    windows: &[Vec<Option<Window>>],
) -> Vec<StageReport<'a>> {
    let mut stages: BTreeSet<&str> = scenario
        .nodes
        .iter()
        .flat_map(|n| n.stages.iter().map(String::as_str))
        .collect();
    stages.extend(
        running
            .iter()
            .flat_map(|j| j.stages.iter().map(String::as_str)),
    );
    stages
        .into_iter()
        .map(|stage| {
            let node = scenario
                .nodes
                .iter()
                .find(|n| n.stages.iter().any(|s| s == stage));
            let jobs = running
                .iter()
                .zip(windows)
                .filter_map(|(job, windows)| {
                    let at = job.stages.iter().position(|s| s == stage)?;
                    Some(JobReport {
                        id: &job.id,
                        labels: &job.labels,
                        window: windows[at],
                    })
                })
                .collect();
            StageReport {
                id: stage,
                node: node.map_or(stage, |n| n.name.as_str()),
                memory_budget: node.map_or(0, |n| n.memory.bytes()),
                reader_budget: node.map_or(0, |n| n.readers),
                jobs,
            }
        })
        .collect()
}

/// The window a stage reports at `time` for a job that did `activity`
/// over the tick before.
fn window(activity: Activity, time: Millis) -> Window {
    let pressure = if activity.pressed { 1.0 } else { 0.0 };
    Window {
        read_bytes_per_second: activity.bytes_per_second,
        delivered_bytes_per_second: activity.bytes_per_second,
        cache_hit_bytes_per_second: 0.0,
        delivered_samples_per_second: 0.0,
        throttled: pressure,
        stalled: pressure,
        ends_at: i64::try_from(time.0).unwrap_or(i64::MAX),
    }
}

fn seconds(time: Millis) -> f64 {
    time.0 as f64 / 1000.0
}

#[cfg(test)]
mod tests;
