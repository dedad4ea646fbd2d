//! The engine's input: a [`Snapshot`] of pools, jobs, stages and nodes.

use serde::{Deserialize, Serialize};

use crate::Sharing;

/// Everything the engine needs to know, taken at one tick.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// The storage pools.
    pub pools: Vec<PoolInput>,
    /// The running jobs, each in one pool.
    pub jobs: Vec<JobInput>,
    /// The nodes the stages run on, with their budgets.
    pub nodes: Vec<NodeInput>,
}

/// A pool: what its storage delivers and how that is shared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolInput {
    /// The pool's name, as jobs refer to it.
    pub name: String,
    /// Bytes per second for all jobs together.
    pub bandwidth: f64,
    /// Read operations per second for all jobs together, when limited.
    pub ops: Option<f64>,
    /// How the capacity is shared.
    pub sharing: Sharing,
}

impl PoolInput {
    /// Returns a pool with a bandwidth and no operations limit.
    pub fn new(name: &str, bandwidth: f64, sharing: Sharing) -> Self {
        PoolInput {
            name: name.to_owned(),
            bandwidth,
            ops: None,
            sharing,
        }
    }

    /// Returns the pool a validated `StoragePool` describes.
    pub fn from_policy(pool: &crate::StoragePool) -> Self {
        let spec = pool.spec();
        PoolInput {
            name: pool.name().to_owned(),
            bandwidth: spec.capacity.bandwidth.bytes_per_second() as f64,
            ops: spec.capacity.ops.map(|o| o.per_second() as f64),
            sharing: spec.sharing,
        }
    }
}

/// A rate in bytes per second and one in read operations per second,
/// either of which may be absent.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Rates {
    /// Bytes per second.
    pub bandwidth: Option<f64>,
    /// Operations per second.
    pub ops: Option<f64>,
}

/// A job and what its policy and telemetry say about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobInput {
    /// The job's id.
    pub id: String,
    /// The pool it reads from.
    pub pool: String,
    /// Relative share, > 0.
    pub weight: f64,
    /// Priority class (used by `priority` pools; higher first).
    pub priority: i32,
    /// Minimums.
    pub guarantee: Rates,
    /// Caps.
    pub limit: Rates,
    /// Estimated demand; `None` means unknown, treated as greedy.
    pub demand: Rates,
    /// The stages that serve it.
    pub stages: Vec<StageInput>,
}

impl JobInput {
    /// Returns a greedy job with a weight and nothing else set.
    pub fn new(id: &str, pool: &str, weight: f64) -> Self {
        JobInput {
            id: id.to_owned(),
            pool: pool.to_owned(),
            weight,
            priority: 0,
            guarantee: Rates::default(),
            limit: Rates::default(),
            demand: Rates::default(),
            stages: Vec::new(),
        }
    }

    /// Returns a greedy job with what its validated policy says (pool,
    /// weight, priority, guarantee, limit); demand and stages are left for
    /// the caller.
    pub fn from_policy(id: &str, spec: &crate::JobPolicySpec) -> Self {
        let bytes = |r: Option<crate::ByteRate>| r.map(|r| r.bytes_per_second() as f64);
        let ops = |r: Option<crate::OpsRate>| r.map(|r| r.per_second() as f64);
        JobInput {
            priority: spec.priority,
            guarantee: Rates {
                bandwidth: bytes(spec.guarantee.bandwidth),
                ops: ops(spec.guarantee.ops),
            },
            limit: Rates {
                bandwidth: bytes(spec.limit.bandwidth),
                ops: ops(spec.limit.ops),
            },
            ..JobInput::new(id, &spec.pool, f64::from(spec.weight))
        }
    }
}

/// Inclusive bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Bounds<T> {
    /// Least.
    pub min: T,
    /// Most.
    pub max: T,
}

/// One stage serving a job: its measured demand and the job's bounds there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageInput {
    /// The stage's id (as [`NodeInput::stages`] lists it).
    pub stage: String,
    /// Bytes per second the job wants from this stage; `None` when not
    /// measured yet.
    pub demand: Option<f64>,
    /// Whether the job wants more than `demand` there (its readers wait on
    /// its limit while its trainers wait for data); false when its demand
    /// is what it consumes.
    #[serde(default)]
    pub wants_more: bool,
    /// Reader threads the job may run on this stage.
    pub readers: Bounds<u32>,
    /// Prefetch-buffer bytes the job may hold on this stage.
    pub buffer: Bounds<u64>,
}

/// A node: the stages on it and the budgets they share.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInput {
    /// The node's name.
    pub name: String,
    /// The stages running on it.
    pub stages: Vec<String>,
    /// Reader threads for all jobs together.
    pub readers: u32,
    /// Buffer bytes for all jobs together.
    pub buffer: u64,
}
