//! How records become database values and back, shared by both backends:
//! the column order of each `SELECT` (as tuple types, decoded without
//! sqlx's derive macros), JSON labels, and signed 64-bit integers.

use std::collections::BTreeMap;

use super::StoreError;
use super::model::{
    DesiredSettings, Event, JobRecord, Labels, Nack, PolicyRevision, StageRecord, StageState,
};

/// `kind, name, revision, canonical, created_ms`.
pub(super) type PolicyRow = (String, String, i64, Option<String>, i64);

pub(super) fn policy_from_row(row: PolicyRow) -> Result<PolicyRevision, StoreError> {
    let (kind, name, revision, canonical, created_ms) = row;
    let revision = to_u64("policy revision", revision)?;
    Ok(PolicyRevision {
        kind,
        name,
        revision,
        canonical,
        created_ms,
    })
}

/// `id, node, labels, state, first_seen_ms, last_seen_ms, desired_version,
/// desired_settings, acked_version, nack_version, nack_reason`: the column
/// order of every stage `SELECT`.
pub(super) type StageRow = (
    String,
    String,
    String,
    String,
    i64,
    i64,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
);

pub(super) fn stage_from_row(row: StageRow) -> Result<StageRecord, StoreError> {
    let (id, node, labels, state, first_seen_ms, last_seen_ms, dv, ds, acked, nv, nr, ended_ms) =
        row;
    let desired = match (dv, ds) {
        (Some(v), Some(document)) => Some(DesiredSettings {
            version: to_u64("desired version", v)?,
            document,
        }),
        _ => None,
    };
    let last_nack = match (nv, nr) {
        (Some(v), Some(reason)) => Some(Nack {
            version: to_u64("nack version", v)?,
            reason,
        }),
        _ => None,
    };
    Ok(StageRecord {
        labels: labels_from_json(&labels)?,
        state: StageState::parse(&state)?,
        acked_version: acked.map(|v| to_u64("acked version", v)).transpose()?,
        id,
        node,
        first_seen_ms,
        last_seen_ms,
        desired,
        last_nack,
        ended_ms,
    })
}

/// `id, labels, first_seen_ms, last_seen_ms`, then the job's stages.
pub(super) type JobRow = (String, String, i64, i64);

pub(super) fn job_from_row(row: JobRow, stages: Vec<String>) -> Result<JobRecord, StoreError> {
    let (id, labels, first_seen_ms, last_seen_ms) = row;
    Ok(JobRecord {
        labels: labels_from_json(&labels)?,
        id,
        first_seen_ms,
        last_seen_ms,
        stages,
    })
}

/// Joins jobs (sorted by id) with their `(job_id, stage_id)` links.
pub(super) fn jobs_with_stages(
    rows: Vec<JobRow>,
    links: Vec<(String, String)>,
) -> Result<Vec<JobRecord>, StoreError> {
    let mut stages: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (job, stage) in links {
        stages.entry(job).or_default().push(stage);
    }
    rows.into_iter()
        .map(|row| {
            let linked = stages.remove(&row.0).unwrap_or_default();
            job_from_row(row, linked)
        })
        .collect()
}

/// `seq, kind, subject, message, unix_millis`.
pub(super) type EventRow = (i64, String, String, String, i64);

pub(super) fn event_from_row(row: EventRow) -> Result<Event, StoreError> {
    let (seq, kind, subject, message, unix_millis) = row;
    Ok(Event {
        seq: to_u64("event seq", seq)?,
        kind,
        subject,
        message,
        unix_millis,
    })
}

pub(super) fn labels_to_json(labels: &Labels) -> String {
    // A map of strings always serializes.
    serde_json::to_string(labels).unwrap_or_else(|_| "{}".to_owned())
}

fn labels_from_json(text: &str) -> Result<Labels, StoreError> {
    serde_json::from_str(text).map_err(|e| corrupt("labels", e.to_string()))
}

/// Converts a version, revision or seq for the database, where integers
/// are signed 64-bit.
pub(super) fn to_i64(field: &'static str, value: u64) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::Invalid {
        field,
        reason: format!("{value} is above {}", i64::MAX),
    })
}

pub(super) fn to_u64(what: &'static str, value: i64) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| corrupt(what, format!("negative value {value}")))
}

fn corrupt(what: &'static str, reason: String) -> StoreError {
    StoreError::Corrupt { what, reason }
}

/// Returns the controller clock in Unix milliseconds.
pub(super) fn now_millis() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
