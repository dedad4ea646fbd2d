//! What a stage is told to enforce: per job a rate, reader and buffer
//! bounds, and why ([`StageAssignment`]), and the hysteresis that decides
//! whether a new assignment is worth pushing ([`settle`]).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::DatasetCacheAssignment;
use crate::JobPolicy;
use crate::allocation::{JobAllocation, StageAllocation};

/// What one stage must enforce: per job, in job order. Its JSON encoding
/// ([`StageAssignment::encode`]) is deterministic and is the document the
/// controller's store keeps as the stage's desired settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageAssignment {
    /// Per job id.
    pub jobs: BTreeMap<String, JobAssignment>,
    /// Jobs reading there that no policy selects: the stage runs them on
    /// its own configuration. Named so that the stage knows the
    /// controller has seen them.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub unmanaged: BTreeSet<String>,
    /// Per data set a `DatasetCache` steers: how the stage's cache keeps
    /// it and whether to stage it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cache: BTreeMap<String, DatasetCacheAssignment>,
}

/// How a stage should serve one job (the domain twin of the wire message
/// `sluice.v1.JobSettings`: zero means the stage's own value, `None` rates
/// mean unlimited).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobAssignment {
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

impl StageAssignment {
    /// Returns the deterministic JSON document stored as desired settings.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads a stored document back; `None` when it is not one.
    pub fn decode(document: &str) -> Option<Self> {
        serde_json::from_str(document).ok()
    }
}

impl JobAssignment {
    /// Returns what a stage enforces for `job` under `policy`, given the
    /// job-stage's allocation and the bytes per second it enforces there
    /// (the allocation plus any loan).
    pub fn new(
        policy: &JobPolicy,
        job: &JobAllocation,
        stage: &StageAllocation,
        bytes_per_second: f64,
    ) -> Self {
        let spec = policy.spec();
        let prefetch = &spec.prefetch;
        // An unbounded buffer (no policy maximum, no stage budget) is left
        // to the stage: a zero pair means "keep your own".
        let (min_buffer_bytes, max_buffer_bytes) = match stage.buffer {
            u64::MAX => (0, 0),
            max => (prefetch.buffer.min.bytes().min(max), max),
        };
        JobAssignment {
            bytes_per_second: Some(whole(bytes_per_second)),
            ops_per_second: stage.ops.map(whole),
            burst_millis: spec
                .limit
                .burst
                .map_or(0, |b| u32::try_from(b.0).unwrap_or(u32::MAX)),
            tuner: Some(prefetch.tuner),
            min_readers: stage.readers.min,
            max_readers: stage.readers.max,
            min_buffer_bytes,
            max_buffer_bytes,
            policy: policy.name().to_owned(),
            pool: job.pool.clone(),
            reason: job.bandwidth.reason.as_str().to_owned(),
        }
    }
}

/// Returns a rate as the whole number the stage enforces, at least 1 (a
/// zero limit would read as "unset" on the wire).
fn whole(rate: f64) -> u64 {
    if rate.is_finite() {
        rate.round().max(1.0) as u64
    } else {
        u64::MAX
    }
}

/// Rates that moved by less than this fraction are not pushed again.
pub const RATE_TOLERANCE: f64 = 0.02;

/// Returns `next` with the rates of `in_force` kept wherever a job's
/// settings differ only in rates that moved by less than
/// [`RATE_TOLERANCE`]: small changes are not worth a new version.
pub fn settle(in_force: &StageAssignment, mut next: StageAssignment) -> StageAssignment {
    let close = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => (a as f64 - b as f64).abs() <= RATE_TOLERANCE * a.max(b) as f64,
        (a, b) => a == b,
    };
    for (job, n) in &mut next.jobs {
        let Some(c) = in_force.jobs.get(job) else {
            continue;
        };
        let same_rest = JobAssignment {
            bytes_per_second: c.bytes_per_second,
            ops_per_second: c.ops_per_second,
            ..n.clone()
        } == *c;
        if same_rest
            && close(c.bytes_per_second, n.bytes_per_second)
            && close(c.ops_per_second, n.ops_per_second)
        {
            n.bytes_per_second = c.bytes_per_second;
            n.ops_per_second = c.ops_per_second;
        }
    }
    next
}

/// Returns the assignment to push to a stage, or `None` when the one in
/// force stands: `next` settled against `in_force` (unless `exact`: after
/// a policy change a new limit must hold exactly), if that differs from
/// what is in force.
pub fn to_push(
    in_force: Option<&StageAssignment>,
    next: StageAssignment,
    exact: bool,
) -> Option<StageAssignment> {
    let empty = StageAssignment::default();
    let in_force = in_force.unwrap_or(&empty);
    let settled = if exact { next } else { settle(in_force, next) };
    (settled != *in_force).then_some(settled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(rates: &[(&str, u64)]) -> StageAssignment {
        StageAssignment {
            unmanaged: BTreeSet::new(),
            cache: BTreeMap::new(),
            jobs: rates
                .iter()
                .map(|&(job, rate)| {
                    let a = JobAssignment {
                        bytes_per_second: Some(rate),
                        reason: "weighted-share".to_owned(),
                        ..JobAssignment::default()
                    };
                    (job.to_owned(), a)
                })
                .collect(),
        }
    }

    #[test]
    fn small_rate_changes_keep_the_settings_in_force() {
        let before = assignment(&[("a", 250), ("b", 750)]);
        let next = assignment(&[("a", 252), ("b", 748)]);
        assert_eq!(settle(&before, next.clone()), before);
        assert_eq!(to_push(Some(&before), next.clone(), false), None);
        // Exact after a policy change.
        assert_eq!(to_push(Some(&before), next.clone(), true), Some(next));
        let moved = assignment(&[("a", 300), ("b", 700)]);
        assert_eq!(settle(&before, moved.clone()), moved);
        // Another field changed: everything new goes out.
        let mut other = before.clone();
        let a = other.jobs.get_mut("a").unwrap();
        a.bytes_per_second = Some(251);
        a.reason = "cap".to_owned();
        assert_eq!(settle(&before, other.clone()), other);
        // Nothing in force yet: everything goes out, an empty one does not.
        assert_eq!(to_push(None, before.clone(), false), Some(before));
        assert_eq!(to_push(None, StageAssignment::default(), false), None);
    }

    #[test]
    fn encoding_is_deterministic_and_round_trips() {
        let one = assignment(&[("x", 1), ("y", 2)]);
        let two = assignment(&[("y", 2), ("x", 1)]);
        assert_eq!(one.encode(), two.encode());
        assert_eq!(StageAssignment::decode(&one.encode()), Some(one));
        assert_eq!(StageAssignment::decode("not json"), None);
        // Documents stored before `unmanaged` existed read as none.
        let old = StageAssignment::decode(r#"{"jobs":{}}"#).unwrap();
        assert!(old.unmanaged.is_empty());
        let mut with = StageAssignment::default();
        with.unmanaged.insert("x".to_owned());
        assert_eq!(StageAssignment::decode(&with.encode()), Some(with));
    }
}
