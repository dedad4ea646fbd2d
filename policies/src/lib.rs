//! The sluice policy language: quantities with units, and the YAML policy
//! documents operators write (`StoragePool`, `JobPolicy`, `DatasetCache`), parsed with
//! `file:line:column` on every error and validated into a [`PolicySet`]
//! that cannot be invalid.
//!
//! This crate is pure: data in, decisions out. It does no I/O (callers read
//! files and pass their text) and knows nothing of gRPC or storage, which
//! is what lets every rule be tested without a server.
//!
//! ```
//! use std::collections::BTreeMap;
//! use sluice_policy::{parse_documents, PolicySet};
//!
//! let text = "
//! apiVersion: sluice.dev/v1
//! kind: StoragePool
//! metadata: {name: shared}
//! spec: {capacity: {bandwidth: 2GiB/s}}
//! ---
//! apiVersion: sluice.dev/v1
//! kind: JobPolicy
//! metadata: {name: vision}
//! spec:
//!   selector: {matchLabels: {team: vision}}
//!   pool: shared
//!   weight: 3
//! ";
//! let docs = parse_documents("example.yaml", text)?;
//! let set = PolicySet::from_documents(docs)?;
//! let job = BTreeMap::from([("team".to_owned(), "vision".to_owned())]);
//! assert_eq!(set.policy_for_job(&job).unwrap().spec().weight, 3);
//! # Ok::<(), sluice_policy::PolicyErrors>(())
//! ```
//!
//! # Which policy applies to a job
//!
//! The policy with the highest `spec.precedence` (default 0) among those
//! whose selector matches the job's labels; among equal precedence, the one
//! whose selector has the most terms (`matchLabels` pairs plus
//! `matchExpressions` entries). Two policies with equal precedence and
//! equal specificity that could select the same job are refused when the
//! set is validated, so [`policy_for_job`] never has to break a tie.

pub mod allocation;
pub mod coordination;
mod de;
mod document;
mod error;
mod model;
pub mod quantity;
mod selector;
mod set;
pub mod simulation;
mod validate;
mod yaml;

use std::sync::Arc;

pub use error::{ErrorKind, Location, PolicyError, PolicyErrors};
pub use model::{
    API_VERSION, BufferBounds, Capacity, DatasetCache, DatasetCacheSpec, Guarantee, JobPolicy,
    JobPolicySpec, Kind, Limit, Metadata, Pin, Policy, PoolSpec, Prefetch, Preload, ReaderBounds,
    STAGING_LABEL, Sharing, Staging, StoragePool, staging_job,
};
pub use quantity::{ByteRate, ByteSize, Millis, OpsRate, QuantityError};
pub use selector::{Labels, Operator, Requirement, Selector, Witness, WitnessValue};
pub use set::{Action, Change, DeleteError, PolicySet, policy_for_job};
pub use validate::{
    DEFAULT_STAGING_RATE, DEFAULT_TENANT, MAX_DATASET_NAME_BYTES, MAX_JOB_ID_BYTES, MAX_READERS,
    MAX_WEIGHT, check_label, job_id_byte, valid_dataset_name, valid_job_id,
};

/// Parses and validates every document of a YAML (or JSON) stream.
/// `source` names the text in error locations (a file path, `-`, or what
/// the caller stored the document as). Documents are checked one by one;
/// the rules that need several documents run in [`PolicySet::apply`].
/// Returns every error found, in source order.
pub fn parse_documents(source: &str, text: &str) -> Result<Vec<Policy>, PolicyErrors> {
    let source: Arc<str> = Arc::from(source);
    let nodes = yaml::parse_stream(text).map_err(|e| PolicyError {
        location: Location::new(&source, e.at),
        kind: ErrorKind::Syntax { reason: e.reason },
    })?;
    let mut policies = Vec::new();
    let mut errors = Vec::new();
    for node in nodes {
        match document::decode(&node, &source) {
            Err(e) => errors.push(e),
            Ok(raw) => match validate::validate(raw, &source, node) {
                Ok(p) => policies.push(p),
                Err(e) => errors.extend(e),
            },
        }
    }
    if errors.is_empty() {
        Ok(policies)
    } else {
        Err(PolicyErrors(errors).sorted())
    }
}

/// The refusal of input that holds no document at all (empty, comments,
/// `---`), naming its sources (`names`; none: "the request"). Applying
/// nothing is a mistake upstream, such as a generator that failed, so the
/// controller refuses it, and `sluicectl validate` with it.
pub fn no_documents(names: &[&str]) -> String {
    let names = if names.is_empty() {
        "the request".to_owned()
    } else {
        names.join(", ")
    };
    format!(
        "no policies in {names}: give at least one document with apiVersion, kind, metadata \
         and spec (the input is empty, or holds only comments and `---`)"
    )
}

#[cfg(test)]
mod tests;
