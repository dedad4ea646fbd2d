//! Splitting a job's share among its stages, and each node's reader
//! threads and buffer memory among the jobs on it.

use std::collections::HashMap;

use super::waterfill::{Claim, fill_units};
use super::{Bounds, JobAllocation, JobInput, NodeInput, NodeResource, Problem};

/// A stage that has reported no demand gets this fraction of an even
/// share, so that a job whose demand moves to it can grow there (its
/// measured demand can only rise once it is allowed to read).
pub const IDLE_STAGE_FLOOR: f64 = 0.05;

/// Splits `total` among stages by their measured demand, each given as
/// `(demand, wants_more)`. A stage that is held back by something other
/// than its allocation (its trainers compute, or its storage is slow:
/// `wants_more` false) gets its demand first, and the stages that want
/// more share the rest in proportion to their demands; when there is not
/// enough for that, or no stage wants more, every stage gets a part in
/// proportion to its demand. Stages with no (or zero, or unusable) demand
/// get [`IDLE_STAGE_FLOOR`] of an even share each; when no stage has
/// reported any demand the split is even. The parts sum to `total`.
pub fn split(total: f64, demands: &[(Option<f64>, bool)]) -> Vec<f64> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let even = total / n as f64;
    let usable = |d: Option<f64>| d.filter(|d| d.is_finite() && *d > 0.0);
    let sum = |more: Option<bool>| -> f64 {
        demands
            .iter()
            .filter(|(_, m)| more.is_none_or(|more| *m == more))
            .filter_map(|(d, _)| usable(*d))
            .sum()
    };
    let reported = sum(None);
    if reported <= 0.0 {
        return vec![even; n];
    }
    let idle = demands.iter().filter(|(d, _)| usable(*d).is_none()).count();
    let floor = even * IDLE_STAGE_FLOOR;
    let rest = total - floor * idle as f64;
    let (held, wanting) = (sum(Some(false)), sum(Some(true)));
    let served_first = wanting > 0.0 && held < rest;
    demands
        .iter()
        .map(|&(d, more)| match usable(d) {
            None => floor,
            Some(d) if served_first && !more => d,
            Some(d) if served_first => (rest - held) * d / wanting,
            Some(d) => rest * d / reported,
        })
        .collect()
}

/// Fills in every job-stage's readers and buffer from its node's budgets,
/// water-filled by job weight within each job's bounds. A stage on no
/// node gets its bounds' maxima and is reported.
pub(crate) fn budget_nodes(
    nodes: &[NodeInput],
    jobs: &[JobInput],
    out: &mut [JobAllocation],
    problems: &mut Vec<Problem>,
) {
    let mut node_of: HashMap<&str, usize> = HashMap::new();
    for (n, node) in nodes.iter().enumerate() {
        for stage in &node.stages {
            node_of.entry(stage.as_str()).or_insert(n);
        }
    }
    // (job, stage) pairs per node.
    let mut placed: Vec<Vec<(usize, usize)>> = vec![Vec::new(); nodes.len()];
    for (j, job) in jobs.iter().enumerate() {
        for (s, stage) in job.stages.iter().enumerate() {
            match node_of.get(stage.stage.as_str()) {
                Some(&n) => {
                    placed[n].push((j, s));
                    out[j].stages[s].node = Some(nodes[n].name.clone());
                }
                None => {
                    let alloc = &mut out[j].stages[s];
                    alloc.readers = stage.readers;
                    alloc.buffer = stage.buffer.max;
                    problems.push(Problem::UnplacedStage {
                        job: job.id.clone(),
                        stage: stage.stage.clone(),
                    });
                }
            }
        }
    }
    for (node, members) in nodes.iter().zip(&placed) {
        let readers = units(node, NodeResource::Readers, members, jobs, problems);
        let buffers = units(node, NodeResource::Buffer, members, jobs, problems);
        for ((&(j, s), r), b) in members.iter().zip(readers).zip(buffers) {
            let wanted = jobs[j].stages[s].readers;
            let r = u32::try_from(r).unwrap_or(u32::MAX);
            let alloc = &mut out[j].stages[s];
            alloc.readers = Bounds {
                min: wanted.min.min(r),
                max: r,
            };
            alloc.buffer = b;
        }
    }
}

/// Water-fills one node budget among the job-stages on the node; minimums
/// that do not fit are scaled down in proportion and reported.
fn units(
    node: &NodeInput,
    resource: NodeResource,
    members: &[(usize, usize)],
    jobs: &[JobInput],
    problems: &mut Vec<Problem>,
) -> Vec<u64> {
    let budget = match resource {
        NodeResource::Readers => u64::from(node.readers),
        NodeResource::Buffer => node.buffer,
    };
    let bounds = |j: usize, s: usize| -> (f64, f64) {
        let stage = &jobs[j].stages[s];
        let (min, max) = match resource {
            NodeResource::Readers => (u64::from(stage.readers.min), u64::from(stage.readers.max)),
            NodeResource::Buffer => (stage.buffer.min, stage.buffer.max),
        };
        (min as f64, max.max(min) as f64)
    };
    let minimums: f64 = members.iter().map(|&(j, s)| bounds(j, s).0).sum();
    let scale = if minimums > budget as f64 {
        problems.push(Problem::NodeOverCommitted {
            node: node.name.clone(),
            resource,
            minimums: minimums as u64,
            budget,
        });
        budget as f64 / minimums
    } else {
        1.0
    };
    let claims: Vec<Claim> = members
        .iter()
        .map(|&(j, s)| {
            let (min, max) = bounds(j, s);
            // Scaling the minimums may leave fractions; round down so they fit.
            Claim {
                weight: jobs[j].weight,
                floor: (min * scale).floor(),
                ceiling: max,
            }
        })
        .collect();
    fill_units(&claims, budget)
}
