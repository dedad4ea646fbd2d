//! The command line: global flags, and one variant per subcommand with its
//! own argument struct. Help text is wrapped by hand to fit 80 columns
//! (clap wraps only with its `wrap_help` feature, which we do without).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Exit codes, shown at the end of `sluicectl --help`.
const EXIT_CODES: &str = "\
Exit codes:
  0  ok
  1  the command found an error (for validate: an invalid policy)
  2  usage: an unknown flag, a missing argument, a path that cannot be read";

/// What `validate` reads and checks, shown by `sluicectl validate --help`.
const VALIDATE_ABOUT: &str = "\
Check policy documents offline, without a controller.

Reads each FILE whatever its name, every *.yaml and *.yml file directly in
each DIR (sorted by name; subdirectories and names starting with `.` are
skipped), and standard input for `-` (shown as <stdin> in errors). All
documents are validated together as one set, as one apply would be: a
policy may use a pool defined in another file, and two policies that could
both claim a job are found.

Each error is printed on standard error as FILE:LINE:COLUMN: message. The
checks that need several documents run once every document is valid on its
own. On success a one-line summary is printed on standard output.";

/// What `validate`'s exit codes mean.
const VALIDATE_EXIT_CODES: &str = "\
Exit codes:
  0  every document is valid
  1  errors were found (printed as FILE:LINE:COLUMN: message)
  2  usage: no -f, a path that is missing or unreadable, a directory with
     no *.yaml or *.yml file, or `-` given twice";

/// `--server` in `--help`. Short help lines are kept short and long ones
/// wrapped here, by hand, because clap wraps only with `wrap_help`.
const SERVER_HELP: &str = "\
The controller's gRPC address. Not used by validate.
[env: SLUICE_SERVER] [default: http://127.0.0.1:7070]";

/// `--filename` in `validate --help`.
const FILENAME_HELP: &str = "\
A policy file (any name), a directory (its *.yaml and *.yml files),
or - for standard input. Repeat -f to validate several together.";

/// `sluicectl`: the sluice operator's command-line tool.
#[derive(Debug, Parser)]
#[command(
    name = "sluicectl",
    version,
    about = "Operate sluice: check and manage storage policies",
    after_help = EXIT_CODES,
    arg_required_else_help = true,
    max_term_width = 80
)]
pub struct Cli {
    /// The controller's gRPC address (env SLUICE_SERVER)
    #[arg(
        long,
        global = true,
        env = "SLUICE_SERVER",
        hide_env = true,
        default_value = "http://127.0.0.1:7070",
        hide_default_value = true,
        value_name = "URL",
        long_help = SERVER_HELP
    )]
    pub server: String,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check policy files offline, without a controller
    #[command(long_about = VALIDATE_ABOUT, after_help = VALIDATE_EXIT_CODES)]
    Validate(ValidateArgs),
}

/// Arguments of `sluicectl validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// A file, a directory, or - (stdin); repeatable
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "FILE|DIR|-",
        required = true,
        long_help = FILENAME_HELP
    )]
    pub files: Vec<PathBuf>,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
