//! The command line: global flags, and one variant per subcommand with its
//! own argument struct. Help text is wrapped by hand to fit 80 columns
//! (clap wraps only with its `wrap_help` feature, which we do without).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Exit codes, shown at the end of `sluicectl --help`.
const EXIT_CODES: &str = "\
Exit codes:
  0  ok
  1  the command found an error: an invalid policy, a request the
     controller refused, a controller that cannot be reached
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
The controller's gRPC address. Not used by validate or
simulate. An https:// server requires mutual TLS: give
--tls-cert, --tls-key and --tls-ca.
[env: SLUICE_SERVER] [default: http://127.0.0.1:7070]";

/// `--tls-cert`, `--tls-key` and `--tls-ca` in `--help`.
const TLS_CERT_HELP: &str = "\
The client certificate chain (PEM) sluicectl presents to an
https:// server. [env: SLUICE_TLS_CERT]";
const TLS_KEY_HELP: &str = "\
The private key (PEM) of --tls-cert. [env: SLUICE_TLS_KEY]";
const TLS_CA_HELP: &str = "\
The CA certificates (PEM) that must have signed the
controller's certificate. [env: SLUICE_TLS_CA]";

/// `--token` in `--help`.
const TOKEN_HELP: &str = "\
The bearer token sent to the controller's admin API: an admin
token for apply and delete, a read or admin token for the
rest. Needed when the controller has a --token-file. Prefer
the variable: a flag shows in the process list.
[env: SLUICE_TOKEN]";

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

    /// Client certificate, PEM (env SLUICE_TLS_CERT)
    #[arg(
        long,
        global = true,
        env = "SLUICE_TLS_CERT",
        hide_env = true,
        value_name = "FILE",
        long_help = TLS_CERT_HELP
    )]
    pub tls_cert: Option<PathBuf>,

    /// Key of --tls-cert, PEM (env SLUICE_TLS_KEY)
    #[arg(
        long,
        global = true,
        env = "SLUICE_TLS_KEY",
        hide_env = true,
        value_name = "FILE",
        long_help = TLS_KEY_HELP
    )]
    pub tls_key: Option<PathBuf>,

    /// CA of the controller, PEM (env SLUICE_TLS_CA)
    #[arg(
        long,
        global = true,
        env = "SLUICE_TLS_CA",
        hide_env = true,
        value_name = "FILE",
        long_help = TLS_CA_HELP
    )]
    pub tls_ca: Option<PathBuf>,

    /// Bearer token of the admin API (env SLUICE_TOKEN)
    #[arg(
        long,
        global = true,
        env = "SLUICE_TOKEN",
        hide_env = true,
        hide_env_values = true,
        value_name = "TOKEN",
        long_help = TOKEN_HELP
    )]
    pub token: Option<String>,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// What `apply` does, shown by `sluicectl apply --help`.
const APPLY_ABOUT: &str = "\
Send policy documents to the controller, all in one request.

Reads -f arguments as validate does. The controller stores all documents or
none: on an invalid document nothing changes, each problem is printed on
standard error as FILE:LINE:COLUMN: message, and the exit code is 1. On
success one line per document says what happened, for example
`pool/shared-nfs created (revision 1)`.";

/// `--filename` in `apply --help`.
const APPLY_FILENAME_HELP: &str = "\
A policy file (any name), a directory (its *.yaml and *.yml files),
or - for standard input. Repeat -f to apply several in one request.";

/// What `top` shows, shown by `sluicectl top --help`.
const TOP_ABOUT: &str = "\
A live view of the jobs and stages, redrawn every second: per job the
throughput, the time its trainers stall, the rate limit in force and why;
per stage the settings version it acknowledged. Ctrl-C quits.";

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check policy files offline, without a controller
    #[command(long_about = VALIDATE_ABOUT, after_help = VALIDATE_EXIT_CODES)]
    Validate(ValidateArgs),
    /// Apply policy files to the controller
    #[command(long_about = APPLY_ABOUT)]
    Apply(ApplyArgs),
    /// Delete a policy
    #[command(subcommand)]
    Delete(DeleteTarget),
    /// List pools, policies, jobs, stages or data sets
    Get(GetArgs),
    /// Show one job, stage or pool in detail
    #[command(subcommand)]
    Describe(DescribeTarget),
    /// Watch jobs and stages live
    #[command(long_about = TOP_ABOUT)]
    Top(TopArgs),
    /// Load a data set into the node caches of the stages serving it
    #[command(long_about = STAGE_ABOUT)]
    Stage(StageArgs),
    /// Replay a scenario through the allocation engine, offline
    #[command(long_about = SIMULATE_ABOUT)]
    Simulate(SimulateArgs),
}

/// Arguments of `sluicectl apply`.
#[derive(Debug, Args)]
pub struct ApplyArgs {
    /// A file, a directory, or - (stdin); repeatable
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "FILE|DIR|-",
        required = true,
        long_help = APPLY_FILENAME_HELP
    )]
    pub files: Vec<PathBuf>,

    /// Show what would change without storing anything
    #[arg(long)]
    pub dry_run: bool,
}

/// What `sluicectl delete` deletes: a policy by name whatever its kind,
/// or one of a kind (the words `apply` prints: `pool/shared-nfs`,
/// `jobpolicy/vision`, `datasetcache/imagenet`), for a name that several
/// kinds share.
#[derive(Debug, Subcommand)]
pub enum DeleteTarget {
    /// Delete a policy of any kind by name
    Policy {
        /// The policy's metadata.name
        name: String,
    },
    /// Delete a StoragePool policy
    Pool {
        /// The pool's metadata.name
        name: String,
    },
    /// Delete a JobPolicy
    Jobpolicy {
        /// The policy's metadata.name
        name: String,
    },
    /// Delete a DatasetCache policy
    Datasetcache {
        /// The policy's metadata.name
        name: String,
    },
}

/// Arguments of `sluicectl get`.
#[derive(Debug, Args)]
pub struct GetArgs {
    /// What to list
    #[arg(value_enum)]
    pub what: Listing,

    /// Output format: a table for people, json or yaml for scripts
    #[arg(
        short = 'o',
        long,
        value_enum,
        value_name = "FORMAT",
        default_value_t = Format::Table
    )]
    pub output: Format,
}

/// The collections `get` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Listing {
    /// Storage pools and how they are shared
    Pools,
    /// Stored policies, current revision of each
    Policies,
    /// Jobs some stage reports
    Jobs,
    /// Stages, connected or lost
    Stages,
    /// Data sets served or given a cache policy, and their node caches
    Datasets,
}

/// How `get` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns, 80 wide
    Table,
    /// A JSON array, stable for scripts
    Json,
    /// The same as YAML
    Yaml,
}

/// What `sluicectl describe` shows.
#[derive(Debug, Subcommand)]
pub enum DescribeTarget {
    /// A job: policy, limits, settings in force and per stage
    Job {
        /// The job's id
        name: String,
    },
    /// A stage: state, settings versions, jobs
    Stage {
        /// The stage's id
        name: String,
    },
    /// A pool: capacity, allocation, jobs
    Pool {
        /// The pool's name
        name: String,
    },
    /// A data set: its cache policy, cache use and staging per stage
    Dataset {
        /// The data set's name, as the stages serve it
        name: String,
    },
}

/// What `stage` does, shown by `sluicectl stage --help`.
const STAGE_ABOUT: &str = "\
Load a data set into the node caches of the stages serving it.

Asks the controller for a new staging round of DATASET: every connected
stage that serves it reads the samples its cache does not hold yet, until
the data set is cached or its share of the cache is full. Staging reads are
a job of their own (`staging:DATASET`) in the pool the data set's
DatasetCache policy names under spec.staging, capped at its rate, so they
cannot starve running jobs. Progress is printed every second until every
stage has finished (--no-wait: return at once).

Exit codes: 0 staged, 1 refused (no DatasetCache with spec.staging, no
stage serving the data set, none of those with a node cache), a stage
failed, or --timeout passed.";

/// Arguments of `sluicectl stage`.
#[derive(Debug, Args)]
pub struct StageArgs {
    /// The data set's name, as the stages serve it
    #[arg(value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub dataset: String,

    /// Return once the round is asked for, without waiting
    #[arg(long)]
    pub no_wait: bool,

    /// Give up waiting after this long: seconds (`60`) or a duration
    /// (`60s`, `1500ms`); 0: never
    #[arg(long, value_name = "SECONDS", default_value_t = 0, value_parser = seconds)]
    pub timeout: u64,
}

/// Whole seconds from `60`, `60s` or `1500ms` (rounded up).
fn seconds(text: &str) -> Result<u64, String> {
    if let Ok(n) = text.trim().parse::<u64>() {
        return Ok(n);
    }
    sluice_policy::Millis::parse(text)
        .map(|m| m.0.div_ceil(1000))
        .map_err(|e| format!("{e}: give seconds, such as 60 or 60s"))
}

/// Arguments of `sluicectl top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// Print one frame, without clearing the screen, and exit
    #[arg(long)]
    pub once: bool,
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

/// What `simulate` does, shown by `sluicectl simulate --help`.
const SIMULATE_ABOUT: &str = "\
Replay a scenario through the allocation engine, offline.

Reads the policies as validate does (-f) and a scenario file: jobs with
labels and stages, when they arrive and leave, and their demand over time
(see docs/policies.md, Simulating). At every tick the engine the controller
runs shares the pools among the running jobs. The table shows the ticks
where an allocation changed (--all-ticks: every tick), then the engine's
problems where they change; -o json prints every tick.

Exit codes: 0 ok, 1 an invalid policy or scenario (FILE:LINE:COLUMN:
message), 2 usage: a path that cannot be read.";

/// `--filename` in `simulate --help`.
const SIMULATE_FILENAME_HELP: &str = "\
A policy file (any name), a directory (its *.yaml and *.yml files),
or - for standard input. Repeat -f to simulate several together.";

/// Arguments of `sluicectl simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// A file, a directory, or - (stdin); repeatable
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "FILE|DIR|-",
        required = true,
        long_help = SIMULATE_FILENAME_HELP
    )]
    pub files: Vec<PathBuf>,

    /// The scenario: jobs, their stages, demand and times
    #[arg(long, value_name = "FILE")]
    pub scenario: PathBuf,

    /// Output format: a table of changes, or every tick as json or yaml
    #[arg(
        short = 'o',
        long,
        value_enum,
        value_name = "FORMAT",
        default_value_t = Format::Table
    )]
    pub output: Format,

    /// Print every tick in the table, not only those that change
    #[arg(long)]
    pub all_ticks: bool,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_staging_timeout_is_seconds_or_a_duration_and_the_data_set_is_named() {
        assert_eq!(seconds("60"), Ok(60));
        assert_eq!(seconds("60s"), Ok(60));
        assert_eq!(seconds("1500ms"), Ok(2));
        assert!(
            seconds("soon")
                .unwrap_err()
                .contains("give seconds, such as 60 or 60s")
        );
        let parsed = Cli::try_parse_from(["sluicectl", "stage", "ds", "--timeout", "90s"]).unwrap();
        assert!(matches!(
            parsed.command,
            Command::Stage(StageArgs { timeout: 90, .. })
        ));
        assert!(Cli::try_parse_from(["sluicectl", "stage", ""]).is_err());
    }
}
