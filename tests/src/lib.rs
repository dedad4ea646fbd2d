//! Support for the workspace's end-to-end tests: locating (and building)
//! the binaries so the tests run the real programs, a Postgres database per
//! test ([`postgres::TestDatabase`]), and polling with a deadline.

pub mod postgres;

use std::collections::HashSet;
use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Returns the path of the workspace binary `name`, building it once per
/// test process so the tests never run a stale one (`cargo test` builds
/// only libraries of other packages).
pub fn binary(name: &str) -> PathBuf {
    static BUILT: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    // target/<profile>/deps/<test-exe> -> target/<profile>
    let exe = std::env::current_exe().expect("the test executable has a path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    let mut built = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if built
        .get_or_insert_with(HashSet::new)
        .insert(name.to_owned())
    {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        // From the workspace root, where every package's binaries are visible.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        build.args(["build", "--bin", name]).current_dir(root);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build
            .status()
            .expect("running cargo build for the end-to-end tests");
        assert!(status.success(), "building {name} failed");
    }
    let path = profile_dir.join(name);
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// Polls `check` until it returns `Some` and returns that, failing the
/// test after `limit`.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`eventually`] for a test without a runtime: polls the blocking `check`.
pub fn eventually_blocking<T>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime for polling")
        .block_on(eventually(what, limit, || std::future::ready(check())))
}

/// Parses a duration flag of the test tools (`5ms`, `1s`) with the
/// project's quantity grammar.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    s.parse::<sluice_policy::Millis>()
        .map(|m| Duration::from_millis(m.0))
        .map_err(|e| e.to_string())
}
