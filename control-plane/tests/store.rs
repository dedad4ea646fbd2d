//! The store test suite, written once and run against both backends (the
//! idea of quickwit's `metastore_test_suite!`): every test in `store/*.rs` is an
//! async fn taking a [`Fixture`] (a fresh, empty database and the URL to
//! open it again), and `store_test_suite!` instantiates each one as
//! `sqlite::NAME` (a temp file) and `postgres::NAME` (a database of its own
//! on the server named by `SLUICE_TEST_POSTGRES_URL`, so tests run in
//! parallel). Without that variable the Postgres tests are skipped with a
//! note, except when `CI=true`, where they fail: a silent skip in CI would
//! hide a broken backend. `scripts/test` starts a server (`scripts/postgres`).

use sluice_controller::store::{Labels, NewEvent, StageHello, Store, StoreError};
use sluice_tests::postgres::TestDatabase;

// A test crate's root looks for modules beside it, where cargo would take
// them for test crates of their own: hence the paths.
#[path = "store/events.rs"]
mod events;
#[path = "store/policies.rs"]
mod policies;
#[path = "store/stages.rs"]
mod stages;

macro_rules! store_test_suite {
    ($($module:ident::$test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    let fixture = super::Fixture::sqlite().await;
                    super::$module::$test(&fixture).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    let Some(fixture) = super::Fixture::postgres(stringify!($test)).await else {
                        return;
                    };
                    super::$module::$test(&fixture).await;
                    fixture.drop_database().await;
                }
            )*
        }
    };
}

store_test_suite!(
    policies::identical_reapply_creates_no_revision,
    policies::history_keeps_every_revision_in_order,
    policies::delete_records_a_tombstone,
    policies::multi_apply_is_all_or_nothing,
    policies::current_policies_are_the_live_heads,
    policies::concurrent_appliers_never_duplicate_revisions,
    policies::bad_names_are_refused,
    stages::stage_hello_creates_then_updates,
    stages::stage_state_and_acks,
    stages::unknown_stages_are_refused,
    stages::versions_and_state_survive_a_reopen,
    stages::jobs_collect_their_stages,
    stages::stages_and_jobs_not_seen_for_long_are_forgotten,
    events::events_are_ordered_and_paged,
    events::concurrent_events_commit_in_seq_order,
    events::leadership_is_exclusive,
);

/// A fresh, empty database of one backend.
struct Fixture {
    url: String,
    /// Keeps the SQLite file's directory alive.
    _dir: Option<tempfile::TempDir>,
    /// Postgres: the database this test created.
    postgres: Option<TestDatabase>,
}

impl Fixture {
    async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("creating a temp dir");
        let url = format!("sqlite://{}", dir.path().join("store.db").display());
        Self {
            url,
            _dir: Some(dir),
            postgres: None,
        }
    }

    /// Creates a database for one test, or returns `None` (skip) when no
    /// server is configured outside CI.
    async fn postgres(test: &str) -> Option<Self> {
        let database = TestDatabase::create(test).await?;
        Some(Self {
            url: database.url().to_owned(),
            _dir: None,
            postgres: Some(database),
        })
    }

    async fn open(&self) -> Store {
        Store::open(&self.url)
            .await
            .unwrap_or_else(|e| panic!("opening {}: {e:?}", self.url))
    }

    /// Drops this test's database (left behind when the test failed, for a
    /// look; the throwaway server goes anyway).
    async fn drop_database(self) {
        if let Some(database) = self.postgres {
            database.remove().await;
        }
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn hello(id: &str, node: &str, running_version: u64) -> StageHello {
    StageHello {
        id: id.into(),
        node: node.into(),
        labels: labels(&[("zone", "a")]),
        running_version,
    }
}

fn event(kind: &str, n: i64) -> NewEvent {
    NewEvent {
        kind: kind.into(),
        subject: format!("stage/s{n}"),
        message: format!("event number {n}"),
        unix_millis: 1_700_000_000_000 + n,
    }
}

const POOL: &str = "StoragePool";
const JOB: &str = "JobPolicy";

#[tokio::test]
async fn unknown_schemes_are_refused() {
    let err = Store::open("mysql://root:hunter2@db/sluice")
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::UnsupportedUrl { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("mysql://root:***@db/sluice") && !message.contains("hunter2"),
        "{message}"
    );
}

#[tokio::test]
async fn sqlite_file_is_created_in_wal_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    let store = Store::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    assert_eq!(store.backend_name(), "sqlite");
    store.apply_policy(JOB, "p", "t").await.unwrap();
    assert!(path.exists() && dir.path().join("new.db-wal").exists());
    store.close().await;
}

#[tokio::test]
async fn sqlite_urls_without_a_file_are_refused() {
    for url in ["sqlite://", "sqlite:", "sqlite://?mode=rwc"] {
        let err = Store::open(url).await.unwrap_err();
        assert!(matches!(err, StoreError::NoPath { .. }), "{url}: {err:?}");
        assert!(err.is_configuration());
        assert!(
            err.to_string()
                .contains("names no database file: write sqlite://PATH"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn a_read_only_sqlite_store_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.db");
    let store = Store::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    store.apply_policy(JOB, "p", "t").await.unwrap();
    store.close().await;
    // A file that does not exist yet is refused as read-only too, not
    // with SQLite's "unable to open database file".
    let missing = dir.path().join("missing.db");
    for (file, params) in [
        (&path, "mode=ro"),
        (&path, "immutable=1"),
        (&missing, "mode=ro"),
        (&missing, "cache=shared&immutable=true"),
    ] {
        let url = format!("sqlite://{}?{params}", file.display());
        let err = Store::open(&url).await.unwrap_err();
        assert!(matches!(err, StoreError::ReadOnly { .. }), "{url}: {err:?}");
        assert!(err.is_configuration());
        assert!(err.to_string().contains("is read-only"), "{err}");
    }
    // Refusing changed nothing: the store opens read-write as before.
    let store = Store::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    assert_eq!(store.current_policies().await.unwrap().len(), 1);
    store.close().await;
}

#[tokio::test]
async fn a_file_that_is_not_a_sqlite_database_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    let text = "not a database, but an operator's notes\n".repeat(200);
    std::fs::write(&path, &text).unwrap();
    let err = Store::open(&format!("sqlite://{}", path.display()))
        .await
        .unwrap_err();
    assert!(err.is_configuration(), "{err:?}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
}

#[tokio::test]
async fn sqlite_in_memory_keeps_its_data() {
    let store = Store::open("sqlite::memory:").await.unwrap();
    store.apply_policy(JOB, "p", "t").await.unwrap();
    assert_eq!(store.current_policies().await.unwrap().len(), 1);
}

/// A store a later release has migrated (a rollback without restoring the
/// backup) is refused as such, an invalid configuration, not with the
/// migrator's "previously applied but missing".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_from_a_later_release_is_refused() {
    let fixture = Fixture::sqlite().await;
    fixture.open().await.close().await;
    let pool = sqlx::SqlitePool::connect(&fixture.url).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99, 'later', TRUE, X'00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let e = Store::open(&fixture.url).await.unwrap_err();
    assert!(matches!(e, StoreError::Newer { version: 99, .. }), "{e:?}");
    assert!(e.is_configuration());
    assert!(e.to_string().contains("from a later release"), "{e}");
}

/// A replica already running when a later release migrates the shared
/// Postgres store stands by: it does not take the lease on a schema it
/// does not know (it would write to it as leader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_does_not_lead_a_store_a_later_release_migrated() {
    let Some(fixture) = Fixture::postgres("later_release_lease").await else {
        return;
    };
    let store = fixture.open().await;
    let pool = sqlx::PgPool::connect(&fixture.url).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99, 'later', TRUE, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let e = store.try_acquire_leadership().await.unwrap_err();
    assert!(matches!(e, StoreError::Newer { version: 99, .. }), "{e:?}");
    store.close().await;
    fixture.drop_database().await;
}
