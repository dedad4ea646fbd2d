//! `sluicectl top`: a live view of jobs and stages, redrawn every second
//! with plain ANSI escapes (home, clear), until Ctrl-C. `--once` prints a
//! single frame without escapes, for scripts and tests.
//!
//! A controller that cannot be reached at start is an error (exit 1); once
//! running, a failed refresh is shown in the frame and retried, so that a
//! controller restart does not end the watch.

use std::fmt::Write as _;
use std::io::{self, IsTerminal, Write};
use std::time::Duration;

use sluice_proto::v1;

use crate::args::TopArgs;
use crate::client::{self, Admin, CallError, Controller};
use crate::exit::{self, Exit};
use crate::human;
use crate::table::{Column, TERMINAL_WIDTH, Table};
use crate::view::{JobView, StageView};

/// How often the live view is redrawn.
const REFRESH: Duration = Duration::from_secs(1);

/// Moves the cursor home and clears the screen.
const CLEAR: &str = "\x1b[H\x1b[2J";
/// Hides the cursor while the view runs, shows it again after.
const HIDE_CURSOR: &str = "\x1b[?25l";
const SHOW_CURSOR: &str = "\x1b[?25h";

/// Runs `top`.
pub fn run(controller: &Controller, args: &TopArgs) -> Exit {
    let server = controller.server.as_str();
    client::block_on(async {
        let admin = match client::connect(controller).await {
            Ok(admin) => admin,
            Err(e) => return client::report(&e),
        };
        if args.once {
            return match snapshot(admin, server).await {
                Ok((jobs, stages)) => {
                    exit::say(&frame(server, &jobs, &stages, human::now_millis()));
                    Exit::Ok
                }
                Err(e) => client::report(&e),
            };
        }
        live(admin, server).await
    })
}

/// Redraws every [`REFRESH`] until Ctrl-C.
async fn live(admin: Admin, server: &str) -> Exit {
    let mut ticks = tokio::time::interval(REFRESH);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut out = io::stdout();
    // Into a file or a pipe: the frames one after another, no control codes.
    let (clear, hide, show) = if out.is_terminal() {
        (CLEAR, HIDE_CURSOR, SHOW_CURSOR)
    } else {
        ("\n", "", "")
    };
    let _ = write!(out, "{hide}");
    let exit = loop {
        // `biased`: polling `ctrl_c` first installs the handler before the
        // first frame, so an early Ctrl-C also quits cleanly.
        tokio::select! {
            biased;
            _ = &mut ctrl_c => break Exit::Ok,
            _ = ticks.tick() => {}
        }
        // A controller slow to answer must not delay quitting.
        let result = tokio::select! {
            biased;
            _ = &mut ctrl_c => break Exit::Ok,
            result = snapshot(admin.clone(), server) => result,
        };
        let now = human::now_millis();
        let text = match result {
            Ok((jobs, stages)) => frame(server, &jobs, &stages, now),
            Err(e) => format!(
                "{}\n\n{e}\nretrying every second\n",
                title(server, None, now)
            ),
        };
        // A closed terminal or pipe ends the watch.
        if write!(out, "{clear}{text}")
            .and_then(|()| out.flush())
            .is_err()
        {
            break Exit::Ok;
        }
    };
    let _ = writeln!(out, "{show}");
    exit
}

/// Asks for the jobs and the stages.
async fn snapshot(
    mut admin: Admin,
    server: &str,
) -> Result<(Vec<JobView>, Vec<StageView>), CallError> {
    let failed = |s| CallError::from_status(server, s);
    let jobs = admin
        .list_jobs(v1::ListJobsRequest {})
        .await
        .map_err(failed)?;
    let stages = admin
        .list_stages(v1::ListStagesRequest {})
        .await
        .map_err(failed)?;
    let jobs = jobs
        .into_inner()
        .jobs
        .into_iter()
        .map(JobView::from)
        .collect();
    let stages = stages
        .into_inner()
        .stages
        .into_iter()
        .map(StageView::from)
        .collect();
    Ok((jobs, stages))
}

/// Returns one frame: a title line, the jobs, the stages.
pub fn frame(server: &str, jobs: &[JobView], stages: &[StageView], now_millis: i64) -> String {
    let mut out = title(server, Some(stages), now_millis);
    out.push_str("\n\n");
    // A job no stage serves now has left (the controller keeps it an hour,
    // for `get jobs` and `describe job`).
    let running: Vec<JobView> = jobs
        .iter()
        .filter(|j| !j.stages.is_empty())
        .cloned()
        .collect();
    let left = jobs.len() - running.len();
    if running.is_empty() {
        out.push_str("no job is running\n");
    } else {
        for line in jobs_table(&running).render(TERMINAL_WIDTH) {
            let _ = writeln!(out, "{line}");
        }
    }
    if left > 0 {
        let _ = writeln!(
            out,
            "{left} job{} left within the hour: sluicectl get jobs",
            if left == 1 { "" } else { "s" }
        );
    }
    out.push('\n');
    if stages.is_empty() {
        out.push_str("no stages yet\n");
    } else {
        for line in stages_table(stages).render(TERMINAL_WIDTH) {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

/// `sluicectl top  http://...  stages: 2 connected, 1 lost  14:03:22 UTC`
/// (and `1 stopped` between them while a stage that ended its session is
/// not back or forgotten yet).
fn title(server: &str, stages: Option<&[StageView]>, now_millis: i64) -> String {
    let seconds = now_millis.div_euclid(1000).rem_euclid(86_400);
    let clock = format!(
        "{:02}:{:02}:{:02} UTC",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    );
    let counts = stages.map_or_else(String::new, |stages| {
        let count = |state: &str| stages.iter().filter(|s| s.state == state).count();
        let (lost, stopped) = (count("lost"), count("stopped"));
        let connected = stages.len() - lost - stopped;
        match stopped {
            0 => format!("  stages: {connected} connected, {lost} lost"),
            _ => format!("  stages: {connected} connected, {stopped} stopped, {lost} lost"),
        }
    });
    format!("sluicectl top  {server}{counts}  {clock}")
}

/// Per job: throughput, stall, its allocation, the limit its stages
/// enforce (the allocation plus capacity lent) and why, and on how many
/// of its stages the settings are acknowledged.
fn jobs_table(jobs: &[JobView]) -> Table {
    let mut t = Table::new(&[
        Column::text("JOB"),
        Column::text("POOL"),
        Column::whole("THROUGHPUT"),
        Column::whole("STALL"),
        Column::whole("ALLOCATED"),
        Column::whole("LIMIT"),
        // Short words (`demand-limited`, `cap`), read whole.
        Column::whole("WHY"),
        Column::whole("ACKED"),
    ]);
    for j in jobs {
        let settings = j.settings.as_ref();
        let allocated = j.allocation.as_ref().map(|a| a.bytes_per_second);
        let acked = j.stages.iter().filter(|s| s.acked).count();
        t.row(vec![
            j.id.clone(),
            j.pool.clone().unwrap_or_else(|| "-".into()),
            human::rate(j.throughput_bytes_per_second),
            human::percent(j.stall_fraction),
            allocated.map_or_else(|| "-".to_owned(), human::rate),
            human::limit(j.limit_shown()),
            human::or_dash(
                j.allocation
                    .as_ref()
                    .map(|a| a.reason.as_str())
                    .or_else(|| settings.and_then(|s| s.reason.as_deref()))
                    .unwrap_or(""),
            ),
            format!("{acked}/{}", j.stages.len()),
        ]);
    }
    t
}

/// Per stage: state and the settings version acknowledged.
fn stages_table(stages: &[StageView]) -> Table {
    let mut t = Table::new(&[
        Column::text("STAGE"),
        Column::text("NODE"),
        Column::whole("STATE"),
        Column::whole("ACKED/DESIRED"),
        Column::whole("SYNC"),
        Column::whole("JOBS"),
    ]);
    for s in stages {
        t.row(vec![
            s.id.clone(),
            s.node.clone(),
            s.state.to_owned(),
            format!("{}/{}", s.acked_version, s.desired_version),
            crate::get::sync_word(s).to_owned(),
            s.jobs.len().to_string(),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_shows_jobs_and_stages() {
        let job = JobView::from(v1::Job {
            id: "resnet50".into(),
            pool: "nfs".into(),
            throughput_bytes_per_second: 812.0 * 1024.0 * 1024.0,
            stall_fraction: 0.032,
            settings: Some(v1::JobSettings {
                bytes_per_second: Some(800 << 20),
                reason: "cap".into(),
                ..v1::JobSettings::default()
            }),
            stages: vec![
                v1::JobStage {
                    acked: true,
                    ..v1::JobStage::default()
                },
                v1::JobStage::default(),
            ],
            allocation: Some(v1::JobAllocation {
                bytes_per_second: 700.0 * 1024.0 * 1024.0,
                reason: "weighted-share".into(),
                ..v1::JobAllocation::default()
            }),
            ..v1::Job::default()
        });
        let stage = StageView::from(v1::Stage {
            id: "node-a-0".into(),
            node: "node-a".into(),
            state: v1::StageState::Lost as i32,
            desired_version: 3,
            acked_version: 3,
            ..v1::Stage::default()
        });
        let text = frame("http://c:7070", &[job], &[stage], 3_723_000);
        assert_eq!(
            text,
            "\
sluicectl top  http://c:7070  stages: 0 connected, 1 lost  01:02:03 UTC

JOB       POOL  THROUGHPUT  STALL  ALLOCATED  LIMIT      WHY             ACKED
resnet50  nfs   812 MiB/s   3.2%   700 MiB/s  800 MiB/s  weighted-share  1/2

STAGE     NODE    STATE  ACKED/DESIRED  SYNC  JOBS
node-a-0  node-a  lost   3/3            yes   0
"
        );
    }

    #[test]
    fn the_title_counts_stopped_stages_apart() {
        let stage = |id: &str, state: v1::StageState| {
            StageView::from(v1::Stage {
                id: id.into(),
                state: state as i32,
                ..v1::Stage::default()
            })
        };
        let stages = [
            stage("a", v1::StageState::Connected),
            stage("b", v1::StageState::Stopped),
            stage("c", v1::StageState::Lost),
        ];
        assert_eq!(
            title("http://c:7070", Some(&stages), 0),
            "sluicectl top  http://c:7070  stages: 1 connected, 1 stopped, 1 lost  00:00:00 UTC"
        );
        assert_eq!(
            title("http://c:7070", Some(&stages[..1]), 0),
            "sluicectl top  http://c:7070  stages: 1 connected, 0 lost  00:00:00 UTC"
        );
    }

    #[test]
    fn a_capped_job_whose_trainers_left_shows_its_policy_cap() {
        let job = JobView::from(v1::Job {
            id: "idle".into(),
            policy: "capped".into(),
            limits: Some(v1::JobLimits {
                limit_bytes_per_second: Some(1 << 20),
                ..v1::JobLimits::default()
            }),
            ..v1::Job::default()
        });
        assert_eq!(job.settings, None);
        for table in [
            jobs_table(std::slice::from_ref(&job)),
            crate::get::jobs_table(&[job]),
        ] {
            let text = table.render(TERMINAL_WIDTH).join("\n");
            assert!(text.contains("1.00 MiB/s"), "{text}");
            assert!(!text.contains("unlimited"), "{text}");
        }
    }

    #[test]
    fn an_empty_controller_says_so() {
        let text = frame("http://c:7070", &[], &[], 0);
        assert!(
            text.contains("no job is running\n\nno stages yet\n"),
            "{text}"
        );
    }

    #[test]
    fn jobs_no_stage_serves_are_counted_not_shown() {
        let serving = v1::JobStage::default();
        let running = JobView::from(v1::Job {
            id: "resnet".into(),
            stages: vec![serving],
            ..v1::Job::default()
        });
        let gone = |id: &str| {
            JobView::from(v1::Job {
                id: id.into(),
                ..v1::Job::default()
            })
        };
        let text = frame(
            "http://c:7070",
            &[running, gone("bert"), gone("t5")],
            &[],
            0,
        );
        assert!(text.contains("resnet") && !text.contains("bert"), "{text}");
        assert!(
            text.contains("2 jobs left within the hour: sluicectl get jobs"),
            "{text}"
        );
        let text = frame("http://c:7070", &[gone("bert")], &[], 0);
        assert!(
            text.contains("no job is running\n1 job left within the hour"),
            "{text}"
        );
    }
}
