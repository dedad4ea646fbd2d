//! The documents as written: serde types that mirror the YAML exactly
//! (`deny_unknown_fields`, optional fields as `Option`), and the first step
//! of decoding, which checks `apiVersion` and `kind` and picks the spec type.
//! The doc comments on these types are the field reference
//! (`docs/policies.md` follows them).
//!
//! Numbers such as `weight` are read as `i64` here so that the validator,
//! not serde, reports a value out of range, with a sentence about what the
//! number means.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;

use crate::de::from_node;
use crate::error::{ErrorKind, Location, PolicyError, suggest};
use crate::model::{API_VERSION, Capacity, Guarantee, Limit, Preload, Sharing};
use crate::selector::Operator;
use crate::yaml::{Node, Resolved, Value};
use crate::{ByteRate, ByteSize, Kind};

/// A whole document: `apiVersion`, `kind`, `metadata` and a kind's `spec`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawDocument<S> {
    /// Always `sluice.dev/v1` (checked before deserialisation).
    #[allow(dead_code)]
    pub api_version: String,
    /// `StoragePool` or `JobPolicy` (checked before deserialisation).
    #[allow(dead_code)]
    pub kind: String,
    /// Name and labels.
    pub metadata: RawMetadata,
    /// What the kind needs.
    pub spec: S,
}

/// `metadata:`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMetadata {
    /// Unique per kind: 1 to 63 lowercase letters, digits and `-`.
    pub name: String,
    /// Labels for the operator's own bookkeeping; they do not select jobs.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Free-form notes (owner, ticket, ...); kept, never interpreted.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// `spec:` of a `StoragePool`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPoolSpec {
    /// What the storage behind the pool delivers.
    pub capacity: Capacity,
    /// How the capacity is shared among the pool's jobs.
    #[serde(default)]
    pub sharing: Sharing,
}

/// `spec:` of a `JobPolicy`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawJobPolicySpec {
    /// Which jobs the policy is for, by the labels trainers report.
    pub selector: RawSelector,
    /// The `StoragePool` the selected jobs draw from.
    pub pool: String,
    /// Relative share of the pool (default 1).
    pub weight: Option<i64>,
    /// Priority class in `sharing: priority` pools (default 0).
    pub priority: Option<i64>,
    /// Breaks ties between policies selecting the same job (default 0).
    pub precedence: Option<i64>,
    /// Minimum each selected job gets when it asks for it.
    #[serde(default)]
    pub guarantee: Guarantee,
    /// Maximum each selected job may use.
    #[serde(default)]
    pub limit: Limit,
    /// Bounds for the stage's prefetcher.
    #[serde(default)]
    pub prefetch: RawPrefetch,
}

/// `spec:` of a `DatasetCache`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawDatasetCacheSpec {
    /// The data set's name, as the stages serve it (`--dataset NAME=...`).
    pub dataset: String,
    /// Who the data set belongs to: a node's cache is split among tenants
    /// first, then among each tenant's data sets (default `default`).
    pub tenant: Option<String>,
    /// The tenant's share of a node's cache (default 1); every document of
    /// one tenant says the same.
    pub tenant_weight: Option<i64>,
    /// The data set's share among its tenant's data sets (default 1).
    pub weight: Option<i64>,
    /// Bytes of the data set each node keeps whatever other data sets
    /// want (`all`, or a size such as `20GiB`).
    pub pin: Option<String>,
    /// When stages load the data set before it is read: `never` (only on
    /// `sluicectl stage`, the default) or `job-start`.
    pub preload: Option<Preload>,
    /// How staging reads are charged and bounded.
    pub staging: Option<RawStaging>,
}

/// `spec.staging:` of a `DatasetCache`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawStaging {
    /// The `StoragePool` staging reads draw from.
    pub pool: String,
    /// Most bytes per second staging reads on each node (default 100MiB/s).
    pub rate: Option<ByteRate>,
    /// Staging's share of the pool, like a job's weight (default 1).
    pub weight: Option<i64>,
}

/// `spec.selector:`
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct RawSelector {
    /// Labels a job must have with exactly these values.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    /// Set-based requirements.
    #[serde(default)]
    pub match_expressions: Vec<RawRequirement>,
}

/// One `matchExpressions` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRequirement {
    /// The label key.
    pub key: String,
    /// `In`, `NotIn`, `Exists` or `DoesNotExist`.
    pub operator: Operator,
    /// Values for `In` and `NotIn`.
    pub values: Option<Vec<String>>,
}

/// `spec.prefetch:`
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPrefetch {
    /// Let the stage tune readers and buffer within the bounds (default true).
    pub tuner: Option<bool>,
    /// Reader threads per job on each stage.
    #[serde(default)]
    pub readers: RawBounds<i64>,
    /// Prefetch buffer per job on each stage.
    #[serde(default)]
    pub buffer: RawBounds<ByteSize>,
}

/// `{min, max, initial}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBounds<T> {
    /// Lower bound.
    pub min: Option<T>,
    /// Upper bound.
    pub max: Option<T>,
    /// Starting value (the fixed value when the tuner is off).
    pub initial: Option<T>,
}

impl<T> Default for RawBounds<T> {
    fn default() -> Self {
        Self {
            min: None,
            max: None,
            initial: None,
        }
    }
}

/// A decoded document of a known kind.
#[derive(Debug)]
pub(crate) enum RawPolicy {
    StoragePool(RawDocument<RawPoolSpec>),
    JobPolicy(Box<RawDocument<RawJobPolicySpec>>),
    DatasetCache(Box<RawDocument<RawDatasetCacheSpec>>),
}

/// Checks `apiVersion` and `kind`, then deserialises the document.
// Errors are the cold path, and one a document: their size does not matter.
#[allow(clippy::result_large_err)]
pub(crate) fn decode(node: &Node, source: &Arc<str>) -> Result<RawPolicy, PolicyError> {
    let err = |at, kind| PolicyError {
        location: Location::new(source, at),
        kind,
    };
    if !matches!(node.value, Value::Map(_)) {
        return Err(err(
            node.at,
            ErrorKind::NotAMapping {
                found: describe(node),
            },
        ));
    }
    let missing = |field: &str, hint: &str| {
        err(
            node.at,
            ErrorKind::MissingField {
                field: field.into(),
                path: "the document".into(),
                hint: hint.into(),
            },
        )
    };
    let api = node
        .get("apiVersion")
        .ok_or_else(|| missing("apiVersion", "write `apiVersion: sluice.dev/v1`"))?;
    if scalar_text(api) != Some(API_VERSION) {
        return Err(err(
            api.at,
            ErrorKind::UnknownApiVersion {
                found: describe_short(api),
            },
        ));
    }
    let kind_node = node.get("kind").ok_or_else(|| {
        missing(
            "kind",
            "write `kind: StoragePool`, `kind: JobPolicy` or `kind: DatasetCache`",
        )
    })?;
    let kind = match scalar_text(kind_node) {
        Some("StoragePool") => Kind::StoragePool,
        Some("JobPolicy") => Kind::JobPolicy,
        Some("DatasetCache") => Kind::DatasetCache,
        other => {
            let found = other.map_or_else(|| describe_short(kind_node), str::to_owned);
            let suggestion = suggest(&found, ["StoragePool", "JobPolicy", "DatasetCache"]);
            return Err(err(
                kind_node.at,
                ErrorKind::UnknownKind { found, suggestion },
            ));
        }
    };
    let to_error = |e: crate::de::DeError| e.into_policy_error(source);
    Ok(match kind {
        Kind::StoragePool => RawPolicy::StoragePool(from_node(node, "").map_err(to_error)?),
        Kind::JobPolicy => RawPolicy::JobPolicy(Box::new(from_node(node, "").map_err(to_error)?)),
        Kind::DatasetCache => {
            RawPolicy::DatasetCache(Box::new(from_node(node, "").map_err(to_error)?))
        }
    })
}

fn scalar_text(node: &Node) -> Option<&str> {
    match node.resolve()? {
        Resolved::Str(s) => Some(s),
        _ => None,
    }
}

/// A short description of a node for messages.
fn describe(node: &Node) -> String {
    match &node.value {
        Value::Seq(_) => "a list".into(),
        Value::Map(_) => "a mapping".into(),
        Value::Scalar { text, .. } => format!("the value `{text}`"),
    }
}

fn describe_short(node: &Node) -> String {
    match &node.value {
        Value::Scalar { text, .. } => text.clone(),
        _ => describe(node),
    }
}
