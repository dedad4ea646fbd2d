//! [`StoreError`]: everything the store can fail with.

/// An error from the store. Database failures keep the `sqlx` error as their
/// [`source`](std::error::Error::source); print the whole chain (`{:#}` with
/// anyhow) to see the cause.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database URL names no backend the store has.
    #[error(
        "unsupported database url `{url}`: write sqlite://PATH (created if absent) \
         or postgres://USER@HOST:PORT/DATABASE"
    )]
    UnsupportedUrl {
        /// The URL, password removed.
        url: String,
    },
    /// The database could not be opened or created.
    #[error("cannot open the {backend} store at `{url}`")]
    Open {
        /// `sqlite` or `postgres`.
        backend: &'static str,
        /// The URL, password removed.
        url: String,
        /// Why.
        #[source]
        source: sqlx::Error,
    },
    /// A SQLite URL that names no database file (`sqlite://`): each
    /// connection would open a private, empty temporary database.
    #[error(
        "`{url}` names no database file: write sqlite://PATH (for example \
         sqlite://sluice.db), or sqlite::memory: for a store that ends with the process"
    )]
    NoPath {
        /// The URL as given.
        url: String,
    },
    /// A SQLite URL that names a directory.
    #[error(
        "`{url}` names a directory, not a database file: write sqlite://DIR/FILE (for \
         example sqlite:///var/lib/sluice/sluice.db)"
    )]
    Directory {
        /// The URL as given.
        url: String,
    },
    /// Another controller (or another store in this process) holds the
    /// SQLite store's lock file: SQLite has no leader lease, so one store
    /// serves one controller.
    #[error(
        "the store {} is in use by another controller{}: a SQLite store serves one \
         controller, so stop that one or give this one another --database-url \
         (several replicas need postgres://)",
        database.display(),
        pid.map_or(String::new(), |pid| format!(" (pid {pid})"))
    )]
    InUse {
        /// The database file.
        database: std::path::PathBuf,
        /// The holder's pid, when it has written it.
        pid: Option<u32>,
    },
    /// The SQLite store's lock file could not be created or locked.
    #[error("cannot lock the store with {}", path.display())]
    Lock {
        /// `<database>.lock`.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The database opened, but refuses writes (`mode=ro`, `immutable=1`,
    /// or a file the controller may not write).
    #[error(
        "the store at `{url}` is read-only: the controller records every change in it, so \
         remove mode=ro or immutable from the URL, or let the controller write the file \
         and its directory"
    )]
    ReadOnly {
        /// The URL, password removed.
        url: String,
    },
    /// The store was migrated by a later release, whose schema this one
    /// does not know (a rollback without restoring the backup).
    #[error(
        "the {backend} store's schema is version {version}, from a later release of \
         sluice-controller than this one (which knows up to {known}): run that release, or \
         restore the backup taken before the upgrade (docs/operations.md, \"Upgrading\")"
    )]
    Newer {
        /// `sqlite` or `postgres`.
        backend: &'static str,
        version: i64,
        known: i64,
    },
    /// The schema could not be brought up to date.
    #[error("cannot migrate the {backend} store schema")]
    Migrate {
        /// `sqlite` or `postgres`.
        backend: &'static str,
        /// Why.
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    /// A delete named a policy that does not exist (never applied, or
    /// already deleted).
    #[error("{kind} `{name}` does not exist")]
    PolicyNotFound {
        /// The kind asked for.
        kind: String,
        /// The name asked for.
        name: String,
    },
    /// An operation named a stage that never said hello.
    #[error("stage `{id}` is not known: a stage must say hello before anything is recorded for it")]
    StageNotFound {
        /// The stage id asked for.
        id: String,
    },
    /// An argument the store refuses (empty name, version out of range).
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// Which argument.
        field: &'static str,
        /// What is wrong and what would be right.
        reason: String,
    },
    /// The connection holding the leader lease is gone (or did not answer
    /// in time): another controller may be leader now.
    #[error(
        "the connection holding the leader lease {}",
        source.as_ref().map_or("did not answer in time".to_owned(), |e| format!("failed: {e}"))
    )]
    LeadershipLost {
        /// Why, when the database said.
        #[source]
        source: Option<sqlx::Error>,
    },
    /// A stored value the store cannot read back.
    #[error("the stored {what} is corrupt: {reason}")]
    Corrupt {
        /// Which value.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The database has not answered `op` for `after` (it is still asked).
    #[error("the database has not answered {op} for {after:?}")]
    NoAnswer {
        /// What the store asked (`the try of the leader lease`).
        op: &'static str,
        after: std::time::Duration,
    },
    /// The database failed while doing `op`.
    #[error("database error while {op}")]
    Database {
        /// What the store was doing (`applying policies`).
        op: &'static str,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },
}

impl StoreError {
    /// Returns whether the error lies in the store's URL or in who else
    /// uses the store, not in the database's health: the operator must
    /// change the configuration (the controller exits 64).
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            Self::UnsupportedUrl { .. }
                | Self::NoPath { .. }
                | Self::Directory { .. }
                | Self::Newer { .. }
                | Self::InUse { .. }
                | Self::ReadOnly { .. }
                | Self::Open {
                    source: sqlx::Error::Configuration(_),
                    ..
                }
        ) || matches!(
            // A file that is not a SQLite database (SQLITE_NOTADB): it
            // failed as the store failing (exit 1), not as a wrong URL.
            self,
            Self::Open { source: sqlx::Error::Database(e), .. }
                | Self::Database { source: sqlx::Error::Database(e), .. }
                if e.code().as_deref() == Some("26")
        ) || matches!(
            // A SQLite file in a directory that is not there, or not ours.
            self,
            Self::Lock { source, .. } if matches!(
                source.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::PermissionDenied
                    | std::io::ErrorKind::ReadOnlyFilesystem
                    | std::io::ErrorKind::NotADirectory
            )
        )
    }
}

/// Returns a `map_err` adapter that names the operation that failed.
pub(super) fn db(op: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Database { op, source }
}

/// Returns `Ok` when an update touched a stage row, else that the stage is
/// unknown.
pub(super) fn found(rows: u64, stage: &str) -> Result<(), StoreError> {
    if rows == 0 {
        Err(StoreError::StageNotFound {
            id: stage.to_owned(),
        })
    } else {
        Ok(())
    }
}

/// Returns the version an `UPDATE stages ... RETURNING` gave, or that the
/// stage is unknown when it updated no row.
pub(super) fn stage_version(version: Option<i64>, stage: &str) -> Result<u64, StoreError> {
    let version = version.ok_or_else(|| StoreError::StageNotFound {
        id: stage.to_owned(),
    })?;
    super::rows::to_u64("settings version", version)
}

/// Returns `url` with any password replaced by `***`, for messages and
/// logs: the one in the authority (`user:pw@`) and a `password` parameter
/// of the query (`?password=pw`, which Postgres URLs take too).
pub(super) fn redact(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut out = redact_authority(base);
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                _ => param.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

fn redact_authority(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redact_hides_only_the_password() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("sqlite://sluice.db"), "sqlite://sluice.db");
        assert_eq!(redact("sqlite:sluice.db"), "sqlite:sluice.db");
        assert_eq!(
            redact("postgres://u@h/db?sslmode=require&password=secret&x=1"),
            "postgres://u@h/db?sslmode=require&password=***&x=1"
        );
        assert_eq!(
            redact("postgres://u:a@h/db?PASSWORD=b"),
            "postgres://u:***@h/db?PASSWORD=***"
        );
        assert_eq!(redact("sqlite://s.db?mode=ro"), "sqlite://s.db?mode=ro");
    }
}
