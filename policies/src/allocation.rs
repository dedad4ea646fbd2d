//! The allocation engine: a snapshot of pools, jobs, stages and nodes in,
//! the settings every stage should enforce out. Pure and deterministic:
//! the controller calls [`allocate`] every tick, `sluicectl simulate`
//! calls it offline, and the two agree by construction.
//!
//! # The algorithm
//!
//! Each pool's bandwidth (and, when the pool declares one, its operations
//! per second, shared the same way on its own) is divided among the jobs
//! that use it according to the pool's [`Sharing`] mode:
//!
//! * **`weighted-fair`** (the default). A job can use at most its
//!   *ceiling*, `min(limit, demand)`, where an unknown demand counts as
//!   infinite (greedy). Its *guarantee* is `min(guarantee, ceiling)`.
//!   Guarantees come first; when they add up to more than the capacity,
//!   they are all scaled down by the same factor and a
//!   [`Problem::GuaranteesInfeasible`] says so. Then the capacity is
//!   water-filled: a water level `L` rises until the jobs together take
//!   the whole capacity, and each job gets `clamp(weight * L, guarantee,
//!   ceiling)`. That is weighted max-min fairness: no job can get more
//!   without taking from a job that has less per unit of weight. It is
//!   work-conserving: a job held at its ceiling leaves the rest to the
//!   others, in proportion to their weights; the pool is fully allocated
//!   whenever the jobs together want at least its capacity, and otherwise
//!   every job gets its whole ceiling. A guarantee is a *floor*, not a
//!   bonus: a job whose weighted share already exceeds its guarantee gets
//!   its weighted share and no more.
//! * **`priority`**. Every job's guarantee first (all classes), then the
//!   classes from the highest `priority` down: each class water-fills what
//!   the classes above it left, weighted-fair inside the class. A lower
//!   class gets more than its guarantees only once every job above it is
//!   at its ceiling.
//! * **`static`**. Every job runs at its limit as written (its guarantee
//!   when it has no limit), whatever the others do; unused capacity is
//!   not lent. Limits adding up to more than the capacity are reported
//!   ([`Problem::StaticOverCommitted`]), not corrected.
//!
//! Each job's allocation carries its [`Reason`]: at its limit (`cap`), at
//! its demand (`demand-limited`), held at its guarantee (`guarantee`),
//! held below its ceiling by a higher class that took capacity beyond its
//! guarantees (`priority`), a fixed share (`static`), or else its
//! `weighted-share`.
//!
//! A job's allocation is split among its stages in proportion to their
//! measured demand, not evenly (see [`split`]): a stage that has reported
//! no demand gets a floor of [`IDLE_STAGE_FLOOR`] (5%) of an even share,
//! so a job whose reads move there can grow; with no demand reported
//! anywhere the split is even. Operations per second are split in the same
//! proportions. Finally each node's reader threads and buffer memory are
//! water-filled among the job-stages on it, by job weight, between each
//! job-stage's minimum and maximum; minimums that do not fit are scaled
//! down and reported.
//!
//! # A worked example
//!
//! A pool of 1000 B/s, four greedy jobs with weights 1:2:3:4: the level
//! rises to 100 and they get 100, 200, 300 and 400. Job `a` then wants
//! only 10: it gets 10, and the 990 left is shared 2:3:4 (level 110), so
//! `b`, `c` and `d` get 220, 330 and 440.
//!
//! ```
//! use sluice_policy::allocation::{allocate, JobInput, PoolInput, Reason, Snapshot};
//! use sluice_policy::Sharing;
//!
//! let pool = PoolInput::new("shared", 1000.0, Sharing::WeightedFair);
//! let jobs = [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0)]
//!     .map(|(id, weight)| JobInput::new(id, "shared", weight));
//! let mut snapshot = Snapshot { pools: vec![pool], jobs: jobs.to_vec(), nodes: vec![] };
//! let rates = |s: &Snapshot| -> Vec<f64> {
//!     allocate(s).jobs.iter().map(|j| j.bandwidth.rate.round()).collect()
//! };
//! assert_eq!(rates(&snapshot), [100.0, 200.0, 300.0, 400.0]);
//!
//! snapshot.jobs[0].demand.bandwidth = Some(10.0);
//! assert_eq!(rates(&snapshot), [10.0, 220.0, 330.0, 440.0]);
//! assert_eq!(allocate(&snapshot).jobs[0].bandwidth.reason, Reason::DemandLimited);
//! ```

mod build;
mod decision;
mod pool;
mod snapshot;
mod stage;
mod waterfill;

use std::collections::HashSet;

use crate::Sharing;
pub use build::ObservedStage;
pub use decision::{
    Allocation, JobAllocation, NodeResource, Problem, Reason, Resource, Share, StageAllocation,
};
use pool::{Ask, Pool};
pub use snapshot::{Bounds, JobInput, NodeInput, PoolInput, Rates, Snapshot, StageInput};
pub use stage::{IDLE_STAGE_FLOOR, split};

/// Returns the allocation for a snapshot: every job's share of its pool,
/// split among its stages, with node budgets shared out, and the problems
/// met on the way.
pub fn allocate(snapshot: &Snapshot) -> Allocation {
    let mut problems = Vec::new();
    let known: HashSet<&str> = snapshot.pools.iter().map(|p| p.name.as_str()).collect();
    let mut jobs: Vec<JobInput> = Vec::new();
    for job in &snapshot.jobs {
        if !known.contains(job.pool.as_str()) {
            problems.push(Problem::UnknownPool {
                job: job.id.clone(),
                pool: job.pool.clone(),
            });
            continue;
        }
        let mut job = job.clone();
        if !(job.weight.is_finite() && job.weight > 0.0) {
            problems.push(Problem::InvalidWeight {
                job: job.id.clone(),
                weight: job.weight,
            });
            job.weight = 1.0;
        }
        jobs.push(job);
    }
    let mut bandwidth = vec![Share::default(); jobs.len()];
    let mut ops = vec![None; jobs.len()];
    let mut seen = HashSet::new();
    for pool in &snapshot.pools {
        if !seen.insert(pool.name.as_str()) {
            problems.push(Problem::DuplicatePool {
                pool: pool.name.clone(),
            });
            continue;
        }
        let members: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].pool == pool.name)
            .collect();
        share_pool(
            pool,
            &jobs,
            &members,
            &mut bandwidth,
            &mut ops,
            &mut problems,
        );
    }
    let mut out: Vec<JobAllocation> = jobs
        .iter()
        .zip(bandwidth)
        .zip(ops)
        .map(|((job, bandwidth), ops)| job_allocation(job, bandwidth, ops))
        .collect();
    stage::budget_nodes(&snapshot.nodes, &jobs, &mut out, &mut problems);
    Allocation {
        jobs: out,
        problems,
    }
}

/// Shares one pool's bandwidth (and operations) among `members`.
fn share_pool(
    pool: &PoolInput,
    jobs: &[JobInput],
    members: &[usize],
    bandwidth: &mut [Share],
    ops: &mut [Option<Share>],
    problems: &mut Vec<Problem>,
) {
    let ask = |job: &JobInput, pick: fn(&Rates) -> Option<f64>| Ask {
        weight: job.weight,
        priority: job.priority,
        guarantee: pick(&job.guarantee),
        limit: pick(&job.limit),
        demand: pick(&job.demand),
    };
    let on = |resource, capacity| Pool {
        name: &pool.name,
        resource,
        capacity,
        sharing: pool.sharing,
    };
    let asks: Vec<Ask> = members
        .iter()
        .map(|&i| ask(&jobs[i], |r| r.bandwidth))
        .collect();
    let shares = pool::share(
        on(
            Resource::Bandwidth,
            capacity(pool, Resource::Bandwidth, problems),
        ),
        &asks,
        problems,
    );
    for (&i, share) in members.iter().zip(shares) {
        bandwidth[i] = share;
        let job = &jobs[i];
        if pool.sharing == Sharing::Static
            && job.limit.bandwidth.is_none()
            && job.guarantee.bandwidth.is_none()
        {
            problems.push(Problem::StaticWithoutLimit {
                job: job.id.clone(),
                pool: pool.name.clone(),
            });
        }
    }
    match pool.ops {
        Some(_) => {
            let asks: Vec<Ask> = members.iter().map(|&i| ask(&jobs[i], |r| r.ops)).collect();
            let shares = pool::share(
                on(Resource::Ops, capacity(pool, Resource::Ops, problems)),
                &asks,
                problems,
            );
            for (&i, share) in members.iter().zip(shares) {
                ops[i] = Some(share);
            }
        }
        // No pool-wide operations limit: only the job's own, if any.
        None => {
            for &i in members {
                ops[i] = jobs[i].limit.ops.map(|rate| Share {
                    rate,
                    reason: Reason::Cap,
                });
            }
        }
    }
}

/// Returns a pool's capacity of `resource`, or 0 (reported) when it is
/// negative or not finite.
fn capacity(pool: &PoolInput, resource: Resource, problems: &mut Vec<Problem>) -> f64 {
    let capacity = match resource {
        Resource::Bandwidth => pool.bandwidth,
        Resource::Ops => pool.ops.unwrap_or(0.0),
    };
    if capacity.is_finite() && capacity >= 0.0 {
        capacity
    } else {
        problems.push(Problem::InvalidCapacity {
            pool: pool.name.clone(),
            resource,
            capacity,
        });
        0.0
    }
}

/// Splits a job's shares among its stages; readers and buffers are filled
/// in later, per node.
fn job_allocation(job: &JobInput, bandwidth: Share, ops: Option<Share>) -> JobAllocation {
    let demands: Vec<(Option<f64>, bool)> = job
        .stages
        .iter()
        .map(|s| (s.demand, s.wants_more))
        .collect();
    let parts = split(bandwidth.rate, &demands);
    let stages = job
        .stages
        .iter()
        .zip(parts)
        .map(|(stage, part)| StageAllocation {
            stage: stage.stage.clone(),
            node: None,
            bandwidth: part,
            // Operations follow bytes: the same proportions.
            ops: ops.map(|o| {
                if bandwidth.rate > 0.0 {
                    o.rate * part / bandwidth.rate
                } else {
                    o.rate / job.stages.len() as f64
                }
            }),
            readers: stage.readers,
            buffer: stage.buffer.max,
        })
        .collect();
    JobAllocation {
        job: job.id.clone(),
        pool: job.pool.clone(),
        bandwidth,
        ops,
        stages,
    }
}

#[cfg(test)]
mod tests;
