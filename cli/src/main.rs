//! `sluicectl`, the sluice operator's command-line tool.
//!
//! `main` only parses the command line and hands each subcommand to its
//! module; every subcommand returns an [`Exit`], the one place where exit
//! codes are decided (0 ok, 1 the command found an error, 2 usage).
//! `validate` and `simulate` work offline; every other subcommand talks to the
//! controller's `AdminService` at `--server` (see `client`) and prints the
//! answer as a table, a description, or JSON/YAML (see `view`).

mod apply;
mod args;
mod client;
mod delete;
mod describe;
mod exit;
mod get;
mod human;
mod input;
mod simulate;
mod stage;
mod table;
mod top;
mod validate;
mod view;
mod yaml;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
use crate::client::Controller;
use crate::exit::Exit;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version are "errors" that go to stdout and exit 0.
            let _ = e.print();
            return if e.use_stderr() {
                Exit::Usage
            } else {
                Exit::Ok
            }
            .into();
        }
    };
    let controller = Controller {
        server: cli.server,
        tls_cert: cli.tls_cert,
        tls_key: cli.tls_key,
        tls_ca: cli.tls_ca,
        token: cli.token,
    };
    match cli.command {
        Command::Validate(args) => validate::run(&args),
        Command::Apply(args) => apply::run(&controller, &args),
        Command::Delete(target) => delete::run(&controller, &target),
        Command::Get(args) => get::run(&controller, &args),
        Command::Describe(target) => describe::run(&controller, &target),
        Command::Top(args) => top::run(&controller, &args),
        Command::Stage(args) => stage::run(&controller, &args),
        Command::Simulate(args) => simulate::run(&args),
    }
    .into()
}
