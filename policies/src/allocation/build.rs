//! Building a [`Snapshot`] from the policies and what is running: the one
//! way the controller (every tick) and `sluicectl simulate` (offline) turn
//! jobs and stages into engine input, so that they agree.

use std::collections::HashMap;

use crate::{JobPolicy, JobPolicySpec, Labels, PolicySet};

use super::{Bounds, JobInput, NodeInput, PoolInput, Rates, Snapshot, StageInput};

/// A stage serving a job, as observed.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservedStage {
    /// The stage's id.
    pub stage: String,
    /// Bytes per second the job wants from this stage; `None` when not
    /// measured yet.
    pub demand: Option<f64>,
    /// Whether the job wants more than `demand` there.
    pub wants_more: bool,
    /// The stage's memory budget for all buffers (0: not limited).
    pub memory_budget: u64,
}

impl Snapshot {
    /// Returns a snapshot holding every pool the policies declare, and no
    /// jobs or nodes yet.
    pub fn with_pools(policies: &PolicySet) -> Self {
        Snapshot {
            pools: policies.pools().map(PoolInput::from_policy).collect(),
            jobs: Vec::new(),
            nodes: Vec::new(),
        }
    }

    /// Adds a running job with its labels, estimated demand and stages, as
    /// the policy that selects it describes it, and returns that policy.
    /// Returns `None` and adds nothing when no policy selects the job (the
    /// stages then run it on their own configuration).
    pub fn add_job<'p, L: Labels + ?Sized>(
        &mut self,
        policies: &'p PolicySet,
        id: &str,
        labels: &L,
        demand: Rates,
        stages: impl IntoIterator<Item = ObservedStage>,
    ) -> Option<&'p JobPolicy> {
        let policy = policies.policy_for_job(labels)?;
        let spec = policy.spec();
        let stages = stages
            .into_iter()
            .map(|s| StageInput::from_policy(spec, s))
            .collect();
        self.jobs.push(JobInput {
            demand,
            stages,
            ..JobInput::from_policy(id, spec)
        });
        Some(policy)
    }

    /// Adds nodes, each `(name, stages on it, reader budget, buffer
    /// budget)`; a reader budget of 0 (the stages did not say) becomes the
    /// sum of its jobs' maxima, and a buffer budget of 0 (not limited) the
    /// sum of their buffer maxima, so an unknown budget never holds a job
    /// below its bounds. Call it after the jobs are added.
    pub fn add_nodes(&mut self, nodes: impl IntoIterator<Item = (String, Vec<String>, u32, u64)>) {
        // Every job's maxima per stage, summed once (not once per node:
        // a cluster has thousands of both).
        let mut maxima: HashMap<&str, (u32, u64)> = HashMap::new();
        for s in self.jobs.iter().flat_map(|j| &j.stages) {
            let sum = maxima.entry(&s.stage).or_default();
            sum.0 = sum.0.saturating_add(s.readers.max);
            sum.1 = sum.1.saturating_add(s.buffer.max);
        }
        let mut added = Vec::new();
        for (name, stages, readers, buffer) in nodes {
            let on_node = || stages.iter().filter_map(|s| maxima.get(s.as_str()));
            let readers = match readers {
                0 => on_node().fold(0u32, |sum, m| sum.saturating_add(m.0)),
                n => n,
            };
            let buffer = match buffer {
                0 => on_node().fold(0u64, |sum, m| sum.saturating_add(m.1)),
                n => n,
            };
            added.push(NodeInput {
                name,
                stages,
                readers,
                buffer,
            });
        }
        self.nodes.extend(added);
    }
}

impl StageInput {
    /// Returns a job's input on one stage: the policy's reader bounds and
    /// buffer bounds, the maximum defaulting to and capped by the stage's
    /// memory budget (0: not limited; then a policy without a maximum
    /// leaves the buffer unbounded, shown as `u64::MAX`).
    pub fn from_policy(spec: &JobPolicySpec, observed: ObservedStage) -> Self {
        let prefetch = &spec.prefetch;
        let max = match (
            prefetch.buffer.max.map(|b| b.bytes()),
            observed.memory_budget,
        ) {
            (Some(max), 0) => max,
            (Some(max), budget) => max.min(budget),
            (None, 0) => u64::MAX,
            (None, budget) => budget,
        };
        StageInput {
            stage: observed.stage,
            demand: observed.demand,
            wants_more: observed.wants_more,
            readers: Bounds {
                min: prefetch.readers.min,
                max: prefetch.readers.max,
            },
            buffer: Bounds {
                min: prefetch.buffer.min.bytes().min(max),
                max,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::allocate;
    use std::collections::BTreeMap;

    const POLICIES: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 1000B/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: vision}
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared
  weight: 3
  prefetch: {readers: {min: 2, max: 8}, buffer: {min: 1MiB, max: 64MiB}}
";

    fn set() -> PolicySet {
        PolicySet::from_documents(crate::parse_documents("t.yaml", POLICIES).unwrap()).unwrap()
    }

    fn labels(team: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("team".to_owned(), team.to_owned())])
    }

    fn stage(id: &str, budget: u64) -> ObservedStage {
        ObservedStage {
            stage: id.to_owned(),
            demand: None,
            wants_more: false,
            memory_budget: budget,
        }
    }

    #[test]
    fn selected_jobs_are_added_with_their_policy_and_others_are_not() {
        let policies = set();
        let mut s = Snapshot::with_pools(&policies);
        let added = s.add_job(
            &policies,
            "a",
            &labels("vision"),
            Rates::default(),
            [stage("s1", 16 << 20), stage("s2", 0)],
        );
        assert_eq!(added.map(|p| p.name()), Some("vision"));
        let other = s.add_job(&policies, "b", &labels("nlp"), Rates::default(), []);
        assert!(other.is_none());
        assert_eq!(s.jobs.len(), 1);
        let job = &s.jobs[0];
        assert_eq!((job.pool.as_str(), job.weight), ("shared", 3.0));
        // The budget caps the policy's maximum; without one the policy's
        // maximum stands.
        assert_eq!(
            job.stages[0].buffer,
            Bounds {
                min: 1 << 20,
                max: 16 << 20
            }
        );
        assert_eq!(
            job.stages[1].buffer,
            Bounds {
                min: 1 << 20,
                max: 64 << 20
            }
        );
        assert_eq!(job.stages[0].readers, Bounds { min: 2, max: 8 });
    }

    #[test]
    fn unknown_node_budgets_never_hold_a_job_below_its_bounds() {
        let policies = set();
        let mut s = Snapshot::with_pools(&policies);
        s.add_job(
            &policies,
            "a",
            &labels("vision"),
            Rates::default(),
            [stage("s1", 0)],
        );
        s.add_nodes([("n1".to_owned(), vec!["s1".to_owned()], 0, 0)]);
        assert_eq!((s.nodes[0].readers, s.nodes[0].buffer), (8, 64 << 20));
        let allocation = allocate(&s);
        let on_stage = &allocation.jobs[0].stages[0];
        assert_eq!(on_stage.readers, Bounds { min: 2, max: 8 });
        assert_eq!(on_stage.buffer, 64 << 20);
        assert!(allocation.problems.is_empty(), "{:?}", allocation.problems);
        assert_eq!(allocation.jobs[0].bandwidth.rate.round(), 1000.0);
    }
}
