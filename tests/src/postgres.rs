//! A database of its own per test on the Postgres server that
//! `SLUICE_TEST_POSTGRES_URL` names (`scripts/postgres` starts a throwaway
//! one and prints that URL).

use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::{Connection, PgConnection};

/// A fresh, empty database created for one test.
#[derive(Debug)]
pub struct TestDatabase {
    /// The server's URL, as the variable gives it.
    server: String,
    /// The database's name on that server.
    name: String,
    /// The URL of the database itself.
    url: String,
}

impl TestDatabase {
    /// Creates a database for `test`, or returns `None` (skip, with a note
    /// on stderr) when no server is configured; under `CI=true` a missing
    /// server fails the test instead: the Postgres tests must run in CI.
    pub async fn create(test: &str) -> Option<Self> {
        let Ok(server) = std::env::var("SLUICE_TEST_POSTGRES_URL") else {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "SLUICE_TEST_POSTGRES_URL is not set but CI=true: the Postgres tests must run \
                 in CI (scripts/test starts a server with scripts/postgres)"
            );
            // Straight to stderr: eprintln! would be captured and hidden
            // because the test passes.
            let _ = writeln!(
                std::io::stderr(),
                "note: skipping {test}: SLUICE_TEST_POSTGRES_URL is not set \
                 (scripts/postgres starts a throwaway server and prints the URL to use)"
            );
            return None;
        };
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut name = format!(
            "sluice_{}_{}_{stamp}_{test}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        name.truncate(63);
        let mut admin = PgConnection::connect(&server)
            .await
            .expect("connecting to the test server");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut admin)
            .await
            .expect("creating the test database");
        admin.close().await.ok();
        let url = with_database(&server, &name);
        Some(Self { server, name, url })
    }

    /// The database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Drops the database (call it once the test passed: a failed test's
    /// database is left for a look, and the throwaway server goes anyway).
    pub async fn remove(self) {
        let mut admin = PgConnection::connect(&self.server)
            .await
            .expect("connecting to the test server");
        let drop = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut admin)
            .await
            .expect("dropping the test database");
        admin.close().await.ok();
    }
}

/// Returns `url` naming database `name` instead of its own, keeping its
/// options.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    format!("{}/{name}{query}", &base[..path_start])
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn test_database_urls_keep_their_options() {
        assert_eq!(
            with_database("postgres://u@h:1/postgres", "t"),
            "postgres://u@h:1/t"
        );
        assert_eq!(with_database("postgres://u@h:1", "t"), "postgres://u@h:1/t");
        assert_eq!(
            with_database("postgres://u@h/db?sslmode=disable", "t"),
            "postgres://u@h/t?sslmode=disable"
        );
    }
}
