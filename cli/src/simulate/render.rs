//! Printing a [`Report`]: a table of the ticks where something changed (or
//! all of them), then the engine's problems where they change; or the
//! report itself as JSON or YAML, every tick.

use crate::args::Format;
use crate::human;
use crate::table::{Column, Table};
use sluice_policy::Millis;
use sluice_policy::coordination::JobShare;
use sluice_policy::simulation::{JobTick, Report, Tick};

/// The table's columns: the estimated demand, the allocation, what the
/// stages enforce (allocation plus loan, per stage under STAGES) and why.
/// Rates and stages are printed whole: they are what the table is read
/// for.
const COLUMNS: [Column; 9] = [
    Column::whole("TICK"),
    Column::whole("TIME"),
    Column::text("JOB"),
    Column::text("POOL"),
    Column::whole("DEMAND"),
    Column::whole("ALLOCATED"),
    Column::whole("LIMIT"),
    Column::whole("REASON"),
    Column::whole("STAGES"),
];

/// Returns the report as `format` prints it, ending in a newline.
pub fn render(report: &Report, format: Format, all_ticks: bool) -> String {
    match format {
        Format::Table => table(report, all_ticks),
        Format::Json => serde_json::to_string(report).unwrap_or_default() + "\n",
        Format::Yaml => serde_json::to_value(report)
            .map_or_else(|_| String::new(), |v| crate::yaml::to_string(&v)),
    }
}

/// The table, then the problems; each tick shown only when it differs from
/// the one before, unless `all_ticks`.
fn table(report: &Report, all_ticks: bool) -> String {
    let mut rows = Table::new(&COLUMNS);
    let mut problems = Vec::new();
    let mut before: Option<&Tick> = None;
    for tick in &report.ticks {
        let time = match (tick.time_s * 1000.0).round() as u64 {
            0 => "0s".to_owned(),
            millis => Millis(millis).to_string(),
        };
        let shares_changed =
            before.is_none_or(|b| shown(b) != shown(tick) || b.unmanaged != tick.unmanaged);
        if all_ticks || shares_changed {
            for job in &tick.jobs {
                rows.row(job_row(tick.tick, &time, job));
            }
            for job in &tick.unmanaged {
                rows.row(unmanaged_row(tick.tick, &time, job));
            }
        }
        if before.is_none_or(|b| b.problems != tick.problems) && !problems_none(before, tick) {
            problems.push(format!("tick {} ({time}):", tick.tick));
            if tick.problems.is_empty() {
                problems.push("  none".to_owned());
            }
            problems.extend(tick.problems.iter().map(|p| format!("  {p}")));
        }
        before = Some(tick);
    }
    // Read as a report, not fitted to a terminal: a job's or pool's name
    // cut to its first letters would make two jobs' rows alike.
    let mut lines = rows.render(usize::MAX);
    if !problems.is_empty() {
        lines.push(String::new());
        lines.push("PROBLEMS".to_owned());
        lines.extend(problems);
    }
    lines.join("\n") + "\n"
}

/// What the table shows of a tick's jobs (not what they read in between).
fn shown(tick: &Tick) -> Vec<(&str, &JobShare)> {
    tick.jobs
        .iter()
        .map(|j| (j.job.as_str(), &j.share))
        .collect()
}

/// True at the first tick when it has no problems: nothing to say yet.
fn problems_none(before: Option<&Tick>, tick: &Tick) -> bool {
    before.is_none() && tick.problems.is_empty()
}

fn job_row(tick: u64, time: &str, job: &JobTick) -> Vec<String> {
    let share = &job.share;
    let stages: Vec<String> = share
        .stages
        .iter()
        .map(|s| format!("{} {}", s.stage, human::rate(s.enforced_bytes_per_second)))
        .collect();
    vec![
        tick.to_string(),
        time.to_owned(),
        job.job.clone(),
        share.pool.clone(),
        share
            .demand_bytes_per_second
            .map_or_else(|| "greedy".to_owned(), human::rate),
        human::rate(share.bytes_per_second),
        human::rate(share.enforced_bytes_per_second),
        share.reason.to_string(),
        stages.join(", "),
    ]
}

fn unmanaged_row(tick: u64, time: &str, job: &str) -> Vec<String> {
    let mut row = vec![tick.to_string(), time.to_owned(), job.to_owned()];
    row.extend(["-", "-", "-", "-", "unmanaged", "-"].map(str::to_owned));
    row
}

#[cfg(test)]
mod tests {
    use sluice_policy::allocation::Reason;
    use sluice_policy::coordination::StageShare;

    use super::*;

    const MIB: f64 = 1024.0 * 1024.0;

    fn tick(n: u64, rate: f64, problems: &[&str]) -> Tick {
        Tick {
            tick: n,
            time_s: n as f64,
            jobs: vec![JobTick {
                job: "j1".into(),
                wants_bytes_per_second: None,
                share: JobShare {
                    pool: "bench".into(),
                    policy: "j1".into(),
                    bytes_per_second: rate,
                    ops_per_second: None,
                    reason: Reason::WeightedShare,
                    demand_bytes_per_second: None,
                    enforced_bytes_per_second: rate,
                    stages: vec![StageShare {
                        stage: "stage-a".into(),
                        bytes_per_second: rate,
                        enforced_bytes_per_second: rate,
                    }],
                },
                rate_bytes_per_second: rate,
            }],
            unmanaged: if n == 0 { vec!["x".into()] } else { vec![] },
            problems: problems.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    #[test]
    fn only_changes_are_printed_unless_asked() {
        let report = Report {
            tick_s: 1.0,
            ticks: vec![
                tick(0, 20.0 * MIB, &[]),
                tick(1, 20.0 * MIB, &["p"]),
                tick(2, 20.0 * MIB, &["p"]),
                tick(3, 20.0 * MIB, &[]),
            ],
        };
        let text = render(&report, Format::Table, false);
        assert_eq!(
            text,
            "\
TICK  TIME  JOB  POOL   DEMAND  ALLOCATED   LIMIT       REASON          STAGES
0     0s    j1   bench  greedy  20.0 MiB/s  20.0 MiB/s  weighted-share  stage-a 20.0 MiB/s
0     0s    x    -      -       -           -           unmanaged       -
1     1s    j1   bench  greedy  20.0 MiB/s  20.0 MiB/s  weighted-share  stage-a 20.0 MiB/s

PROBLEMS
tick 1 (1s):
  p
tick 3 (3s):
  none
"
        );
        let all = render(&report, Format::Table, true);
        assert_eq!(all.lines().filter(|l| l.contains("stage-a")).count(), 4);
    }
}
