//! The controller's whole decision, pure: what each job wants
//! ([`demand`]: estimated from telemetry windows), what it gets (the
//! [`allocation`](crate::allocation) engine), what its stages enforce
//! (the allocation plus a [`loan`] of capacity nobody wants), and what is
//! worth pushing ([`settle`], [`to_push`]). The controller feeds a
//! [`Coordinator`] the stages' telemetry every tick and pushes what it
//! returns; `sluicectl simulate` feeds the same [`Coordinator`] the
//! telemetry a scenario implies (the `simulation` module), so the two agree
//! by construction.
//!
//! ```text
//!  StageReport (windows) ──▶ Demands::update ──▶ Snapshot ──▶ allocate ──▶ lend_spare ──▶ Decision
//!                            (demand.rs)        (allocation::build)        (loan.rs)      per stage: StageAssignment
//!                                                                                         per job:   JobShare
//! ```
//!
//! Jobs no policy selects are left out, so their stages run them on their
//! own configuration.

mod assignment;
mod cache;
pub mod demand;
mod loan;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::allocation::{
    Allocation, JobAllocation, ObservedStage, Rates, Reason, Snapshot, allocate,
};
use crate::{JobPolicy, PolicySet};
pub use assignment::{JobAssignment, RATE_TOLERANCE, StageAssignment, settle, to_push};
pub use cache::{DatasetCacheAssignment, PRELOAD_ROUND, cache_assignment};
use demand::{Demands, StageDemand, Window, job_demand};
pub use loan::lend_spare;

/// A stage at one tick: where it runs, its budgets, and the jobs it
/// serves with what each did since the stage's previous report.
#[derive(Debug, Clone)]
pub struct StageReport<'a> {
    /// The stage's id.
    pub id: &'a str,
    /// The node it runs on.
    pub node: &'a str,
    /// Bytes for all its buffers (0: not limited).
    pub memory_budget: u64,
    /// Reader threads for all its jobs (0: not said).
    pub reader_budget: u32,
    /// The jobs reading there (with trainers connected).
    pub jobs: Vec<JobReport<'a>>,
}

/// A job on a stage at one tick.
#[derive(Debug, Clone)]
pub struct JobReport<'a> {
    /// The job's id.
    pub id: &'a str,
    /// Its labels, which the policies' selectors match.
    pub labels: &'a BTreeMap<String, String>,
    /// What it did since the stage's previous report; `None` when there
    /// is nothing to compare with yet (a job new on the stage).
    pub window: Option<Window>,
}

/// A job's allocation as operators see it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobShare {
    /// The pool it draws from.
    pub pool: String,
    /// The JobPolicy that selects it.
    pub policy: String,
    /// Bytes per second, all stages together.
    pub bytes_per_second: f64,
    /// Operations per second, all stages together; `None`: unlimited.
    pub ops_per_second: Option<f64>,
    /// Why the bandwidth is what it is (`weighted-share`, `cap`, ...).
    pub reason: Reason,
    /// Estimated demand in bytes per second; `None`: greedy or unknown.
    pub demand_bytes_per_second: Option<f64>,
    /// What its stages enforce, all together: the allocation plus pool
    /// capacity lent while no other job wants it (see [`lend_spare`]).
    pub enforced_bytes_per_second: f64,
    /// Per stage, in the order the stages reported.
    pub stages: Vec<StageShare>,
}

/// A job's share on one stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageShare {
    /// The stage's id.
    pub stage: String,
    /// Allocated bytes per second.
    pub bytes_per_second: f64,
    /// Enforced bytes per second (allocation plus loan).
    pub enforced_bytes_per_second: f64,
}

/// A pool's capacity and how much of it is allocated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolShare {
    /// Declared bandwidth, bytes per second.
    pub capacity_bytes_per_second: f64,
    /// Allocated to its jobs, bytes per second.
    pub allocated_bytes_per_second: f64,
    /// Declared operations per second, when limited.
    pub capacity_ops_per_second: Option<f64>,
    /// Operations per second allocated to its jobs.
    pub allocated_ops_per_second: f64,
    /// What the engine could not do in it as its policies say.
    pub problems: Vec<String>,
}

/// One tick's decision: what every stage should enforce, and the shares
/// behind it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    /// Per stage id (every stage reported, possibly with no jobs).
    pub assignments: BTreeMap<String, StageAssignment>,
    /// Jobs' and pools' shares, as operators see them.
    pub shares: Shares,
}

/// Every managed job's and every pool's share at one tick.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shares {
    /// Per managed job.
    pub jobs: BTreeMap<String, JobShare>,
    /// Per pool.
    pub pools: BTreeMap<String, PoolShare>,
    /// What the engine could not do as the policies say.
    pub problems: Vec<String>,
}

/// What the controller carries from tick to tick: the demand estimates
/// (with their hysteresis).
#[derive(Debug, Default)]
pub struct Coordinator {
    demands: Demands,
}

impl Coordinator {
    /// Returns a coordinator that knows nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Estimates every job's demand from this tick's reports and decides
    /// what each stage enforces. Jobs and stages not reported are
    /// forgotten.
    pub fn decide(&mut self, policies: &PolicySet, stages: &[StageReport<'_>]) -> Decision {
        let windows = stages
            .iter()
            .flat_map(|s| s.jobs.iter().map(move |j| (j.id, s.id, j.window)));
        let demands = self.demands.update(windows);
        assign(policies, stages, demands)
    }
}

/// Decides what each stage enforces from the policies, the stages and the
/// jobs' estimated demand (by job, then stage; a job or stage missing
/// there counts as unknown, that is greedy). The one-tick core of
/// [`Coordinator::decide`].
pub fn assign(
    policies: &PolicySet,
    stages: &[StageReport<'_>],
    demands: &BTreeMap<String, BTreeMap<String, StageDemand>>,
) -> Decision {
    let (snapshot, placed) = snapshot(policies, stages, demands);
    let allocation = allocate(&snapshot);
    let enforced = lend_spare(&snapshot, &allocation);
    let mut decision = Decision {
        assignments: stages
            .iter()
            .map(|s| (s.id.to_owned(), unmanaged(s, &placed)))
            .collect(),
        shares: Shares {
            pools: pool_shares(&snapshot, &allocation),
            problems: allocation
                .problems
                .iter()
                .map(ToString::to_string)
                .collect(),
            jobs: BTreeMap::new(),
        },
    };
    for (job, &enforced) in allocation.jobs.iter().zip(&enforced) {
        if let Some(&(policy, demand)) = placed.get(&job.job) {
            decision.record(policy, job, demand, enforced);
        }
    }
    decision
}

/// Returns a stage's assignment before the managed jobs are added: the
/// jobs reading there that no policy placed.
fn unmanaged(stage: &StageReport<'_>, placed: &Placed<'_>) -> StageAssignment {
    StageAssignment {
        jobs: BTreeMap::new(),
        unmanaged: stage
            .jobs
            .iter()
            .filter(|j| !placed.contains_key(j.id))
            .map(|j| j.id.to_owned())
            .collect(),
        cache: BTreeMap::new(),
    }
}

/// The policy that placed a job, and its estimated demand.
type Placed<'p> = BTreeMap<String, (&'p JobPolicy, Option<f64>)>;

/// Builds the engine's input: every pool, every job some policy selects
/// (with its demand over all its stages and on each), every node.
fn snapshot<'p>(
    policies: &'p PolicySet,
    stages: &[StageReport<'_>],
    demands: &BTreeMap<String, BTreeMap<String, StageDemand>>,
) -> (Snapshot, Placed<'p>) {
    // Each job's labels (from the first stage reporting it) and stages.
    let mut jobs: BTreeMap<&str, (&BTreeMap<String, String>, Vec<&StageReport<'_>>)> =
        BTreeMap::new();
    for stage in stages {
        for job in &stage.jobs {
            jobs.entry(job.id)
                .or_insert((job.labels, Vec::new()))
                .1
                .push(stage);
        }
    }
    let mut snapshot = Snapshot::with_pools(policies);
    let mut placed = Placed::new();
    let unknown = BTreeMap::new();
    for (&job, (labels, on)) in &jobs {
        let estimates = demands.get(job).unwrap_or(&unknown);
        let on_stage = |s: &StageReport<'_>| estimates.get(s.id).copied();
        let all: Vec<StageDemand> = on
            .iter()
            .map(|s| on_stage(s).unwrap_or(StageDemand::UNKNOWN))
            .collect();
        let demand = job_demand(&all);
        let observed = on.iter().map(|s| ObservedStage {
            stage: s.id.to_owned(),
            demand: on_stage(s).and_then(|d| d.bytes_per_second),
            wants_more: on_stage(s).is_some_and(|d| d.wants_more),
            memory_budget: s.memory_budget,
        });
        let rates = Rates {
            bandwidth: demand,
            ops: None,
        };
        if let Some(policy) = snapshot.add_job(policies, job, *labels, rates, observed) {
            placed.insert(job.to_owned(), (policy, demand));
        }
    }
    add_nodes(&mut snapshot, stages);
    (snapshot, placed)
}

/// Adds each node with the stages on it and the sum of their budgets.
fn add_nodes(snapshot: &mut Snapshot, stages: &[StageReport<'_>]) {
    let mut nodes: BTreeMap<&str, (Vec<String>, u32, u64)> = BTreeMap::new();
    for stage in stages {
        let node = nodes.entry(stage.node).or_default();
        node.0.push(stage.id.to_owned());
        node.1 = node.1.saturating_add(stage.reader_budget);
        node.2 = node.2.saturating_add(stage.memory_budget);
    }
    snapshot.add_nodes(
        nodes
            .into_iter()
            .map(|(name, (ids, readers, buffer))| (name.to_owned(), ids, readers, buffer)),
    );
}

/// Returns every pool's capacity and what the allocation gives its jobs.
fn pool_shares(snapshot: &Snapshot, allocation: &Allocation) -> BTreeMap<String, PoolShare> {
    snapshot
        .pools
        .iter()
        .map(|pool| {
            let members = || allocation.jobs.iter().filter(|j| j.pool == pool.name);
            let share = PoolShare {
                capacity_bytes_per_second: pool.bandwidth,
                // From +0 (an empty f64 sum is -0, shown as `-0`).
                allocated_bytes_per_second: members().fold(0.0, |sum, j| sum + j.bandwidth.rate),
                capacity_ops_per_second: pool.ops,
                allocated_ops_per_second: members()
                    .filter_map(|j| j.ops)
                    .fold(0.0, |sum, o| sum + o.rate),
                problems: allocation
                    .problems
                    .iter()
                    .filter(|p| p.pool() == Some(pool.name.as_str()))
                    .map(ToString::to_string)
                    .collect(),
            };
            (pool.name.clone(), share)
        })
        .collect()
}

impl Decision {
    /// Records a managed job's share and its assignment on each stage; the
    /// loan goes to the stages in the allocation's proportions.
    fn record(
        &mut self,
        policy: &JobPolicy,
        job: &JobAllocation,
        demand: Option<f64>,
        enforced: f64,
    ) {
        let scale = |part: f64| match job.bandwidth.rate {
            0.0 => enforced / job.stages.len() as f64,
            rate => part * enforced / rate,
        };
        let mut stages = Vec::with_capacity(job.stages.len());
        for stage in &job.stages {
            let on_stage = scale(stage.bandwidth);
            if let Some(assignment) = self.assignments.get_mut(&stage.stage) {
                let settings = JobAssignment::new(policy, job, stage, on_stage);
                assignment.jobs.insert(job.job.clone(), settings);
            }
            stages.push(StageShare {
                stage: stage.stage.clone(),
                bytes_per_second: stage.bandwidth,
                enforced_bytes_per_second: on_stage,
            });
        }
        let share = JobShare {
            pool: job.pool.clone(),
            policy: policy.name().to_owned(),
            bytes_per_second: job.bandwidth.rate,
            ops_per_second: job.ops.map(|o| o.rate),
            reason: job.bandwidth.reason,
            demand_bytes_per_second: demand,
            enforced_bytes_per_second: enforced,
            stages,
        };
        self.shares.jobs.insert(job.job.clone(), share);
    }
}

#[cfg(test)]
mod tests;
