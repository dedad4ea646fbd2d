//! Labels and selectors: keys and values a trainer can send, requirement
//! shapes (`In` needs values, `Exists` takes none), and selectors that can
//! match at least one job.

use std::collections::{BTreeMap, BTreeSet};

use super::{Check, invalid};
use crate::document::{RawRequirement, RawSelector};
use crate::error::{ErrorKind, Printable};
use crate::selector::{Operator, Requirement, Selector};
use crate::yaml::Node;

/// A label key a trainer can send: at most 63 bytes of letters, digits,
/// `-`, `_`, `.` and at most one `/` (a Kubernetes-style prefix), starting
/// and ending with a letter or digit.
pub(super) fn label_key(key: &str) -> Result<(), String> {
    let ok = (1..=63).contains(&key.len())
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && key.matches('/').count() <= 1
        && key.starts_with(|c: char| c.is_ascii_alphanumeric())
        && key.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        return Ok(());
    }
    Err(format!(
        "label key `{}` is not valid: use 1 to 63 letters, digits, `-`, `_`, `.` and at most one `/`, starting and ending with a letter or digit, e.g. `team` or `example.com/team`",
        Printable(key)
    ))
}

/// A label value a trainer can send: at most 256 bytes, no control
/// characters.
pub(super) fn label_value(value: &str) -> Result<(), String> {
    if value.len() <= 256 && !value.chars().any(char::is_control) {
        return Ok(());
    }
    Err(format!(
        "label value `{}` is not valid: use at most 256 bytes and no control characters",
        value.escape_debug()
    ))
}

/// Longest job id.
pub const MAX_JOB_ID_BYTES: usize = 128;

/// Whether `job` is a job id trainers may claim: 1 to [`MAX_JOB_ID_BYTES`]
/// letters, digits, `.`, `_` and `-`. Stages take no other from trainers,
/// and the controller no other from stages.
pub fn valid_job_id(job: &str) -> bool {
    // `.` and `..` would name directories, not jobs, in the mount's `@job`
    // paths and the order files' directory.
    !job.is_empty()
        && job != "."
        && job != ".."
        && job.len() <= MAX_JOB_ID_BYTES
        && job.bytes().all(job_id_byte)
}

/// Whether `b` may be part of a job id: a letter, a digit, `.`, `_` or `-`.
pub fn job_id_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// Longest data set name.
pub const MAX_DATASET_NAME_BYTES: usize = 128;

/// Whether `name` is a data set name a stage serves: 1 to
/// [`MAX_DATASET_NAME_BYTES`] bytes, no `/` or control characters, not
/// `.` or `..`, not starting with `@` (the mount shows a data set as
/// `DIR/<name>` and a job as `DIR/@<job>`).
pub fn valid_dataset_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_DATASET_NAME_BYTES
        && name != "."
        && name != ".."
        && !name.starts_with('@')
        && !name.contains('/')
        && !name.chars().any(char::is_control)
}

/// Whether `key: value` is a label a trainer or a stage can send, and if
/// not, why (for the stage's `--label` and `labels:`, checked at start).
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    label_key(key).and_then(|()| label_value(value))
}

pub(super) fn check_labels(check: &mut Check, path: &str, labels: &BTreeMap<String, String>) {
    for (key, value) in labels {
        let (result, located_at_key) = match label_key(key) {
            Err(e) => (Err(e), true),
            Ok(()) => (label_value(value), false),
        };
        if let Err(reason) = result {
            let kind = ErrorKind::InvalidLabel {
                path: format!("{path}.{key}"),
                reason,
            };
            check.push_entry(path, key, !located_at_key, kind);
        }
    }
}

pub(super) fn selector(check: &mut Check, raw: RawSelector) -> Option<Selector> {
    let errors_before = check.errors.len();
    // `selector:` with nothing after it reads as an empty selector, which
    // selects every job: too much to grant by accident.
    if check
        .origin
        .node
        .get("spec")
        .and_then(|s| s.get("selector"))
        .is_some_and(Node::is_null)
    {
        check.push("spec.selector", invalid(
            "spec.selector",
            "an empty selector would select every job: write `selector: {}` if that is meant, or add `matchLabels:`",
        ));
        return None;
    }
    check_labels(check, "spec.selector.matchLabels", &raw.match_labels);
    let mut expressions: Vec<Requirement> = raw
        .match_expressions
        .into_iter()
        .enumerate()
        .map(|(i, r)| requirement(check, i, r))
        .collect();
    if check.errors.len() > errors_before {
        return None;
    }
    // Which entry to point at when a key's requirements contradict: the
    // last one that mentions the key.
    let last_entry: BTreeMap<String, usize> = expressions
        .iter()
        .enumerate()
        .map(|(i, r)| (r.key.clone(), i))
        .collect();
    expressions.sort();
    expressions.dedup();
    let selector = Selector {
        match_labels: raw.match_labels,
        match_expressions: expressions,
    };
    if let Err(c) = selector.check_satisfiable() {
        let reason = format!(
            "no value of label `{}` satisfies all of {}",
            c.key,
            c.terms
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let kind = ErrorKind::UnsatisfiableSelector { reason };
        match last_entry.get(&c.key) {
            Some(i) => check.push(&format!("spec.selector.matchExpressions[{i}]"), kind),
            None => check.push_entry("spec.selector.matchLabels", &c.key, false, kind),
        }
        return None;
    }
    Some(selector)
}

/// Checks one `matchExpressions` entry: its key, its values, and that the
/// operator has values exactly when it needs them.
fn requirement(check: &mut Check, i: usize, r: RawRequirement) -> Requirement {
    let path = format!("spec.selector.matchExpressions[{i}]");
    if let Err(reason) = label_key(&r.key) {
        check.push(
            &format!("{path}.key"),
            ErrorKind::InvalidLabel {
                path: format!("{path}.key"),
                reason,
            },
        );
    }
    let values: BTreeSet<String> = r.values.unwrap_or_default().into_iter().collect();
    for v in &values {
        if let Err(reason) = label_value(v) {
            check.push(
                &format!("{path}.values"),
                ErrorKind::InvalidLabel {
                    path: format!("{path}.values"),
                    reason,
                },
            );
        }
    }
    let problem = match (r.operator, values.is_empty()) {
        (Operator::In, true) => Some(
            "operator `In` with no values matches no job: list the values to select, or use `Exists` to select any value",
        ),
        (Operator::NotIn, true) => Some(
            "operator `NotIn` needs at least one value: list the values to exclude, or remove this requirement",
        ),
        (Operator::Exists | Operator::DoesNotExist, false) => Some(
            "operators `Exists` and `DoesNotExist` take no values: remove `values`, or use `In`/`NotIn`",
        ),
        _ => None,
    };
    if let Some(reason) = problem {
        check.push(
            &format!("{path}.values"),
            ErrorKind::BadRequirement {
                path: path.clone(),
                reason: reason.into(),
            },
        );
    }
    Requirement {
        key: r.key,
        operator: r.operator,
        values,
    }
}
