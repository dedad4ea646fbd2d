//! Static settings: what the policies imply for each stage, job by job.
//! Pure (data in, settings out): the dynamic sharing engine replaces this
//! module later without touching sessions or the store.
//!
//! Per job on a stage: the policy that selects the job's labels
//! ([`PolicySet::policy_for_job`]); its `limit` divided evenly among the
//! stages that serve the job; its prefetch bounds as they are. Jobs no
//! policy selects are left out, so the stage runs them on its own
//! configuration.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_policy::{JobPolicy, PolicySet};

use crate::store::Labels;

/// The settings for one stage: per job, in job order. Its JSON encoding
/// ([`StageSettings::encode`]) is deterministic and is the document the
/// store keeps as the stage's desired settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSettings {
    /// Settings per job id.
    pub jobs: BTreeMap<String, JobSettings>,
}

/// How a stage should serve one job (the domain twin of
/// `sluice.v1.JobSettings`: zero means the stage's own value, `None` rates
/// mean unlimited).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSettings {
    /// Bytes per second on this stage.
    pub bytes_per_second: Option<u64>,
    /// Storage operations per second on this stage.
    pub ops_per_second: Option<u64>,
    /// Token-bucket window in milliseconds.
    pub burst_millis: u32,
    /// Whether the stage's tuner runs.
    pub tuner: Option<bool>,
    /// Fewest reader threads.
    pub min_readers: u32,
    /// Most reader threads.
    pub max_readers: u32,
    /// Smallest buffer.
    pub min_buffer_bytes: u64,
    /// Largest buffer.
    pub max_buffer_bytes: u64,
    /// The JobPolicy that produced these settings.
    pub policy: String,
    /// The pool the job draws from.
    pub pool: String,
    /// Why the rate is what it is.
    pub reason: String,
}

impl StageSettings {
    /// Returns the deterministic JSON document stored as desired settings.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads a stored document back; `None` when it is not one.
    pub fn decode(document: &str) -> Option<Self> {
        serde_json::from_str(document).ok()
    }
}

/// One job as a stage serves it: its labels and how many stages serve it.
#[derive(Debug, Clone)]
pub struct JobOnStage<'a> {
    /// The job's id.
    pub job: &'a str,
    /// Its labels.
    pub labels: &'a Labels,
    /// How many live stages serve the job (at least 1: this one).
    pub stages: usize,
}

/// Returns the settings the policies imply for a stage serving `jobs`
/// with `memory_budget` bytes for buffers (0: not limited).
pub fn stage_settings<'a>(
    policies: &PolicySet,
    memory_budget: u64,
    jobs: impl IntoIterator<Item = JobOnStage<'a>>,
) -> StageSettings {
    let jobs = jobs
        .into_iter()
        .filter_map(|j| {
            let policy = policies.policy_for_job(j.labels)?;
            Some((
                j.job.to_owned(),
                job_settings(policy, j.stages.max(1), memory_budget),
            ))
        })
        .collect();
    StageSettings { jobs }
}

/// Returns the buffer bounds to push: both or neither (stages read a zero
/// pair as "keep your own"), the maximum defaulting to and capped by the
/// stage's memory budget, the minimum at most the maximum.
fn buffer_bounds(min: u64, max: Option<u64>, budget: u64) -> (u64, u64) {
    let max = match (max, budget) {
        (Some(max), 0) => max,
        (Some(max), budget) => max.min(budget),
        (None, 0) => return (0, 0),
        (None, budget) => budget,
    };
    (min.min(max), max)
}

fn job_settings(policy: &JobPolicy, stages: usize, memory_budget: u64) -> JobSettings {
    let spec = policy.spec();
    let share = |total: u64| (total / stages as u64).max(1);
    let limit = &spec.limit;
    let bytes_per_second = limit.bandwidth.map(|b| share(b.bytes_per_second()));
    let ops_per_second = limit.ops.map(|o| share(o.per_second()));
    let limited = bytes_per_second.is_some() || ops_per_second.is_some();
    let prefetch = &spec.prefetch;
    let (min_buffer_bytes, max_buffer_bytes) = buffer_bounds(
        prefetch.buffer.min.bytes(),
        prefetch.buffer.max.map(|b| b.bytes()),
        memory_budget,
    );
    JobSettings {
        bytes_per_second,
        ops_per_second,
        burst_millis: limit
            .burst
            .map_or(0, |b| u32::try_from(b.0).unwrap_or(u32::MAX)),
        tuner: Some(prefetch.tuner),
        min_readers: prefetch.readers.min,
        max_readers: prefetch.readers.max,
        min_buffer_bytes,
        max_buffer_bytes,
        policy: policy.name().to_owned(),
        pool: spec.pool.clone(),
        reason: if limited { "static-limit" } else { "static" }.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICIES: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 2GB/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: vision}
spec:
  selector: {matchLabels: {team: vision}}
  pool: shared
  limit: {bandwidth: 300MB/s, ops: 3k ops/s, burst: 200ms}
";

    fn set() -> PolicySet {
        PolicySet::from_documents(sluice_policy::parse_documents("t.yaml", POLICIES).unwrap())
            .unwrap()
    }

    fn labels(team: &str) -> Labels {
        Labels::from([("team".to_owned(), team.to_owned())])
    }

    #[test]
    fn limits_split_evenly_and_unselected_jobs_are_left_out() {
        let (vision, other) = (labels("vision"), labels("nlp"));
        let jobs = [
            JobOnStage {
                job: "a",
                labels: &vision,
                stages: 3,
            },
            JobOnStage {
                job: "b",
                labels: &other,
                stages: 1,
            },
        ];
        let s = stage_settings(&set(), 0, jobs);
        assert_eq!(s.jobs.keys().collect::<Vec<_>>(), ["a"]);
        let a = &s.jobs["a"];
        assert_eq!(a.bytes_per_second, Some(100_000_000));
        assert_eq!(a.ops_per_second, Some(1000));
        assert_eq!(a.burst_millis, 200);
        assert_eq!((a.policy.as_str(), a.pool.as_str()), ("vision", "shared"));
        assert_eq!(a.reason, "static-limit");
    }

    #[test]
    fn buffer_bounds_are_a_pair_within_the_budget() {
        assert_eq!(buffer_bounds(4, None, 0), (0, 0));
        assert_eq!(buffer_bounds(4, None, 100), (4, 100));
        assert_eq!(buffer_bounds(4, Some(200), 100), (4, 100));
        assert_eq!(buffer_bounds(40, Some(20), 0), (20, 20));
    }

    #[test]
    fn encoding_is_deterministic_and_round_trips() {
        let vision = labels("vision");
        let jobs = |order: [&'static str; 2]| {
            order.map(|job| JobOnStage {
                job,
                labels: &vision,
                stages: 1,
            })
        };
        let one = stage_settings(&set(), 0, jobs(["x", "y"]));
        let two = stage_settings(&set(), 0, jobs(["y", "x"]));
        assert_eq!(one.encode(), two.encode());
        assert_eq!(StageSettings::decode(&one.encode()), Some(one));
    }
}
