//! `sluicectl`, the sluice operator's command-line tool.
//!
//! `main` only parses the command line and hands each subcommand to its
//! module; every subcommand returns an [`Exit`], the one place where exit
//! codes are decided (0 ok, 1 the command found an error, 2 usage).

mod args;
mod exit;
mod input;
mod validate;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
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
    match cli.command {
        Command::Validate(args) => validate::run(&args),
    }
    .into()
}
