//! Schema migrations: each backend's steps, numbered from 1 in order, and
//! running them.

use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};

use super::StoreError;

/// A backend's migrations in order: a description and the SQL of each.
pub(super) type Steps = [(&'static str, &'static str)];

/// The migrator of `steps` (step N is version N).
pub(super) fn migrator(steps: &Steps) -> Migrator {
    Migrator::with_migrations(
        (1..)
            .zip(steps)
            .map(|(version, (description, sql))| {
                Migration::new(
                    version,
                    (*description).into(),
                    MigrationType::Simple,
                    sql.into_sql_str(),
                    false,
                )
            })
            .collect(),
    )
}

/// The schema version `steps` bring a store to.
pub(super) fn latest(steps: &Steps) -> i64 {
    steps.len() as i64
}

/// Brings the schema up to date with `steps`; a store migrated by a later
/// release (one that has applied a version `steps` do not hold) is
/// refused as such.
pub(super) async fn migrate<'a, A>(
    steps: &Steps,
    pool: A,
    backend: &'static str,
) -> Result<(), StoreError>
where
    A: sqlx::Acquire<'a>,
    <A::Connection as std::ops::Deref>::Target: sqlx::migrate::Migrate,
{
    match migrator(steps).run(pool).await {
        Ok(()) => Ok(()),
        Err(sqlx::migrate::MigrateError::VersionMissing(version)) => Err(StoreError::Newer {
            backend,
            version,
            known: latest(steps),
        }),
        Err(source) => Err(StoreError::Migrate { backend, source }),
    }
}
