//! `sluicectl simulate -f POLICIES --scenario FILE`: an offline what-if.
//! Jobs arrive, change their demand and leave as the scenario says; at
//! every tick the allocation engine the controller runs shares the pools
//! among them, from a snapshot built the way the controller builds its
//! own, so what the simulation shows is what the controller would do.
//!
//! Policies are read and checked as `validate` reads them; the scenario
//! is [`scenario`], running it [`timeline`], printing it [`render`].

mod render;
mod scenario;
mod timeline;

use std::fs;
use std::io::{self, Write};

use crate::args::SimulateArgs;
use crate::exit::Exit;
use crate::input::{self, InputError, Source};
use crate::validate;
use scenario::Scenario;

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
        let parsed = Scenario::parse(&scenario.name, text).map_err(|e| vec![e])?;
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
    let report = timeline::simulate(&scenario, &set);
    let text = render::render(&report, args.output, args.all_ticks);
    // A closed pipe (`| head`) is not worth a panic.
    let _ = io::stdout().lock().write_all(text.as_bytes());
    Exit::Ok
}

fn usage(error: &InputError) -> Exit {
    eprintln!("sluicectl: {error}");
    Exit::Usage
}
