//! Validation of one document: names, labels, ranges, `min <= max`,
//! `guarantee <= limit`, selectors that can match something. Rules that
//! need other documents (pools that exist, capacities, ambiguity) live in
//! `set.rs`. Every rule reports all its findings, each at the position of
//! the offending node.

use std::sync::Arc;

use crate::document::{RawDocument, RawJobPolicySpec, RawMetadata, RawPolicy, RawPoolSpec};
use crate::error::{ErrorKind, PolicyError};
use crate::model::{
    Guarantee, JobPolicy, JobPolicySpec, Limit, Metadata, Origin, Policy, PoolSpec, StoragePool,
};
use crate::yaml::Node;

mod cache;
mod labels;
mod prefetch;

pub use cache::{DEFAULT_STAGING_RATE, DEFAULT_TENANT};
pub use labels::{
    MAX_DATASET_NAME_BYTES, MAX_JOB_ID_BYTES, check_label, job_id_byte, valid_dataset_name,
    valid_job_id,
};

use labels::{check_labels, label_key, selector};
use prefetch::prefetch;

/// Most reader threads a policy may give one job (as the stage allows).
pub const MAX_READERS: u32 = 1024;
/// Largest `weight`.
pub const MAX_WEIGHT: u32 = 10_000;
/// Bounds of `priority` and `precedence` (as Kubernetes' user priorities).
pub const MAX_CLASS: i64 = 1_000_000_000;
/// Longest burst window, as the stage allows.
const MAX_BURST_MS: u64 = 60_000;

/// Collects the errors of one document.
pub(super) struct Check {
    pub(super) origin: Origin,
    pub(super) errors: Vec<PolicyError>,
}

impl Check {
    pub(super) fn push(&mut self, path: &str, kind: ErrorKind) {
        self.errors.push(PolicyError {
            location: self.origin.at(path),
            kind,
        });
    }

    /// Records an error at `key` (`value: false`) or its value in the
    /// mapping at `path`.
    pub(super) fn push_entry(&mut self, path: &str, key: &str, value: bool, kind: ErrorKind) {
        self.errors.push(PolicyError {
            location: self.origin.entry_at(path, key, value),
            kind,
        });
    }
}

/// Validates a decoded document into a [`Policy`], or returns every error.
pub(crate) fn validate(
    raw: RawPolicy,
    source: &Arc<str>,
    node: Node,
) -> Result<Policy, Vec<PolicyError>> {
    let mut check = Check {
        origin: Origin {
            source: Arc::clone(source),
            node: Arc::new(node),
        },
        errors: Vec::new(),
    };
    let policy = match raw {
        RawPolicy::StoragePool(doc) => pool(&mut check, doc).map(Policy::StoragePool),
        RawPolicy::JobPolicy(doc) => job_policy(&mut check, *doc).map(Policy::JobPolicy),
        RawPolicy::DatasetCache(doc) => {
            cache::dataset_cache(&mut check, *doc).map(Policy::DatasetCache)
        }
    };
    match policy {
        Some(p) if check.errors.is_empty() => Ok(p),
        _ => {
            debug_assert!(
                !check.errors.is_empty(),
                "a document was refused without a reason"
            );
            Err(check.errors)
        }
    }
}

fn pool(check: &mut Check, doc: RawDocument<RawPoolSpec>) -> Option<StoragePool> {
    let metadata = metadata(check, doc.metadata);
    let capacity = doc.spec.capacity;
    if capacity.bandwidth.0 == 0 {
        check.push(
            "spec.capacity.bandwidth",
            invalid(
                "spec.capacity.bandwidth",
                "a pool with no bandwidth can serve no job: write what the storage sustains, e.g. `2GiB/s`",
            ),
        );
    }
    if capacity.ops.is_some_and(|o| o.0 == 0) {
        check.push(
            "spec.capacity.ops",
            invalid(
                "spec.capacity.ops",
                "a pool with no operations per second can serve no job: write what the storage sustains, e.g. `20k ops/s`, or leave it out",
            ),
        );
    }
    Some(StoragePool {
        metadata,
        spec: PoolSpec {
            capacity,
            sharing: doc.spec.sharing,
        },
        origin: check.origin.clone(),
    })
}

fn job_policy(check: &mut Check, doc: RawDocument<RawJobPolicySpec>) -> Option<JobPolicy> {
    let metadata = metadata(check, doc.metadata);
    let spec = doc.spec;
    let selector = selector(check, spec.selector);
    check_name(check, "spec.pool", &spec.pool);
    let weight = ranged(
        check,
        "spec.weight",
        spec.weight.unwrap_or(1),
        1,
        i64::from(MAX_WEIGHT),
        "weights are relative shares: a job with weight 2 gets twice what a job with weight 1 gets",
    );
    let priority = ranged(
        check,
        "spec.priority",
        spec.priority.unwrap_or(0),
        -MAX_CLASS,
        MAX_CLASS,
        "in a `sharing: priority` pool a higher class is served first",
    );
    let precedence = ranged(
        check,
        "spec.precedence",
        spec.precedence.unwrap_or(0),
        -MAX_CLASS,
        MAX_CLASS,
        "when several policies select a job, the highest precedence wins",
    );
    let (guarantee, limit) = (spec.guarantee, spec.limit);
    rates(check, &guarantee, &limit);
    let prefetch = prefetch(check, spec.prefetch);
    Some(JobPolicy {
        metadata,
        spec: JobPolicySpec {
            selector: selector?,
            pool: spec.pool,
            weight: u32::try_from(weight?).ok()?,
            priority: i32::try_from(priority?).unwrap_or_default(),
            precedence: i32::try_from(precedence?).unwrap_or_default(),
            guarantee,
            limit,
            prefetch: prefetch?,
        },
        origin: check.origin.clone(),
    })
}

/// Checks guarantees and limits: no zeros, a sane burst window, and no
/// guarantee above the limit of the same resource.
fn rates(check: &mut Check, guarantee: &Guarantee, limit: &Limit) {
    if guarantee.bandwidth.is_some_and(|b| b.0 == 0) || guarantee.ops.is_some_and(|o| o.0 == 0) {
        let field = if guarantee.bandwidth.is_some_and(|b| b.0 == 0) {
            "bandwidth"
        } else {
            "ops"
        };
        let path = format!("spec.guarantee.{field}");
        check.push(
            &path,
            invalid(&path, "a guarantee of 0 promises nothing: leave it out"),
        );
    }
    for (field, zero) in [
        ("bandwidth", limit.bandwidth.is_some_and(|b| b.0 == 0)),
        ("ops", limit.ops.is_some_and(|o| o.0 == 0)),
    ] {
        if zero {
            let path = format!("spec.limit.{field}");
            check.push(
                &path,
                invalid(
                    &path,
                    "a limit of 0 would stop every read: leave it out for no limit",
                ),
            );
        }
    }
    if let Some(burst) = limit.burst
        && !(1..=MAX_BURST_MS).contains(&burst.0)
    {
        check.push("spec.limit.burst", ErrorKind::OutOfRange {
            path: "spec.limit.burst".into(),
            found: burst.to_string(),
            min: "1ms".into(),
            max: "60s".into(),
            hint: "the burst window is how long a job may read above its rate after idling; 100ms is typical".into(),
        });
    }
    if let (Some(g), Some(l)) = (guarantee.bandwidth, limit.bandwidth)
        && g > l
    {
        check.push(
            "spec.guarantee.bandwidth",
            ErrorKind::GuaranteeAboveLimit {
                resource: "bandwidth",
                guarantee: g.to_string(),
                limit: l.to_string(),
            },
        );
    }
    if let (Some(g), Some(l)) = (guarantee.ops, limit.ops)
        && g > l
    {
        check.push(
            "spec.guarantee.ops",
            ErrorKind::GuaranteeAboveLimit {
                resource: "ops",
                guarantee: g.to_string(),
                limit: l.to_string(),
            },
        );
    }
}

pub(super) fn invalid(path: &str, message: &str) -> ErrorKind {
    ErrorKind::InvalidValue {
        path: path.into(),
        message: message.into(),
    }
}

/// Checks `min <= value <= max`.
pub(super) fn ranged(
    check: &mut Check,
    path: &str,
    value: i64,
    min: i64,
    max: i64,
    hint: &str,
) -> Option<i64> {
    if (min..=max).contains(&value) {
        return Some(value);
    }
    check.push(
        path,
        ErrorKind::OutOfRange {
            path: path.into(),
            found: value.to_string(),
            min: min.to_string(),
            max: max.to_string(),
            hint: hint.into(),
        },
    );
    None
}

pub(super) fn metadata(check: &mut Check, raw: RawMetadata) -> Metadata {
    check_name(check, "metadata.name", &raw.name);
    check_labels(check, "metadata.labels", &raw.labels);
    for key in raw.annotations.keys() {
        if let Err(reason) = label_key(key) {
            check.push_entry(
                "metadata.annotations",
                key,
                false,
                ErrorKind::InvalidLabel {
                    path: "metadata.annotations".into(),
                    reason,
                },
            );
        }
    }
    Metadata {
        name: raw.name,
        labels: raw.labels,
        annotations: raw.annotations,
    }
}

/// Returns whether `s` is a DNS label: 1 to 63 of `[a-z0-9-]`, starting and
/// ending with a letter or digit.
pub(crate) fn is_dns_label(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    (1..=63).contains(&s.len())
        && s.chars().all(|c| alnum(c) || c == '-')
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

pub(super) fn check_name(check: &mut Check, path: &str, name: &str) {
    if is_dns_label(name) {
        return;
    }
    let mut fixed = String::new();
    for c in name.trim().chars().flat_map(char::to_lowercase) {
        let c = if c.is_ascii_alphanumeric() { c } else { '-' };
        if !(c == '-' && (fixed.is_empty() || fixed.ends_with('-'))) {
            fixed.push(c);
        }
    }
    let fixed: String = fixed.trim_end_matches('-').chars().take(63).collect();
    let fixed = fixed.trim_end_matches('-').to_owned();
    check.push(
        path,
        ErrorKind::InvalidName {
            path: path.into(),
            found: name.into(),
            suggestion: is_dns_label(&fixed).then_some(fixed),
        },
    );
}
