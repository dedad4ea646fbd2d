//! The PostgreSQL backend, for several controller replicas sharing one
//! database (one of them leader, see [`super::leadership`]). Transactions
//! run at READ COMMITTED; the few places where that is not enough take an
//! explicit lock, named where it is taken. Labels are `JSONB`.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{Connection, PgPool, PgTransaction};

use super::StoreError;
use super::error::{db, found, redact, stage_version};
use super::leadership::Leadership;
use super::migrations::{self, Steps};
use super::model::{
    Applied, Event, Forgotten, JobRecord, PolicyDocument, PolicyRevision, Record, StageHello,
    StageRecord, StageState, check_name,
};
use super::revision::{self, ApplyPlan, HeadRow};
use super::rows::{self, EventRow, JobRow, PolicyRow, StageRow};

/// How long an operation waits for a free pool connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// Every stage `SELECT` lists these columns, in [`StageRow`] order.
macro_rules! stage_columns {
    () => {
        "id, node, labels::text, state, first_seen_ms, last_seen_ms, desired_version, \
         desired_settings, acked_version, nack_version, nack_reason, ended_ms"
    };
}

/// Every job `SELECT` lists these columns, in [`JobRow`] order.
macro_rules! job_columns {
    () => {
        "id, labels::text, first_seen_ms, last_seen_ms"
    };
}

/// The statement that appends an event (binds kind, subject, message,
/// time; returns the seq).
macro_rules! insert_event_sql {
    () => {
        // The counter row stays locked until the transaction commits (see
        // event_counter in the migration): events commit in seq order.
        "WITH next AS (UPDATE event_counter SET last_seq = last_seq + 1 RETURNING last_seq)
         INSERT INTO events (seq, kind, subject, message, unix_millis)
         SELECT last_seq, $1, $2, $3, $4 FROM next
         RETURNING seq"
    };
}

/// The labels parameter of a job `INSERT`.
macro_rules! labels_param {
    () => {
        "$2::jsonb"
    };
}

#[derive(Clone, Debug)]
pub(super) struct PgStore {
    pool: PgPool,
}

/// The schema's migrations (see [`migrations`]).
const MIGRATIONS: &Steps = &[
    (
        "initial",
        include_str!("../../migrations/postgres/0001_initial.sql"),
    ),
    (
        "stage ended",
        include_str!("../../migrations/postgres/0002_stage_ended.sql"),
    ),
];

impl PgStore {
    common_queries!();

    pub(super) async fn open(url: &str) -> Result<Self, StoreError> {
        let open_err = |source| StoreError::Open {
            backend: "postgres",
            url: redact(url),
            source,
        };
        let options = PgConnectOptions::from_str(url)
            .map_err(open_err)?
            .application_name("sluice-controller");
        // One connection first, outside the pool: a pool tries a failing
        // connect again until its timeout and then says only that it timed
        // out, hiding "connection refused" or a refused password.
        match tokio::time::timeout(ACQUIRE_TIMEOUT, PgConnection::connect_with(&options)).await {
            Ok(Ok(first)) => {
                let _ = first.close().await;
            }
            Ok(Err(e)) => return Err(open_err(e)),
            Err(_) => {
                return Err(open_err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {ACQUIRE_TIMEOUT:?}"),
                ))));
            }
        }
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(open_err)?;
        // The migrator holds an advisory lock while it runs, so replicas
        // starting together migrate once.
        migrations::migrate(MIGRATIONS, &pool, "postgres").await?;
        Ok(Self { pool })
    }

    /// Starts a transaction that changes policies. The table lock conflicts
    /// with itself but not with readers: concurrent appliers queue, so two
    /// of them never compute the same next revision.
    async fn begin_policy_write(
        &self,
        op: &'static str,
    ) -> Result<PgTransaction<'static>, StoreError> {
        let mut tx = self.pool.begin().await.map_err(db(op))?;
        sqlx::query("LOCK TABLE policy_revisions IN SHARE ROW EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await
            .map_err(db(op))?;
        Ok(tx)
    }

    /// Starts a read-only transaction that sees one snapshot (READ
    /// COMMITTED would give each statement its own).
    async fn begin_write(&self, op: &'static str) -> Result<PgTransaction<'static>, StoreError> {
        self.pool.begin().await.map_err(db(op))
    }

    async fn begin_snapshot(&self, op: &'static str) -> Result<PgTransaction<'static>, StoreError> {
        let begin = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";
        self.pool.begin_with(begin).await.map_err(db(op))
    }

    pub(super) async fn try_acquire_leadership(&self) -> Result<Option<Leadership>, StoreError> {
        // A replica of this release still running while a later one has
        // migrated the store must not lead on a schema it does not know.
        let version: i64 = sqlx::query_scalar(
            "SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(db("reading the store's schema version"))?;
        let known = migrations::latest(MIGRATIONS);
        if version > known {
            return Err(StoreError::Newer {
                backend: "postgres",
                version,
                known,
            });
        }
        // A connection of its own: the lock must not go back to the pool
        // with it, and must end when (only when) this session ends.
        let conn = self
            .pool
            .acquire()
            .await
            .map_err(db("trying the leader lease"))?
            .detach();
        Leadership::try_acquire(conn).await
    }

    pub(super) async fn apply_policies(
        &self,
        docs: &[PolicyDocument],
    ) -> Result<Vec<Applied>, StoreError> {
        const OP: &str = "applying policies";
        let mut tx = self.begin_policy_write(OP).await?;
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
        let mut tx = self.begin_policy_write(OP).await?;
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
             VALUES ($1, $2, $3::jsonb, 'connected', $4, $4, $5, NULLIF($5, 0))
             ON CONFLICT (id) DO UPDATE SET
                 node = excluded.node, labels = excluded.labels, state = 'connected',
                 last_seen_ms = excluded.last_seen_ms,
                 settings_version = GREATEST(stages.settings_version, excluded.settings_version),
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

common_revision_queries!(PgTransaction<'static>);
common_record_queries!(PgTransaction<'static>);
