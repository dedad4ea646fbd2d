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
    let timed_out = || args.timeout > 0 && started.elapsed() >= Duration::from_secs(args.timeout);
    let mut admin = Some(client::connect(controller).await?);
    // While the controller cannot be reached (a restart, a standby taking
    // over), the round goes on on the stages: watching goes on too.
    let mut away = false;
    loop {
        tokio::time::sleep(POLL).await;
        let dataset = match progress(controller, &mut admin, &args.dataset).await {
            Ok(dataset) => dataset,
            Err(e) if passing(&e) => {
                if !std::mem::replace(&mut away, true) {
                    for line in e.lines() {
                        eprintln!("{line}");
                    }
                    eprintln!("the round goes on on the stages; still watching");
                }
                if timed_out() {
                    return Ok(not_finished(args));
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if std::mem::replace(&mut away, false) {
            eprintln!("the controller answers again");
        }
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
        if timed_out() {
            return Ok(not_finished(args));
        }
    }
}

/// The data set's view, over the connection in `admin` (made again after
/// one failed).
async fn progress(
    controller: &Controller,
    admin: &mut Option<client::Admin>,
    dataset: &str,
) -> Result<v1::Dataset, CallError> {
    let mut client = match admin.take() {
        Some(client) => client,
        None => client::connect(controller).await?,
    };
    let request = v1::GetDatasetRequest {
        name: dataset.to_owned(),
    };
    let answer = client
        .get_dataset(request)
        .await
        .map_err(|s| CallError::from_status(&controller.server, s))?;
    *admin = Some(client);
    Ok(answer.into_inner())
}

/// Whether a failed call may pass: the controller out of reach, or one
/// that is not the leader (a standby while it takes over).
fn passing(e: &CallError) -> bool {
    match e {
        CallError::Unreachable { .. } => true,
        CallError::Refused(status) => status.code() == tonic::Code::Unavailable,
        _ => false,
    }
}

/// Says the round is not finished within `--timeout`.
fn not_finished(args: &StageArgs) -> Exit {
    eprintln!(
        "staging of {} is not finished after {} s: it goes on; watch it with `sluicectl describe dataset {}`",
        args.dataset, args.timeout, args.dataset
    );
    Exit::Failed
}
