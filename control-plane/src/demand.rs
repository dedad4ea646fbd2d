//! Demand estimation: how many bytes per second each job wants from each
//! stage, from the stage's last two telemetry snapshots.
//!
//! The stage reports, per job, cumulative bytes read from storage and
//! delivered to trainers, and the seconds its readers spent waiting for the
//! job's token bucket. Over the window between two snapshots the job's
//! *rate* is the larger of what it read and what it delivered: reads run
//! ahead while the prefetch buffer fills and pause while a full buffer
//! drains, delivery shows what the trainers consume, and the larger of the
//! two never understates what the job uses. Then:
//!
//! * **Throttled** (readers waited at least [`THROTTLED`] of a second per
//!   second): the limit binds, so the job wants more than it has. Its
//!   demand on that stage is [`PROBE`] times its rate, and the job as a
//!   whole counts as greedy (`None`): the engine gives it its full share
//!   at once, so a job whose demand grows gets it on the next tick.
//! * **Not throttled**: the job gets what it wants (its consumers are
//!   compute-bound and its buffer full, or storage or its readers hold it
//!   back; more allocation would not help either way). Its demand is its
//!   rate plus [`HEADROOM`], at least [`MIN_DEMAND`], so a job that starts
//!   to want more soon reads at its allocation, is throttled, and counts as
//!   greedy.
//!
//! Hysteresis: a demand moves only when the new figure is more than
//! [`RISE`] above or [`FALL`] below the one in force, so measurement noise
//! does not move every job's allocation every tick. (A job that wants more
//! than the rise needs is throttled first, and a throttled job counts as
//! greedy at once.) A job seen on a stage for
//! the first time (no window yet) is unknown, which also counts as greedy.

use std::collections::BTreeMap;

use crate::state::JobSample;

/// Reader-seconds waited per second above which a job counts as throttled.
pub const THROTTLED: f64 = 0.1;

/// A throttled job's demand on a stage, as a multiple of what it read.
pub const PROBE: f64 = 1.5;

/// A job's demand above what it read when it was not throttled.
pub const HEADROOM: f64 = 0.05;

/// How far a demand must rise before the higher figure is used.
pub const RISE: f64 = 0.05;

/// How far a demand must fall before the lower figure is used.
pub const FALL: f64 = 0.10;

/// The least demand of a job on a stage, in bytes per second (so an idle
/// job keeps a rate at which it can show that it wants more).
pub const MIN_DEMAND: f64 = 1024.0 * 1024.0;

/// What a job did on one stage between two snapshots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// Storage bytes read per second.
    pub read_bytes_per_second: f64,
    /// Bytes delivered to trainers per second.
    pub delivered_bytes_per_second: f64,
    /// Reader-seconds spent waiting for the job's token bucket, per second.
    pub throttled: f64,
}

impl Window {
    /// Returns the window between two samples `seconds` apart, or `None`
    /// when they cannot be compared (no time passed, or the counters went
    /// back: the stage restarted).
    pub fn between(before: &JobSample, now: &JobSample, seconds: f64) -> Option<Self> {
        if seconds.is_nan()
            || seconds <= 0.0
            || now.storage_read_bytes < before.storage_read_bytes
            || now.delivered_bytes < before.delivered_bytes
            || now.throttled_seconds < before.throttled_seconds
        {
            return None;
        }
        let per_second = |now: u64, before: u64| (now - before) as f64 / seconds;
        Some(Window {
            read_bytes_per_second: per_second(now.storage_read_bytes, before.storage_read_bytes),
            delivered_bytes_per_second: per_second(now.delivered_bytes, before.delivered_bytes),
            throttled: (now.throttled_seconds - before.throttled_seconds) / seconds,
        })
    }

    /// Returns the job's rate: the larger of what it read and what it
    /// delivered.
    pub fn rate(&self) -> f64 {
        self.read_bytes_per_second
            .max(self.delivered_bytes_per_second)
    }
}

/// A job's estimated demand on one stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageDemand {
    /// Bytes per second it wants there; `None` when unknown.
    pub bytes_per_second: Option<f64>,
    /// Whether it wants more than it has (throttled, or unknown).
    pub wants_more: bool,
}

/// Returns the demand a window shows, given the demand in force before
/// (for hysteresis; only used when neither is throttled).
pub fn estimate(window: Option<Window>, before: Option<StageDemand>) -> StageDemand {
    let Some(w) = window else {
        return StageDemand {
            bytes_per_second: None,
            wants_more: true,
        };
    };
    if w.throttled >= THROTTLED {
        return StageDemand {
            bytes_per_second: Some((w.rate() * PROBE).max(MIN_DEMAND)),
            wants_more: true,
        };
    }
    let measured = (w.rate() * (1.0 + HEADROOM)).max(MIN_DEMAND);
    let kept = before
        .filter(|b| !b.wants_more)
        .and_then(|b| b.bytes_per_second)
        .filter(|&b| measured <= b * (1.0 + RISE) && measured >= b * (1.0 - FALL));
    StageDemand {
        bytes_per_second: Some(kept.unwrap_or(measured)),
        wants_more: false,
    }
}

/// Returns a job's demand over all its stages: `None` (greedy) when any
/// stage wants more, else the sum.
pub fn job_demand<'a>(stages: impl IntoIterator<Item = &'a StageDemand>) -> Option<f64> {
    let mut total = 0.0;
    for s in stages {
        if s.wants_more {
            return None;
        }
        total += s.bytes_per_second?;
    }
    Some(total)
}

/// The demands in force, per job and stage, carried from tick to tick.
#[derive(Debug, Default)]
pub struct Demands {
    by_job: BTreeMap<String, BTreeMap<String, StageDemand>>,
}

impl Demands {
    /// Replaces the estimates with this tick's: `(job, stage, window)` for
    /// every job on every live stage. Jobs and stages not listed are
    /// forgotten. Returns the new estimates by job, then stage.
    pub fn update<'a>(
        &mut self,
        windows: impl IntoIterator<Item = (&'a str, &'a str, Option<Window>)>,
    ) -> &BTreeMap<String, BTreeMap<String, StageDemand>> {
        let mut next: BTreeMap<String, BTreeMap<String, StageDemand>> = BTreeMap::new();
        for (job, stage, window) in windows {
            let before = self.by_job.get(job).and_then(|s| s.get(stage)).copied();
            next.entry(job.to_owned())
                .or_default()
                .insert(stage.to_owned(), estimate(window, before));
        }
        self.by_job = next;
        &self.by_job
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = 1024.0 * 1024.0;

    fn window(mib: f64, throttled: f64) -> Option<Window> {
        Some(Window {
            read_bytes_per_second: mib * MIB,
            delivered_bytes_per_second: mib * MIB,
            throttled,
        })
    }

    fn demand(mib: f64) -> StageDemand {
        StageDemand {
            bytes_per_second: Some(mib * MIB),
            wants_more: false,
        }
    }

    /// Returns a demand in MiB/s rounded to hundredths, and whether it
    /// wants more.
    fn mib(d: StageDemand) -> (Option<f64>, bool) {
        let round = |b: f64| (b / MIB * 100.0).round() / 100.0;
        (d.bytes_per_second.map(round), d.wants_more)
    }

    #[test]
    fn throttled_jobs_want_more_and_count_as_greedy() {
        let d = estimate(window(40.0, 2.0), Some(demand(10.0)));
        assert_eq!(mib(d), (Some(60.0), true));
        assert_eq!(job_demand(&[d, demand(5.0)]), None);
    }

    #[test]
    fn unthrottled_jobs_want_what_they_read_plus_headroom() {
        let d = estimate(window(20.0, 0.01), None);
        assert_eq!(mib(d), (Some(21.0), false));
        let total = job_demand(&[d, demand(4.0)]).unwrap();
        assert_eq!((total / MIB).round(), 25.0);
    }

    #[test]
    fn demand_moves_only_past_the_thresholds() {
        let before = Some(demand(21.0));
        // A little less: kept.
        assert_eq!(mib(estimate(window(19.5, 0.0), before)), (Some(21.0), false));
        // A little more: kept too.
        assert_eq!(mib(estimate(window(21.0, 0.0), before)), (Some(21.0), false));
        // More: taken.
        assert_eq!(mib(estimate(window(22.0, 0.0), before)), (Some(23.1), false));
        // Much less: taken.
        assert_eq!(mib(estimate(window(10.0, 0.0), before)), (Some(10.5), false));
        // Hysteresis does not hold a figure that came from a probe.
        let probing = StageDemand {
            bytes_per_second: Some(60.0 * MIB),
            wants_more: true,
        };
        assert_eq!(mib(estimate(window(20.0, 0.0), Some(probing))), (Some(21.0), false));
    }

    #[test]
    fn a_draining_buffer_does_not_hide_what_the_trainers_consume() {
        // The stage reads nothing while a full buffer drains at 20 MiB/s.
        let draining = Some(Window {
            read_bytes_per_second: 0.0,
            delivered_bytes_per_second: 20.0 * MIB,
            throttled: 0.0,
        });
        assert_eq!(mib(estimate(draining, None)), (Some(21.0), false));
    }

    #[test]
    fn idle_and_unknown_jobs() {
        assert_eq!(mib(estimate(window(0.0, 0.0), None)), (Some(1.0), false));
        let unknown = estimate(None, Some(demand(30.0)));
        assert_eq!(unknown.bytes_per_second, None);
        assert!(unknown.wants_more);
        assert_eq!(job_demand(&[unknown]), None);
    }

    #[test]
    fn windows_need_time_and_monotonic_counters() {
        let sample = |bytes: u64, throttled: f64| JobSample {
            storage_read_bytes: bytes,
            delivered_bytes: bytes / 2,
            throttled_seconds: throttled,
            ..JobSample::default()
        };
        let w = Window::between(&sample(0, 1.0), &sample(4 << 20, 1.5), 2.0).unwrap();
        assert_eq!(w.read_bytes_per_second, 2.0 * MIB);
        assert_eq!(w.delivered_bytes_per_second, MIB);
        assert_eq!(w.throttled, 0.25);
        assert_eq!(Window::between(&sample(10, 0.0), &sample(5, 0.0), 1.0), None);
        assert_eq!(Window::between(&sample(0, 0.0), &sample(5, 0.0), 0.0), None);
    }

    #[test]
    fn forgotten_jobs_start_over() {
        let mut d = Demands::default();
        d.update([("a", "s1", window(20.0, 0.0))]);
        let kept = d.update([("a", "s1", window(19.0, 0.0))]);
        assert_eq!(mib(kept["a"]["s1"]), (Some(21.0), false));
        d.update([("b", "s1", window(1.0, 0.0))]);
        let fresh = d.update([("a", "s1", window(19.0, 0.0))]);
        assert_eq!(mib(fresh["a"]["s1"]), (Some(19.95), false));
    }
}
