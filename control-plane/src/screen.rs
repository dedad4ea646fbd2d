//! What the controller takes from a stage, screened before anything of it
//! is kept, counted or shown: names a stage of this release never sends
//! (trainers' job ids and labels are checked on the stage, data set names
//! at its start) are dropped, and the free text it sends (a refusal's
//! reason, a staging error) is kept as a line an operator's terminal shows
//! as written: control characters escaped, its length bounded.

use sluice_policy::{MAX_DATASET_NAME_BYTES, valid_dataset_name};
use sluice_proto::v1;

/// The longest free text kept of a stage's message, in bytes.
pub const MAX_TEXT: usize = 1024;

/// The most labels a job may carry in a report: a trainer may send 64,
/// and a stage adds its own.
const MAX_JOB_LABELS: usize = 256;

/// `text` as one bounded line: control characters (line breaks, escapes)
/// escaped, at most [`MAX_TEXT`] bytes, `...` where it was cut.
pub fn line(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        let shown = if c.is_control() {
            c.escape_debug().to_string()
        } else {
            c.to_string()
        };
        if out.len() + shown.len() > MAX_TEXT {
            out.push_str("...");
            break;
        }
        out.push_str(&shown);
    }
    out
}

/// Why a job entry of a report is dropped, if it is.
fn bad_job(job: &v1::JobTelemetry) -> Option<String> {
    // A stage's own job staging a data set is named apart from trainers'.
    let staging = job
        .job
        .strip_prefix(&sluice_policy::staging_job(""))
        .is_some_and(valid_dataset_name);
    if !staging && !sluice_policy::valid_job_id(&job.job) {
        return Some(format!(
            "job id `{}` is not one trainers can claim",
            line(&job.job)
        ));
    }
    if job.labels.len() > MAX_JOB_LABELS {
        return Some(format!(
            "job `{}` has {} labels (at most {MAX_JOB_LABELS})",
            job.job,
            job.labels.len()
        ));
    }
    job.labels.iter().find_map(|(k, v)| {
        sluice_policy::check_label(k, v)
            .err()
            .map(|e| format!("job `{}`: {}", job.job, line(&e)))
    })
}

/// Drops what no stage sends from a report (see the module docs) and
/// bounds its free text. Returns how many entries were dropped and why
/// the first one was, for a warning.
pub fn telemetry(t: &mut v1::Telemetry) -> Option<(usize, String)> {
    let mut dropped = 0;
    let mut first = None;
    let mut note = |why: String| {
        dropped += 1;
        first.get_or_insert(why);
    };
    t.jobs.retain(|job| match bad_job(job) {
        Some(why) => {
            note(why);
            false
        }
        None => true,
    });
    if let Some(cache) = &mut t.cache {
        cache.datasets.retain(|d| {
            let ok = valid_dataset_name(&d.dataset);
            if !ok {
                note(format!("data set name `{}` is not valid", line(&d.dataset)));
            }
            ok
        });
        for staging in cache.datasets.iter_mut().filter_map(|d| d.staging.as_mut()) {
            staging.state = line(&staging.state);
            staging.error = line(&staging.error);
        }
    }
    first.map(|why| (dropped, why))
}

/// Refuses a hello that names what no stage sends (labels, data sets,
/// capabilities or a software version that are not one bounded line),
/// saying which.
pub fn hello(h: &v1::Hello) -> Result<(), String> {
    if let Some(e) = h
        .labels
        .iter()
        .find_map(|(k, v)| sluice_policy::check_label(k, v).err())
    {
        return Err(format!("hello.labels: {}", line(&e)));
    }
    if let Some(d) = h.datasets.iter().find(|d| !valid_dataset_name(d)) {
        return Err(format!(
            "hello.datasets: `{}` is not a data set name (1 to {MAX_DATASET_NAME_BYTES} bytes, no `/` or control characters)",
            line(d)
        ));
    }
    let one_line = |s: &str| s.len() <= 256 && !s.chars().any(char::is_control);
    if let Some(c) = h.capabilities.iter().find(|c| !one_line(c)) {
        return Err(format!(
            "hello.capabilities: `{}` is not a capability",
            line(c)
        ));
    }
    if !one_line(&h.software_version) {
        return Err(format!(
            "hello.software_version `{}` is not a version",
            line(&h.software_version)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, labels: &[(&str, &str)]) -> v1::JobTelemetry {
        v1::JobTelemetry {
            job: id.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn jobs_no_trainer_could_claim_are_dropped_and_the_rest_kept() {
        let mut t = v1::Telemetry {
            jobs: vec![
                job("train-1", &[("team", "a")]),
                job("\u{1b}[2Jred", &[]),
                job("", &[]),
                job("a/b", &[]),
                job("..", &[]),
                job(&"x".repeat(129), &[]),
                job("bad-label", &[("team", "a\nb")]),
                job("train.2_b", &[]),
                job(
                    &sluice_policy::staging_job("imagenet"),
                    &[("sluice.dev/staging", "imagenet")],
                ),
                job(&sluice_policy::staging_job("a/b"), &[]),
            ],
            ..Default::default()
        };
        let (dropped, why) = telemetry(&mut t).unwrap();
        assert_eq!(dropped, 7);
        assert!(why.contains(r"\u{1b}[2Jred"), "{why}");
        let kept: Vec<&str> = t.jobs.iter().map(|j| j.job.as_str()).collect();
        assert_eq!(kept, ["train-1", "train.2_b", "staging:imagenet"]);
        let mut clean = v1::Telemetry {
            jobs: vec![job("train-1", &[])],
            ..Default::default()
        };
        assert_eq!(telemetry(&mut clean), None);
    }

    #[test]
    fn free_text_is_one_bounded_line() {
        assert_eq!(line("disk full"), "disk full");
        assert_eq!(line("a\u{1b}]0;x\u{7}\nb"), r"a\u{1b}]0;x\u{7}\nb");
        let long = line(&"é".repeat(10_000));
        assert!(
            long.len() <= MAX_TEXT + 3 && long.ends_with("..."),
            "{}",
            long.len()
        );
    }

    #[test]
    fn a_hello_naming_what_no_stage_sends_is_refused() {
        let good = v1::Hello {
            stage_id: "s".into(),
            datasets: vec!["imagenet".into()],
            software_version: "0.1.0".into(),
            ..Default::default()
        };
        assert_eq!(hello(&good), Ok(()));
        let mut bad = good.clone();
        bad.datasets.push("a/../b".into());
        assert!(hello(&bad).unwrap_err().contains("hello.datasets"));
        let mut bad = good.clone();
        bad.labels.insert("team".into(), "\u{1b}[31m".into());
        assert!(hello(&bad).unwrap_err().contains("hello.labels"));
        let mut bad = good;
        bad.software_version = "1\n2".into();
        assert!(hello(&bad).unwrap_err().contains("software_version"));
    }
}
