//! The process's exit codes, decided in one place.

use std::process::ExitCode;

/// How `sluicectl` ends. Scripts rely on these codes; they are listed in
/// `sluicectl --help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The command did what was asked (for `validate`: every document is
    /// valid).
    Ok = 0,
    /// The command ran and found a problem (an invalid policy, a request
    /// the controller refused).
    Failed = 1,
    /// The command line was wrong: an unknown flag, a missing argument, a
    /// path that cannot be read.
    Usage = 2,
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> Self {
        ExitCode::from(exit as u8)
    }
}
