//! Demand estimation: how many bytes per second each job wants from each
//! stage, from the window between the stage's last two telemetry reports.
//!
//! The stage reports, per job, cumulative bytes read from storage and
//! delivered to trainers, the seconds its readers spent waiting for the
//! job's token bucket and the seconds its trainers waited for data. Over
//! the window between two snapshots the job's *rate* is what it delivered:
//! storage reads run ahead while the prefetch buffer fills and pause while
//! a full buffer drains, so they swing around what the trainers consume,
//! which is what the job needs in the long run. Then:
//!
//! * **Throttled and stalled** (readers waited at least [`THROTTLED`] of a
//!   second per second, and its trainers waited for data at least
//!   [`STALLED`] of the time): the limit binds and the trainers feel it, so
//!   the job wants more than it has. Its demand on that stage is [`PROBE`]
//!   times its rate, and the job as a whole counts as greedy (`None`): the
//!   engine gives it its full share at once, so a job whose demand grows
//!   gets it on the next tick.
//! * **Otherwise** the job gets what it wants: its trainers are
//!   compute-bound (readers throttled while they refill a buffer the
//!   trainers are not waiting on do not count), or storage or its readers
//!   hold it back and more allocation would not help. Its demand is its
//!   rate plus [`HEADROOM`], at least [`MIN_DEMAND`], so a job that starts
//!   to want more soon reads at its allocation, stalls while throttled, and
//!   counts as greedy.
//!
//! Hysteresis: the figure is the *peak* rate of the last [`RECENT`]
//! windows (plus the headroom); it replaces the one in force only when it
//! is more than [`RISE`] above or [`FALL`] below it; and a job held at its
//! demand counts as wanting more only after [`PRESS_WINDOWS`] throttled
//! and stalled windows in a row. So a job whose reads come in bursts (a
//! slow reader's one-second windows swing by a third) keeps one figure,
//! measurement noise does not move every job's allocation every tick, and
//! one slow window does not leave a job short (which would stall its
//! trainers and make it greedy). Each window counts once, however many
//! computations see it.
//!
//! A stage that wants more gets at least the largest demand of the job's
//! stages: the job's share is split among its stages by demand, and a
//! stage whose trainer was starved would otherwise keep a small share in
//! proportion to the little it could read. A job seen on a stage for
//! the first time (no window yet) is unknown, which also counts as greedy;
//! so is it in its first window there ([warm-up](StageDemand::warming)):
//! a trainer that just connected spends that window starting (connecting,
//! sending its plan, its readers filling the buffer) and reads less than
//! it will, without waiting long enough to count as stalled. Taking that
//! window as its demand would hold a greedy job far below its share for
//! the windows it then takes to press. A job already reading when the
//! controller first sees it (a controller that restarted) has no warm-up:
//! its first window is a steady one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A job's cumulative counters on one stage, as its telemetry reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct JobCounters {
    /// Bytes read from storage for the job.
    pub storage_read_bytes: u64,
    /// Bytes delivered to its trainers.
    pub delivered_bytes: u64,
    /// Bytes of its samples the node cache served: storage was not read.
    pub cache_hit_bytes: u64,
    /// Samples delivered to its trainers.
    pub delivered_samples: u64,
    /// Reader-seconds spent waiting for the job's token bucket.
    pub throttled_seconds: f64,
    /// Seconds its trainers waited for data, summed over connections.
    pub stall_seconds: f64,
    /// Trainer connections open now.
    pub connections: u32,
}

/// Reader-seconds waited per second above which a job counts as throttled.
pub const THROTTLED: f64 = 0.1;

/// Fraction of the time its trainers waited for data above which a job
/// counts as stalled.
pub const STALLED: f64 = 0.05;

/// A throttled job's demand on a stage, as a multiple of what it read.
pub const PROBE: f64 = 1.5;

/// A job's demand above its rate when it was not throttled: room for a
/// stage that fell behind (a slow read, a reader the tuner had parked) to
/// catch up without starving its trainers.
pub const HEADROOM: f64 = 0.10;

/// How far a demand must rise before the higher figure is used.
pub const RISE: f64 = 0.05;

/// How far a demand must fall before the lower figure is used.
pub const FALL: f64 = 0.10;

/// How many windows the peak rate is taken over.
pub const RECENT: usize = 5;

/// How many windows in a row a job held at its demand must be throttled
/// and stalled before it counts as wanting more.
pub const PRESS_WINDOWS: u8 = 2;

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
    /// Of those, bytes per second the node cache served.
    pub cache_hit_bytes_per_second: f64,
    /// Samples delivered to trainers per second.
    pub delivered_samples_per_second: f64,
    /// Reader-seconds spent waiting for the job's token bucket, per second.
    pub throttled: f64,
    /// Fraction of the time the job's trainers waited for data (per
    /// connection, 0 to 1).
    pub stalled: f64,
    /// When the window ends (the later snapshot's Unix milliseconds).
    pub ends_at: i64,
}

impl Window {
    /// Returns the window between two samples `seconds` apart, or `None`
    /// when they cannot be compared (no time passed, or the counters went
    /// back: the stage restarted).
    pub fn between(
        before: &JobCounters,
        now: &JobCounters,
        seconds: f64,
        ends_at: i64,
    ) -> Option<Self> {
        if seconds.is_nan()
            || seconds <= 0.0
            || now.storage_read_bytes < before.storage_read_bytes
            || now.delivered_bytes < before.delivered_bytes
            || now.cache_hit_bytes < before.cache_hit_bytes
            || now.throttled_seconds < before.throttled_seconds
            || now.stall_seconds < before.stall_seconds
        {
            return None;
        }
        let per_second = |now: u64, before: u64| (now - before) as f64 / seconds;
        Some(Window {
            read_bytes_per_second: per_second(now.storage_read_bytes, before.storage_read_bytes),
            delivered_bytes_per_second: per_second(now.delivered_bytes, before.delivered_bytes),
            cache_hit_bytes_per_second: per_second(now.cache_hit_bytes, before.cache_hit_bytes),
            delivered_samples_per_second: per_second(
                now.delivered_samples,
                before.delivered_samples.min(now.delivered_samples),
            ),
            throttled: (now.throttled_seconds - before.throttled_seconds) / seconds,
            stalled: ((now.stall_seconds - before.stall_seconds)
                / seconds
                / f64::from(now.connections.max(1)))
            .min(1.0),
            ends_at,
        })
    }

    /// Returns the job's rate on storage: what it delivered to its
    /// trainers that storage gave (a cache hit costs storage nothing).
    /// Delivery, not reads, because reads come in bursts as buffers refill
    /// while delivery follows the trainers.
    pub fn rate(&self) -> f64 {
        (self.delivered_bytes_per_second - self.cache_hit_bytes_per_second).max(0.0)
    }

    /// Whether the job wants more than it has in this window: its readers
    /// waited for the limit while its trainers waited for data.
    pub fn pressed(&self) -> bool {
        self.throttled >= THROTTLED && self.stalled >= STALLED
    }

    /// Whether this window may move the job's demand from what `before`
    /// showed: it started or stopped pressing, or its rate moved past the
    /// hysteresis band. Lets the controller decide at once when a job's
    /// behaviour changes rather than at the next tick; windows that cannot
    /// change anything (no window yet) never ask for it.
    pub fn moved_from(&self, before: Option<&Window>) -> bool {
        let Some(b) = before else {
            return true;
        };
        let (rate, was) = (self.rate(), b.rate());
        self.pressed() != b.pressed()
            || rate > was * (1.0 + RISE + HEADROOM)
            || rate < was * (1.0 - FALL - HEADROOM)
    }
}

/// A job's estimated demand on one stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageDemand {
    /// Bytes per second it wants there; `None` when unknown.
    pub bytes_per_second: Option<f64>,
    /// Whether it wants more than it has (throttled, or unknown).
    pub wants_more: bool,
    /// The rates of the last [`RECENT`] windows, newest first, since it was
    /// last throttled (0 where none).
    pub recent: [f64; RECENT],
    /// Windows in a row that showed it wanting more, not yet taken.
    pub pressing: u8,
    /// The end of the window it was estimated from (0: none).
    pub seen_at: i64,
}

impl StageDemand {
    /// Unknown: no window yet, counts as wanting more.
    pub const UNKNOWN: StageDemand = StageDemand {
        bytes_per_second: None,
        wants_more: true,
        recent: [0.0; RECENT],
        pressing: 0,
        seen_at: 0,
    };

    /// Whether the job was seen on the stage with no window yet: its next
    /// window is its first there, a warm-up that does not set its demand.
    pub fn warming(&self) -> bool {
        self.seen_at == 0 && self.bytes_per_second.is_none()
    }
}

/// Returns the demand a window shows, given the demand in force before
/// (for hysteresis; only used when neither is throttled).
pub fn estimate(window: Option<Window>, before: Option<StageDemand>) -> StageDemand {
    let Some(w) = window else {
        return StageDemand::UNKNOWN;
    };
    if let Some(b) = before.filter(|b| b.seen_at == w.ends_at) {
        return b;
    }
    let pressed = w.pressed();
    if before.is_some_and(|b| b.warming()) && !pressed {
        return StageDemand {
            seen_at: w.ends_at,
            ..StageDemand::UNKNOWN
        };
    }
    let fresh = |bytes: f64, wants_more: bool, recent: [f64; RECENT]| StageDemand {
        bytes_per_second: Some(bytes.max(MIN_DEMAND)),
        wants_more,
        recent,
        pressing: 0,
        seen_at: w.ends_at,
    };
    let held = before
        .filter(|b| !b.wants_more)
        .and_then(|b| Some((b, b.bytes_per_second?)));
    if pressed {
        return match held {
            // Held at its demand: one short window may be a stage that fell
            // behind and is catching up within its headroom.
            Some((b, _)) if b.pressing + 1 < PRESS_WINDOWS => StageDemand {
                pressing: b.pressing + 1,
                seen_at: w.ends_at,
                ..b
            },
            _ => fresh(w.rate() * PROBE, true, [0.0; RECENT]),
        };
    }
    let mut recent = [0.0; RECENT];
    recent[0] = w.rate();
    if let Some((b, _)) = held {
        recent[1..].copy_from_slice(&b.recent[..RECENT - 1]);
    }
    let peak = recent.iter().copied().fold(0.0, f64::max);
    let measured = fresh(peak * (1.0 + HEADROOM), false, recent);
    let Some((b, bytes)) = held else {
        return measured;
    };
    let new = measured.bytes_per_second.unwrap_or(0.0);
    if new > bytes * (1.0 + RISE) || new < bytes * (1.0 - FALL) {
        return measured;
    }
    StageDemand {
        recent,
        pressing: 0,
        seen_at: w.ends_at,
        ..b
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

/// Raises every stage that wants more to at least the largest demand of
/// the job's stages.
fn raise_to_busiest(stages: &mut BTreeMap<String, StageDemand>) {
    let most = stages
        .values()
        .filter_map(|s| s.bytes_per_second)
        .fold(0.0, f64::max);
    for s in stages.values_mut().filter(|s| s.wants_more) {
        if let Some(bytes) = &mut s.bytes_per_second {
            *bytes = bytes.max(most);
        }
    }
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
        for stages in next.values_mut() {
            raise_to_busiest(stages);
        }
        self.by_job = next;
        &self.by_job
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = 1024.0 * 1024.0;

    /// A window in which the job read and delivered `mib` MiB/s, its
    /// readers waited `throttled` s/s, and its trainers waited as long
    /// whenever the readers did.
    fn window(mib: f64, throttled: f64) -> Option<Window> {
        Some(Window {
            read_bytes_per_second: mib * MIB,
            delivered_bytes_per_second: mib * MIB,
            cache_hit_bytes_per_second: 0.0,
            delivered_samples_per_second: 0.0,
            throttled,
            stalled: throttled.min(1.0),
            ends_at: next_window(),
        })
    }

    fn demand(mib: f64) -> StageDemand {
        StageDemand {
            bytes_per_second: Some(mib * MIB),
            wants_more: false,
            ..StageDemand::UNKNOWN
        }
    }

    /// Returns a fresh window end each call.
    fn next_window() -> i64 {
        use std::sync::atomic::{AtomicI64, Ordering};
        static NEXT: AtomicI64 = AtomicI64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// Returns a demand in MiB/s rounded to hundredths, and whether it
    /// wants more.
    fn mib(d: StageDemand) -> (Option<f64>, bool) {
        let round = |b: f64| (b / MIB * 100.0).round() / 100.0;
        (d.bytes_per_second.map(round), d.wants_more)
    }

    #[test]
    fn throttled_jobs_want_more_and_count_as_greedy() {
        let d = estimate(window(40.0, 2.0), None);
        assert_eq!(mib(d), (Some(60.0), true));
        assert_eq!(job_demand(&[d, demand(5.0)]), None);
    }

    #[test]
    fn a_job_held_at_its_demand_must_press_twice() {
        let held = Some(demand(22.0));
        let once = estimate(window(18.0, 2.0), held);
        assert_eq!(mib(once), (Some(22.0), false));
        let twice = estimate(window(18.0, 2.0), Some(once));
        assert_eq!(mib(twice), (Some(27.0), true));
        // A normal window in between starts over.
        let normal = estimate(window(20.0, 0.0), Some(once));
        assert_eq!(
            mib(estimate(window(18.0, 2.0), Some(normal))),
            (Some(22.0), false)
        );
    }

    #[test]
    fn unthrottled_jobs_want_what_they_read_plus_headroom() {
        let d = estimate(window(20.0, 0.01), None);
        assert_eq!(mib(d), (Some(22.0), false));
        let total = job_demand(&[d, demand(4.0)]).unwrap();
        assert_eq!((total / MIB).round(), 26.0);
    }

    #[test]
    fn demand_moves_only_past_the_thresholds() {
        // A job that has read 20 MiB/s for a while: 22 with the headroom.
        let mut steady = None;
        for _ in 0..RECENT {
            steady = Some(estimate(window(20.0, 0.0), steady));
        }
        let before = steady;
        assert_eq!(mib(before.unwrap()), (Some(22.0), false));
        // A little less: kept.
        assert_eq!(
            mib(estimate(window(19.0, 0.0), before)),
            (Some(22.0), false)
        );
        // A little more: kept too.
        assert_eq!(
            mib(estimate(window(21.0, 0.0), before)),
            (Some(22.0), false)
        );
        // More: taken.
        assert_eq!(
            mib(estimate(window(22.0, 0.0), before)),
            (Some(24.2), false)
        );
        // Much less: taken once no window of the last RECENT is high.
        let mut d = before;
        for _ in 0..RECENT - 1 {
            d = Some(estimate(window(10.0, 0.0), d));
            assert_eq!(mib(d.unwrap()), (Some(22.0), false));
        }
        assert_eq!(mib(estimate(window(10.0, 0.0), d)), (Some(11.0), false));
        // The same window seen twice counts once.
        let w = window(10.0, 0.0);
        let first = estimate(w, before);
        assert_eq!(estimate(w, Some(first)), first);
        // Hysteresis does not hold a figure that came from a probe.
        let probing = StageDemand {
            bytes_per_second: Some(60.0 * MIB),
            wants_more: true,
            ..demand(0.0)
        };
        assert_eq!(
            mib(estimate(window(20.0, 0.0), Some(probing))),
            (Some(22.0), false)
        );
    }

    #[test]
    fn a_bursty_reader_keeps_one_figure() {
        let mut d = None;
        let mut figures = Vec::new();
        for rate in [3.0, 2.0, 3.9, 2.2, 3.5, 2.0, 2.4, 3.8, 2.1, 3.0] {
            d = Some(estimate(window(rate, 0.0), d));
            figures.push(mib(d.unwrap()).0.unwrap());
        }
        // Set by the first peak (3.9 -> 4.29), then held: no five windows
        // in a row stay below 3.9 by a tenth.
        assert!(figures[2..].iter().all(|&f| f == 4.29), "{figures:?}");
    }

    #[test]
    fn a_draining_buffer_does_not_hide_what_the_trainers_consume() {
        // The stage reads nothing while a full buffer drains at 20 MiB/s.
        let draining = Some(Window {
            read_bytes_per_second: 0.0,
            delivered_bytes_per_second: 20.0 * MIB,
            cache_hit_bytes_per_second: 0.0,
            delivered_samples_per_second: 0.0,
            throttled: 0.0,
            stalled: 0.0,
            ends_at: 1,
        });
        assert_eq!(mib(estimate(draining, None)), (Some(22.0), false));
    }

    #[test]
    fn throttled_readers_refilling_a_buffer_nobody_waits_on_want_no_more() {
        let refilling = Some(Window {
            read_bytes_per_second: 30.0 * MIB,
            delivered_bytes_per_second: 20.0 * MIB,
            cache_hit_bytes_per_second: 0.0,
            delivered_samples_per_second: 0.0,
            throttled: 3.0,
            stalled: 0.0,
            ends_at: 1,
        });
        assert_eq!(mib(estimate(refilling, None)), (Some(22.0), false));
    }

    #[test]
    fn a_new_jobs_first_window_is_a_warm_up() {
        // Seen without a window, then a first window of a trainer that is
        // starting: still unknown, so greedy.
        let new = estimate(None, None);
        assert!(new.warming());
        let first = estimate(window(3.0, 0.0), Some(new));
        assert_eq!(mib(first), (None, true));
        assert!(!first.warming());
        // From the second window on the job is measured.
        assert_eq!(
            mib(estimate(window(20.0, 0.0), Some(first))),
            (Some(22.0), false)
        );
        // A first window that presses counts at once.
        let pressed = estimate(window(40.0, 2.0), Some(new));
        assert_eq!(mib(pressed), (Some(60.0), true));
        // A job already reading when the controller first sees it (a
        // restart) is measured from its first window.
        assert_eq!(mib(estimate(window(20.0, 0.0), None)), (Some(22.0), false));
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
    fn a_window_asks_for_a_decision_only_when_it_may_move_the_demand() {
        let w = |mib, throttled| window(mib, throttled).unwrap();
        assert!(w(20.0, 0.0).moved_from(None));
        assert!(!w(20.0, 0.0).moved_from(Some(&w(21.0, 0.0))));
        assert!(!w(20.0, 0.0).moved_from(Some(&w(18.0, 0.0))));
        assert!(w(20.0, 0.0).moved_from(Some(&w(30.0, 0.0))));
        assert!(w(20.0, 0.0).moved_from(Some(&w(12.0, 0.0))));
        // Starting or stopping to press, at any rate.
        assert!(w(20.0, 1.0).moved_from(Some(&w(20.0, 0.0))));
        assert!(w(20.0, 0.0).moved_from(Some(&w(20.0, 1.0))));
    }

    #[test]
    fn windows_need_time_and_monotonic_counters() {
        let sample = |bytes: u64, throttled: f64| JobCounters {
            storage_read_bytes: bytes,
            delivered_bytes: bytes / 2,
            cache_hit_bytes: bytes / 8,
            delivered_samples: bytes / 1024,
            throttled_seconds: throttled,
            stall_seconds: throttled * 2.0,
            connections: 2,
        };
        let w = Window::between(&sample(0, 1.0), &sample(4 << 20, 1.5), 2.0, 7).unwrap();
        assert_eq!(w.read_bytes_per_second, 2.0 * MIB);
        assert_eq!(w.delivered_bytes_per_second, MIB);
        assert_eq!(w.cache_hit_bytes_per_second, MIB / 4.0);
        // Storage gave what the cache did not.
        assert_eq!(w.rate(), 0.75 * MIB);
        assert_eq!(w.delivered_samples_per_second, 2048.0);
        assert_eq!(w.throttled, 0.25);
        // One second of waiting over two seconds and two connections.
        assert_eq!(w.stalled, 0.25);
        assert_eq!(
            Window::between(&sample(10, 0.0), &sample(5, 0.0), 1.0, 7),
            None
        );
        assert_eq!(
            Window::between(&sample(0, 0.0), &sample(5, 0.0), 0.0, 7),
            None
        );
    }

    #[test]
    fn a_starved_stage_that_wants_more_gets_as_much_as_the_busiest() {
        let mut d = Demands::default();
        let now = d.update([
            ("a", "s1", window(2.0, 1.0)),
            ("a", "s2", window(78.0, 1.0)),
        ]);
        assert_eq!(mib(now["a"]["s1"]), (Some(117.0), true));
        assert_eq!(mib(now["a"]["s2"]), (Some(117.0), true));
        // A stage that does not want more keeps its own figure.
        let now = d.update([
            ("a", "s1", window(2.0, 0.0)),
            ("a", "s2", window(78.0, 1.0)),
        ]);
        assert_eq!(mib(now["a"]["s1"]), (Some(2.2), false));
    }

    #[test]
    fn forgotten_jobs_start_over() {
        let mut d = Demands::default();
        d.update([("a", "s1", window(20.0, 0.0))]);
        let kept = d.update([("a", "s1", window(19.0, 0.0))]);
        assert_eq!(mib(kept["a"]["s1"]), (Some(22.0), false));
        d.update([("b", "s1", window(1.0, 0.0))]);
        let fresh = d.update([("a", "s1", window(19.0, 0.0))]);
        assert_eq!(mib(fresh["a"]["s1"]), (Some(20.9), false));
    }
}
