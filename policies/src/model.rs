//! The validated policy model. A [`StoragePool`] or [`JobPolicy`] can only
//! be obtained from [`crate::parse_documents`], so every value in it has
//! passed validation; defaults are filled in, so two documents that mean
//! the same thing have the same [canonical form](Policy::canonical).
//!
//! Serialising a document gives it back in the YAML/JSON shape it was
//! written in (`apiVersion`, `kind`, `metadata`, `spec`), which
//! [`crate::parse_documents`] reads again.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};

use crate::error::Location;
use crate::selector::Selector;
use crate::yaml::Node;
use crate::{ByteRate, ByteSize, Millis, OpsRate};

/// The one `apiVersion` this version understands.
pub const API_VERSION: &str = "sluice.dev/v1";

/// The kinds of document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A [`StoragePool`].
    StoragePool,
    /// A [`JobPolicy`].
    JobPolicy,
    /// A [`DatasetCache`].
    DatasetCache,
}

impl Kind {
    /// Returns the name written in `kind:`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::StoragePool => "StoragePool",
            Kind::JobPolicy => "JobPolicy",
            Kind::DatasetCache => "DatasetCache",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Kind {
    type Err = String;

    /// Parses `StoragePool`/`pool`, `JobPolicy`/`policy` or
    /// `DatasetCache`/`cache` (any case), as command lines write them.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "storagepool" | "pool" | "pools" => Ok(Kind::StoragePool),
            "jobpolicy" | "policy" | "policies" => Ok(Kind::JobPolicy),
            "datasetcache" | "cache" | "caches" => Ok(Kind::DatasetCache),
            _ => Err(format!(
                "unknown kind `{s}`: write `pool`, `policy` or `cache`"
            )),
        }
    }
}

/// How a pool's capacity is shared among its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sharing {
    /// Weighted max-min fairness: guarantees first, then the rest in
    /// proportion to `weight`; what one job leaves unused goes to the others.
    #[default]
    WeightedFair,
    /// Strict priority classes: higher `priority` is served first (after
    /// every job's guarantee); weighted-fair within a class.
    Priority,
    /// Fixed shares: every job runs at exactly its `limit`, whatever the
    /// others do; unused capacity is not lent.
    Static,
}

/// `spec.capacity` of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// Bytes per second the storage sustains for all jobs together.
    pub bandwidth: ByteRate,
    /// Operations (reads) per second it sustains, if that is a limit too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops: Option<OpsRate>,
}

/// `spec.guarantee` of a job policy: per job, not per policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Guarantee {
    /// Bandwidth each selected job gets when it asks for at least that much.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<ByteRate>,
    /// Read operations per second each selected job gets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops: Option<OpsRate>,
}

impl Guarantee {
    fn is_empty(&self) -> bool {
        self.bandwidth.is_none() && self.ops.is_none()
    }
}

/// `spec.limit` of a job policy: per job, enforced by each stage's token
/// bucket on the job's share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Most bytes per second each selected job may read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<ByteRate>,
    /// Most read operations per second each selected job may issue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops: Option<OpsRate>,
    /// Burst window of the token bucket: a full bucket holds rate x burst
    /// (the stage's default, 100ms, when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<Millis>,
}

impl Limit {
    fn is_empty(&self) -> bool {
        self.bandwidth.is_none() && self.ops.is_none() && self.burst.is_none()
    }
}

/// Reader-thread bounds per job per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ReaderBounds {
    /// Fewest readers (default 1).
    pub min: u32,
    /// Most readers (default 64).
    pub max: u32,
    /// Readers a job starts with (the stage's choice when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initial: Option<u32>,
}

/// Prefetch-buffer bounds per job per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct BufferBounds {
    /// Smallest buffer (default 4MiB, or `max` when that is smaller).
    pub min: ByteSize,
    /// Largest buffer (the stage's memory budget when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max: Option<ByteSize>,
    /// Buffer a job starts with (the stage's choice when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initial: Option<ByteSize>,
}

/// `spec.prefetch` of a job policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Prefetch {
    /// Whether the stage tunes readers and buffer within the bounds; when
    /// false it runs `initial` readers with an `initial` buffer.
    pub tuner: bool,
    /// Reader threads.
    pub readers: ReaderBounds,
    /// Buffer bytes.
    pub buffer: BufferBounds,
}

/// `metadata` of any document.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Metadata {
    /// The document's name, unique per kind.
    pub name: String,
    /// The operator's labels on the document itself.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Free-form notes.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// `spec` of a [`StoragePool`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct PoolSpec {
    /// What the storage delivers.
    pub capacity: Capacity,
    /// How it is shared.
    pub sharing: Sharing,
}

/// `spec` of a [`JobPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct JobPolicySpec {
    /// Which jobs the policy is for.
    pub selector: Selector,
    /// The pool they draw from.
    pub pool: String,
    /// Relative share, 1 to 10000.
    pub weight: u32,
    /// Priority class (used by `sharing: priority` pools).
    pub priority: i32,
    /// Tie-breaker between policies that select the same job.
    pub precedence: i32,
    /// Minimums per job.
    #[serde(skip_serializing_if = "Guarantee::is_empty")]
    pub guarantee: Guarantee,
    /// Caps per job.
    #[serde(skip_serializing_if = "Limit::is_empty")]
    pub limit: Limit,
    /// Prefetcher bounds.
    pub prefetch: Prefetch,
}

/// When stages load a data set into their cache before it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preload {
    /// Only when an operator asks (`sluicectl stage DATASET`).
    #[default]
    Never,
    /// On every stage that serves the data set, once a job reads there.
    JobStart,
}

/// How much of a data set a node's cache keeps whatever other data sets
/// want.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pin {
    /// The whole data set (as much as the cache holds).
    All,
    /// At most this many bytes.
    Bytes(ByteSize),
}

impl Pin {
    /// Returns the bytes pinned (`u64::MAX` for all).
    pub fn bytes(self) -> u64 {
        match self {
            Pin::All => u64::MAX,
            Pin::Bytes(b) => b.bytes(),
        }
    }
}

impl Serialize for Pin {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Pin::All => s.serialize_str("all"),
            Pin::Bytes(b) => b.serialize(s),
        }
    }
}

/// `spec.staging` of a data set cache: staging reads are a job of their
/// own (`staging:<dataset>` on each stage) in this pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Staging {
    /// The pool staging reads draw from.
    pub pool: String,
    /// Most bytes per second staging reads on each node.
    pub rate: ByteRate,
    /// Staging's share of the pool.
    pub weight: u32,
}

/// `spec` of a [`DatasetCache`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DatasetCacheSpec {
    /// The data set, as the stages name it.
    pub dataset: String,
    /// Its tenant.
    pub tenant: String,
    /// The tenant's share of a node's cache.
    pub tenant_weight: u32,
    /// The data set's share within its tenant.
    pub weight: u32,
    /// What each node keeps whatever others want.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin: Option<Pin>,
    /// When stages load it before it is read.
    pub preload: Preload,
    /// How staging reads are charged; without it the data set cannot be
    /// staged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staging: Option<Staging>,
}

/// Where a document came from: its source and its node tree, kept to put
/// positions on errors found later (for example when a later apply makes
/// it ambiguous). Not part of equality or serialisation.
#[derive(Clone)]
pub(crate) struct Origin {
    pub source: Arc<str>,
    pub node: Arc<Node>,
}

impl Origin {
    /// Returns the location of the node at a dotted path
    /// (`spec.selector.matchExpressions[1].values`), or of its deepest
    /// existing ancestor.
    pub fn at(&self, path: &str) -> Location {
        let segments = segments(path);
        let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
        Location::new(&self.source, self.node.locate(&segments))
    }

    /// Returns the location of `key` itself (`value: false`) or of its
    /// value in the mapping at `path`; `key` may contain dots.
    pub fn entry_at(&self, path: &str, key: &str, value: bool) -> Location {
        let segments = segments(path);
        let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
        Location::new(&self.source, self.node.locate_entry(&segments, key, value))
    }
}

/// `a.b[2].c` -> `["a", "b", "2", "c"]`.
fn segments(path: &str) -> Vec<String> {
    path.split(['.', '['])
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches(']').to_owned())
        .collect()
}

impl fmt::Debug for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Location::new(&self.source, self.node.at))
    }
}

macro_rules! document_type {
    ($name:ident, $spec:ty, $kind:expr) => {
        impl $name {
            /// Returns the document's name.
            pub fn name(&self) -> &str {
                &self.metadata.name
            }

            /// Returns the document's metadata.
            pub fn metadata(&self) -> &Metadata {
                &self.metadata
            }

            /// Returns the validated spec, defaults filled in.
            pub fn spec(&self) -> &$spec {
                &self.spec
            }

            /// Returns where the document starts (`file:line:column`).
            pub fn location(&self) -> Location {
                Location::new(&self.origin.source, self.origin.node.at)
            }

            /// Returns the canonical text: JSON (hence also YAML) with
            /// defaults filled in, fields in a fixed order and quantities
            /// in one spelling. Documents that mean the same compare equal
            /// by it, so it is what to hash or store to detect "identical
            /// apply, no new revision".
            pub fn canonical(&self) -> String {
                serde_json::to_string_pretty(self).unwrap_or_default()
            }
        }

        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                self.metadata == other.metadata && self.spec == other.spec
            }
        }

        impl Eq for $name {}

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut st = s.serialize_struct(stringify!($name), 4)?;
                st.serialize_field("apiVersion", API_VERSION)?;
                st.serialize_field("kind", $kind.as_str())?;
                st.serialize_field("metadata", &self.metadata)?;
                st.serialize_field("spec", &self.spec)?;
                st.end()
            }
        }
    };
}

/// A validated `StoragePool` document: storage capacity and how it is
/// shared.
#[derive(Debug, Clone)]
pub struct StoragePool {
    pub(crate) metadata: Metadata,
    pub(crate) spec: PoolSpec,
    pub(crate) origin: Origin,
}

document_type!(StoragePool, PoolSpec, Kind::StoragePool);

/// A validated `JobPolicy` document: which jobs, which pool, their share,
/// guarantees, limits and prefetch bounds.
#[derive(Debug, Clone)]
pub struct JobPolicy {
    pub(crate) metadata: Metadata,
    pub(crate) spec: JobPolicySpec,
    pub(crate) origin: Origin,
}

document_type!(JobPolicy, JobPolicySpec, Kind::JobPolicy);

/// A validated `DatasetCache` document: a data set's share of each node's
/// cache, what is pinned, and how it is staged.
#[derive(Debug, Clone)]
pub struct DatasetCache {
    pub(crate) metadata: Metadata,
    pub(crate) spec: DatasetCacheSpec,
    pub(crate) origin: Origin,
    /// With `spec.staging`: the job policy staging jobs run under (derived
    /// from the spec, so not compared or serialised).
    pub(crate) staging_policy: Option<Box<JobPolicy>>,
}

impl DatasetCache {
    /// Returns the job policy of the data set's staging jobs: they select
    /// [`STAGING_LABEL`]` = dataset`, draw from `spec.staging.pool` with its
    /// weight and are capped at its rate.
    pub fn staging_policy(&self) -> Option<&JobPolicy> {
        self.staging_policy.as_deref()
    }
}

/// The label a stage puts on the job that stages a data set (its value is
/// the data set's name).
pub const STAGING_LABEL: &str = "sluice.dev/staging";

/// Returns the id of the job that stages `dataset` on a stage. Trainers
/// cannot claim it: `:` is not allowed in their job ids.
pub fn staging_job(dataset: &str) -> String {
    format!("staging:{dataset}")
}

document_type!(DatasetCache, DatasetCacheSpec, Kind::DatasetCache);

/// Any validated document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// A `StoragePool`.
    StoragePool(StoragePool),
    /// A `JobPolicy`.
    JobPolicy(JobPolicy),
    /// A `DatasetCache`.
    DatasetCache(DatasetCache),
}

impl Policy {
    /// Returns the document's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Policy::StoragePool(_) => Kind::StoragePool,
            Policy::JobPolicy(_) => Kind::JobPolicy,
            Policy::DatasetCache(_) => Kind::DatasetCache,
        }
    }

    /// Returns the document's name.
    pub fn name(&self) -> &str {
        match self {
            Policy::StoragePool(p) => p.name(),
            Policy::JobPolicy(p) => p.name(),
            Policy::DatasetCache(p) => p.name(),
        }
    }

    /// Returns where the document starts.
    pub fn location(&self) -> Location {
        match self {
            Policy::StoragePool(p) => p.location(),
            Policy::JobPolicy(p) => p.location(),
            Policy::DatasetCache(p) => p.location(),
        }
    }

    /// Returns the canonical text (see [`JobPolicy::canonical`]).
    pub fn canonical(&self) -> String {
        match self {
            Policy::StoragePool(p) => p.canonical(),
            Policy::JobPolicy(p) => p.canonical(),
            Policy::DatasetCache(p) => p.canonical(),
        }
    }

    pub(crate) fn origin(&self) -> &Origin {
        match self {
            Policy::StoragePool(p) => &p.origin,
            Policy::JobPolicy(p) => &p.origin,
            Policy::DatasetCache(p) => &p.origin,
        }
    }
}

impl Serialize for Policy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Policy::StoragePool(p) => p.serialize(s),
            Policy::JobPolicy(p) => p.serialize(s),
            Policy::DatasetCache(p) => p.serialize(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_segments() {
        assert_eq!(
            segments("spec.selector.matchExpressions[1].values"),
            ["spec", "selector", "matchExpressions", "1", "values"]
        );
        assert_eq!(segments(""), Vec::<String>::new());
    }

    #[test]
    fn kinds_parse_as_command_lines_write_them() {
        assert_eq!("pool".parse::<Kind>().unwrap(), Kind::StoragePool);
        assert_eq!("JobPolicy".parse::<Kind>().unwrap(), Kind::JobPolicy);
        assert_eq!("cache".parse::<Kind>().unwrap(), Kind::DatasetCache);
        assert!("job".parse::<Kind>().is_err());
    }
}
