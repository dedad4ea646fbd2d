//! The controller's read model: stages, jobs, pools and policies as
//! operators see them, assembled from the store, the live sessions and the
//! policy set. The admin API converts these to protobuf, the HTTP view
//! serialises them as JSON.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::error::ApiError;
use crate::state::{LiveStage, Shared, lock};
use crate::store::{JobRecord, Labels, PolicyRevision, StageRecord};
use sluice_policy::coordination::{JobAssignment, JobShare};

/// A stage's last rejection.
#[derive(Debug, Clone, Serialize)]
pub struct NackView {
    pub version: u64,
    pub reason: String,
}

/// One stage.
#[derive(Debug, Clone, Serialize)]
pub struct StageView {
    pub id: String,
    pub node: String,
    pub labels: Labels,
    /// `connected`, `stopped` (it ended its session and is not back
    /// yet) or `lost`.
    pub state: &'static str,
    pub desired_version: u64,
    pub acked_version: u64,
    /// It runs the settings the controller wants for it (as `sluicectl
    /// get stages` shows).
    pub in_sync: bool,
    pub last_nack: Option<NackView>,
    pub last_seen_unix_millis: i64,
    pub jobs: Vec<String>,
    pub software_version: String,
    pub capabilities: Vec<String>,
    pub datasets: Vec<String>,
    pub memory_budget_bytes: u64,
    pub memory_used_bytes: u64,
}

/// One job on one stage.
#[derive(Debug, Clone, Serialize)]
pub struct JobStageView {
    pub stage_id: String,
    pub settings: Option<JobAssignment>,
    pub acked: bool,
    pub throughput_bytes_per_second: f64,
    pub stall_fraction: f64,
}

/// What a job's policy declares.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LimitsView {
    pub guarantee_bytes_per_second: Option<u64>,
    pub limit_bytes_per_second: Option<u64>,
    pub guarantee_ops_per_second: Option<u64>,
    pub limit_ops_per_second: Option<u64>,
    pub weight: u32,
    pub priority: i32,
}

/// One job across its stages.
#[derive(Debug, Clone, Serialize)]
pub struct JobView {
    pub id: String,
    pub labels: Labels,
    pub policy: String,
    pub pool: String,
    pub stages: Vec<JobStageView>,
    /// Bytes per second delivered to its trainers (the node cache's hits
    /// included).
    pub throughput_bytes_per_second: f64,
    pub throughput_samples_per_second: f64,
    /// Of those, bytes per second read from storage: what its pool's
    /// capacity and its limits are measured in.
    pub storage_bytes_per_second: f64,
    pub stall_fraction: f64,
    pub limits: Option<LimitsView>,
    /// The job's current share of its pool; `None` when no policy selects
    /// it (or before the first tick after it appeared).
    pub allocation: Option<JobShare>,
}

/// One storage pool.
#[derive(Debug, Clone, Serialize)]
pub struct PoolView {
    pub name: String,
    pub bandwidth_bytes_per_second: Option<u64>,
    pub ops_per_second: Option<u64>,
    pub sharing: String,
    pub allocated_bytes_per_second: u64,
    pub allocated_ops_per_second: u64,
    /// Bytes per second its jobs read from storage (hits of the node cache
    /// cost the pool nothing).
    pub throughput_bytes_per_second: f64,
    pub jobs: Vec<String>,
    /// What the last allocation could not do in it as its policies say.
    pub problems: Vec<String>,
}

/// One policy revision.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyView {
    pub kind: String,
    pub name: String,
    pub revision: u64,
    pub yaml: String,
    pub json: String,
    pub created_unix_millis: i64,
    pub deleted: bool,
}

/// Returns every stage, by id.
pub async fn stages(shared: &Shared) -> Result<Vec<StageView>, ApiError> {
    let records = shared.store.stages().await?;
    let live = lock(&shared.live);
    Ok(records
        .into_iter()
        .map(|r| {
            let l = live.get(&r.id);
            stage_view(r, l)
        })
        .collect())
}

/// Returns one stage.
pub async fn stage(shared: &Shared, id: &str) -> Result<StageView, ApiError> {
    let record = shared.store.stage(id).await?;
    let record = record.ok_or_else(|| ApiError::NotFound(format!("no stage has id `{id}`")))?;
    let live = lock(&shared.live);
    Ok(stage_view(record, live.get(id)))
}

fn stage_view(r: StageRecord, live: Option<&LiveStage>) -> StageView {
    let lost = live.map_or(r.state == crate::store::StageState::Lost, |l| l.lost);
    // Ended its session itself and not back yet: a stage stopping or
    // restarting (the store's mark counts where the controller has no
    // session record, as on a standby).
    let stopped = live.map_or(
        r.ended_ms.is_some_and(|ms| ms >= r.last_seen_ms),
        LiveStage::stopped,
    );
    let hello = live.map(|l| l.hello.clone()).unwrap_or_default();
    let telemetry = live.and_then(LiveStage::latest);
    let (desired_version, acked_version) = (
        r.desired_version().unwrap_or(0),
        r.acked_version.unwrap_or(0),
    );
    StageView {
        desired_version,
        acked_version,
        in_sync: desired_version == acked_version,
        last_nack: r.last_nack.map(|n| NackView {
            version: n.version,
            reason: n.reason,
        }),
        state: if lost {
            "lost"
        } else if stopped {
            "stopped"
        } else {
            "connected"
        },
        // The store is told every few seconds; the controller hears more.
        // A stage that ended its session was heard until then (the store's
        // sighting is written every few seconds only).
        last_seen_unix_millis: live
            .map_or(r.last_seen_ms, |l| l.heard_ms.max(r.last_seen_ms))
            .max(r.ended_ms.unwrap_or(0)),
        // The jobs it serves now (trainers connected), not those it keeps
        // idle, nor those of a lost stage's last report.
        jobs: live
            .map(|l| l.serving().cloned().collect())
            .unwrap_or_default(),
        memory_used_bytes: telemetry.map_or(0, |t| t.memory_used_bytes),
        software_version: hello.software_version,
        capabilities: hello.capabilities,
        datasets: hello.datasets,
        memory_budget_bytes: hello.memory_budget_bytes,
        id: r.id,
        node: r.node,
        labels: r.labels,
    }
}

/// Returns every job, by id.
pub async fn jobs(shared: &Shared) -> Result<Vec<JobView>, ApiError> {
    let records = shared.store.jobs().await?;
    let acked = acked_versions(shared).await?;
    Ok(records
        .into_iter()
        .map(|r| job_view(shared, r, &acked))
        .collect())
}

/// Returns one job.
pub async fn job(shared: &Shared, id: &str) -> Result<JobView, ApiError> {
    let record = shared.store.job(id).await?;
    let record = record.ok_or_else(|| ApiError::NotFound(format!("no job has id `{id}`")))?;
    let acked = acked_versions(shared).await?;
    Ok(job_view(shared, record, &acked))
}

async fn acked_versions(shared: &Shared) -> Result<BTreeMap<String, u64>, ApiError> {
    let stages = shared.store.stages().await?;
    Ok(stages
        .into_iter()
        .map(|s| (s.id, s.acked_version.unwrap_or(0)))
        .collect())
}

/// What `job` did on one stage over the last few seconds of its reports.
#[derive(Default)]
struct Rates {
    delivered_bytes: f64,
    delivered_samples: f64,
    storage_bytes: f64,
    stalled: f64,
}

fn rates(live: Option<&LiveStage>, job: &str) -> Rates {
    let Some((window, _)) = live.and_then(|l| l.shown_window(job)) else {
        return Rates::default();
    };
    Rates {
        delivered_bytes: window.delivered_bytes_per_second,
        delivered_samples: window.delivered_samples_per_second,
        storage_bytes: window.read_bytes_per_second,
        stalled: window.stalled,
    }
}

/// The limits a stage enforces for a job the controller pushed no settings
/// for (no policy selects it): the stage's own (`--rate-limit`,
/// `--ops-limit`), as its last report gave them, with reason `stage`.
fn stage_own(live: Option<&LiveStage>, job: &str) -> Option<JobAssignment> {
    let (bytes_per_second, ops_per_second) = live?.latest()?.jobs.get(job)?.in_force;
    Some(JobAssignment {
        bytes_per_second,
        ops_per_second,
        reason: "stage".into(),
        ..JobAssignment::default()
    })
}

fn job_view(shared: &Shared, r: JobRecord, acked: &BTreeMap<String, u64>) -> JobView {
    // Lock order everywhere: live, then policies, then desired.
    let live = lock(&shared.live);
    let policies = shared.read_policies();
    let policy = policies.policy_for_job(&r.labels);
    let desired = lock(&shared.desired);
    let allocation = lock(&shared.shares).jobs.get(&r.id).cloned();
    let mut stages = Vec::new();
    let mut total = Rates::default();
    // Only the stages that serve the job now: a lost stage's last rates
    // and settings would count toward the job's throughput and the limit
    // in force long after it died (its share goes to the stages that
    // remain), and a job every stage has let go of has left.
    let serving = r
        .stages
        .iter()
        .filter(|stage| live.get(*stage).is_some_and(|l| l.serves(&r.id)));
    for stage in serving {
        let here = rates(live.get(stage), &r.id);
        let d = desired.get(stage);
        total.delivered_bytes += here.delivered_bytes;
        total.delivered_samples += here.delivered_samples;
        total.storage_bytes += here.storage_bytes;
        total.stalled = total.stalled.max(here.stalled);
        stages.push(JobStageView {
            stage_id: stage.clone(),
            settings: d
                .and_then(|d| d.settings.jobs.get(&r.id).cloned())
                .or_else(|| stage_own(live.get(stage), &r.id)),
            acked: d.is_some_and(|d| acked.get(stage).copied().unwrap_or(0) >= d.version),
            throughput_bytes_per_second: here.delivered_bytes,
            stall_fraction: here.stalled,
        });
    }
    let limits = policy.map(|p| {
        let spec = p.spec();
        LimitsView {
            guarantee_bytes_per_second: spec.guarantee.bandwidth.map(|b| b.bytes_per_second()),
            limit_bytes_per_second: spec.limit.bandwidth.map(|b| b.bytes_per_second()),
            guarantee_ops_per_second: spec.guarantee.ops.map(|o| o.per_second()),
            limit_ops_per_second: spec.limit.ops.map(|o| o.per_second()),
            weight: spec.weight,
            priority: spec.priority,
        }
    });
    JobView {
        policy: policy.map(|p| p.name().to_owned()).unwrap_or_default(),
        pool: policy.map(|p| p.spec().pool.clone()).unwrap_or_default(),
        id: r.id,
        labels: r.labels,
        stages,
        throughput_bytes_per_second: total.delivered_bytes,
        throughput_samples_per_second: total.delivered_samples,
        storage_bytes_per_second: total.storage_bytes,
        stall_fraction: total.stalled,
        limits,
        allocation,
    }
}

/// Returns every pool, by name.
pub async fn pools(shared: &Shared) -> Result<Vec<PoolView>, ApiError> {
    let jobs = jobs(shared).await?;
    let policies = shared.read_policies();
    let shares = lock(&shared.shares);
    let pools = policies.pools().map(|p| {
        // The jobs that draw from it now (one that left draws nothing).
        let mine: Vec<&JobView> = jobs
            .iter()
            .filter(|j| j.pool == p.name() && !j.stages.is_empty())
            .collect();
        let share = shares.pools.get(p.name());
        let sharing = serde_json::to_value(p.spec().sharing)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        PoolView {
            name: p.name().to_owned(),
            bandwidth_bytes_per_second: Some(p.spec().capacity.bandwidth.bytes_per_second()),
            ops_per_second: p.spec().capacity.ops.map(|o| o.per_second()),
            sharing,
            allocated_bytes_per_second: share
                .map_or(0, |s| s.allocated_bytes_per_second.round() as u64),
            allocated_ops_per_second: share
                .map_or(0, |s| s.allocated_ops_per_second.round() as u64),
            // From +0 (an empty f64 sum is -0, shown as `-0`).
            throughput_bytes_per_second: mine
                .iter()
                .fold(0.0, |sum, j| sum + j.storage_bytes_per_second),
            jobs: mine.iter().map(|j| j.id.clone()).collect(),
            problems: share.map(|s| s.problems.clone()).unwrap_or_default(),
        }
    });
    Ok(pools.collect())
}

/// Returns one pool.
pub async fn pool(shared: &Shared, name: &str) -> Result<PoolView, ApiError> {
    pools(shared)
        .await?
        .into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| ApiError::NotFound(format!("no StoragePool is named `{name}`")))
}

/// Returns the live policies, or (with `history`) every revision of them.
/// Policies deleted for good are not listed: the store has no query for
/// them yet.
pub async fn policies(shared: &Shared, history: bool) -> Result<Vec<PolicyView>, ApiError> {
    let current = shared.store.current_policies().await?;
    if !history {
        return Ok(current.into_iter().map(policy_view).collect());
    }
    let mut out = Vec::new();
    for p in current {
        let revisions = shared.store.policy_history(&p.kind, &p.name).await?;
        out.extend(revisions.into_iter().map(policy_view));
    }
    Ok(out)
}

fn policy_view(p: PolicyRevision) -> PolicyView {
    let json = p.canonical.clone().unwrap_or_default();
    let yaml = serde_json::from_str::<serde_json::Value>(&json)
        .ok()
        .and_then(|v| serde_yaml_ng::to_string(&v).ok())
        .unwrap_or_default();
    PolicyView {
        deleted: p.is_tombstone(),
        kind: p.kind,
        name: p.name,
        revision: p.revision,
        yaml,
        json,
        created_unix_millis: p.created_ms,
    }
}
