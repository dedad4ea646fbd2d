//! Errors of the policy language. Every error has a [`Location`]
//! (`file:line:column`) and a message that says what was wrong and what to
//! write instead; [`PolicyErrors`] carries all errors found in one apply.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use crate::yaml::Pos;

/// A position in a named source: `policies/a.yaml:12:5`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Location {
    /// The source name given to [`crate::parse_documents`] (usually a file
    /// path, `-` for standard input).
    pub source: Arc<str>,
    /// Line, starting at 1.
    pub line: u32,
    /// Column in characters, starting at 1.
    pub column: u32,
}

impl Location {
    pub(crate) fn new(source: &Arc<str>, pos: Pos) -> Self {
        Self {
            source: Arc::clone(source),
            line: pos.line,
            column: pos.column,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.source, self.line, self.column)
    }
}

/// One problem found in a policy document, with where it is.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyError {
    /// Where the problem is.
    pub location: Location,
    /// What the problem is.
    pub kind: ErrorKind,
}

impl fmt::Display for PolicyError {
    /// `FILE:LINE:COLUMN: message`, on one line: control characters the
    /// message quotes from the document or its name (an escape sequence, a
    /// newline in a key) are written escaped (`\u{1b}`), so that an error
    /// shown in a terminal or a log is the error's text and nothing else.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format!("{}: {}", self.location, self.kind);
        write!(f, "{}", Printable(&text))
    }
}

/// Text quoted in an error, its control characters written escaped
/// (`\u{1b}`), so that what a terminal or a log shows is the text and
/// nothing else.
pub(crate) struct Printable<'a>(pub &'a str);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for PolicyError {}

/// Renders `Some(x)` as "did you mean `x`? " and `None` as nothing.
struct DidYouMean<'a>(&'a Option<String>);

impl fmt::Display for DidYouMean<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(s) => write!(f, "did you mean `{s}`? "),
            None => Ok(()),
        }
    }
}

/// Renders a list as "`a`, `b` or `c`".
struct OneOf<'a>(&'a [String]);

impl fmt::Display for OneOf<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, item) in self.0.iter().enumerate() {
            match i {
                0 => {}
                i if i + 1 == self.0.len() => f.write_str(" or ")?,
                _ => f.write_str(", ")?,
            }
            write!(f, "`{item}`")?;
        }
        Ok(())
    }
}

/// What is wrong, and what to write instead. Field paths are written as in
/// the document: `spec.prefetch.readers.min`, `spec.selector.matchExpressions[0]`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The text is not valid YAML.
    #[error("invalid YAML: {reason}")]
    Syntax { reason: String },

    /// A document is not a mapping.
    #[error(
        "a policy document must be a mapping with `apiVersion`, `kind`, `metadata` and `spec`, found {found}"
    )]
    NotAMapping { found: String },

    /// `apiVersion` is not one this version understands.
    #[error("unknown apiVersion `{found}`: write `apiVersion: sluice.dev/v1`")]
    UnknownApiVersion { found: String },

    /// `kind` is not one this version understands.
    #[error(
        "unknown kind `{found}`: {}sluice.dev/v1 has the kinds `StoragePool`, `JobPolicy` and `DatasetCache`",
        DidYouMean(.suggestion)
    )]
    UnknownKind {
        found: String,
        suggestion: Option<String>,
    },

    /// A field this kind does not have (often a typo).
    #[error(
        "unknown field `{field}` in {path}: {}the fields here are {}",
        DidYouMean(.suggestion),
        OneOf(.expected)
    )]
    UnknownField {
        field: String,
        path: String,
        suggestion: Option<String>,
        expected: Vec<String>,
    },

    /// A required field is absent.
    #[error("missing field `{field}` in {path}: {hint}")]
    MissingField {
        field: String,
        path: String,
        hint: String,
    },

    /// A value of the wrong type (a string where a number belongs...).
    #[error("{path} must be {expected}, found {found}")]
    WrongType {
        path: String,
        expected: String,
        found: String,
    },

    /// A word that is not one of a fixed set (`sharing`, `operator`).
    #[error("{path} cannot be `{found}`: {}write {}", DidYouMean(.suggestion), OneOf(.expected))]
    UnknownValue {
        path: String,
        found: String,
        suggestion: Option<String>,
        expected: Vec<String>,
    },

    /// A value that does not parse or is impossible, such as a quantity
    /// with a bad unit; the message says what to write.
    #[error("{path}: {message}")]
    InvalidValue { path: String, message: String },

    /// A number outside its allowed range.
    #[error("{path} must be from {min} to {max}, found {found}: {hint}")]
    OutOfRange {
        path: String,
        found: String,
        min: String,
        max: String,
        hint: String,
    },

    /// A `min` above its `max`.
    #[error("{path}.min ({min}) is above {path}.max ({max}): write a min that is at most the max")]
    MinAboveMax {
        path: String,
        min: String,
        max: String,
    },

    /// An `initial` value outside `min..=max`.
    #[error(
        "{path}.initial ({initial}) is not between min ({min}) and max ({max}): write an initial value between them"
    )]
    InitialOutsideBounds {
        path: String,
        initial: String,
        min: String,
        max: String,
    },

    /// A guarantee above the limit of the same resource.
    #[error(
        "spec.guarantee.{resource} ({guarantee}) is above spec.limit.{resource} ({limit}): a job cannot be promised more than it may use; lower the guarantee or raise the limit"
    )]
    GuaranteeAboveLimit {
        resource: &'static str,
        guarantee: String,
        limit: String,
    },

    /// A guarantee above the capacity of the policy's pool.
    #[error(
        "spec.guarantee.{resource} ({guarantee}) is above the capacity of pool `{pool}` ({capacity}, {pool_at}): lower the guarantee or raise the pool's spec.capacity.{resource}"
    )]
    GuaranteeAboveCapacity {
        resource: &'static str,
        guarantee: String,
        pool: String,
        capacity: String,
        pool_at: Location,
    },

    /// An ops guarantee in a pool that declares no ops capacity.
    #[error(
        "spec.guarantee.ops cannot be honoured: pool `{pool}` ({pool_at}) declares no spec.capacity.ops; add one to the pool or remove the ops guarantee"
    )]
    GuaranteeWithoutCapacity { pool: String, pool_at: Location },

    /// A policy in a `static` pool without the limit that is its share.
    #[error(
        "pool `{pool}` ({pool_at}) shares statically, so each job gets exactly its limit: set spec.limit.bandwidth, or use `sharing: weighted-fair` in the pool"
    )]
    StaticNeedsLimit { pool: String, pool_at: Location },

    /// A guarantee in a `static` pool, where it would have no effect.
    #[error(
        "pool `{pool}` ({pool_at}) shares statically, so each job gets exactly its limit and a guarantee has no effect: remove spec.guarantee, or use `sharing: weighted-fair` in the pool"
    )]
    StaticForbidsGuarantee { pool: String, pool_at: Location },

    /// `metadata.name` or `spec.pool` is not a DNS label.
    #[error(
        "{path} `{found}` is not a valid name: use 1 to 63 lowercase letters, digits and `-`, starting and ending with a letter or digit{}",
        .suggestion.as_ref().map(|s| format!(", e.g. `{s}`")).unwrap_or_default()
    )]
    InvalidName {
        path: String,
        found: String,
        suggestion: Option<String>,
    },

    /// A label key or value that jobs could never carry.
    #[error("{path}: {reason}")]
    InvalidLabel { path: String, reason: String },

    /// `In`/`NotIn` without values, or `Exists`/`DoesNotExist` with values.
    #[error("{path}: {reason}")]
    BadRequirement { path: String, reason: String },

    /// A selector whose requirements contradict each other.
    #[error(
        "this selector can match no job: {reason}; remove one of the contradicting requirements"
    )]
    UnsatisfiableSelector { reason: String },

    /// Two documents of one kind with the same name in one apply.
    #[error(
        "{kind} `{name}` is defined twice (first at {first}): give each document its own metadata.name"
    )]
    DuplicateName {
        kind: &'static str,
        name: String,
        first: Location,
    },

    /// `spec.pool` names no StoragePool.
    #[error(
        "pool `{pool}` does not exist: {}{}",
        DidYouMean(.suggestion),
        if .known.is_empty() { "no StoragePool is defined yet; apply one with this name, in this apply or before it".to_owned() }
        else { format!("apply a StoragePool with this name or name one of {}", OneOf(.known)) }
    )]
    UnknownPool {
        pool: String,
        suggestion: Option<String>,
        known: Vec<String>,
    },

    /// Two `DatasetCache` documents steer the cache of one data set.
    #[error(
        "data set `{dataset}` already has DatasetCache `{other}` ({other_at}): one document steers one data set's cache; merge them or delete one"
    )]
    DatasetCachedTwice {
        dataset: String,
        other: String,
        other_at: Location,
    },

    /// Two `DatasetCache` documents give one tenant different weights.
    #[error(
        "tenant `{tenant}` has tenantWeight {weight} here but {other_weight} in DatasetCache `{other}` ({other_at}): a tenant's share of a node's cache is one number; write the same in both"
    )]
    TenantWeightDisagrees {
        tenant: String,
        weight: u32,
        other: String,
        other_weight: u32,
        other_at: Location,
    },

    /// Two policies could both be the one that applies to a job.
    #[error(
        "policies `{policy}` ({policy_at}) and `{other}` ({other_at}) both select jobs with labels {labels} with equal precedence ({precedence}) and specificity ({specificity}): add a label requirement to one selector or set spec.precedence on one of them"
    )]
    Ambiguous {
        policy: String,
        policy_at: Location,
        other: String,
        other_at: Location,
        labels: String,
        precedence: i32,
        specificity: usize,
    },
}

/// Every error found in one parse or apply, in source order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PolicyErrors(pub Vec<PolicyError>);

impl PolicyErrors {
    /// Returns the errors.
    pub fn errors(&self) -> &[PolicyError] {
        &self.0
    }

    pub(crate) fn sorted(mut self) -> Self {
        self.0.sort_by(|a, b| a.location.cmp(&b.location));
        self.0.dedup();
        self
    }
}

impl From<PolicyError> for PolicyErrors {
    fn from(e: PolicyError) -> Self {
        Self(vec![e])
    }
}

impl fmt::Display for PolicyErrors {
    /// One error a line: `FILE:LINE:COLUMN: message`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PolicyErrors {}

impl IntoIterator for PolicyErrors {
    type Item = PolicyError;
    type IntoIter = std::vec::IntoIter<PolicyError>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// Returns the candidate `input` was most likely meant to be: equal but for
/// case, `-` and `_`, or within a small edit distance.
pub(crate) fn suggest<'a>(
    input: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let fold = |s: &str| {
        s.chars()
            .filter(|c| !matches!(c, '-' | '_'))
            .flat_map(char::to_lowercase)
            .collect::<String>()
    };
    let folded = fold(input);
    let budget = (input.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .filter_map(|c| {
            let d = if fold(c) == folded {
                0
            } else {
                edit_distance(&folded, &fold(c))
            };
            (d <= budget).then_some((d, c))
        })
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c.to_owned())
}

/// Levenshtein distance with adjacent transpositions counted as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = d;
        }
    }
    rows[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_catch_typos_and_case() {
        let fields = ["weight", "priority", "precedence", "matchLabels"];
        assert_eq!(suggest("wieght", fields).as_deref(), Some("weight"));
        assert_eq!(suggest("priorty", fields).as_deref(), Some("priority"));
        assert_eq!(
            suggest("match_labels", fields).as_deref(),
            Some("matchLabels")
        );
        assert_eq!(suggest("bandwidth", fields), None);
        assert_eq!(
            suggest("weighted_fair", ["weighted-fair", "static"]).as_deref(),
            Some("weighted-fair")
        );
    }

    #[test]
    fn lists_read_as_prose() {
        let l =
            |v: &[&str]| OneOf(&v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).to_string();
        assert_eq!(l(&["a"]), "`a`");
        assert_eq!(l(&["a", "b"]), "`a` or `b`");
        assert_eq!(l(&["a", "b", "c"]), "`a`, `b` or `c`");
    }
}
