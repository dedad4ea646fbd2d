//! What every stage should run: one tick's snapshot of the policies, the
//! live stages and their jobs' estimated demand goes through the
//! allocation engine ([`sluice_policy::allocation::allocate`], built with
//! the same [`Snapshot`] builder `sluicectl simulate` uses), and the
//! engine's per-stage decisions become [`StageSettings`]. Pure (data in,
//! settings out), so the control loop only gathers inputs and publishes.
//!
//! Jobs no policy selects are left out, so the stages run them on their
//! own configuration.
//!
//! What a stage enforces is the engine's allocation plus a loan: capacity
//! of a `weighted-fair` or `priority` pool that no job wants (all its jobs
//! are held at their demand) is lent to the jobs held at their demand, by
//! weight and up to their limits. A job whose demand grows then reads more
//! at once, its measured demand rises, and the next tick allocates it; the
//! loan shrinks as soon as another job wants the capacity.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_policy::allocation::{
    Allocation, JobAllocation, ObservedStage, Rates, Reason, Snapshot, StageAllocation, allocate,
};
use sluice_policy::{JobPolicy, PolicySet, Sharing};

use crate::demand::{StageDemand, job_demand};
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

/// A live stage at one tick: where it runs, its budgets and its jobs.
#[derive(Debug, Clone)]
pub struct StageInfo<'a> {
    /// The stage's id.
    pub id: &'a str,
    /// The node it runs on.
    pub node: &'a str,
    /// Bytes for all its buffers (0: not limited).
    pub memory_budget: u64,
    /// Reader threads for all its jobs (0: not said).
    pub reader_budget: u32,
    /// The jobs it serves: id and labels.
    pub jobs: Vec<(&'a str, &'a Labels)>,
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
    pub reason: String,
    /// Estimated demand in bytes per second; `None`: greedy or unknown.
    pub demand_bytes_per_second: Option<f64>,
    /// What its stages enforce, all together: the allocation plus pool
    /// capacity lent while no other job wants it (see [`lend_spare`]).
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
}

/// One tick's outcome: settings for every stage given, and the
/// allocation behind them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Computed {
    /// Settings per stage id (every stage given, possibly with no jobs).
    pub settings: BTreeMap<String, StageSettings>,
    /// Allocation per managed job.
    pub jobs: BTreeMap<String, JobShare>,
    /// Allocation per pool.
    pub pools: BTreeMap<String, PoolShare>,
    /// What the engine could not do as the policies say.
    pub problems: Vec<String>,
}

/// Computes every stage's settings from the policies, the live stages and
/// the jobs' estimated demand (by job, then stage; a job or stage missing
/// there counts as unknown, that is greedy).
pub fn compute(
    policies: &PolicySet,
    stages: &[StageInfo<'_>],
    demands: &BTreeMap<String, BTreeMap<String, StageDemand>>,
) -> Computed {
    // Each job's labels (from the first stage reporting it) and stages.
    let mut jobs: BTreeMap<&str, (&Labels, Vec<&StageInfo<'_>>)> = BTreeMap::new();
    for stage in stages {
        for &(job, labels) in &stage.jobs {
            jobs.entry(job)
                .or_insert((labels, Vec::new()))
                .1
                .push(stage);
        }
    }
    let mut snapshot = Snapshot::with_pools(policies);
    let mut placed: BTreeMap<String, (&JobPolicy, Option<f64>)> = BTreeMap::new();
    for (&job, (labels, on)) in &jobs {
        let unknown = BTreeMap::new();
        let estimates = demands.get(job).unwrap_or(&unknown);
        let stage_demand = |s: &StageInfo<'_>| estimates.get(s.id).copied();
        let all: Vec<StageDemand> = on
            .iter()
            .map(|s| stage_demand(s).unwrap_or(StageDemand::UNKNOWN))
            .collect();
        let demand = job_demand(&all);
        let observed = on.iter().map(|s| ObservedStage {
            stage: s.id.to_owned(),
            demand: stage_demand(s).and_then(|d| d.bytes_per_second),
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
    let mut nodes: BTreeMap<&str, (Vec<String>, u32, u64)> = BTreeMap::new();
    for stage in stages {
        let node = nodes.entry(stage.node).or_default();
        node.0.push(stage.id.to_owned());
        node.1 = node.1.saturating_add(stage.reader_budget);
        node.2 = node.2.saturating_add(stage.memory_budget);
    }
    for (name, (ids, readers, buffer)) in nodes {
        snapshot.add_node(name, ids, readers, buffer);
    }
    let allocation = allocate(&snapshot);
    let enforced = lend_spare(&snapshot, &allocation);
    let mut out = Computed {
        settings: stages
            .iter()
            .map(|s| (s.id.to_owned(), StageSettings::default()))
            .collect(),
        problems: allocation
            .problems
            .iter()
            .map(ToString::to_string)
            .collect(),
        ..Computed::default()
    };
    for pool in &snapshot.pools {
        out.pools.insert(
            pool.name.clone(),
            PoolShare {
                capacity_bytes_per_second: pool.bandwidth,
                allocated_bytes_per_second: 0.0,
                capacity_ops_per_second: pool.ops,
                allocated_ops_per_second: 0.0,
            },
        );
    }
    for (job, &enforced) in allocation.jobs.iter().zip(&enforced) {
        let Some(&(policy, demand)) = placed.get(&job.job) else {
            continue;
        };
        if let Some(pool) = out.pools.get_mut(&job.pool) {
            pool.allocated_bytes_per_second += job.bandwidth.rate;
            pool.allocated_ops_per_second += job.ops.map_or(0.0, |o| o.rate);
        }
        out.jobs.insert(
            job.job.clone(),
            JobShare {
                pool: job.pool.clone(),
                policy: policy.name().to_owned(),
                bytes_per_second: job.bandwidth.rate,
                ops_per_second: job.ops.map(|o| o.rate),
                reason: job.bandwidth.reason.as_str().to_owned(),
                demand_bytes_per_second: demand,
                enforced_bytes_per_second: enforced,
            },
        );
        // The loan goes to the stages in the allocation's proportions.
        let scale = |part: f64| match job.bandwidth.rate {
            0.0 => enforced / job.stages.len() as f64,
            rate => part * enforced / rate,
        };
        for stage in &job.stages {
            if let Some(settings) = out.settings.get_mut(&stage.stage) {
                let s = job_settings(policy, job, stage, scale(stage.bandwidth));
                settings.jobs.insert(job.job.clone(), s);
            }
        }
    }
    out
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

fn job_settings(
    policy: &JobPolicy,
    job: &JobAllocation,
    stage: &StageAllocation,
    bytes_per_second: f64,
) -> JobSettings {
    let spec = policy.spec();
    let prefetch = &spec.prefetch;
    // An unbounded buffer (no policy maximum, no stage budget) is left to
    // the stage: a zero pair means "keep your own".
    let (min_buffer_bytes, max_buffer_bytes) = match stage.buffer {
        u64::MAX => (0, 0),
        max => (prefetch.buffer.min.bytes().min(max), max),
    };
    JobSettings {
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

/// Returns each job's enforced bandwidth (in allocation order): its
/// allocation, plus, in `weighted-fair` and `priority` pools, a share of
/// the capacity left unallocated, lent by weight to the jobs held at their
/// demand, each up to its limit.
fn lend_spare(snapshot: &Snapshot, allocation: &Allocation) -> Vec<f64> {
    let mut enforced: Vec<f64> = allocation.jobs.iter().map(|j| j.bandwidth.rate).collect();
    let input = |id: &str| snapshot.jobs.iter().find(|j| j.id == id);
    for pool in &snapshot.pools {
        if pool.sharing == Sharing::Static {
            continue;
        }
        let members = || {
            allocation
                .jobs
                .iter()
                .enumerate()
                .filter(|(_, j)| j.pool == pool.name)
        };
        let allocated: f64 = members().map(|(_, j)| j.bandwidth.rate).sum();
        let mut spare = pool.bandwidth - allocated;
        // (index, weight, room left under its limit)
        let mut takers: Vec<(usize, f64, f64)> = members()
            .filter(|(_, j)| j.bandwidth.reason == Reason::DemandLimited)
            .filter_map(|(i, j)| {
                let job = input(&j.job)?;
                let limit = job.limit.bandwidth.unwrap_or(f64::INFINITY);
                Some((i, job.weight, limit - j.bandwidth.rate))
            })
            .filter(|&(_, _, room)| room > 0.0)
            .collect();
        // Weighted shares of what is left, capped by each one's room; the
        // capped drop out and the rest share again.
        while spare > 1.0 && !takers.is_empty() {
            let weights: f64 = takers.iter().map(|t| t.1).sum();
            let mut given = 0.0;
            for t in &mut takers {
                let part = (spare * t.1 / weights).min(t.2);
                enforced[t.0] += part;
                t.2 -= part;
                given += part;
            }
            spare -= given;
            takers.retain(|t| t.2 > 1e-9);
        }
    }
    enforced
}

/// Rates that moved by less than this fraction are not pushed again.
pub const RATE_TOLERANCE: f64 = 0.02;

/// Returns `next` with the rates of `current` kept wherever a job's
/// settings differ only in rates that moved by less than
/// [`RATE_TOLERANCE`]: small changes are not worth a new version.
pub fn settle(current: &StageSettings, mut next: StageSettings) -> StageSettings {
    let close = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => (a as f64 - b as f64).abs() <= RATE_TOLERANCE * a.max(b) as f64,
        (a, b) => a == b,
    };
    for (job, n) in &mut next.jobs {
        let Some(c) = current.jobs.get(job) else {
            continue;
        };
        let same_rest = JobSettings {
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

#[cfg(test)]
mod tests {
    use super::*;

    const POLICIES: &str = "
apiVersion: sluice.dev/v1
kind: StoragePool
metadata: {name: shared}
spec: {capacity: {bandwidth: 1000B/s}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: light}
spec:
  selector: {matchLabels: {team: light}}
  pool: shared
  limit: {burst: 200ms}
  prefetch: {readers: {min: 1, max: 8}, buffer: {min: 1MiB, max: 64MiB}}
---
apiVersion: sluice.dev/v1
kind: JobPolicy
metadata: {name: heavy}
spec:
  selector: {matchLabels: {team: heavy}}
  pool: shared
  weight: 3
";

    fn set() -> PolicySet {
        PolicySet::from_documents(sluice_policy::parse_documents("t.yaml", POLICIES).unwrap())
            .unwrap()
    }

    fn labels(team: &str) -> Labels {
        Labels::from([("team".to_owned(), team.to_owned())])
    }

    fn stage<'a>(id: &'a str, jobs: Vec<(&'a str, &'a Labels)>) -> StageInfo<'a> {
        StageInfo {
            id,
            node: id,
            memory_budget: 32 << 20,
            reader_budget: 0,
            jobs,
        }
    }

    fn demand(bytes: f64) -> StageDemand {
        StageDemand {
            bytes_per_second: Some(bytes),
            wants_more: false,
            ..StageDemand::UNKNOWN
        }
    }

    #[test]
    fn greedy_jobs_share_by_weight_and_split_over_their_stages() {
        let (light, heavy, other) = (labels("light"), labels("heavy"), labels("x"));
        let stages = [
            stage("s1", vec![("a", &light), ("b", &heavy), ("c", &other)]),
            stage("s2", vec![("a", &light), ("b", &heavy)]),
            stage("s3", vec![]),
        ];
        let c = compute(&set(), &stages, &BTreeMap::new());
        assert_eq!(c.settings.keys().collect::<Vec<_>>(), ["s1", "s2", "s3"]);
        assert_eq!(c.settings["s1"].jobs.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert!(c.settings["s3"].jobs.is_empty());
        let rate = |s: &str, j: &str| c.settings[s].jobs[j].bytes_per_second;
        assert_eq!((rate("s1", "a"), rate("s2", "a")), (Some(125), Some(125)));
        assert_eq!((rate("s1", "b"), rate("s2", "b")), (Some(375), Some(375)));
        let a = &c.settings["s1"].jobs["a"];
        assert_eq!(a.reason, "weighted-share");
        assert_eq!((a.policy.as_str(), a.pool.as_str()), ("light", "shared"));
        assert_eq!((a.min_readers, a.max_readers, a.burst_millis), (1, 8, 200));
        // The stage's 32 MiB budget, shared 1:3 with `b`.
        assert_eq!((a.min_buffer_bytes, a.max_buffer_bytes), (1 << 20, 8 << 20));
        assert_eq!(c.settings["s1"].jobs["b"].max_buffer_bytes, 24 << 20);
        assert_eq!(c.jobs["b"].bytes_per_second.round(), 750.0);
        assert_eq!(c.jobs["b"].demand_bytes_per_second, None);
        assert!(!c.jobs.contains_key("c"));
        assert_eq!(c.pools["shared"].allocated_bytes_per_second.round(), 1000.0);
    }

    #[test]
    fn a_job_that_wants_little_leaves_the_rest_and_splits_by_demand() {
        let (light, heavy) = (labels("light"), labels("heavy"));
        let stages = [
            stage("s1", vec![("a", &light), ("b", &heavy)]),
            stage("s2", vec![("a", &light), ("b", &heavy)]),
        ];
        let demands = BTreeMap::from([(
            "a".to_owned(),
            BTreeMap::from([
                ("s1".to_owned(), demand(90.0)),
                ("s2".to_owned(), demand(10.0)),
            ]),
        )]);
        let c = compute(&set(), &stages, &demands);
        let a = &c.jobs["a"];
        assert_eq!(
            (a.bytes_per_second.round(), a.reason.as_str()),
            (100.0, "demand-limited")
        );
        assert_eq!(a.demand_bytes_per_second, Some(100.0));
        assert_eq!(c.settings["s1"].jobs["a"].bytes_per_second, Some(90));
        assert_eq!(c.settings["s2"].jobs["a"].bytes_per_second, Some(10));
        assert_eq!(c.jobs["b"].bytes_per_second.round(), 900.0);
        // The pool is fully allocated: nothing to lend.
        assert_eq!(c.jobs["a"].enforced_bytes_per_second.round(), 100.0);
    }

    #[test]
    fn capacity_nobody_wants_is_lent_by_weight_up_to_limits() {
        let (light, heavy) = (labels("light"), labels("heavy"));
        let stages = [stage("s1", vec![("a", &light), ("b", &heavy)])];
        let wants = |bytes| BTreeMap::from([("s1".to_owned(), demand(bytes))]);
        let demands = BTreeMap::from([
            ("a".to_owned(), wants(100.0)),
            ("b".to_owned(), wants(100.0)),
        ]);
        let c = compute(&set(), &stages, &demands);
        // 800 spare, lent 1:3.
        assert_eq!(c.jobs["a"].bytes_per_second.round(), 100.0);
        assert_eq!(c.jobs["a"].enforced_bytes_per_second.round(), 300.0);
        assert_eq!(c.jobs["b"].enforced_bytes_per_second.round(), 700.0);
        assert_eq!(c.settings["s1"].jobs["b"].bytes_per_second, Some(700));
        assert_eq!(c.settings["s1"].jobs["b"].reason, "demand-limited");
    }

    #[test]
    fn small_rate_changes_keep_the_settings_in_force() {
        let (light, heavy) = (labels("light"), labels("heavy"));
        let stages = [stage("s1", vec![("a", &light), ("b", &heavy)])];
        let before = compute(&set(), &stages, &BTreeMap::new()).settings["s1"].clone();
        let mut next = before.clone();
        next.jobs.get_mut("a").unwrap().bytes_per_second = Some(252);
        assert_eq!(settle(&before, next.clone()), before);
        next.jobs.get_mut("a").unwrap().bytes_per_second = Some(300);
        assert_eq!(settle(&before, next.clone()), next);
        // Another field changed: everything new goes out.
        let mut other = before.clone();
        let a = other.jobs.get_mut("a").unwrap();
        a.bytes_per_second = Some(251);
        a.reason = "cap".to_owned();
        assert_eq!(settle(&before, other.clone()), other);
    }

    #[test]
    fn encoding_is_deterministic_and_round_trips() {
        let light = labels("light");
        let one = compute(
            &set(),
            &[stage("s1", vec![("x", &light), ("y", &light)])],
            &BTreeMap::new(),
        );
        let two = compute(
            &set(),
            &[stage("s1", vec![("y", &light), ("x", &light)])],
            &BTreeMap::new(),
        );
        let (one, two) = (&one.settings["s1"], &two.settings["s1"]);
        assert_eq!(one.encode(), two.encode());
        assert_eq!(StageSettings::decode(&one.encode()).as_ref(), Some(one));
    }
}
