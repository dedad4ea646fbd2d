//! The records the store reads and writes.

use std::collections::BTreeMap;
use std::fmt;

use super::StoreError;

/// Labels of a stage or a job (Kubernetes-style `key: value` pairs), stored
/// as a JSON object.
pub type Labels = BTreeMap<String, String>;

/// The longest kind, name or id the store accepts (a DNS subdomain's limit,
/// as Kubernetes object names).
pub const MAX_NAME_LEN: usize = 253;

/// One policy document to apply: its identity and its canonical text
/// (`sluice_policy::Policy::canonical`), the text that decides whether an
/// apply changes anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyDocument {
    /// The document's kind (`StoragePool`, `JobPolicy`).
    pub kind: String,
    /// The document's `metadata.name`.
    pub name: String,
    /// The canonical text.
    pub canonical: String,
}

impl PolicyDocument {
    /// Returns a document from its parts.
    pub fn new(
        kind: impl Into<String>,
        name: impl Into<String>,
        canonical: impl Into<String>,
    ) -> Self {
        Self {
            kind: kind.into(),
            name: name.into(),
            canonical: canonical.into(),
        }
    }

    pub(super) fn validate(&self) -> Result<(), StoreError> {
        check_name("policy kind", &self.kind)?;
        check_name("policy name", &self.name)?;
        if self.canonical.trim().is_empty() {
            return Err(StoreError::Invalid {
                field: "policy text",
                reason: format!("{}/{} has an empty canonical text", self.kind, self.name),
            });
        }
        Ok(())
    }
}

/// What an apply did to one document, named as `sluice_policy::Action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApplyOutcome {
    /// The policy did not exist (never, or deleted): a revision was added.
    Created,
    /// The policy existed with another text: a revision was added.
    Updated,
    /// The policy's current revision has this exact text: nothing was written.
    Unchanged,
}

impl fmt::Display for ApplyOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Created => "created",
            Self::Updated => "updated",
            Self::Unchanged => "unchanged",
        })
    }
}

/// The result of applying one document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The document's kind.
    pub kind: String,
    /// The document's name.
    pub name: String,
    /// The policy's current revision after the apply.
    pub revision: u64,
    /// Whether a revision was added, and why.
    pub outcome: ApplyOutcome,
}

/// One revision of a policy. Revisions count from 1 per kind and name and
/// are never rewritten or removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRevision {
    /// The policy's kind.
    pub kind: String,
    /// The policy's name.
    pub name: String,
    /// This revision's number.
    pub revision: u64,
    /// The canonical text, or `None` when this revision is a delete.
    pub canonical: Option<String>,
    /// When the revision was written (Unix milliseconds, controller clock).
    pub created_ms: i64,
}

impl PolicyRevision {
    /// Returns whether this revision records a delete.
    pub fn is_tombstone(&self) -> bool {
        self.canonical.is_none()
    }
}

/// A stage's connection state as the controller last saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StageState {
    /// Its session is open (or it spoke within the timeout).
    Connected,
    /// It was silent past the timeout.
    Lost,
}

impl StageState {
    /// Returns the stored (and `sluicectl -o json`) spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connected => "connected",
            Self::Lost => "lost",
        }
    }

    pub(super) fn parse(text: &str) -> Result<Self, StoreError> {
        match text {
            "connected" => Ok(Self::Connected),
            "lost" => Ok(Self::Lost),
            other => Err(StoreError::Corrupt {
                what: "stage state",
                reason: format!("unknown state `{other}`"),
            }),
        }
    }
}

impl fmt::Display for StageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a stage says when its session opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageHello {
    /// The stage's id.
    pub id: String,
    /// The node it runs on.
    pub node: String,
    /// Its labels.
    pub labels: Labels,
    /// The settings version it runs (0: none yet). Recorded as acknowledged,
    /// and the stage's next settings version is raised above it.
    pub running_version: u64,
}

/// What [`crate::store::Store::forget_unseen`] forgot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Forgotten {
    pub stages: Vec<String>,
    pub jobs: Vec<String>,
    /// How many of the oldest events went (the log keeps its newest
    /// [`super::KEPT_EVENTS`]).
    pub events: u64,
}

/// Settings the controller wants a stage to run, under their version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredSettings {
    /// The version they were published under.
    pub version: u64,
    /// The settings document (opaque to the store).
    pub document: String,
}

/// A stage's last rejection of a settings version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nack {
    /// The version rejected.
    pub version: u64,
    /// The stage's reason.
    pub reason: String,
}

/// A stage as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageRecord {
    /// The stage's id.
    pub id: String,
    /// The node it runs on.
    pub node: String,
    /// Its labels, from its last hello.
    pub labels: Labels,
    /// Connected or lost.
    pub state: StageState,
    /// Its first hello (Unix milliseconds).
    pub first_seen_ms: i64,
    /// The last time the controller recorded it alive (Unix milliseconds).
    pub last_seen_ms: i64,
    /// The newest settings the controller published for it.
    pub desired: Option<DesiredSettings>,
    /// The settings version it last acknowledged (or reported running).
    pub acked_version: Option<u64>,
    /// Its last rejection, cleared when it acknowledges that version or a
    /// later one.
    pub last_nack: Option<Nack>,
    /// When it last ended its session itself (it was stopping), until its
    /// next hello (Unix milliseconds).
    pub ended_ms: Option<i64>,
}

impl StageRecord {
    /// Returns the desired settings version, if any was published.
    pub fn desired_version(&self) -> Option<u64> {
        self.desired.as_ref().map(|d| d.version)
    }
}

/// One write of a batch that [`Store::record`](super::Store::record)
/// commits in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// The stage was heard from at `unix_millis`: connected, last seen then.
    Seen { stage: String, unix_millis: i64 },
    /// The stage applied settings `version`; clears its last nack when that
    /// was for `version` or earlier.
    Ack { stage: String, version: u64 },
    /// The stage's next settings version, with `document` as its desired
    /// settings; yields the version.
    Desired { stage: String, document: String },
    /// A trainer of a job was seen on a stage at `unix_millis`.
    Job {
        sighting: JobSighting,
        unix_millis: i64,
    },
    /// An event; yields its seq.
    Event(NewEvent),
}

/// A stage reporting a trainer of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSighting {
    /// The job's id.
    pub job: String,
    /// The job's labels (from the trainer's hello); the last sighting wins.
    pub labels: Labels,
    /// The stage serving it (it must have said hello).
    pub stage: String,
}

/// A job as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    /// The job's id.
    pub id: String,
    /// Its labels, from the last sighting.
    pub labels: Labels,
    /// Its first sighting (Unix milliseconds).
    pub first_seen_ms: i64,
    /// Its last sighting (Unix milliseconds).
    pub last_seen_ms: i64,
    /// The stages that ever reported it, sorted.
    pub stages: Vec<String>,
}

/// An event to append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    /// What happened, as a dotted name (`policy.applied`, `stage.lost`).
    pub kind: String,
    /// What it happened to (`stage/node-1`, `JobPolicy/vision`).
    pub subject: String,
    /// A sentence for operators.
    pub message: String,
    /// When (Unix milliseconds).
    pub unix_millis: i64,
}

/// An event as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Its position: strictly increasing in the order events were committed.
    pub seq: u64,
    /// See [`NewEvent::kind`].
    pub kind: String,
    /// See [`NewEvent::subject`].
    pub subject: String,
    /// See [`NewEvent::message`].
    pub message: String,
    /// See [`NewEvent::unix_millis`].
    pub unix_millis: i64,
}

pub(super) fn check_name(field: &'static str, value: &str) -> Result<(), StoreError> {
    // The value as a message may repeat it: its start, escaped.
    let shown = || {
        let start: String = value.chars().take(64).collect();
        let more = if start.len() < value.len() { "..." } else { "" };
        format!("{}{more}", start.escape_debug())
    };
    if value.is_empty() || value.len() > MAX_NAME_LEN {
        return Err(StoreError::Invalid {
            field,
            reason: format!(
                "`{}` ({} bytes) must be 1 to {MAX_NAME_LEN} bytes long",
                shown(),
                value.len()
            ),
        });
    }
    if value.chars().any(char::is_control) {
        return Err(StoreError::Invalid {
            field,
            reason: format!(
                "`{}` holds a control character (a line break, an escape): tables and logs would show it raw",
                shown()
            ),
        });
    }
    Ok(())
}

/// Checks what a stage's hello names it by before anything is recorded
/// of it: its id, and the node it runs on when it gives one.
pub fn check_stage_hello(id: &str, node: &str) -> Result<(), StoreError> {
    check_name("stage id", id)?;
    if !node.is_empty() {
        check_name("node", node)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_bounded() {
        assert!(check_name("stage id", "").is_err());
        assert!(check_name("stage id", &"x".repeat(MAX_NAME_LEN + 1)).is_err());
        assert!(check_name("stage id", "node-1").is_ok());
        let long = check_name("stage id", &"x".repeat(10_000)).unwrap_err();
        assert!(long.to_string().len() < 300, "{long}");
        assert!(check_name("stage id", "evil\nstage").is_err());
        assert!(check_stage_hello("stage-a", "n\u{1b}[31mred").is_err());
        assert!(check_stage_hello("stage-a", "").is_ok());
    }
}
