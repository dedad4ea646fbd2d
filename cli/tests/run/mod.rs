//! Running the real `sluicectl` binary from the integration tests.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// What one run of `sluicectl` did.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `sluicectl` in `dir` with `args`, `stdin` piped in, and no
/// `SLUICE_SERVER` inherited from the caller's environment.
pub fn sluicectl(dir: &Path, args: &[&str], stdin: &str) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluicectl"))
        .args(args)
        .current_dir(dir)
        .env_remove("SLUICE_SERVER")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sluicectl starts");
    // A usage error exits before reading stdin: a broken pipe is fine.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    let Output {
        status,
        stdout,
        stderr,
    } = child.wait_with_output().unwrap();
    Run {
        code: status.code().expect("sluicectl exits, not killed"),
        stdout: String::from_utf8(stdout).unwrap(),
        stderr: String::from_utf8(stderr).unwrap(),
    }
}
