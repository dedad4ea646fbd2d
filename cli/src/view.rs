//! What `get -o json` and `get -o yaml` print: the controller's answers
//! converted into structs of our own, so that the output is a documented,
//! stable contract for scripts and does not follow every change of the
//! wire types. Fields may be added; none is renamed or removed.
//!
//! Conventions: names are `snake_case`; rates carry their unit in the
//! name (`_bytes_per_second`, `_ops_per_second`); a limit that is not set
//! is `null` (unlimited), never 0; an empty name (no policy, no pool) is
//! `null`; times are milliseconds since the Unix epoch; fractions go from
//! 0 to 1; maps are sorted by key.

use std::collections::BTreeMap;

use serde::Serialize;
use sluice_proto::v1;

/// One stage, an element of `get stages -o json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageView {
    /// The stage's id.
    pub id: String,
    /// The node it runs on.
    pub node: String,
    /// `connected` or `lost` (`unknown` if the controller sent neither).
    pub state: &'static str,
    /// Settings version the controller wants in force; 0 = none yet.
    pub desired_version: u64,
    /// Last settings version the stage acknowledged; 0 = none.
    pub acked_version: u64,
    /// True when the stage acknowledged the desired version.
    pub in_sync: bool,
    /// The last rejection after the acknowledged version, if any.
    pub last_nack: Option<NackView>,
    /// When the controller last heard from the stage.
    pub last_seen_unix_millis: i64,
    /// The stage's labels.
    pub labels: BTreeMap<String, String>,
    /// Ids of the jobs it serves, ordered.
    pub jobs: Vec<String>,
    /// Its software version.
    pub software_version: String,
    /// Its capabilities.
    pub capabilities: Vec<String>,
    /// The datasets it serves.
    pub datasets: Vec<String>,
    /// Buffer memory budget in bytes; 0 = not limited.
    pub memory_budget_bytes: u64,
    /// Buffer memory in use, in bytes.
    pub memory_used_bytes: u64,
}

/// A stage's rejection of a settings version.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NackView {
    /// The version rejected.
    pub version: u64,
    /// Why, as the stage said it.
    pub reason: String,
}

/// One policy revision, an element of `get policies -o json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyView {
    /// `StoragePool`, `JobPolicy`, ...
    pub kind: String,
    /// The document's `metadata.name`.
    pub name: String,
    /// The policy's current revision (1 for the first).
    pub revision: u64,
    /// True if this revision records a deletion.
    pub deleted: bool,
    /// When this revision was stored.
    pub created_unix_millis: i64,
    /// The stored document in canonical form; `null` for a deletion.
    pub document: Option<serde_json::Value>,
}

/// One job, an element of `get jobs -o json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobView {
    /// The job's id.
    pub id: String,
    /// Its labels, as its trainers announced them.
    pub labels: BTreeMap<String, String>,
    /// The JobPolicy that selects it; `null` = none (defaults).
    pub policy: Option<String>,
    /// The StoragePool it draws from; `null` = none.
    pub pool: Option<String>,
    /// Bytes per second delivered to its trainers, all stages together.
    pub throughput_bytes_per_second: f64,
    /// Samples per second delivered, all stages together.
    pub throughput_samples_per_second: f64,
    /// Of the bytes delivered, bytes per second read from storage (the
    /// node cache's hits are not), all stages together.
    pub storage_bytes_per_second: f64,
    /// Fraction of time its trainers waited for data, 0 to 1.
    pub stall_fraction: f64,
    /// What its policy declares about its share.
    pub limits: LimitsView,
    /// Settings in force for the job as a whole (rates summed over
    /// stages); `null` if none were pushed.
    pub settings: Option<SettingsView>,
    /// The job on each stage that serves it, ordered by stage id.
    pub stages: Vec<JobStageView>,
    /// Its current share of its pool; `null` when no policy selects it.
    pub allocation: Option<AllocationView>,
}

impl JobView {
    /// The bandwidth limit a table shows: what its stages enforce, or,
    /// while no stage serves it (its trainers left), what its policy caps
    /// it at, which its stages keep for its next trainer.
    pub fn limit_shown(&self) -> Option<u64> {
        match &self.settings {
            Some(settings) => settings.bytes_per_second,
            None => self.limits.limit_bytes_per_second,
        }
    }
}

/// A job's share of its pool, as the controller's allocation engine
/// computed it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocationView {
    /// Allocated bandwidth, all stages together.
    pub bytes_per_second: f64,
    /// Allocated operations per second; `null` = unlimited.
    pub ops_per_second: Option<f64>,
    /// Why: `guarantee`, `weighted-share`, `cap`, `demand-limited`,
    /// `priority` or `static`.
    pub reason: String,
    /// Estimated demand; `null` = greedy (wants more than it has) or not
    /// measured yet.
    pub demand_bytes_per_second: Option<f64>,
    /// What its stages enforce: the allocation plus pool capacity lent
    /// while no other job wants it.
    pub enforced_bytes_per_second: f64,
}

/// A job's share as its policy declares it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LimitsView {
    /// Guaranteed bandwidth; `null` = none.
    pub guarantee_bytes_per_second: Option<u64>,
    /// Bandwidth cap; `null` = none.
    pub limit_bytes_per_second: Option<u64>,
    /// Guaranteed operations per second; `null` = none.
    pub guarantee_ops_per_second: Option<u64>,
    /// Cap on operations per second; `null` = none.
    pub limit_ops_per_second: Option<u64>,
    /// Weight in the pool's fair sharing (a whole number, as policies
    /// write it and the REST API gives it).
    pub weight: u32,
    /// Priority; higher is served first.
    pub priority: i32,
}

/// Settings pushed for a job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingsView {
    /// Rate limit; `null` = unlimited.
    pub bytes_per_second: Option<u64>,
    /// Operation rate limit; `null` = unlimited.
    pub ops_per_second: Option<u64>,
    /// Burst window in milliseconds; 0 = stage default.
    pub burst_millis: u32,
    /// Whether the auto-tuner runs; `null` = stage default.
    pub tuner: Option<bool>,
    /// Reader thread bounds; 0 = stage default.
    pub min_readers: u32,
    /// See `min_readers`.
    pub max_readers: u32,
    /// Prefetch buffer bounds in bytes; 0 = stage default.
    pub min_buffer_bytes: u64,
    /// See `min_buffer_bytes`.
    pub max_buffer_bytes: u64,
    /// Why the rate is what it is (`guarantee`, `cap`, `weighted-share`...);
    /// `null` if not said.
    pub reason: Option<String>,
}

/// One job on one stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobStageView {
    /// The stage's id.
    pub stage_id: String,
    /// True if the stage acknowledged the version carrying `settings`.
    pub acked: bool,
    /// Bytes per second delivered on this stage.
    pub throughput_bytes_per_second: f64,
    /// Fraction of time the job's trainers on this stage waited, 0 to 1.
    pub stall_fraction: f64,
    /// The settings pushed to this stage for this job.
    pub settings: Option<SettingsView>,
}

/// One pool, an element of `get pools -o json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolView {
    /// The pool's `metadata.name`.
    pub name: String,
    /// Declared bandwidth capacity; `null` = unlimited.
    pub bandwidth_bytes_per_second: Option<u64>,
    /// Declared operations per second; `null` = unlimited.
    pub ops_per_second: Option<u64>,
    /// Sharing mode, as written in the policy.
    pub sharing: String,
    /// Bandwidth currently allocated to jobs.
    pub allocated_bytes_per_second: u64,
    /// Operations per second currently allocated to jobs.
    pub allocated_ops_per_second: u64,
    /// Bytes per second its jobs read, all together.
    pub throughput_bytes_per_second: f64,
    /// Ids of the jobs drawing from it, ordered.
    pub jobs: Vec<String>,
    /// What the last allocation could not do in it as its policies say.
    pub problems: Vec<String>,
}

/// One data set, an element of `get datasets -o json`: the controller's
/// REST view of it (`GET /api/v1/datasets`), field for field.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DatasetView {
    /// The name the stages serve it by.
    pub name: String,
    /// The DatasetCache policy naming it; `null` when none does.
    pub policy: Option<String>,
    /// The staging round last asked for (`sluicectl stage`); 0 = none.
    pub staging_round: u64,
    /// Each stage serving it, by stage id.
    pub stages: Vec<DatasetOnStageView>,
}

/// A data set on one stage, from the stage's last report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DatasetOnStageView {
    /// The stage's id.
    pub stage: String,
    /// `connected` or `lost`.
    pub state: &'static str,
    /// The stage's node cache memory tier, bytes (0: none).
    pub memory_capacity_bytes: u64,
    /// The stage's node cache disk tier, bytes (0: none).
    pub disk_capacity_bytes: u64,
    /// What its cache holds of the data set; `null` when it has no cache.
    pub cache: Option<CacheUseView>,
}

/// What one stage's node cache holds and did for a data set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheUseView {
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    /// Samples held.
    pub entries: u64,
    /// The data set's share of the cache, bytes.
    pub share_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_bytes: u64,
    pub evictions: u64,
    /// The stage's latest staging round of it; `null` when none.
    pub staging: Option<StagingView>,
}

/// A stage's latest staging round of a data set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StagingView {
    pub round: u64,
    /// `running`, `done`, `full` (its share of the cache filled),
    /// `failed` or `stopped`, as the stage reports it.
    pub state: String,
    pub samples_done: u64,
    pub samples_total: u64,
    pub source_bytes: u64,
    /// Samples it could not read.
    pub errors: u64,
    /// Why the round failed; empty when it did not.
    pub error: String,
}

impl DatasetView {
    /// Bytes held by every stage's cache, both tiers.
    pub fn cached_bytes(&self) -> u64 {
        self.caches().map(|c| c.memory_bytes + c.disk_bytes).sum()
    }

    /// Samples held by every stage's cache.
    pub fn cached_samples(&self) -> u64 {
        self.caches().map(|c| c.entries).sum()
    }

    /// Cache hits over lookups on every stage; `None` before any lookup.
    pub fn hit_ratio(&self) -> Option<f64> {
        let (hits, lookups) = self
            .caches()
            .fold((0, 0), |(h, n), c| (h + c.hits, n + c.hits + c.misses));
        (lookups > 0).then(|| hits as f64 / lookups as f64)
    }

    fn caches(&self) -> impl Iterator<Item = &CacheUseView> {
        self.stages.iter().filter_map(|s| s.cache.as_ref())
    }
}

impl From<v1::Dataset> for DatasetView {
    fn from(d: v1::Dataset) -> Self {
        Self {
            name: d.name,
            policy: non_empty(d.policy),
            staging_round: d.staging_round,
            stages: d
                .stages
                .into_iter()
                .map(|s| DatasetOnStageView {
                    stage: s.stage,
                    state: state_word(s.state),
                    memory_capacity_bytes: s.memory_capacity_bytes,
                    disk_capacity_bytes: s.disk_capacity_bytes,
                    cache: s.cache.map(|c| CacheUseView {
                        memory_bytes: c.memory_bytes,
                        disk_bytes: c.disk_bytes,
                        entries: c.entries,
                        share_bytes: c.share_bytes,
                        hits: c.hits,
                        misses: c.misses,
                        hit_bytes: c.hit_bytes,
                        evictions: c.evictions,
                        staging: c.staging.map(|p| StagingView {
                            round: p.round,
                            state: p.state,
                            samples_done: p.samples_done,
                            samples_total: p.samples_total,
                            source_bytes: p.source_bytes,
                            errors: p.errors,
                            error: p.error,
                        }),
                    }),
                })
                .collect(),
        }
    }
}

/// Returns `None` for an empty string.
fn non_empty(text: String) -> Option<String> {
    if text.is_empty() { None } else { Some(text) }
}

/// Returns a stage state as the word scripts compare against.
pub fn state_word(state: i32) -> &'static str {
    match v1::StageState::try_from(state) {
        Ok(v1::StageState::Connected) => "connected",
        Ok(v1::StageState::Lost) => "lost",
        Ok(v1::StageState::Stopped) => "stopped",
        _ => "unknown",
    }
}

impl From<v1::Stage> for StageView {
    fn from(s: v1::Stage) -> Self {
        Self {
            state: state_word(s.state),
            in_sync: s.desired_version == s.acked_version,
            last_nack: s.last_nack.map(|n| NackView {
                version: n.version,
                reason: n.reason,
            }),
            id: s.id,
            node: s.node,
            desired_version: s.desired_version,
            acked_version: s.acked_version,
            last_seen_unix_millis: s.last_seen_unix_millis,
            labels: s.labels.into_iter().collect(),
            jobs: s.jobs,
            software_version: s.software_version,
            capabilities: s.capabilities,
            datasets: s.datasets,
            memory_budget_bytes: s.memory_budget_bytes,
            memory_used_bytes: s.memory_used_bytes,
        }
    }
}

impl From<v1::Policy> for PolicyView {
    fn from(p: v1::Policy) -> Self {
        // A document the controller sent as something other than JSON is
        // kept as a string rather than dropped.
        let document = non_empty(p.json)
            .map(|json| serde_json::from_str(&json).unwrap_or(serde_json::Value::String(json)));
        Self {
            kind: p.kind,
            name: p.name,
            revision: p.revision,
            deleted: p.deleted,
            created_unix_millis: p.created_unix_millis,
            document,
        }
    }
}

impl From<v1::JobSettings> for SettingsView {
    fn from(s: v1::JobSettings) -> Self {
        Self {
            bytes_per_second: s.bytes_per_second,
            ops_per_second: s.ops_per_second,
            burst_millis: s.burst_millis,
            tuner: s.tuner,
            min_readers: s.min_readers,
            max_readers: s.max_readers,
            min_buffer_bytes: s.min_buffer_bytes,
            max_buffer_bytes: s.max_buffer_bytes,
            reason: non_empty(s.reason),
        }
    }
}

impl From<v1::JobLimits> for LimitsView {
    fn from(l: v1::JobLimits) -> Self {
        Self {
            guarantee_bytes_per_second: l.guarantee_bytes_per_second,
            limit_bytes_per_second: l.limit_bytes_per_second,
            guarantee_ops_per_second: l.guarantee_ops_per_second,
            limit_ops_per_second: l.limit_ops_per_second,
            // Sent as a double; policies allow 1 to 10,000.
            weight: l.weight.round() as u32,
            priority: l.priority,
        }
    }
}

impl From<v1::Job> for JobView {
    fn from(j: v1::Job) -> Self {
        Self {
            id: j.id,
            labels: j.labels.into_iter().collect(),
            policy: non_empty(j.policy),
            pool: non_empty(j.pool),
            throughput_bytes_per_second: j.throughput_bytes_per_second,
            throughput_samples_per_second: j.throughput_samples_per_second,
            storage_bytes_per_second: j.storage_bytes_per_second,
            stall_fraction: j.stall_fraction,
            limits: j.limits.map(LimitsView::from).unwrap_or_default(),
            settings: j.settings.map(SettingsView::from),
            stages: j
                .stages
                .into_iter()
                .map(|s| JobStageView {
                    stage_id: s.stage_id,
                    acked: s.acked,
                    throughput_bytes_per_second: s.throughput_bytes_per_second,
                    stall_fraction: s.stall_fraction,
                    settings: s.settings.map(SettingsView::from),
                })
                .collect(),
            allocation: j.allocation.map(|a| AllocationView {
                bytes_per_second: a.bytes_per_second,
                ops_per_second: a.ops_per_second,
                reason: a.reason,
                demand_bytes_per_second: a.demand_bytes_per_second,
                enforced_bytes_per_second: a.enforced_bytes_per_second,
            }),
        }
    }
}

impl From<v1::Pool> for PoolView {
    fn from(p: v1::Pool) -> Self {
        Self {
            name: p.name,
            bandwidth_bytes_per_second: p.bandwidth_bytes_per_second,
            ops_per_second: p.ops_per_second,
            sharing: p.sharing,
            allocated_bytes_per_second: p.allocated_bytes_per_second,
            allocated_ops_per_second: p.allocated_ops_per_second,
            throughput_bytes_per_second: p.throughput_bytes_per_second,
            jobs: p.jobs,
            problems: p.problems,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_stage_has_the_documented_json_shape() {
        let stage = v1::Stage {
            id: "node-a-0".into(),
            node: "node-a".into(),
            state: v1::StageState::Lost as i32,
            desired_version: 3,
            acked_version: 2,
            last_nack: Some(v1::Nack {
                version: 3,
                reason: "buffer over budget".into(),
            }),
            jobs: vec!["resnet50".into()],
            ..v1::Stage::default()
        };
        let value = serde_json::to_value(StageView::from(stage)).unwrap();
        assert_eq!(value["id"], "node-a-0");
        assert_eq!(value["node"], "node-a");
        assert_eq!(value["state"], "lost");
        assert_eq!(value["desired_version"], 3);
        assert_eq!(value["acked_version"], 2);
        assert_eq!(value["in_sync"], false);
        assert_eq!(
            value["last_nack"],
            json!({"version": 3, "reason": "buffer over budget"})
        );
        assert_eq!(value["jobs"], json!(["resnet50"]));
    }

    #[test]
    fn a_policy_carries_its_document_as_json() {
        let policy = v1::Policy {
            kind: "StoragePool".into(),
            name: "nfs".into(),
            revision: 2,
            json: r#"{"kind":"StoragePool"}"#.into(),
            ..v1::Policy::default()
        };
        let value = serde_json::to_value(PolicyView::from(policy)).unwrap();
        assert_eq!(value["kind"], "StoragePool");
        assert_eq!(value["name"], "nfs");
        assert_eq!(value["revision"], 2);
        assert_eq!(value["deleted"], false);
        assert_eq!(value["document"], json!({"kind": "StoragePool"}));
    }

    #[test]
    fn unset_limits_and_empty_names_are_null() {
        let job = v1::Job {
            id: "bert".into(),
            settings: Some(v1::JobSettings {
                ops_per_second: Some(0),
                ..v1::JobSettings::default()
            }),
            ..v1::Job::default()
        };
        let value = serde_json::to_value(JobView::from(job)).unwrap();
        assert_eq!(value["policy"], json!(null));
        assert_eq!(value["pool"], json!(null));
        assert_eq!(value["settings"]["bytes_per_second"], json!(null));
        // Zero is a limit ("stopped"), distinct from unlimited.
        assert_eq!(value["settings"]["ops_per_second"], 0);
        assert_eq!(value["limits"]["limit_bytes_per_second"], json!(null));
    }
}
