//! The configuration one job runs with: tuner bounds, starting reader count
//! and buffer, tuner on/off, and QoS limits. The stage's flags give every
//! job a base [`JobConfig`]; the controller's pushed settings may override
//! parts of it per job.

use std::time::Duration;

use crate::token_bucket::Limits;
use crate::tuner::Bounds;

/// Most reader threads one job may run.
pub const MAX_READERS: u32 = 1024;
/// Longest burst window of a job's limiter.
pub const MAX_BURST: Duration = Duration::from_secs(60);

/// The effective configuration of one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobConfig {
    pub bounds: Bounds,
    pub initial_readers: u32,
    pub initial_buffer: u64,
    /// When false the reader count and buffer stay as set.
    pub tuner: bool,
    pub limits: Limits,
}
