//! The controller's durable state: every policy revision, stages, jobs,
//! per-stage settings versions and desired settings, events, and the
//! leader lease. Telemetry is not stored (it lives in memory for the
//! control loop and in Prometheus for history).
//!
//! Two backends sit behind one [`Store`], picked by the URL scheme:
//! `sqlite://PATH` (the embedded default: the file is created if absent and
//! runs in WAL mode; one controller replica) and `postgres://...` (the
//! scale-out choice: several replicas, one leader by advisory lock, see
//! [`leadership`]). Each backend has its own migrations under
//! `control-plane/migrations/`, run by [`Store::open`].
//!
//! Postgres is reached without TLS (sqlx is built with no TLS stack): use it
//! over loopback or a trusted cluster network, and leave `sslmode` unset or
//! `disable`; `sslmode=require` fails at connect time.
//!
//! `Store` is an enum over the two pools rather than a trait object: the set
//! of backends is closed and known, callers get one concrete cheap-to-clone
//! type without boxed futures, and the one test suite drives exactly the
//! type the controller uses. The rules both backends must agree on (when an
//! apply writes a revision, how rows decode) live once, in `revision.rs` and
//! `rows.rs`, so only the SQL differs between `sqlite.rs` and `postgres.rs`.

#[macro_use]
mod common;
mod error;
mod file_lock;
pub mod leadership;
mod migrations;
mod model;
mod postgres;
mod revision;
mod rows;
mod sqlite;

/// How many of the newest events the store keeps (about 20,000 short jobs'
/// worth); older ones are dropped once a minute.
pub const KEPT_EVENTS: i64 = 100_000;

pub use error::StoreError;
pub use leadership::Leadership;
pub use model::{
    Applied, ApplyOutcome, DesiredSettings, Event, Forgotten, JobRecord, JobSighting, Labels,
    MAX_NAME_LEN, Nack, NewEvent, PolicyDocument, PolicyRevision, Record, StageHello, StageRecord,
    StageState, check_stage_hello,
};

use error::redact;

/// The controller's store; cloning it is cheap and shares the pool.
#[derive(Clone, Debug)]
pub struct Store {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    Sqlite(sqlite::SqliteStore),
    Postgres(postgres::PgStore),
}

/// Calls the same method on whichever backend this store uses.
macro_rules! dispatch {
    ($self:ident.$method:ident($($arg:expr),*)) => {
        match &$self.backend {
            Backend::Sqlite(s) => s.$method($($arg),*).await,
            Backend::Postgres(s) => s.$method($($arg),*).await,
        }
    };
}

impl Store {
    /// Opens the store at `url` (`sqlite://sluice.db`, `sqlite::memory:`,
    /// `postgres://user@host:port/db`), creating a SQLite file if absent,
    /// and brings its schema up to date. A SQLite file is locked for as
    /// long as the store is open: a second open fails with
    /// [`StoreError::InUse`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite(sqlite::SqliteStore::open(url).await?)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres(postgres::PgStore::open(url).await?)
        } else {
            return Err(StoreError::UnsupportedUrl { url: redact(url) });
        };
        Ok(Self { backend })
    }

    /// Returns `sqlite` or `postgres`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres(_) => "postgres",
        }
    }

    /// Closes every connection, waiting for operations in flight, and
    /// gives up a SQLite file's lock (so another controller may open it).
    /// Later calls on this store (or its clones) fail.
    pub async fn close(&self) {
        match &self.backend {
            Backend::Sqlite(s) => s.close_and_unlock().await,
            Backend::Postgres(s) => s.close().await,
        }
    }

    /// Applies one policy document; see [`Store::apply_policies`].
    pub async fn apply_policy(
        &self,
        kind: &str,
        name: &str,
        canonical: &str,
    ) -> Result<(u64, ApplyOutcome), StoreError> {
        let applied = self
            .apply_policies(&[PolicyDocument::new(kind, name, canonical)])
            .await?;
        // One document in, one result out.
        Ok((applied[0].revision, applied[0].outcome))
    }

    /// Applies documents in one transaction: all or nothing. A document
    /// whose canonical text equals its policy's current revision writes
    /// nothing ([`ApplyOutcome::Unchanged`]); any other appends the next
    /// revision. Concurrent applies are serialized, so revisions are never
    /// duplicated. Returns one [`Applied`] per document, in order.
    pub async fn apply_policies(
        &self,
        docs: &[PolicyDocument],
    ) -> Result<Vec<Applied>, StoreError> {
        dispatch!(self.apply_policies(docs))
    }

    /// Records the delete of a live policy as a new revision without text (a
    /// tombstone) and returns its number. Fails with
    /// [`StoreError::PolicyNotFound`] when the policy was never applied or is
    /// already deleted.
    pub async fn delete_policy(&self, kind: &str, name: &str) -> Result<u64, StoreError> {
        dispatch!(self.delete_policy(kind, name))
    }

    /// Returns the current revision of every live (not deleted) policy,
    /// sorted by kind then name.
    pub async fn current_policies(&self) -> Result<Vec<PolicyRevision>, StoreError> {
        dispatch!(self.current_policies())
    }

    /// Returns every revision of one policy, oldest first (empty when it
    /// was never applied).
    pub async fn policy_history(
        &self,
        kind: &str,
        name: &str,
    ) -> Result<Vec<PolicyRevision>, StoreError> {
        dispatch!(self.policy_history(kind, name))
    }

    /// Records a stage's hello at `now_ms`: creates or updates it as
    /// connected with the node and labels it gave, records its running
    /// version as acknowledged, and raises its settings version counter to
    /// at least that version. Returns the stage, with the desired settings
    /// to re-push.
    pub async fn stage_hello(
        &self,
        hello: &StageHello,
        now_ms: i64,
    ) -> Result<StageRecord, StoreError> {
        model::check_name("stage id", &hello.id)?;
        dispatch!(self.stage_hello(hello, now_ms))
    }

    /// Marks a stage connected and seen at `now_ms`.
    pub async fn mark_stage_seen(&self, id: &str, now_ms: i64) -> Result<(), StoreError> {
        self.record_one(Record::Seen {
            stage: id.to_owned(),
            unix_millis: now_ms,
        })
        .await
        .map(drop)
    }

    /// Marks a stage lost (its `last_seen_ms` is kept).
    pub async fn mark_stage_lost(&self, id: &str) -> Result<(), StoreError> {
        dispatch!(self.set_stage_state(id, StageState::Lost, None))
    }

    /// Records that the stage ended its session itself at `ended_ms` (it is
    /// stopping): a leader that takes over before it would have counted as
    /// left still counts it left, not lost. Its next hello clears it.
    pub async fn record_stage_ended(&self, id: &str, ended_ms: i64) -> Result<(), StoreError> {
        dispatch!(self.record_stage_ended(id, ended_ms))
    }

    /// Forgets a stage: its record and which jobs it reported.
    pub async fn forget_stage(&self, id: &str) -> Result<(), StoreError> {
        dispatch!(self.forget_stage(id))
    }

    /// Forgets the lost stages and the jobs last seen before `before_ms`,
    /// and returns their ids; drops the events older than the newest
    /// `kept_events` (the controller keeps [`KEPT_EVENTS`]).
    pub async fn forget_unseen(
        &self,
        before_ms: i64,
        kept_events: i64,
    ) -> Result<Forgotten, StoreError> {
        dispatch!(self.forget_unseen(before_ms, kept_events))
    }

    /// Allocates the stage's next settings version: strictly greater than
    /// every version allocated before for it, across restarts.
    pub async fn next_settings_version(&self, stage: &str) -> Result<u64, StoreError> {
        dispatch!(self.next_settings_version(stage))
    }

    /// Allocates the stage's next settings version (as
    /// [`Store::next_settings_version`]) and records `document` as its
    /// desired settings under it, in one statement. Returns the version.
    pub async fn set_desired_settings(
        &self,
        stage: &str,
        document: &str,
    ) -> Result<u64, StoreError> {
        self.record_one(Record::Desired {
            stage: stage.to_owned(),
            document: document.to_owned(),
        })
        .await
    }

    /// Records that a stage applied `version`; clears its last nack when that
    /// was for `version` or earlier.
    pub async fn record_ack(&self, stage: &str, version: u64) -> Result<(), StoreError> {
        self.record_one(Record::Ack {
            stage: stage.to_owned(),
            version,
        })
        .await
        .map(drop)
    }

    /// Commits `writes` in one transaction, so a batch costs one flush to
    /// disk however many writes it holds: the controller batches what
    /// thousands of stages report. Each write has its own outcome, in
    /// order (a [`Record::Desired`] its version, a [`Record::Event`] its
    /// seq, others 0); a stage that is not known fails only its write. A
    /// database error fails the whole batch and writes nothing.
    pub async fn record(
        &self,
        writes: &[Record],
    ) -> Result<Vec<Result<u64, StoreError>>, StoreError> {
        dispatch!(self.record(writes))
    }

    async fn record_one(&self, write: Record) -> Result<u64, StoreError> {
        let mut outcomes = self.record(std::slice::from_ref(&write)).await?;
        outcomes.pop().unwrap_or(Ok(0))
    }

    /// Records that a stage rejected `version`, and why.
    pub async fn record_nack(
        &self,
        stage: &str,
        version: u64,
        reason: &str,
    ) -> Result<(), StoreError> {
        let version = rows::to_i64("nacked version", version)?;
        dispatch!(self.record_nack(stage, version, reason))
    }

    /// Returns every stage, sorted by id.
    pub async fn stages(&self) -> Result<Vec<StageRecord>, StoreError> {
        dispatch!(self.stages())
    }

    /// Returns one stage.
    pub async fn stage(&self, id: &str) -> Result<Option<StageRecord>, StoreError> {
        dispatch!(self.stage(id))
    }

    /// Records that a stage reported a trainer of a job at `now_ms`: creates
    /// or updates the job (labels: last sighting wins) and links the stage.
    /// Fails with [`StoreError::StageNotFound`] if the stage never said hello.
    pub async fn upsert_job(&self, sighting: &JobSighting, now_ms: i64) -> Result<(), StoreError> {
        self.record_one(Record::Job {
            sighting: sighting.clone(),
            unix_millis: now_ms,
        })
        .await
        .map(drop)
    }

    /// Returns every job, sorted by id.
    pub async fn jobs(&self) -> Result<Vec<JobRecord>, StoreError> {
        dispatch!(self.jobs())
    }

    /// Returns one job.
    pub async fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        dispatch!(self.job(id))
    }

    /// Appends an event and returns its seq, greater than every seq
    /// committed before it (so a watcher reading [`Store::events_since`] its
    /// last seq misses nothing).
    pub async fn append_event(&self, event: &NewEvent) -> Result<u64, StoreError> {
        self.record_one(Record::Event(event.clone())).await
    }

    /// Returns up to `limit` events with a seq above `after`, oldest first.
    pub async fn events_since(&self, after: u64, limit: u32) -> Result<Vec<Event>, StoreError> {
        let after = rows::to_i64("event seq", after)?;
        dispatch!(self.events_since(after, i64::from(limit)))
    }

    /// Returns the seq of the newest event (0 when there is none), where a
    /// watch that wants only new events starts.
    pub async fn latest_event_seq(&self) -> Result<u64, StoreError> {
        dispatch!(self.latest_event_seq())
    }

    /// Tries to become the leader without waiting: `Some` while this
    /// controller holds the lease, `None` when another one does. SQLite
    /// always grants it (one replica). See [`leadership`] for the HA plan.
    pub async fn try_acquire_leadership(&self) -> Result<Option<Leadership>, StoreError> {
        match &self.backend {
            Backend::Sqlite(_) => Ok(Some(Leadership::embedded())),
            Backend::Postgres(s) => s.try_acquire_leadership().await,
        }
    }
}
