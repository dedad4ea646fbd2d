//! Faults a test can inject into a debug build, to show what one failure
//! takes down and what it leaves running. Release builds have none of this.
//!
//! - `SLUICE_STAGE_PANIC_JOB=JOB`: the first `HELLO` of `JOB` panics while
//!   holding that job's lock; every other connection must stay served.
//! - `SLUICE_STAGE_PANIC_TASK=NAME`: the long-lived task `NAME` (`tuner`,
//!   `metrics server`, `controller session`) panics as it starts; the stage
//!   must say so and exit non-zero.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::engine::Job;

static JOB_FIRED: AtomicBool = AtomicBool::new(false);

pub fn panic_job_if_asked(job: &Job) {
    let asked = std::env::var("SLUICE_STAGE_PANIC_JOB").is_ok_and(|j| j == job.id());
    if asked && !JOB_FIRED.swap(true, Ordering::SeqCst) {
        job.panic_holding_lock();
    }
}

pub fn panic_task_if_asked(name: &str) {
    if std::env::var("SLUICE_STAGE_PANIC_TASK").is_ok_and(|t| t == name) {
        panic!("injected fault: the {name} task panics");
    }
}
