//! The leader lease: which controller replica pushes settings.
//!
//! # HA plan
//!
//! With SQLite there is one controller replica and it is always the leader:
//! the store's lock file (`file_lock.rs`) refuses a second controller on
//! the same database when it opens the store, so no lease is needed.
//!
//! With Postgres, every replica opens the same database; the leader is the
//! one holding a session-level advisory lock ([`LOCK_KEY`], taken with
//! `pg_try_advisory_lock`) on a connection of its own, outside the pool, so
//! the lock lives exactly as long as that session:
//!
//! - Standbys try the lease every tick ([`Leadership::wait`]). They run no
//!   control loop and push no settings, they refuse stage sessions and
//!   admin calls, and their `/readyz` fails, so the Kubernetes Service sends
//!   stages and `sluicectl` to the leader only.
//! - The leader calls [`Leadership::check`] every tick with a timeout shorter
//!   than the tick. An error means the session is gone or unreachable:
//!   the leader stops deciding and pushing at once, keeps its stage
//!   sessions, refuses changes, and tries the lease again every tick; it
//!   leads on if it gets it, and stands by (ending its sessions, so the
//!   stages move to the leader) if another replica holds it.
//! - When a leader dies or is partitioned from Postgres, the server ends its
//!   session (on TCP reset at once, otherwise after the server's keepalive
//!   or `tcp_user_timeout`), which frees the lock for a standby. A leader
//!   that stops without its connection closing (a paused or frozen
//!   process, whose kernel still answers for the socket) stops its checks:
//!   the lease session carries an `idle_session_timeout` of three ticks
//!   (at least [`IDLE_LEASE_MIN`]), so the server ends it then.
//! - A new leader reloads desired settings from the store and re-pushes;
//!   stages reconnect to it through the Service once it turns ready.
//!   Settings versions come from the database counter, so they keep
//!   increasing across leaders. Provided a stage refuses a version at or
//!   below the one it runs (a rule the stage side must keep), a deposed
//!   leader that pushes once more before its next check cannot roll a
//!   stage back.
//!
//! Left for later: a server-side `tcp_user_timeout` / keepalive setting
//! recommendation for the Helm chart, and fencing writes with the lease
//! (today only settings pushes are fenced, by versions).

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::error::db;
use super::{Store, StoreError};

/// The advisory lock key every sluice controller contends for: "sluice" in
/// ASCII, then 1.
pub const LOCK_KEY: i64 = 0x736c_7569_6365_0001;

/// The least time a lease session may sit without a check before the
/// server ends it (see the module's notes).
pub const IDLE_LEASE_MIN: Duration = Duration::from_secs(10);

/// Proof of leadership while held. Dropping it gives the lease up (for
/// Postgres, by closing its session); [`Leadership::release`] does so
/// promptly and waits for it.
pub struct Leadership {
    inner: Inner,
}

enum Inner {
    /// SQLite: a single replica, leader for as long as it runs.
    Embedded,
    /// Postgres: the session holding the advisory lock, and whether it
    /// has its idle limit yet.
    Postgres(PgConnection, bool),
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            Inner::Embedded => "embedded",
            Inner::Postgres(..) => "postgres advisory lock",
        };
        f.debug_struct("Leadership").field("lease", &kind).finish()
    }
}

/// How long a try of the lease may go unanswered before a standby says
/// that the store does not answer (at least a tick).
const SLOW_STORE: Duration = Duration::from_secs(2);

impl Leadership {
    pub(super) fn embedded() -> Self {
        Self {
            inner: Inner::Embedded,
        }
    }

    /// Takes the lease on `conn` (a connection of its own, never returned to
    /// a pool) if no other session holds it.
    pub(super) async fn try_acquire(mut conn: PgConnection) -> Result<Option<Self>, StoreError> {
        let acquired: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(LOCK_KEY)
            .fetch_one(&mut conn)
            .await
            .map_err(db("trying the leader lease"))?;
        if acquired {
            Ok(Some(Self {
                inner: Inner::Postgres(conn, false),
            }))
        } else {
            // Closing is best effort: the session held nothing.
            let _ = conn.close().await;
            Ok(None)
        }
    }

    /// Tries the lease on `store` every `every` until it is taken, and
    /// returns it; `None` when `cancel` fires first. A store that cannot be
    /// reached is reported and tried again: a standby keeps waiting.
    /// `reached` hears after every try whether the store answered (`None`)
    /// or why not.
    pub async fn wait(
        store: &Store,
        every: Duration,
        cancel: &CancellationToken,
        reached: impl Fn(Option<&StoreError>),
    ) -> Option<Self> {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut told: Option<(String, std::time::Instant)> = None;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return None,
                _ = interval.tick() => {}
            }
            // A store that does not answer at once is said to be away while
            // the try goes on (a pool tries for seconds before it fails),
            // rather than that another controller leads.
            let attempt = store.try_acquire_leadership();
            tokio::pin!(attempt);
            let tried = tokio::select! {
                tried = &mut attempt => tried,
                () = tokio::time::sleep(every.max(SLOW_STORE)) => {
                    reached(Some(&StoreError::NoAnswer {
                        op: "the try of the leader lease",
                        after: every.max(SLOW_STORE),
                    }));
                    attempt.await
                }
            };
            reached(tried.as_ref().err());
            match tried {
                Ok(Some(leadership)) => return Some(leadership),
                Ok(None) => debug!("another controller still holds the leader lease"),
                // The same failure each tick is told once a minute.
                Err(e) => {
                    let text = e.to_string();
                    if told.as_ref().is_none_or(|(said, at)| {
                        *said != text || at.elapsed() >= Duration::from_secs(60)
                    }) {
                        warn!(error = %text, "cannot try the leader lease; trying again");
                        told = Some((text, std::time::Instant::now()));
                    }
                }
            }
        }
    }

    /// Checks that the lease is still held: the session holding it answers
    /// within three quarters of `tick` (the leader checks once a tick).
    /// Fails with [`StoreError::LeadershipLost`] otherwise; the caller must
    /// then stop acting as leader. The first check gives the session its
    /// idle limit.
    pub async fn check(&mut self, tick: Duration) -> Result<(), StoreError> {
        let Inner::Postgres(conn, bounded) = &mut self.inner else {
            return Ok(());
        };
        let timeout = tick * 3 / 4;
        if !*bounded {
            *bounded = true;
            let limit = (tick * 3).max(IDLE_LEASE_MIN).as_millis();
            let set = sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
                .bind(limit.to_string());
            match tokio::time::timeout(timeout, set.execute(&mut *conn)).await {
                Ok(Ok(_)) => {}
                // Before PostgreSQL 14: a frozen leader keeps the lease
                // until its connection closes.
                Ok(Err(e)) => {
                    warn!(error = %e, "the store cannot end a frozen leader's lease session (idle_session_timeout)");
                }
                Err(_elapsed) => return Err(StoreError::LeadershipLost { source: None }),
            }
        }
        match tokio::time::timeout(timeout, conn.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::LeadershipLost { source: Some(e) }),
            Err(_elapsed) => Err(StoreError::LeadershipLost { source: None }),
        }
    }

    /// Gives the lease up now, so a standby can take over without waiting
    /// for this session to end.
    pub async fn release(self) -> Result<(), StoreError> {
        let Inner::Postgres(mut conn, _) = self.inner else {
            return Ok(());
        };
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(LOCK_KEY)
            .execute(&mut conn)
            .await
            .map_err(db("releasing the leader lease"))?;
        conn.close().await.map_err(db("releasing the leader lease"))
    }
}
