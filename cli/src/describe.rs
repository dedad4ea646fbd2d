//! `sluicectl describe job|stage|pool NAME`: one object in detail, as
//! aligned `Key: value` lines with indented sections, for people.

use std::fmt::Write as _;

use sluice_policy::coordination::PRELOAD_ROUND;
use sluice_proto::v1;

use crate::args::DescribeTarget;
use crate::client::{self, CallError, Controller};
use crate::exit::{self, Exit};
use crate::human;
use crate::table::{Column, TERMINAL_WIDTH, Table};
use crate::view::{JobView, PoolView, SettingsView, StageView};

/// Runs `describe`: asks the controller for one object, prints it.
pub fn run(controller: &Controller, target: &DescribeTarget) -> Exit {
    match client::block_on(fetch(controller, target)) {
        Ok(text) => {
            exit::say(&text);
            Exit::Ok
        }
        Err(e) => client::report(&e),
    }
}

async fn fetch(controller: &Controller, target: &DescribeTarget) -> Result<String, CallError> {
    let mut admin = client::connect(controller).await?;
    let failed = |s| CallError::from_status(&controller.server, s);
    let now = human::now_millis();
    let text = match target {
        DescribeTarget::Job { name } => {
            let request = v1::GetJobRequest { id: name.clone() };
            let job = admin.get_job(request).await.map_err(failed)?;
            job_text(&JobView::from(job.into_inner()))
        }
        DescribeTarget::Stage { name } => {
            let request = v1::GetStageRequest { id: name.clone() };
            let stage = admin.get_stage(request).await.map_err(failed)?;
            stage_text(&StageView::from(stage.into_inner()), now)
        }
        DescribeTarget::Pool { name } => {
            let request = v1::GetPoolRequest { name: name.clone() };
            let pool = admin.get_pool(request).await.map_err(failed)?;
            pool_text(&PoolView::from(pool.into_inner()))
        }
        DescribeTarget::Dataset { name } => {
            let request = v1::GetDatasetRequest { name: name.clone() };
            let dataset = admin.get_dataset(request).await.map_err(failed)?;
            dataset_text(&dataset.into_inner())
        }
    };
    Ok(text)
}

/// Lines of `Key: value`, values aligned within each block.
#[derive(Debug, Default)]
struct Fields {
    lines: Vec<(String, String)>,
}

impl Fields {
    fn add(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.lines.push((format!("{key}:"), value.into()));
        self
    }

    /// Appends the block to `out`, each line indented by `indent`.
    fn write(&self, out: &mut String, indent: usize) {
        let width = self.lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (key, value) in &self.lines {
            let line = format!("{:indent$}{key:width$} {value}", "");
            let _ = writeln!(out, "{}", line.trim_end());
        }
    }
}

/// The multi-line view of a job.
pub fn job_text(job: &JobView) -> String {
    let mut out = String::new();
    let mut head = Fields::default();
    head.add("Job", &job.id)
        .add("Labels", human::labels(&job.labels))
        .add("Policy", job.policy.as_deref().unwrap_or("none (defaults)"))
        .add("Pool", job.pool.as_deref().unwrap_or("none"))
        .add(
            "Throughput",
            // What the trainers got, and of it what storage gave (the node
            // cache's hits are not: a pool and a limit count only that).
            format!(
                "{}, {:.0} samples/s ({} from storage)",
                human::rate(job.throughput_bytes_per_second),
                job.throughput_samples_per_second,
                human::rate(job.storage_bytes_per_second),
            ),
        )
        .add("Stall", human::percent(job.stall_fraction));
    head.write(&mut out, 0);

    let l = &job.limits;
    if job.policy.is_none() {
        // Nothing declared: no weight, guarantee or limit to show (a
        // weight of 0, which no policy may declare, was shown).
        out.push_str(
            "Declared by the policy: no policy selects it (its stages' own limits apply)\n",
        );
    } else {
        out.push_str("Declared by the policy:\n");
        let mut limits = Fields::default();
        limits
            .add(
                "Guarantee",
                human::limit(l.guarantee_bytes_per_second).replace("unlimited", "none"),
            )
            .add("Limit", human::limit(l.limit_bytes_per_second))
            .add(
                "Ops guarantee",
                human::ops_limit(l.guarantee_ops_per_second).replace("unlimited", "none"),
            )
            .add("Ops limit", human::ops_limit(l.limit_ops_per_second))
            .add("Weight", format!("{}", l.weight))
            .add("Priority", l.priority.to_string());
        limits.write(&mut out, 2);
    }

    out.push_str("Allocated (all stages):\n");
    match &job.allocation {
        Some(a) => {
            let mut fields = Fields::default();
            fields
                .add("Bandwidth", human::rate(a.bytes_per_second))
                .add("Reason", &a.reason)
                .add(
                    "Demand",
                    a.demand_bytes_per_second
                        .map_or_else(|| "greedy (wants more than it has)".to_owned(), human::rate),
                )
                .add("Enforced", human::rate(a.enforced_bytes_per_second));
            if let Some(ops) = a.ops_per_second {
                fields.add("Ops", format!("{ops:.0} ops/s"));
            }
            fields.write(&mut out, 2);
        }
        None if job.stages.is_empty() => {
            out.push_str("  nothing: no stage serves the job now (its trainers left)\n");
        }
        None => out.push_str("  nothing (no policy selects the job, or not computed yet)\n"),
    }

    out.push_str("In force (all stages):\n");
    match &job.settings {
        Some(settings) => settings_fields(settings).write(&mut out, 2),
        None if job.stages.is_empty() => out.push_str("  nothing: no stage serves the job now\n"),
        None => out.push_str("  nothing pushed yet\n"),
    }

    out.push_str("Stages:\n");
    if job.stages.is_empty() {
        out.push_str("  none\n");
        return out;
    }
    let mut t = Table::new(&[
        Column::text("STAGE"),
        Column::whole("ACKED"),
        Column::whole("THROUGHPUT"),
        Column::whole("STALL"),
        Column::whole("LIMIT"),
        Column::text("REASON"),
    ]);
    for s in &job.stages {
        let settings = s.settings.as_ref();
        t.row(vec![
            s.stage_id.clone(),
            if s.acked { "yes" } else { "no" }.to_owned(),
            human::rate(s.throughput_bytes_per_second),
            human::percent(s.stall_fraction),
            human::limit(settings.and_then(|s| s.bytes_per_second)),
            human::or_dash(settings.and_then(|s| s.reason.as_deref()).unwrap_or("")),
        ]);
    }
    for line in t.render(TERMINAL_WIDTH - 2) {
        let _ = writeln!(out, "  {line}");
    }
    out
}

fn settings_fields(s: &SettingsView) -> Fields {
    let or_default = |n: u64, text: String| {
        if n == 0 {
            "stage default".to_owned()
        } else {
            text
        }
    };
    let mut f = Fields::default();
    f.add("Rate", human::limit(s.bytes_per_second))
        .add("Ops", human::ops_limit(s.ops_per_second))
        .add("Reason", human::or_dash(s.reason.as_deref().unwrap_or("")))
        .add(
            "Tuner",
            match s.tuner {
                Some(true) => "on",
                Some(false) => "off",
                None => "stage default",
            },
        )
        .add(
            "Readers",
            format!(
                "{} to {}",
                or_default(s.min_readers.into(), s.min_readers.to_string()),
                or_default(s.max_readers.into(), s.max_readers.to_string())
            ),
        )
        .add(
            "Buffer",
            format!(
                "{} to {}",
                or_default(s.min_buffer_bytes, human::bytes(s.min_buffer_bytes as f64)),
                or_default(s.max_buffer_bytes, human::bytes(s.max_buffer_bytes as f64))
            ),
        );
    f
}

/// The multi-line view of a stage.
pub fn stage_text(stage: &StageView, now_millis: i64) -> String {
    let mut out = String::new();
    let version = |v: u64| {
        if v == 0 {
            "none".to_owned()
        } else {
            v.to_string()
        }
    };
    let used = human::bytes(stage.memory_used_bytes as f64);
    let memory = if stage.memory_budget_bytes == 0 {
        format!("{used} used, budget not limited")
    } else {
        let budget = human::bytes(stage.memory_budget_bytes as f64);
        format!("{used} used of {budget}")
    };
    let mut f = Fields::default();
    f.add("Stage", &stage.id)
        .add("Node", &stage.node)
        .add("State", stage.state)
        .add(
            "Last seen",
            last_seen(stage.last_seen_unix_millis, now_millis),
        )
        .add("Labels", human::labels(&stage.labels))
        .add("Software", human::or_dash(&stage.software_version))
        .add("Capabilities", list(&stage.capabilities))
        .add("Datasets", list(&stage.datasets))
        .add("Memory", memory);
    f.write(&mut out, 0);
    out.push_str("Settings:\n");
    let mut s = Fields::default();
    s.add("Desired version", version(stage.desired_version))
        .add("Acked version", version(stage.acked_version))
        .add("In sync", if stage.in_sync { "yes" } else { "no" });
    if let Some(nack) = &stage.last_nack {
        s.add(
            "Rejected",
            format!("version {}: {}", nack.version, nack.reason),
        );
    }
    s.write(&mut out, 2);
    let _ = writeln!(out, "Jobs: {}", list(&stage.jobs));
    out
}

/// The multi-line view of a pool.
pub fn pool_text(pool: &PoolView) -> String {
    let mut out = String::new();
    let mut f = Fields::default();
    f.add("Pool", &pool.name)
        .add("Sharing", human::or_dash(&pool.sharing))
        .add(
            "Capacity",
            format!(
                "{}, {}",
                human::limit(pool.bandwidth_bytes_per_second),
                human::ops_limit(pool.ops_per_second)
            ),
        )
        .add(
            "Allocated",
            format!(
                "{}, {} ops/s",
                human::rate(pool.allocated_bytes_per_second as f64),
                pool.allocated_ops_per_second
            ),
        )
        .add("Throughput", human::rate(pool.throughput_bytes_per_second))
        .add("Jobs", list(&pool.jobs));
    f.write(&mut out, 0);
    // One line each: the sentence the allocation alert points to.
    let _ = writeln!(
        out,
        "Problems:{}",
        if pool.problems.is_empty() {
            " none"
        } else {
            ""
        }
    );
    for problem in &pool.problems {
        let _ = writeln!(out, "  {problem}");
    }
    out
}

/// Returns `4s ago`, or `never` when the controller has no time.
fn last_seen(then_millis: i64, now_millis: i64) -> String {
    if then_millis <= 0 {
        "never".to_owned()
    } else {
        format!("{} ago", human::age(then_millis, now_millis))
    }
}

/// Returns the items joined by `, `; `none` when there are none.
fn list(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_owned()
    } else {
        items.join(", ")
    }
}

/// The multi-line view of a data set: its policy, then per stage what
/// the cache holds, its hits and misses, and the latest staging round.
pub fn dataset_text(d: &v1::Dataset) -> String {
    let mut out = String::new();
    let mut head = Fields::default();
    head.add("Dataset", &d.name)
        .add("Cache policy", human::or_dash(&d.policy))
        .add(
            "Staging asked",
            match d.staging_round {
                0 if d.stages.iter().any(preloaded) => {
                    "never (preloaded as a job reads it)".to_owned()
                }
                0 => "never".to_owned(),
                round => format!("round {round}"),
            },
        );
    head.write(&mut out, 0);
    out.push_str("Stages:\n");
    if d.stages.is_empty() {
        out.push_str("  none serves it\n");
    }
    for s in &d.stages {
        let state = crate::view::state_word(s.state);
        let _ = writeln!(out, "  {} ({state})", s.stage);
        let Some(c) = &s.cache else {
            out.push_str("    no cache\n");
            continue;
        };
        let mut f = Fields::default();
        f.add(
            "Memory",
            format!(
                "{} of {} (share {})",
                human::bytes(c.memory_bytes as f64),
                human::bytes(s.memory_capacity_bytes as f64),
                human::bytes(c.share_bytes as f64)
            ),
        );
        if s.disk_capacity_bytes > 0 {
            f.add(
                "Disk",
                format!(
                    "{} of {}",
                    human::bytes(c.disk_bytes as f64),
                    human::bytes(s.disk_capacity_bytes as f64)
                ),
            );
        }
        let lookups = c.hits + c.misses;
        let ratio = if lookups == 0 {
            0.0
        } else {
            c.hits as f64 / lookups as f64
        };
        f.add("Samples", c.entries.to_string())
            .add(
                "Hits",
                format!(
                    "{} ({} of lookups, {})",
                    c.hits,
                    human::percent(ratio),
                    human::bytes(c.hit_bytes as f64)
                ),
            )
            .add("Misses", c.misses.to_string())
            .add("Evictions", c.evictions.to_string())
            .add("Staging", staging_line(c.staging.as_ref()));
        f.write(&mut out, 4);
    }
    out
}

/// Whether the stage staged the data set's preload (`preload: job-start`).
fn preloaded(s: &v1::DatasetOnStage) -> bool {
    let staging = s.cache.as_ref().and_then(|c| c.staging.as_ref());
    staging.is_some_and(|p| p.round == PRELOAD_ROUND)
}

/// `round 7: running, 1200/2000 samples, 117 MiB read from the source`.
pub fn staging_line(p: Option<&v1::StagingProgress>) -> String {
    let Some(p) = p else {
        return "none".to_owned();
    };
    let mut line = format!(
        "round {}: {}, {}/{} samples, {} read from the source",
        p.round,
        p.state,
        p.samples_done,
        p.samples_total,
        human::bytes(p.source_bytes as f64)
    );
    if p.errors > 0 {
        line.push_str(&format!(", {} unreadable", p.errors));
    }
    if !p.error.is_empty() {
        line.push_str(&format!(": {}", p.error));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_reads_as_aligned_fields() {
        let stage = StageView::from(v1::Stage {
            id: "node-a-0".into(),
            node: "node-a".into(),
            state: v1::StageState::Connected as i32,
            desired_version: 3,
            acked_version: 2,
            last_nack: Some(v1::Nack {
                version: 3,
                reason: "buffer over budget".into(),
            }),
            last_seen_unix_millis: 1_000,
            jobs: vec!["bert".into(), "resnet50".into()],
            memory_budget_bytes: 8 << 30,
            memory_used_bytes: 1 << 30,
            ..v1::Stage::default()
        });
        let text = stage_text(&stage, 3_000);
        assert!(
            text.starts_with("Stage:        node-a-0\nNode:         node-a\n"),
            "{text}"
        );
        assert!(
            text.contains("Memory:       1.00 GiB used of 8.00 GiB\n"),
            "{text}"
        );
        assert!(
            text.contains("  Rejected:        version 3: buffer over budget\n"),
            "{text}"
        );
        assert!(text.ends_with("Jobs: bert, resnet50\n"), "{text}");
    }

    #[test]
    fn a_job_shows_limits_settings_and_stages() {
        let job = JobView::from(v1::Job {
            id: "resnet50".into(),
            policy: "vision".into(),
            limits: Some(v1::JobLimits {
                limit_bytes_per_second: Some(800 << 20),
                weight: 3.0,
                ..v1::JobLimits::default()
            }),
            settings: Some(v1::JobSettings {
                bytes_per_second: Some(800 << 20),
                reason: "cap".into(),
                ..v1::JobSettings::default()
            }),
            stages: vec![v1::JobStage {
                stage_id: "node-a-0".into(),
                acked: true,
                ..v1::JobStage::default()
            }],
            ..v1::Job::default()
        });
        let text = job_text(&job);
        assert!(text.contains("Policy:     vision\n"), "{text}");
        assert!(
            text.contains("Throughput: 0 B/s, 0 samples/s (0 B/s from storage)\n"),
            "{text}"
        );
        assert!(text.contains("  Limit:         800 MiB/s\n"), "{text}");
        assert!(text.contains("  Reason:  cap\n"), "{text}");
        assert!(text.contains("  node-a-0  yes"), "{text}");
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{line:?}");
        }
        // A job no policy selects: nothing declared (a weight of 0 was
        // shown), the limit its stage enforces on its own.
        let free = JobView::from(v1::Job {
            id: "free".into(),
            settings: Some(v1::JobSettings {
                bytes_per_second: Some(5 << 20),
                reason: "stage".into(),
                ..v1::JobSettings::default()
            }),
            ..v1::Job::default()
        });
        let text = job_text(&free);
        assert!(text.contains("no policy selects it"), "{text}");
        assert!(!text.contains("Weight"), "{text}");
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{line:?}");
        }
    }
}
