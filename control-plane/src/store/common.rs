//! Queries that read the same on both backends (sqlx takes `$N` placeholders
//! on SQLite too): written once, expanded into each backend's `impl`.
//!
//! The expansion site provides `self.pool`, `begin_write` and `begin_snapshot`,
//! the `stage_columns!`, `job_columns!`, `labels_param!` and
//! `insert_event_sql!` macros (the SQL that differs) and the error and row
//! helpers, so the same text serves both pool types.

macro_rules! common_queries {
    () => {
    pub(super) async fn close(&self) {
        self.pool.close().await;
    }

    pub(super) async fn current_policies(&self) -> Result<Vec<PolicyRevision>, StoreError> {
        let rows: Vec<PolicyRow> = sqlx::query_as(
            "SELECT p.kind, p.name, p.revision, p.canonical, p.created_ms
             FROM policy_revisions p
             WHERE p.canonical IS NOT NULL
               AND p.revision = (SELECT MAX(h.revision) FROM policy_revisions h
                                 WHERE h.kind = p.kind AND h.name = p.name)
             ORDER BY p.kind, p.name",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(db("listing policies"))?;
        rows.into_iter().map(rows::policy_from_row).collect()
    }

    pub(super) async fn policy_history(
        &self,
        kind: &str,
        name: &str,
    ) -> Result<Vec<PolicyRevision>, StoreError> {
        let rows: Vec<PolicyRow> = sqlx::query_as(
            "SELECT kind, name, revision, canonical, created_ms FROM policy_revisions
             WHERE kind = $1 AND name = $2 ORDER BY revision",
        )
        .bind(kind)
        .bind(name)
        .fetch_all(&self.pool)
        .await
        .map_err(db("reading a policy's history"))?;
        rows.into_iter().map(rows::policy_from_row).collect()
    }

    pub(super) async fn set_stage_state(
        &self,
        id: &str,
        state: StageState,
        seen_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE stages SET state = $2, last_seen_ms = COALESCE($3, last_seen_ms) WHERE id = $1",
        )
        .bind(id)
        .bind(state.as_str())
        .bind(seen_ms)
        .execute(&self.pool)
        .await
        .map_err(db("recording a stage's state"))?;
        found(done.rows_affected(), id)
    }

    pub(super) async fn record_stage_ended(&self, id: &str, ended_ms: i64) -> Result<(), StoreError> {
        let done = sqlx::query("UPDATE stages SET ended_ms = $2 WHERE id = $1")
            .bind(id)
            .bind(ended_ms)
            .execute(&self.pool)
            .await
            .map_err(db("recording that a stage ended its session"))?;
        found(done.rows_affected(), id)
    }

    pub(super) async fn forget_stage(&self, id: &str) -> Result<(), StoreError> {
        const OP: &str = "forgetting a stage";
        let mut tx = self.begin_write(OP).await?;
        sqlx::query("DELETE FROM job_stages WHERE stage_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(db(OP))?;
        sqlx::query("DELETE FROM stages WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(db(OP))?;
        tx.commit().await.map_err(db(OP))
    }

    pub(super) async fn forget_unseen(
        &self,
        before_ms: i64,
        kept_events: i64,
    ) -> Result<Forgotten, StoreError> {
        const OP: &str = "forgetting stages and jobs not seen for long";
        let mut tx = self.begin_write(OP).await?;
        let stages: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM stages WHERE state = 'lost' AND last_seen_ms < $1 ORDER BY id",
        )
        .bind(before_ms)
        .fetch_all(&mut *tx)
        .await
        .map_err(db(OP))?;
        let jobs: Vec<String> =
            sqlx::query_scalar("SELECT id FROM jobs WHERE last_seen_ms < $1 ORDER BY id")
                .bind(before_ms)
                .fetch_all(&mut *tx)
                .await
                .map_err(db(OP))?;
        let deletes: [(&'static str, &Vec<String>); 4] = [
            ("DELETE FROM job_stages WHERE stage_id = $1", &stages),
            ("DELETE FROM stages WHERE id = $1", &stages),
            ("DELETE FROM job_stages WHERE job_id = $1", &jobs),
            ("DELETE FROM jobs WHERE id = $1", &jobs),
        ];
        for (sql, ids) in deletes {
            for id in ids {
                sqlx::query(sql)
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(OP))?;
            }
        }
        // The event log keeps its newest `kept_events`: every job that
        // comes and goes adds a few, and a controller runs for months.
        let events = sqlx::query(
            "DELETE FROM events WHERE seq <= (SELECT MAX(seq) FROM events) - $1",
        )
        .bind(kept_events)
        .execute(&mut *tx)
        .await
        .map_err(db(OP))?
        .rows_affected();
        tx.commit().await.map_err(db(OP))?;
        Ok(Forgotten {
            stages,
            jobs,
            events,
        })
    }

    pub(super) async fn next_settings_version(&self, stage: &str) -> Result<u64, StoreError> {
        let version: Option<i64> = sqlx::query_scalar(
            "UPDATE stages SET settings_version = settings_version + 1 WHERE id = $1
             RETURNING settings_version",
        )
        .bind(stage)
        .fetch_optional(&self.pool)
        .await
        .map_err(db("allocating a settings version"))?;
        stage_version(version, stage)
    }

    /// Commits `writes` in one transaction (one commit, so one flush to
    /// disk for the whole batch). Each write has its own outcome (a stage
    /// that is not known fails only its write); a database error fails
    /// the batch and writes nothing.
    pub(super) async fn record(
        &self,
        writes: &[Record],
    ) -> Result<Vec<Result<u64, StoreError>>, StoreError> {
        const OP: &str = "recording";
        let mut tx = self.begin_write(OP).await?;
        let mut outcomes = Vec::with_capacity(writes.len());
        for write in writes {
            outcomes.push(record_one(&mut tx, write).await?);
        }
        tx.commit().await.map_err(db(OP))?;
        Ok(outcomes)
    }

    pub(super) async fn record_nack(
        &self,
        stage: &str,
        version: i64,
        reason: &str,
    ) -> Result<(), StoreError> {
        let done =
            sqlx::query("UPDATE stages SET nack_version = $2, nack_reason = $3 WHERE id = $1")
                .bind(stage)
                .bind(version)
                .bind(reason)
                .execute(&self.pool)
                .await
                .map_err(db("recording a nack"))?;
        found(done.rows_affected(), stage)
    }

    pub(super) async fn stages(&self) -> Result<Vec<StageRecord>, StoreError> {
        let rows: Vec<StageRow> = sqlx::query_as(concat!(
            "SELECT ",
            stage_columns!(),
            " FROM stages ORDER BY id"
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(db("listing stages"))?;
        rows.into_iter().map(rows::stage_from_row).collect()
    }

    pub(super) async fn stage(&self, id: &str) -> Result<Option<StageRecord>, StoreError> {
        let row: Option<StageRow> = sqlx::query_as(concat!(
            "SELECT ",
            stage_columns!(),
            " FROM stages WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(db("reading a stage"))?;
        row.map(rows::stage_from_row).transpose()
    }

    pub(super) async fn jobs(&self) -> Result<Vec<JobRecord>, StoreError> {
        const OP: &str = "listing jobs";
        // The jobs and their links from one snapshot.
        let mut tx = self.begin_snapshot(OP).await?;
        let rows: Vec<JobRow> =
            sqlx::query_as(concat!("SELECT ", job_columns!(), " FROM jobs ORDER BY id"))
                .fetch_all(&mut *tx)
                .await
                .map_err(db(OP))?;
        let links: Vec<(String, String)> =
            sqlx::query_as("SELECT job_id, stage_id FROM job_stages ORDER BY job_id, stage_id")
                .fetch_all(&mut *tx)
                .await
                .map_err(db(OP))?;
        tx.commit().await.map_err(db(OP))?;
        rows::jobs_with_stages(rows, links)
    }

    pub(super) async fn job(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        const OP: &str = "reading a job";
        let mut tx = self.begin_snapshot(OP).await?;
        let row: Option<JobRow> =
            sqlx::query_as(concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = $1"))
                .bind(id)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db(OP))?;
        let stages: Vec<String> = sqlx::query_scalar(
            "SELECT stage_id FROM job_stages WHERE job_id = $1 ORDER BY stage_id",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await
        .map_err(db(OP))?;
        tx.commit().await.map_err(db(OP))?;
        row.map(|row| rows::job_from_row(row, stages)).transpose()
    }

    pub(super) async fn events_since(
        &self,
        after: i64,
        limit: i64,
    ) -> Result<Vec<Event>, StoreError> {
        let rows: Vec<EventRow> = sqlx::query_as(
            "SELECT seq, kind, subject, message, unix_millis FROM events
             WHERE seq > $1 ORDER BY seq LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(db("reading events"))?;
        rows.into_iter().map(rows::event_from_row).collect()
    }

    pub(super) async fn latest_event_seq(&self) -> Result<u64, StoreError> {
        let seq: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0) FROM events")
            .fetch_one(&self.pool)
            .await
            .map_err(db("reading the latest event seq"))?;
        rows::to_u64("event seq", seq)
    }
    };
}

/// The two statements a policy apply or delete runs inside its transaction,
/// for a backend's transaction type `$tx`.
macro_rules! common_revision_queries {
    ($tx:ty) => {
        async fn head(
            tx: &mut $tx,
            kind: &str,
            name: &str,
            op: &'static str,
        ) -> Result<Option<HeadRow>, StoreError> {
            sqlx::query_as(
                "SELECT revision, canonical FROM policy_revisions
         WHERE kind = $1 AND name = $2 ORDER BY revision DESC LIMIT 1",
            )
            .bind(kind)
            .bind(name)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db(op))
        }

        async fn insert_revision(
            tx: &mut $tx,
            doc: &PolicyDocument,
            revision: i64,
            canonical: Option<&str>,
            now_ms: i64,
            op: &'static str,
        ) -> Result<(), StoreError> {
            sqlx::query(
                "INSERT INTO policy_revisions (kind, name, revision, canonical, created_ms)
         VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&doc.kind)
            .bind(&doc.name)
            .bind(revision)
            .bind(canonical)
            .bind(now_ms)
            .execute(&mut **tx)
            .await
            .map_err(db(op))?;
            Ok(())
        }
    };
}

/// One write of [`record`](super::Store::record) inside its transaction,
/// for a backend's transaction type `$tx`: the outer error is the
/// database's (it fails the batch), the inner one the write's own.
macro_rules! common_record_queries {
    ($tx:ty) => {
        async fn record_one(
            tx: &mut $tx,
            write: &Record,
        ) -> Result<Result<u64, StoreError>, StoreError> {
            match write {
                Record::Seen { stage, unix_millis } => {
                    const OP: &str = "recording a stage's state";
                    let done = sqlx::query(
                        "UPDATE stages SET state = 'connected', last_seen_ms = $2 WHERE id = $1",
                    )
                    .bind(stage)
                    .bind(unix_millis)
                    .execute(&mut **tx)
                    .await
                    .map_err(db(OP))?;
                    Ok(found(done.rows_affected(), stage).map(|()| 0))
                }
                Record::Ack { stage, version } => {
                    let version = match rows::to_i64("acked version", *version) {
                        Ok(v) => v,
                        Err(e) => return Ok(Err(e)),
                    };
                    let done = sqlx::query(
                        "UPDATE stages SET acked_version = CASE WHEN acked_version > $2 THEN acked_version ELSE $2 END,
                 nack_reason  = CASE WHEN nack_version <= $2 THEN NULL ELSE nack_reason END,
                 nack_version = CASE WHEN nack_version <= $2 THEN NULL ELSE nack_version END
             WHERE id = $1",
                    )
                    .bind(stage)
                    .bind(version)
                    .execute(&mut **tx)
                    .await
                    .map_err(db("recording an ack"))?;
                    Ok(found(done.rows_affected(), stage).map(|()| 0))
                }
                Record::Desired { stage, document } => {
                    // Every right-hand side reads the row as it was before
                    // the update.
                    let version: Option<i64> = sqlx::query_scalar(
                        "UPDATE stages SET settings_version = settings_version + 1,
                               desired_version = settings_version + 1,
                               desired_settings = $2
             WHERE id = $1 RETURNING desired_version",
                    )
                    .bind(stage)
                    .bind(document)
                    .fetch_optional(&mut **tx)
                    .await
                    .map_err(db("recording desired settings"))?;
                    Ok(stage_version(version, stage))
                }
                Record::Job {
                    sighting,
                    unix_millis,
                } => {
                    const OP: &str = "recording a job";
                    if let Err(e) = check_name("job id", &sighting.job) {
                        return Ok(Err(e));
                    }
                    // Checked first: a failed statement would abort the
                    // whole transaction on Postgres.
                    let known: Option<String> = sqlx::query_scalar("SELECT id FROM stages WHERE id = $1")
                        .bind(&sighting.stage)
                        .fetch_optional(&mut **tx)
                        .await
                        .map_err(db(OP))?;
                    if known.is_none() {
                        return Ok(found(0, &sighting.stage).map(|()| 0));
                    }
                    sqlx::query(concat!(
                        "INSERT INTO jobs (id, labels, first_seen_ms, last_seen_ms) VALUES ($1, ",
                        labels_param!(),
                        ", $3, $3)
             ON CONFLICT (id) DO UPDATE SET labels = excluded.labels,
                                            last_seen_ms = excluded.last_seen_ms"
                    ))
                    .bind(&sighting.job)
                    .bind(rows::labels_to_json(&sighting.labels))
                    .bind(unix_millis)
                    .execute(&mut **tx)
                    .await
                    .map_err(db(OP))?;
                    sqlx::query(
                        "INSERT INTO job_stages (job_id, stage_id, last_seen_ms) VALUES ($1, $2, $3)
             ON CONFLICT (job_id, stage_id) DO UPDATE SET last_seen_ms = excluded.last_seen_ms",
                    )
                    .bind(&sighting.job)
                    .bind(&sighting.stage)
                    .bind(unix_millis)
                    .execute(&mut **tx)
                    .await
                    .map_err(db(OP))?;
                    Ok(Ok(0))
                }
                Record::Event(event) => {
                    let seq: i64 = sqlx::query_scalar(insert_event_sql!())
                        .bind(&event.kind)
                        .bind(&event.subject)
                        .bind(&event.message)
                        .bind(event.unix_millis)
                        .fetch_one(&mut **tx)
                        .await
                        .map_err(db("appending an event"))?;
                    Ok(rows::to_u64("event seq", seq))
                }
            }
        }
    };
}
