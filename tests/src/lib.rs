//! Support for the end-to-end tests in `tests/`: locating (and building) the
//! workspace's binaries so the tests run the real programs.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Once;

/// Returns the path of the workspace binary `name`, building every binary of
/// the workspace once per test process so the tests never run a stale one.
pub fn binary(name: &str) -> PathBuf {
    static BUILD: Once = Once::new();
    // target/<profile>/deps/<test-exe> -> target/<profile>
    let exe = std::env::current_exe().expect("the test executable has a path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    BUILD.call_once(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build
            .args(["build", "--workspace", "--bins"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build
            .status()
            .expect("running cargo build for the end-to-end tests");
        assert!(status.success(), "building the workspace binaries failed");
    });
    let path = profile_dir.join(name);
    assert!(path.exists(), "{} was not built", path.display());
    path
}
