//! `sluicectl stage DATASET`: asks the controller for a staging round,
//! then prints each stage's progress every second until every stage asked
//! has finished the round (or `--timeout` passes).

use std::time::{Duration, Instant};

use sluice_proto::v1;

use crate::args::StageArgs;
use crate::client::{self, CallError, Controller};
use crate::describe::staging_line;
use crate::exit::{self, Exit};

/// How often progress is asked for and printed.
const POLL: Duration = Duration::from_secs(1);

/// Runs `stage`.
pub fn run(controller: &Controller, args: &StageArgs) -> Exit {
    match client::block_on(stage(controller, args)) {
        Ok(exit) => exit,
        Err(e) => client::report(&e),
    }
}

async fn stage(controller: &Controller, args: &StageArgs) -> Result<Exit, CallError> {
    let name = args.dataset.clone();
    let asked = client::call(controller, |mut admin| async move {
        admin.stage_dataset(v1::StageDatasetRequest { name }).await
    })
    .await?;
    exit::say(&format!(
        "staging round {} of {} asked of {}\n",
        asked.round,
        args.dataset,
        asked.stages.join(", ")
    ));
    if args.no_wait {
        return Ok(Exit::Ok);
    }
    let started = Instant::now();
    let mut admin = client::connect(controller).await?;
    loop {
        tokio::time::sleep(POLL).await;
        let request = v1::GetDatasetRequest {
            name: args.dataset.clone(),
        };
        let dataset = admin
            .get_dataset(request)
            .await
            .map_err(|s| CallError::from_status(&controller.server, s))?
            .into_inner();
        let mut finished = 0;
        let mut failed = false;
        for stage in dataset
            .stages
            .iter()
            .filter(|s| asked.stages.contains(&s.stage))
        {
            let progress = stage
                .cache
                .as_ref()
                .and_then(|c| c.staging.as_ref())
                .filter(|p| p.round == asked.round);
            let lost = stage.state == v1::StageState::Lost as i32;
            let state = match progress {
                _ if lost => "lost",
                Some(p) => p.state.as_str(),
                None => "waiting",
            };
            if matches!(state, "done" | "full" | "failed" | "stopped" | "lost") {
                finished += 1;
            }
            failed |= matches!(state, "failed" | "stopped" | "lost");
            let line = match progress {
                _ if lost => "lost: the controller no longer hears from it".to_owned(),
                Some(p) => staging_line(Some(p)),
                None => "waiting for the stage to start the round".to_owned(),
            };
            exit::say(&format!("{}: {line}\n", stage.stage));
        }
        if finished == asked.stages.len() {
            return Ok(if failed { Exit::Failed } else { Exit::Ok });
        }
        if args.timeout > 0 && started.elapsed() >= Duration::from_secs(args.timeout) {
            eprintln!(
                "staging of {} is not finished after {} s: it goes on; watch it with `sluicectl describe dataset {}`",
                args.dataset, args.timeout, args.dataset
            );
            return Ok(Exit::Failed);
        }
    }
}
