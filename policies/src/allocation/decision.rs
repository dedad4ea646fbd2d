//! The engine's output: an [`Allocation`] per job and stage, with the
//! [`Problem`]s met on the way.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::Bounds;

/// The engine's decisions for one snapshot.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Allocation {
    /// One entry per job whose pool exists, in snapshot order.
    pub jobs: Vec<JobAllocation>,
    /// What could not be done as the policy says, and what was done instead.
    pub problems: Vec<Problem>,
}

impl Allocation {
    /// Returns the allocation of the job with this id.
    pub fn job(&self, id: &str) -> Option<&JobAllocation> {
        self.jobs.iter().find(|j| j.job == id)
    }
}

/// A job's allocation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobAllocation {
    /// The job's id.
    pub job: String,
    /// Its pool.
    pub pool: String,
    /// Bytes per second, and why.
    pub bandwidth: Share,
    /// Operations per second, and why; `None` when unlimited (the pool has
    /// no operations capacity and the job no operations limit).
    pub ops: Option<Share>,
    /// Per stage, in the job's order.
    pub stages: Vec<StageAllocation>,
}

/// An allocated rate and the reason it is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Share {
    /// Per second.
    pub rate: f64,
    /// Why.
    pub reason: Reason,
}

/// Why a job's allocation is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// Held at its guarantee (possibly scaled down, see `problems`).
    Guarantee,
    /// Its weighted max-min share.
    #[default]
    WeightedShare,
    /// At its limit.
    Cap,
    /// At its estimated demand.
    DemandLimited,
    /// Held below its demand by a higher priority class.
    Priority,
    /// A `static` pool's fixed share.
    Static,
}

impl Reason {
    /// Returns the kebab-case name shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Guarantee => "guarantee",
            Reason::WeightedShare => "weighted-share",
            Reason::Cap => "cap",
            Reason::DemandLimited => "demand-limited",
            Reason::Priority => "priority",
            Reason::Static => "static",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one stage should enforce for one job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageAllocation {
    /// The stage's id.
    pub stage: String,
    /// The node it runs on, when known.
    pub node: Option<String>,
    /// Bytes per second (the token bucket's rate).
    pub bandwidth: f64,
    /// Operations per second, when limited.
    pub ops: Option<f64>,
    /// Reader threads the stage's tuner may use.
    pub readers: Bounds<u32>,
    /// Prefetch-buffer bytes.
    pub buffer: u64,
}

/// A pool resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Resource {
    /// Bytes per second.
    Bandwidth,
    /// Operations per second.
    Ops,
}

impl Resource {
    /// Its name in a problem's text.
    fn name(self) -> &'static str {
        match self {
            Self::Bandwidth => "bandwidth",
            Self::Ops => "operation",
        }
    }

    /// `value` of it as people read it (`27.0 MiB/s`, `1200 ops/s`).
    fn amount(self, value: f64) -> String {
        match self {
            Self::Bandwidth => format!("{:.1} MiB/s", value / MIB),
            Self::Ops => format!("{value:.0} ops/s"),
        }
    }
}

const MIB: f64 = (1u64 << 20) as f64;

impl NodeResource {
    /// Its name in a problem's text.
    fn name(self) -> &'static str {
        match self {
            Self::Readers => "reader",
            Self::Buffer => "buffer",
        }
    }

    /// `value` of it as people read it (`3 readers`, `512.0 MiB`).
    fn amount(self, value: u64) -> String {
        match self {
            Self::Readers => format!("{value} reader{}", if value == 1 { "" } else { "s" }),
            Self::Buffer => format!("{:.1} MiB", value as f64 / MIB),
        }
    }
}

/// A node resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeResource {
    /// Reader threads.
    Readers,
    /// Buffer bytes.
    Buffer,
}

/// Something the policy asks for that could not be done as written.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "problem", rename_all = "kebab-case")]
pub enum Problem {
    /// A job names a pool the snapshot does not have; it got nothing.
    UnknownPool { job: String, pool: String },
    /// A job's weight is not a positive number; 1 was used.
    InvalidWeight { job: String, weight: f64 },
    /// A pool's capacity is negative or not a finite number; 0 was used.
    InvalidCapacity {
        pool: String,
        resource: Resource,
        capacity: f64,
    },
    /// A second pool with a name already seen; it was ignored.
    DuplicatePool { pool: String },
    /// The pool's guarantees add up to more than its capacity; every
    /// guarantee was multiplied by `scale`.
    GuaranteesInfeasible {
        pool: String,
        resource: Resource,
        guaranteed: f64,
        capacity: f64,
        scale: f64,
    },
    /// A static pool's limits add up to more than its capacity.
    StaticOverCommitted {
        pool: String,
        resource: Resource,
        limits: f64,
        capacity: f64,
    },
    /// A job in a static pool has neither a limit nor a guarantee; it got 0.
    StaticWithoutLimit { job: String, pool: String },
    /// The minimums of the jobs on a node exceed its budget; they were
    /// scaled down in proportion.
    NodeOverCommitted {
        node: String,
        resource: NodeResource,
        minimums: u64,
        budget: u64,
    },
    /// A job's stage is on no known node; it got its maximum bounds.
    UnplacedStage { job: String, stage: String },
}

impl Problem {
    /// The pool the problem is in, when it is one pool's.
    pub fn pool(&self) -> Option<&str> {
        match self {
            Problem::UnknownPool { pool, .. }
            | Problem::InvalidCapacity { pool, .. }
            | Problem::DuplicatePool { pool }
            | Problem::GuaranteesInfeasible { pool, .. }
            | Problem::StaticOverCommitted { pool, .. }
            | Problem::StaticWithoutLimit { pool, .. } => Some(pool),
            Problem::InvalidWeight { .. }
            | Problem::NodeOverCommitted { .. }
            | Problem::UnplacedStage { .. } => None,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UnknownPool { job, pool } => write!(f, "job {job} names unknown pool {pool}"),
            Problem::InvalidWeight { job, weight } => {
                write!(f, "job {job} has weight {weight}; used 1")
            }
            Problem::InvalidCapacity {
                pool,
                resource,
                capacity,
            } => write!(
                f,
                "pool {pool} has {resource:?} capacity {capacity}; used 0"
            ),
            Problem::DuplicatePool { pool } => {
                write!(f, "pool {pool} is listed twice; the second was ignored")
            }
            Problem::GuaranteesInfeasible {
                pool,
                resource,
                guaranteed,
                capacity,
                scale,
            } => {
                write!(
                    f,
                    "pool {pool}: {} guarantees add up to {} against capacity {}; scaled by {scale:.4}",
                    resource.name(),
                    resource.amount(*guaranteed),
                    resource.amount(*capacity)
                )?;
                if guaranteed * scale < capacity * (1.0 - 1e-9) {
                    write!(f, " (the rest is left to the jobs without one)")?;
                }
                Ok(())
            }
            Problem::StaticOverCommitted {
                pool,
                resource,
                limits,
                capacity,
            } => {
                write!(
                    f,
                    "static pool {pool}: {} limits add up to {} > capacity {}",
                    resource.name(),
                    resource.amount(*limits),
                    resource.amount(*capacity)
                )
            }
            Problem::StaticWithoutLimit { job, pool } => {
                write!(
                    f,
                    "job {job} in static pool {pool} has no limit or guarantee; allocated 0"
                )
            }
            Problem::NodeOverCommitted {
                node,
                resource,
                minimums,
                budget,
            } => {
                write!(
                    f,
                    "node {node}: {} minimums add up to {} > budget {}; scaled",
                    resource.name(),
                    resource.amount(*minimums),
                    resource.amount(*budget)
                )
            }
            Problem::UnplacedStage { job, stage } => {
                write!(f, "job {job}: stage {stage} is on no known node")
            }
        }
    }
}
