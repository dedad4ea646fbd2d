//! The per-job auto-tuner: picks the reader count and buffer bytes from what
//! the consumer experiences.
//!
//! Every tick it looks at the last window: how long consumers stalled waiting
//! for data, how full the buffer was, how many storage reads completed, how
//! long they took, and how long readers sat throttled by the QoS limiter.
//!
//! - **Starved** (consumers stall, the buffer is not full, not throttled):
//!   readers are the bottleneck. Grow them by half (at least one), then check
//!   on the next window that storage throughput actually rose by 5%; if it did
//!   not, storage is saturated: go back to the previous count and do not probe
//!   above it again for a while (hysteresis, re-probed later so a faster
//!   device is noticed).
//!   On slow storage (reads of a millisecond or more: a filer's or an
//!   object store's round trip, where concurrency scales much further than
//!   on a local disk) a probe that paid off in proportion to its step is
//!   followed by a step of four times, so that a job reaches hundreds of
//!   reads in flight within a second instead of several; a step of four
//!   that gains less than half of its ratio is cut back to a step of two.
//! - **Buffer-bound** (consumers stall although the buffer is full): the
//!   buffer is too small for the lead the plan needs. Grow it by half.
//! - **Ahead** (no stall and a nearly full buffer for a second): the consumer
//!   is compute-bound. Shrink readers to what Little's law says sustains the
//!   consumer's rate (reads/s x read latency, with 50% headroom) and shrink the
//!   buffer toward a quarter second of consumption.
//! - **Throttled**: the limiter, not the readers, sets the pace; readers are
//!   trimmed to what the allowed rate needs.
//! - **Memory-bound** (consumers stall while readers wait for room in the
//!   node's memory budget, which other jobs' buffers hold): more readers
//!   would only wait with them, so none are added, and readers are trimmed
//!   to what the reads that do fit need.
//! - **Store throttled** (an object store answered 503 SlowDown or 429
//!   during the window): fewer reads in flight, by a quarter each window
//!   it throttles, and that count is a ceiling for a while: asking a
//!   throttling store for more only lengthens its backoff.
//! - **CPU-bound reads** (nearly none of the reads sampled blocked: they
//!   were served from the page cache, not waiting for a device): readers
//!   beyond the node's cores only take turns on them, so the readers are
//!   held to the cores, whatever the other states ask.
//!
//! The tuner never switches itself off: any of these states can follow any
//! other, for as long as the job runs.

use std::ops::ControlFlow;
use std::time::Duration;

/// How often the tuner looks.
pub const TICK: Duration = Duration::from_millis(100);
/// Stall fraction above which consumers are considered starved.
const STALL_HIGH: f64 = 0.05;
/// Stall fraction below which consumers are considered fed.
const STALL_LOW: f64 = 0.01;
/// Buffer occupancy regarded as full.
const FULL: f64 = 0.75;
/// Ticks the "ahead" state must hold before shrinking.
const AHEAD_TICKS: u32 = 10;
/// Ticks an unfruitful reader count stays the ceiling.
const CEILING_TICKS: u32 = 20;
/// Windows a probe is measured over (after its settle window): one window
/// is too noisy on shared storage to condemn a reader count.
const PROBE_WINDOWS: u32 = 2;
/// A probe gaining this much means reads still scale about linearly with
/// readers: the next step doubles instead of adding half.
const LINEAR_GAIN: f64 = 1.4;
/// Reads at least this slow on average wait on a network round trip.
const SLOW_READ: Duration = Duration::from_millis(1);
/// The share of its step a probe on slow storage must gain (its gain over
/// its reader ratio) for the next step to multiply the readers by
/// [`FAST_STEP`].
const FAST_SCALING: f64 = 0.8;
/// Readers are multiplied by this after a proportional probe on slow storage.
const FAST_STEP: u32 = 4;
/// The share of its ratio a step of [`FAST_STEP`] must gain to be kept
/// whole; one that gains less (but enough to keep some) is cut back to a
/// step of two: several jobs probing one filer at once see muted gains,
/// and a step of four kept on a 5% gain left hundreds of readers where
/// dozens read as fast.
const FAST_KEEP: f64 = 0.5;
/// Gain a probe must show to be kept.
const PROBE_GAIN: f64 = 1.05;
/// Consumption the buffer should hold when shrinking, in seconds.
const LEAD_SECONDS: f64 = 0.25;
/// Share of the reads that blocked below which they are CPU-bound (a read
/// from the page cache does not block; one from a disk or a filer does).
const CPU_BOUND: f64 = 0.1;

/// Limits the tuner stays within (settings may change them at any time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min_readers: u32,
    pub max_readers: u32,
    pub min_buffer: u64,
    pub max_buffer: u64,
}

impl Bounds {
    pub fn clamp_readers(&self, n: u32) -> u32 {
        n.clamp(self.min_readers, self.max_readers.max(self.min_readers))
    }

    pub fn clamp_buffer(&self, n: u64) -> u64 {
        n.clamp(self.min_buffer, self.max_buffer.max(self.min_buffer))
    }
}

/// What the job saw during one window.
#[derive(Debug, Clone, Copy, Default)]
pub struct Observation {
    pub elapsed: Duration,
    /// Consumer stall time summed over consumers.
    pub stall: Duration,
    /// Consumers attached to plans during the window (at least 1 if any work).
    pub consumers: u32,
    pub delivered_bytes: u64,
    pub reads: u64,
    /// Sum of storage read latencies.
    pub read_time: Duration,
    /// The share of the local reads sampled in the window that blocked
    /// (`None`: too few sampled).
    pub reads_blocked: Option<f64>,
    /// Time readers spent waiting on the limiter.
    pub throttled: Duration,
    /// Whether readers found no room in the node's memory budget.
    pub memory_short: bool,
    /// Requests the object stores read throttled (503, 429) in the window.
    pub store_throttled: u64,
    /// Buffer bytes in use at the end of the window.
    pub buffer_used: u64,
    /// What the buffer may hold now: its size, or less when the job's share
    /// of the node's memory budget is smaller (0: not known, its size).
    pub buffer_room: u64,
    /// Whether any plan still has entries to fetch.
    pub has_work: bool,
}

/// Why the tuner changed something (for logs and traces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Starved,
    ProbeFailed,
    BufferBound,
    Ahead,
    Throttled,
    CpuBound,
    StoreThrottled,
    MemoryBound,
}

impl Reason {
    pub const ALL: [Self; 8] = [
        Self::Starved,
        Self::ProbeFailed,
        Self::BufferBound,
        Self::Ahead,
        Self::Throttled,
        Self::CpuBound,
        Self::StoreThrottled,
        Self::MemoryBound,
    ];

    /// Returns the metric label for this reason.
    pub fn name(self) -> &'static str {
        match self {
            Self::Starved => "starved",
            Self::ProbeFailed => "probe_failed",
            Self::BufferBound => "buffer_bound",
            Self::Ahead => "ahead",
            Self::Throttled => "throttled",
            Self::CpuBound => "cpu_bound",
            Self::StoreThrottled => "store_throttled",
            Self::MemoryBound => "memory_bound",
        }
    }
}

/// A change the job should apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub readers: u32,
    pub buffer: u64,
    pub reason: Reason,
}

/// One window's measurements, as rates and fractions.
#[derive(Debug, Clone, Copy)]
struct Rates {
    reads_per_s: f64,
    /// Fraction of the window consumers stalled (per consumer).
    stall: f64,
    /// Fraction of the buffer in use.
    occupancy: f64,
    /// Fraction of reader time spent waiting on the limiter.
    throttled: f64,
}

impl Rates {
    fn of(obs: &Observation, secs: f64, buffer: u64, readers: u32) -> Self {
        Self {
            reads_per_s: obs.reads as f64 / secs,
            stall: obs.stall.as_secs_f64() / (secs * f64::from(obs.consumers.max(1))),
            // Full is full of what the buffer may hold: a job whose share
            // of the node's budget is below its buffer size never reaches
            // 75% of the size, and would look starved for readers forever.
            occupancy: obs.buffer_used as f64 / room(buffer, obs.buffer_room).max(1) as f64,
            throttled: obs.throttled.as_secs_f64() / (secs * f64::from(readers)),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Probe {
    from: u32,
    baseline: f64,
    windows: u32,
}

/// Per-job tuner state.
#[derive(Debug)]
pub struct Tuner {
    bounds: Bounds,
    readers: u32,
    buffer: u64,
    probe: Option<Probe>,
    ceiling: Option<(u32, u32)>,
    ahead_ticks: u32,
    settle: bool,
    /// Reads and seconds observed since the last change (its steady rate).
    steady: (u64, f64),
    /// Throughput gain of the last successful probe.
    last_gain: f64,
    /// That gain over the probe's ratio of readers (1.0: throughput grew in
    /// proportion to the readers).
    last_scaling: f64,
    /// Consecutive windows with stalls although the buffer was full.
    full_stalls: u32,
    /// The cores reads can run on at once.
    cores: u32,
    /// Whether the last window's reads were CPU-bound.
    cpu_bound: bool,
}

impl Tuner {
    pub fn new(bounds: Bounds, readers: u32, buffer: u64) -> Self {
        Self {
            readers: bounds.clamp_readers(readers),
            buffer: bounds.clamp_buffer(buffer),
            bounds,
            probe: None,
            ceiling: None,
            ahead_ticks: 0,
            settle: false,
            steady: (0, 0.0),
            last_gain: 2.0,
            last_scaling: 1.0,
            full_stalls: 0,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            cpu_bound: false,
        }
    }

    /// Sets the cores reads can run on at once (the tests' machine).
    #[cfg(test)]
    fn with_cores(mut self, cores: u32) -> Self {
        self.cores = cores;
        self
    }

    pub fn readers(&self) -> u32 {
        self.readers
    }

    pub fn buffer(&self) -> u64 {
        self.buffer
    }

    /// Applies new bounds, clamping the current values into them.
    pub fn set_bounds(&mut self, bounds: Bounds) -> Option<Change> {
        self.bounds = bounds;
        self.probe = None;
        let (readers, buffer) = (
            bounds.clamp_readers(self.readers),
            bounds.clamp_buffer(self.buffer),
        );
        self.apply(readers, buffer, Reason::Starved)
    }

    /// Looks at one window and returns the change to make, if any.
    pub fn observe(&mut self, obs: &Observation) -> Option<Change> {
        let secs = obs.elapsed.as_secs_f64();
        if !obs.has_work || secs <= 0.0 {
            self.ahead_ticks = 0;
            return None;
        }
        if std::mem::take(&mut self.settle) {
            // This window straddled the last change; judge the next one.
            return None;
        }
        self.age_ceiling();
        // Too few reads to tell is not CPU-bound: a job whose readers were
        // held to the cores and whose reads turned slow must grow again.
        self.cpu_bound = obs.reads_blocked.is_some_and(|blocked| blocked < CPU_BOUND);
        if obs.store_throttled > 0 {
            self.probe = None;
            self.ahead_ticks = 0;
            let fewer = self.bounds.clamp_readers(self.readers - self.readers / 4);
            self.ceiling = Some((fewer, CEILING_TICKS));
            return self.apply(fewer, self.buffer, Reason::StoreThrottled);
        }
        let cpu_cap = self.bounds.clamp_readers(self.cores);
        if self.cpu_bound && self.readers > cpu_cap {
            self.probe = None;
            return self.apply(cpu_cap, self.buffer, Reason::CpuBound);
        }
        let rates = Rates::of(obs, secs, self.buffer, self.readers);
        let steady_rate = self.record_steady(obs.reads, secs);
        if let ControlFlow::Break(change) = self.judge_probe(steady_rate, rates.stall) {
            return change;
        }
        if rates.throttled > 0.3 {
            self.ahead_ticks = 0;
            return self.trim_to_need(rates.reads_per_s, obs, Reason::Throttled);
        }
        if rates.stall > STALL_HIGH {
            self.ahead_ticks = 0;
            if obs.memory_short {
                self.full_stalls = 0;
                return self.trim_to_need(rates.reads_per_s, obs, Reason::MemoryBound);
            }
            let slow = !self.cpu_bound && mean_latency(obs) >= SLOW_READ;
            return self.feed_starved(rates.occupancy, steady_rate, slow);
        }
        self.full_stalls = 0;
        self.shrink_when_ahead(&rates, obs, secs)
    }

    /// Counts down the tick that lifts the reader ceiling.
    fn age_ceiling(&mut self) {
        if let Some((_, ticks)) = self.ceiling.as_mut() {
            *ticks = ticks.saturating_sub(1);
            if *ticks == 0 {
                self.ceiling = None;
            }
        }
    }

    /// Adds a window to the steady totals since the last change and returns
    /// their read rate.
    fn record_steady(&mut self, reads: u64, secs: f64) -> f64 {
        self.steady.0 += reads;
        self.steady.1 += secs;
        self.steady.0 as f64 / self.steady.1
    }

    /// Judges a running probe once it has been measured long enough: undoes
    /// it (and sets a ceiling) if throughput did not rise while consumers
    /// still stall. Breaks with the answer for this window while the probe
    /// is being measured or when it is undone.
    fn judge_probe(&mut self, steady_rate: f64, stall: f64) -> ControlFlow<Option<Change>> {
        let Some(probe) = self.probe.as_mut() else {
            return ControlFlow::Continue(());
        };
        probe.windows += 1;
        if probe.windows < PROBE_WINDOWS {
            return ControlFlow::Break(None);
        }
        let probe = self.probe.take().expect("checked above");
        let gain = steady_rate / probe.baseline.max(f64::MIN_POSITIVE);
        if gain < PROBE_GAIN && stall > STALL_HIGH {
            self.ceiling = Some((probe.from, CEILING_TICKS));
            self.last_gain = 0.0;
            self.last_scaling = 0.0;
            return ControlFlow::Break(self.apply(probe.from, self.buffer, Reason::ProbeFailed));
        }
        let ratio = f64::from(self.readers) / f64::from(probe.from.max(1));
        if ratio >= f64::from(FAST_STEP) && gain < ratio * FAST_KEEP {
            // A step of four that paid off by less than half of it: storage
            // stopped scaling on the way. Keep the step of two that was
            // the alternative, and take the next one carefully.
            self.last_gain = 0.0;
            self.last_scaling = 0.0;
            let two = self.bounds.clamp_readers(probe.from.saturating_mul(2));
            return ControlFlow::Break(self.apply(two, self.buffer, Reason::ProbeFailed));
        }
        self.last_gain = gain;
        self.last_scaling = gain / ratio;
        ControlFlow::Continue(())
    }

    /// Throttled, or short of memory: trims readers to what the rate that
    /// gets through needs.
    fn trim_to_need(
        &mut self,
        reads_per_s: f64,
        obs: &Observation,
        reason: Reason,
    ) -> Option<Change> {
        let needed = self.little(reads_per_s, obs);
        (needed < self.readers)
            .then(|| self.apply(needed, self.buffer, reason))
            .flatten()
    }

    /// Consumers stall: grows the buffer if it is full, the readers if not.
    fn feed_starved(&mut self, occupancy: f64, steady_rate: f64, slow: bool) -> Option<Change> {
        if occupancy >= FULL {
            // Twice in a row: a single window can hold both the stall of
            // a new plan's first batch and the buffer filling after it.
            self.full_stalls += 1;
            if self.full_stalls < 2 {
                return None;
            }
            self.full_stalls = 0;
            let buffer = self.bounds.clamp_buffer(self.buffer + self.buffer / 2);
            return self.apply(self.readers, buffer, Reason::BufferBound);
        }
        self.full_stalls = 0;
        self.probe_more_readers(steady_rate, slow)
    }

    /// Grows the readers by half (doubles them after a linear gain, and
    /// multiplies them by four on `slow` storage after a proportional
    /// one), up to the ceiling, and starts a probe that checks the growth
    /// paid off.
    fn probe_more_readers(&mut self, steady_rate: f64, slow: bool) -> Option<Change> {
        let mut ceiling = self.ceiling.map_or(u32::MAX, |(c, _)| c);
        if self.cpu_bound {
            ceiling = ceiling.min(self.cores);
        }
        let step = if slow && self.last_scaling >= FAST_SCALING {
            self.readers * (FAST_STEP - 1)
        } else if self.last_gain >= LINEAR_GAIN {
            self.readers
        } else {
            (self.readers / 2).max(1)
        };
        let grown = self
            .bounds
            .clamp_readers((self.readers + step).min(ceiling));
        if grown <= self.readers {
            return None;
        }
        self.probe = Some(Probe {
            from: self.readers,
            baseline: steady_rate,
            windows: 0,
        });
        self.apply(grown, self.buffer, Reason::Starved)
    }

    /// Fed with a nearly full buffer for long enough: shrinks readers to
    /// what sustains the consumer and the buffer toward its lead.
    fn shrink_when_ahead(&mut self, rates: &Rates, obs: &Observation, secs: f64) -> Option<Change> {
        if !(rates.stall < STALL_LOW && rates.occupancy >= FULL) {
            self.ahead_ticks = 0;
            return None;
        }
        self.ahead_ticks += 1;
        if self.ahead_ticks < AHEAD_TICKS {
            return None;
        }
        self.ahead_ticks = 0;
        let readers = self.little(rates.reads_per_s, obs).min(self.readers);
        let consumed = obs.delivered_bytes as f64 / secs;
        let floor = (consumed * LEAD_SECONDS) as u64;
        let buffer = self
            .bounds
            .clamp_buffer(floor.max(self.buffer * 4 / 5))
            .min(self.buffer);
        self.apply(readers, buffer, Reason::Ahead)
    }

    /// Readers needed to sustain `reads_per_s` at the observed latency, with
    /// 50% headroom (Little's law: concurrency = throughput x latency).
    fn little(&self, reads_per_s: f64, obs: &Observation) -> u32 {
        let latency = mean_latency(obs).as_secs_f64();
        let needed = (reads_per_s * latency * 1.5).ceil() as u32 + 1;
        self.bounds.clamp_readers(needed)
    }

    fn apply(&mut self, readers: u32, buffer: u64, reason: Reason) -> Option<Change> {
        if readers == self.readers && buffer == self.buffer {
            return None;
        }
        self.readers = readers;
        self.buffer = buffer;
        self.settle = true;
        self.steady = (0, 0.0);
        Some(Change {
            readers,
            buffer,
            reason,
        })
    }
}

/// The bytes a buffer of `buffer` may hold when the memory budget allows
/// it `room` (0: not known).
fn room(buffer: u64, room: u64) -> u64 {
    if room == 0 { buffer } else { buffer.min(room) }
}

/// The mean latency of the window's storage reads (zero without reads).
fn mean_latency(obs: &Observation) -> Duration {
    if obs.reads == 0 {
        Duration::ZERO
    } else {
        obs.read_time.div_f64(obs.reads as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn bounds() -> Bounds {
        Bounds {
            min_readers: 1,
            max_readers: 64,
            min_buffer: 8 * MIB,
            max_buffer: 512 * MIB,
        }
    }

    /// A device that scales linearly up to `best` readers, 5000 reads/s each.
    fn starved_window(readers: u32, best: u32) -> Observation {
        let reads = u64::from(readers.min(best)) * 1000;
        Observation {
            elapsed: TICK,
            stall: TICK.mul_f64(0.5),
            consumers: 1,
            delivered_bytes: reads * 100 * 1024,
            reads,
            read_time: Duration::from_micros(200) * reads as u32,
            buffer_used: 0,
            has_work: true,
            ..Default::default()
        }
    }

    fn run(tuner: &mut Tuner, window: impl Fn(u32) -> Observation, ticks: usize) -> Vec<u32> {
        (0..ticks)
            .map(|_| {
                tuner.observe(&window(tuner.readers()));
                tuner.readers()
            })
            .collect()
    }

    #[test]
    fn grows_from_one_reader_to_the_device_limit_and_stops() {
        let mut t = Tuner::new(bounds(), 1, 64 * MIB);
        let trace = run(&mut t, |r| starved_window(r, 16), 40);
        // Within 25 ticks (2.5 s) it is at 90% of the best count and stays.
        assert!(trace[24] >= 15, "{trace:?}");
        assert!(
            trace[24..].iter().all(|&r| (15..=24).contains(&r)),
            "{trace:?}"
        );
    }

    /// A filer (10 ms a read) that scales linearly up to `best` readers.
    fn slow_starved_window(readers: u32, best: u32) -> Observation {
        let reads = u64::from(readers.min(best)) * 10;
        Observation {
            read_time: Duration::from_millis(10) * reads as u32,
            reads,
            delivered_bytes: reads * 100 * 1024,
            ..starved_window(readers, best)
        }
    }

    /// A tuner at its initial 16 readers with a remote store's ceiling.
    fn remote_tuner() -> Tuner {
        let bounds = Bounds {
            max_readers: 512,
            ..bounds()
        };
        Tuner::new(bounds, 16, 64 * MIB)
    }

    #[test]
    fn slow_storage_that_scales_is_given_reads_in_flight_four_times_at_a_step() {
        let mut t = remote_tuner();
        let trace = run(&mut t, |r| slow_starved_window(r, 200), 40);
        // 16 -> 64 -> 256 in two probes, where steps of two take four;
        // then one more step, which does not pay off and is undone.
        assert_eq!(&trace[..7], &[64, 64, 64, 256, 256, 256, 512], "{trace:?}");
        assert!(trace[9..29].iter().all(|&r| r == 256), "{trace:?}");
        // A local disk's fast reads keep the steps of two.
        let mut t = remote_tuner();
        let trace = run(&mut t, |r| starved_window(r, 300), 7);
        assert_eq!(&trace[..7], &[32, 32, 32, 64, 64, 64, 128], "{trace:?}");
    }

    #[test]
    fn a_step_of_four_past_where_storage_stops_scaling_is_cut_back_to_two() {
        let mut t = remote_tuner();
        let trace = run(&mut t, |r| slow_starved_window(r, 100), 30);
        // 64 -> 256 gains 1.56x for 4x the readers: back to 128, then a
        // step of half, which pays nothing and is undone.
        assert_eq!(&trace[..7], &[64, 64, 64, 256, 256, 256, 128], "{trace:?}");
        assert!(trace[12..].iter().all(|&r| r == 128), "{trace:?}");
    }

    #[test]
    fn readers_short_of_memory_are_not_grown_but_trimmed() {
        // Another job's buffers hold the node's budget: 40 reads of 10 ms
        // fit per window whatever the readers, and consumers stall.
        let squeezed = |_r: u32| Observation {
            memory_short: true,
            ..slow_starved_window(4, 4)
        };
        let mut t = Tuner::new(
            Bounds {
                max_readers: 512,
                ..bounds()
            },
            64,
            64 * MIB,
        );
        let trace = run(&mut t, squeezed, 20);
        // 400 reads/s x 10 ms x 1.5, plus one: 7 readers.
        assert_eq!(trace[0], 7, "{trace:?}");
        assert!(trace.iter().all(|&r| r == 7), "{trace:?}");
    }

    #[test]
    fn a_probe_that_does_not_pay_off_is_undone() {
        let mut t = Tuner::new(bounds(), 16, 64 * MIB);
        t.last_gain = 1.0;
        assert_eq!(t.observe(&starved_window(16, 16)).unwrap().readers, 24);
        t.observe(&starved_window(24, 16)); // settle window
        assert_eq!(
            t.observe(&starved_window(24, 16)),
            None,
            "a probe is judged over two windows"
        );
        let change = t.observe(&starved_window(24, 16)).unwrap();
        assert_eq!((change.readers, change.reason), (16, Reason::ProbeFailed));
        // It does not probe above the ceiling right away.
        t.observe(&starved_window(16, 16));
        assert_eq!(t.observe(&starved_window(16, 16)), None);
    }

    #[test]
    fn lowers_readers_and_buffer_for_a_compute_bound_consumer() {
        let mut t = Tuner::new(bounds(), 32, 256 * MIB);
        let ahead = Observation {
            elapsed: TICK,
            stall: Duration::ZERO,
            consumers: 1,
            delivered_bytes: 20 * MIB,
            reads: 200,
            read_time: Duration::from_micros(300) * 200,
            buffer_used: 250 * MIB,
            has_work: true,
            ..Default::default()
        };
        let mut trace = Vec::new();
        for _ in 0..60 {
            let obs = Observation {
                buffer_used: t.buffer(),
                ..ahead
            };
            t.observe(&obs);
            trace.push((t.readers(), t.buffer()));
        }
        let (readers, buffer) = *trace.last().unwrap();
        assert!(readers <= 3, "{trace:?}");
        assert!(
            (25 * MIB..256 * MIB).contains(&buffer),
            "keeps a quarter second of lead: {trace:?}"
        );
        // Demand comes back: it grows again (never latched off).
        let starved = starved_window(readers, 16);
        assert!(t.observe(&starved).is_some_and(|c| c.readers > readers));
    }

    #[test]
    fn a_buffer_full_of_what_the_memory_budget_allows_counts_as_full() {
        // The job's share of the node's budget is 64 MiB of its 256 MiB
        // buffer, and that share is full: compute-bound, not starved.
        let mut t = Tuner::new(bounds(), 32, 256 * MIB);
        let full_share = Observation {
            elapsed: TICK,
            consumers: 1,
            delivered_bytes: 2 * MIB,
            reads: 20,
            read_time: Duration::from_millis(10) * 20,
            buffer_used: 60 * MIB,
            buffer_room: 64 * MIB,
            has_work: true,
            ..Default::default()
        };
        let trace = run(&mut t, |_| full_share, 12);
        assert!(trace.last() < Some(&8), "{trace:?}");
        // With a stall on top it is the buffer, not the readers, that is
        // short: the readers do not grow.
        let stalled = Observation {
            stall: TICK.mul_f64(0.5),
            ..full_share
        };
        let readers = t.readers();
        let trace = run(&mut t, |_| stalled, 12);
        assert!(trace.iter().all(|&r| r <= readers), "{trace:?}");
    }

    #[test]
    fn full_buffer_with_stalls_grows_the_buffer() {
        let mut t = Tuner::new(bounds(), 8, 16 * MIB);
        let obs = Observation {
            buffer_used: 16 * MIB,
            ..starved_window(8, 8)
        };
        assert_eq!(t.observe(&obs), None, "one window is not enough");
        let change = t.observe(&obs).unwrap();
        assert_eq!(
            (change.reason, change.buffer),
            (Reason::BufferBound, 24 * MIB)
        );
    }

    #[test]
    fn throttled_jobs_do_not_grow() {
        let mut t = Tuner::new(bounds(), 16, 64 * MIB);
        // The limiter allows 1000 reads/s: readers spend most of the window waiting on it.
        let obs = Observation {
            throttled: TICK * 12,
            reads: 200,
            read_time: Duration::from_micros(200) * 200,
            ..starved_window(16, 64)
        };
        let change = t.observe(&obs).unwrap();
        assert_eq!(change.reason, Reason::Throttled);
        assert!(change.readers < 16);
    }

    #[test]
    fn bounds_are_respected() {
        let tight = Bounds {
            min_readers: 2,
            max_readers: 4,
            ..bounds()
        };
        let mut t = Tuner::new(tight, 1, 64 * MIB);
        assert_eq!(t.readers(), 2);
        let trace = run(&mut t, |r| starved_window(r, 64), 20);
        assert!(trace.iter().all(|&r| (2..=4).contains(&r)), "{trace:?}");
        assert_eq!(
            t.set_bounds(Bounds {
                max_readers: 3,
                ..tight
            })
            .unwrap()
            .readers,
            3
        );
    }

    #[test]
    fn reads_on_the_cpu_are_held_to_the_cores() {
        let mut t = Tuner::new(bounds(), 16, 64 * MIB).with_cores(4);
        let on_cpu = |r| Observation {
            reads_blocked: Some(0.02),
            ..starved_window(r, 64)
        };
        let change = t.observe(&on_cpu(16)).unwrap();
        assert_eq!((change.reason, change.readers), (Reason::CpuBound, 4));
        // Starved all the same: more readers would only take turns.
        let trace = run(&mut t, on_cpu, 40);
        assert!(trace.iter().all(|&r| r <= 4), "{trace:?}");
        // Reads that wait for a device again: the readers grow.
        let waiting = |r| Observation {
            reads_blocked: Some(0.9),
            ..starved_window(r, 64)
        };
        let trace = run(&mut t, waiting, 40);
        assert!(trace.last() > Some(&4), "{trace:?}");
        // Held to the cores, then reads so slow that few are sampled.
        let mut t = Tuner::new(bounds(), 16, 64 * MIB).with_cores(2);
        run(&mut t, on_cpu, 4);
        assert_eq!(t.readers(), 2);
        let trace = run(&mut t, |r| starved_window(r, 64), 40);
        assert!(trace.last() > Some(&2), "{trace:?}");
    }

    #[test]
    fn a_throttling_store_gets_fewer_reads_in_flight() {
        let mut t = Tuner::new(bounds(), 64, 64 * MIB);
        let throttled = |r| Observation {
            store_throttled: 5,
            ..starved_window(r, 128)
        };
        let change = t.observe(&throttled(64)).unwrap();
        assert_eq!(
            (change.reason, change.readers),
            (Reason::StoreThrottled, 48)
        );
        let trace = run(&mut t, throttled, 10);
        assert!(trace.windows(2).all(|w| w[1] <= w[0]), "{trace:?}");
        let low = t.readers();
        assert!(low < 20, "{trace:?}");
        // The storm over, consumers still starved: no growth at once ...
        let trace = run(
            &mut t,
            |r| starved_window(r, 128),
            CEILING_TICKS as usize / 2,
        );
        assert!(trace.iter().all(|&r| r <= low), "{trace:?}");
        // ... and probing again later.
        let trace = run(&mut t, |r| starved_window(r, 128), 60);
        assert!(trace.last() > Some(&low), "{trace:?}");
    }

    #[test]
    fn idle_jobs_change_nothing() {
        let mut t = Tuner::new(bounds(), 4, 64 * MIB);
        assert_eq!(
            t.observe(&Observation {
                elapsed: TICK,
                ..Default::default()
            }),
            None
        );
    }
}
