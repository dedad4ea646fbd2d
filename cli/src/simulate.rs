//! `sluicectl simulate -f POLICIES --scenario FILE`: an offline what-if.
//! Jobs arrive, change their demand and leave as the scenario says; at
//! every tick the controller's own decision (`sluice_policy::coordination`:
//! demand estimation, allocation, loans, what is pushed) runs on the
//! telemetry the scenario implies (`sluice_policy::simulation`), so what
//! the simulation shows is what the controller would enforce.
//!
//! Policies are read and checked as `validate` reads them, the scenario
//! with the policy language's positioned YAML; printing is [`render`].

mod render;

use std::fs;
use std::io;

use crate::args::SimulateArgs;
use crate::exit::{self, Exit};
use crate::input::{self, InputError, Source};
use crate::validate;
use sluice_policy::simulation::{Scenario, simulate};

/// Runs `simulate`: reads the policies and the scenario, runs it, prints
/// the report on stdout; errors go to stderr.
pub fn run(args: &SimulateArgs) -> Exit {
    let sources = match input::read_all(&args.files, &mut io::stdin().lock()) {
        Ok(sources) => sources,
        Err(e) => return usage(&e),
    };
    let scenario = match fs::read(&args.scenario) {
        Ok(bytes) => Source {
            name: args.scenario.display().to_string(),
            bytes,
        },
        Err(error) => {
            let path = args.scenario.clone();
            return usage(&InputError::Read { path, error });
        }
    };
    let loaded = validate::load(&sources).and_then(|set| {
        let text = validate::decode(&scenario)?;
        let parsed = Scenario::parse(&scenario.name, text).map_err(|e| {
            e.errors()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        })?;
        Ok((set, parsed))
    });
    let (set, scenario) = match loaded {
        Ok(loaded) => loaded,
        Err(errors) => {
            for line in errors {
                eprintln!("{line}");
            }
            return Exit::Failed;
        }
    };
    let report = simulate(&scenario, &set);
    let text = render::render(&report, args.output, args.all_ticks);
    exit::say(&text);
    Exit::Ok
}

fn usage(error: &InputError) -> Exit {
    eprintln!("sluicectl: {error}");
    Exit::Usage
}
