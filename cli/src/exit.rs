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

/// Writes `text` on standard output. A reader that went away (`| head`)
/// is not worth a panic: there is no one left to tell, and the command
/// ends there, quietly.
pub fn say(text: &str) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_all(text.as_bytes())
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(Exit::Ok as i32);
    }
}
