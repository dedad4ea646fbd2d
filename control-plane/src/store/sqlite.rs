//! The SQLite backend: one file in WAL mode (readers never wait for the
//! writer), for a single controller replica. Transactions that write start
//! with `BEGIN IMMEDIATE`, taking the write lock before their first read, so
//! two writers queue on the busy timeout instead of one failing with
//! `SQLITE_BUSY` when it upgrades from reader to writer.
//!
//! A store on a file holds that file's [`FileLock`] while it is open, so a
//! second controller on the same file is refused at start instead of
//! leading beside the first. Opening also checks that the database takes
//! writes: a read-only store would fail every change later.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{SqlitePool, SqliteTransaction};

use super::StoreError;
use super::error::{db, found, redact, stage_version};
use super::file_lock::FileLock;
use super::migrations::{self, Steps};
use super::model::{
    Applied, Event, Forgotten, JobRecord, PolicyDocument, PolicyRevision, Record, StageHello,
    StageRecord, StageState, check_name,
};
use super::revision::{self, ApplyPlan, HeadRow};
use super::rows::{self, EventRow, JobRow, PolicyRow, StageRow};

/// How long a writer waits for another writer's transaction to finish.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// SQLite's primary result code for a write to a read-only database (the
/// low byte of every extended `SQLITE_READONLY_*` code).
const SQLITE_READONLY: i32 = 8;

/// Every stage `SELECT` lists these columns, in [`StageRow`] order.
macro_rules! stage_columns {
    () => {
        "id, node, labels, state, first_seen_ms, last_seen_ms, desired_version, \
         desired_settings, acked_version, nack_version, nack_reason, ended_ms"
    };
}

/// Every job `SELECT` lists these columns, in [`JobRow`] order.
macro_rules! job_columns {
    () => {
        "id, labels, first_seen_ms, last_seen_ms"
    };
}

/// The statement that appends an event (binds kind, subject, message,
/// time; returns the seq).
macro_rules! insert_event_sql {
    () => {
        "INSERT INTO events (kind, subject, message, unix_millis) VALUES ($1, $2, $3, $4)
         RETURNING seq"
    };
}

/// The labels parameter of a job `INSERT`.
macro_rules! labels_param {
    () => {
        "$2"
    };
}

#[derive(Clone, Debug)]
pub(super) struct SqliteStore {
    pool: SqlitePool,
    /// The file's lock; `None` for an in-memory database.
    lock: Option<Arc<FileLock>>,
}

/// The schema's migrations (see [`migrations`]).
const MIGRATIONS: &Steps = &[
    (
        "initial",
        include_str!("../../migrations/sqlite/0001_initial.sql"),
    ),
    (
        "stage ended",
        include_str!("../../migrations/sqlite/0002_stage_ended.sql"),
    ),
];

impl SqliteStore {
    common_queries!();

    pub(super) async fn open(url: &str) -> Result<Self, StoreError> {
        let open_err = |source| StoreError::Open {
            backend: "sqlite",
            url: redact(url),
            source,
        };
        // Refused before connecting: a read-only URL naming a file that
        // does not exist yet fails there with SQLite's bare "unable to
        // open database file".
        if read_only(url) {
            return Err(StoreError::ReadOnly { url: redact(url) });
        }
        let options = SqliteConnectOptions::from_str(url)
            .map_err(open_err)?
            .create_if_missing(true)
            .busy_timeout(BUSY_TIMEOUT);
        // An in-memory database lives as long as its last connection and
        // cannot use WAL: keep exactly one connection, forever.
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        let database = options.get_filename().to_owned();
        let lock = if in_memory {
            None
        } else {
            if database.as_os_str().is_empty() {
                return Err(StoreError::NoPath { url: redact(url) });
            }
            // Its lock file would be made beside it before SQLite refused it.
            if database.is_dir() || database.as_os_str().as_encoded_bytes().ends_with(b"/") {
                return Err(StoreError::Directory { url: redact(url) });
            }
            Some(Arc::new(FileLock::acquire(&database)?))
        };
        let pool = if in_memory {
            SqlitePoolOptions::new()
                .min_connections(1)
                .max_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options)
                .await
        } else {
            // synchronous stays FULL (the default): an accepted policy must
            // survive a power cut, and writes are rare.
            let options = options.journal_mode(SqliteJournalMode::Wal);
            SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(options)
                .await
        }
        .map_err(open_err)?;
        if let Some(lock) = &lock
            && let Err(e) = lock.hold_database(&database)
        {
            pool.close().await;
            return Err(e);
        }
        check_writable(&pool, url).await?;
        migrations::migrate(MIGRATIONS, &pool, "sqlite").await?;
        Ok(Self { pool, lock })
    }

    /// Closes every connection, then gives the file's lock up.
    pub(super) async fn close_and_unlock(&self) {
        self.close().await;
        if let Some(lock) = &self.lock {
            lock.release();
        }
    }

    async fn begin_write(
        &self,
        op: &'static str,
    ) -> Result<SqliteTransaction<'static>, StoreError> {
        self.pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(db(op))
    }

    /// A read transaction: its statements see one snapshot.
    async fn begin_snapshot(
        &self,
        op: &'static str,
    ) -> Result<SqliteTransaction<'static>, StoreError> {
        self.pool.begin().await.map_err(db(op))
    }

    pub(super) async fn apply_policies(
        &self,
        docs: &[PolicyDocument],
    ) -> Result<Vec<Applied>, StoreError> {
        const OP: &str = "applying policies";
        let mut tx = self.begin_write(OP).await?;
        let now = rows::now_millis();
        let mut applied = Vec::with_capacity(docs.len());
        for doc in docs {
            // Checked inside the transaction: a bad document rolls back
            // the ones written before it (the test suite relies on this).
            doc.validate()?;
            let plan = ApplyPlan::new(
                head(&mut tx, &doc.kind, &doc.name, OP).await?,
                &doc.canonical,
            );
            if plan.writes() {
                insert_revision(&mut tx, doc, plan.revision, Some(&doc.canonical), now, OP).await?;
            }
            applied.push(plan.applied(doc)?);
        }
        tx.commit().await.map_err(db(OP))?;
        Ok(applied)
    }

    pub(super) async fn delete_policy(&self, kind: &str, name: &str) -> Result<u64, StoreError> {
        const OP: &str = "deleting a policy";
        let mut tx = self.begin_write(OP).await?;
        let revision = revision::delete_revision(head(&mut tx, kind, name, OP).await?, kind, name)?;
        let doc = PolicyDocument::new(kind, name, "");
        insert_revision(&mut tx, &doc, revision, None, rows::now_millis(), OP).await?;
        tx.commit().await.map_err(db(OP))?;
        rows::to_u64("policy revision", revision)
    }

    pub(super) async fn stage_hello(
        &self,
        hello: &StageHello,
        now_ms: i64,
    ) -> Result<StageRecord, StoreError> {
        let running = rows::to_i64("running version", hello.running_version)?;
        let row: StageRow = sqlx::query_as(concat!(
            "INSERT INTO stages (id, node, labels, state, first_seen_ms, last_seen_ms,
                                 settings_version, acked_version)
             VALUES ($1, $2, $3, 'connected', $4, $4, $5, NULLIF($5, 0))
             ON CONFLICT (id) DO UPDATE SET
                 node = excluded.node, labels = excluded.labels, state = 'connected',
                 last_seen_ms = excluded.last_seen_ms,
                 settings_version = MAX(settings_version, excluded.settings_version),
                 acked_version = excluded.acked_version, ended_ms = NULL
             RETURNING ",
            stage_columns!()
        ))
        .bind(&hello.id)
        .bind(&hello.node)
        .bind(rows::labels_to_json(&hello.labels))
        .bind(now_ms)
        .bind(running)
        .fetch_one(&self.pool)
        .await
        .map_err(db("recording a stage hello"))?;
        rows::stage_from_row(row)
    }
}

/// Whether the URL's parameters open the database read-only.
fn read_only(url: &str) -> bool {
    let Some((_, query)) = url.split_once('?') else {
        return false;
    };
    query.split('&').any(|param| match param.split_once('=') {
        Some(("mode", mode)) => mode.eq_ignore_ascii_case("ro"),
        Some(("immutable", on)) => ["1", "true", "yes", "on"]
            .iter()
            .any(|v| on.eq_ignore_ascii_case(v)),
        _ => false,
    })
}

/// Fails with [`StoreError::ReadOnly`] when the database refuses writes
/// (`mode=ro`, `immutable=1`, a file or directory the process may not
/// write): creates a table and rolls it back.
async fn check_writable(pool: &SqlitePool, url: &str) -> Result<(), StoreError> {
    const OP: &str = "checking that the store takes writes";
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.map_err(db(OP))?;
    let written = sqlx::query("CREATE TABLE sluice_write_check (x)")
        .execute(&mut *tx)
        .await;
    match written {
        Ok(_) => tx.rollback().await.map_err(db(OP)),
        Err(sqlx::Error::Database(e))
            if e.code()
                .and_then(|c| c.parse::<i32>().ok())
                .is_some_and(|c| c & 0xff == SQLITE_READONLY) =>
        {
            Err(StoreError::ReadOnly { url: redact(url) })
        }
        Err(e) => Err(db(OP)(e)),
    }
}

common_revision_queries!(SqliteTransaction<'static>);
common_record_queries!(SqliteTransaction<'static>);
