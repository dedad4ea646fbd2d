//! The per-job QoS limiter: two token buckets, one for bytes and one for
//! operations, refilled continuously, with a burst of `rate x window`.
//!
//! A read asks for its size in bytes and one operation. It waits until both
//! buckets hold enough, then takes from both. A request larger than a whole
//! burst is let through once the bucket is full and drives the balance
//! negative, so the long-run rate stays exact for any sample size. Limits can
//! change at any time; readers already waiting re-check within a few
//! milliseconds and see the new rate.

use crate::sync::lock;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Longest single sleep while waiting for tokens, so a raised limit is seen
/// quickly by readers that are already waiting.
const MAX_NAP: Duration = Duration::from_millis(20);

/// Limits in force: `None` means unlimited.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub bytes_per_s: Option<u64>,
    pub ops_per_s: Option<u64>,
    /// The burst window: a full bucket holds `rate x burst`.
    pub burst: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            bytes_per_s: None,
            ops_per_s: None,
            burst: Duration::from_millis(100),
        }
    }
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
}

impl Bucket {
    fn refill(&mut self, rate: Option<u64>, burst: Duration, elapsed: f64) {
        if let Some(rate) = rate {
            let cap = capacity(rate, burst);
            self.tokens = (self.tokens + rate as f64 * elapsed).min(cap);
        }
    }

    /// Seconds until `cost` can be taken (0 when it can be now).
    fn wait_for(&self, rate: Option<u64>, burst: Duration, cost: f64) -> f64 {
        let Some(rate) = rate else { return 0.0 };
        // A request bigger than the burst needs a full bucket, not more.
        let need = cost.min(capacity(rate, burst));
        if self.tokens >= need {
            0.0
        } else {
            (need - self.tokens) / rate.max(1) as f64
        }
    }
}

fn capacity(rate: u64, burst: Duration) -> f64 {
    (rate as f64 * burst.as_secs_f64()).max(1.0)
}

#[derive(Debug)]
struct State {
    limits: Limits,
    bytes: Bucket,
    ops: Bucket,
    last: Instant,
}

/// A live-adjustable limiter on bytes/s and operations/s.
#[derive(Debug)]
pub struct TokenBucket {
    state: Mutex<State>,
}

impl TokenBucket {
    /// Creates a limiter whose buckets start full.
    pub fn new(limits: Limits) -> Self {
        let full = |rate: Option<u64>| Bucket {
            tokens: rate.map_or(0.0, |r| capacity(r, limits.burst)),
        };
        Self {
            state: Mutex::new(State {
                bytes: full(limits.bytes_per_s),
                ops: full(limits.ops_per_s),
                limits,
                last: Instant::now(),
            }),
        }
    }

    /// Returns the limits in force.
    pub fn limits(&self) -> Limits {
        lock(&self.state).limits
    }

    /// Changes the limits. Tokens already earned are kept (up to the new
    /// burst); a bucket that was unlimited starts full.
    pub fn set_limits(&self, limits: Limits) {
        let mut s = lock(&self.state);
        s.refill(Instant::now());
        if s.limits.bytes_per_s.is_none() {
            s.bytes.tokens = limits
                .bytes_per_s
                .map_or(0.0, |r| capacity(r, limits.burst));
        }
        if s.limits.ops_per_s.is_none() {
            s.ops.tokens = limits.ops_per_s.map_or(0.0, |r| capacity(r, limits.burst));
        }
        if let Some(r) = limits.bytes_per_s {
            s.bytes.tokens = s.bytes.tokens.min(capacity(r, limits.burst));
        }
        if let Some(r) = limits.ops_per_s {
            s.ops.tokens = s.ops.tokens.min(capacity(r, limits.burst));
        }
        s.limits = limits;
    }

    /// Takes `bytes` and one operation if both are available now; otherwise
    /// returns how long to wait before asking again.
    pub fn try_acquire(&self, bytes: u64) -> Result<(), Duration> {
        let mut s = lock(&self.state);
        let limits = s.limits;
        if limits.bytes_per_s.is_none() && limits.ops_per_s.is_none() {
            return Ok(());
        }
        s.refill(Instant::now());
        let wait = s
            .bytes
            .wait_for(limits.bytes_per_s, limits.burst, bytes as f64)
            .max(s.ops.wait_for(limits.ops_per_s, limits.burst, 1.0));
        if wait > 0.0 {
            return Err(Duration::from_secs_f64(wait));
        }
        if limits.bytes_per_s.is_some() {
            s.bytes.tokens -= bytes as f64;
        }
        if limits.ops_per_s.is_some() {
            s.ops.tokens -= 1.0;
        }
        Ok(())
    }

    /// Blocks the calling (reader) thread until `bytes` and one operation may
    /// go, telling `napped` of each nap as it ends (a wait that outlasts
    /// the tuner's window counts in that window, not only once it is over);
    /// asks `wanted` between naps and gives up, taking nothing, when it
    /// says no (false): a caller that may stop wanting the bytes meanwhile.
    pub fn acquire_blocking_while(
        &self,
        bytes: u64,
        mut wanted: impl FnMut() -> bool,
        mut napped: impl FnMut(Duration),
    ) -> bool {
        while let Err(wait) = self.try_acquire(bytes) {
            if !wanted() {
                return false;
            }
            let nap = Instant::now();
            std::thread::sleep(wait.min(MAX_NAP));
            napped(nap.elapsed());
        }
        true
    }
}

impl State {
    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.bytes
            .refill(self.limits.bytes_per_s, self.limits.burst, elapsed);
        self.ops
            .refill(self.limits.ops_per_s, self.limits.burst, elapsed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(bytes: Option<u64>, ops: Option<u64>) -> TokenBucket {
        TokenBucket::new(Limits {
            bytes_per_s: bytes,
            ops_per_s: ops,
            burst: Duration::from_millis(100),
        })
    }

    #[test]
    fn unlimited_never_waits() {
        let tb = TokenBucket::new(Limits::default());
        for _ in 0..10_000 {
            assert!(tb.try_acquire(1 << 30).is_ok());
        }
    }

    #[test]
    fn a_long_wait_is_told_nap_by_nap_and_a_caller_may_give_up() {
        // 10 kB at 1000 B/s went through on a full bucket: the next read
        // waits ten seconds, and is given up after a tenth of one.
        let tb = limited(Some(1000), None);
        assert!(tb.try_acquire(10_000).is_ok());
        let start = Instant::now();
        let (mut naps, mut told) = (0, Duration::ZERO);
        let taken = tb.acquire_blocking_while(
            100,
            || start.elapsed() < Duration::from_millis(100),
            |nap| {
                naps += 1;
                told += nap;
            },
        );
        assert!(!taken);
        assert!(naps >= 4, "{naps} naps");
        assert!(told >= Duration::from_millis(80), "{told:?}");
    }

    #[test]
    fn burst_then_wait_proportional_to_the_deficit() {
        // 1000 B/s with a 100 ms window: 100 bytes of burst.
        let tb = limited(Some(1000), None);
        assert!(tb.try_acquire(60).is_ok());
        assert!(tb.try_acquire(40).is_ok());
        let wait = tb.try_acquire(50).unwrap_err();
        assert!(
            wait > Duration::from_millis(40) && wait <= Duration::from_millis(51),
            "{wait:?}"
        );
    }

    #[test]
    fn ops_limit_counts_operations_not_bytes() {
        let tb = limited(None, Some(100)); // burst of 10 ops
        for _ in 0..10 {
            assert!(tb.try_acquire(1 << 20).is_ok());
        }
        assert!(tb.try_acquire(1).is_err());
    }

    #[test]
    fn oversized_requests_pass_on_a_full_bucket_and_leave_debt() {
        let tb = limited(Some(1000), None);
        assert!(
            tb.try_acquire(500).is_ok(),
            "a full bucket lets a 5x-burst request through"
        );
        let wait = tb.try_acquire(1).unwrap_err();
        assert!(
            wait >= Duration::from_millis(390),
            "the debt is paid before anything else: {wait:?}"
        );
    }

    #[test]
    fn limits_change_live() {
        let tb = limited(Some(1000), None);
        assert!(tb.try_acquire(100).is_ok());
        assert!(tb.try_acquire(100).is_err());
        tb.set_limits(Limits {
            bytes_per_s: None,
            ..tb.limits()
        });
        assert!(
            tb.try_acquire(1 << 30).is_ok(),
            "lifting the limit takes effect at once"
        );
        tb.set_limits(Limits {
            bytes_per_s: Some(1_000_000),
            ..tb.limits()
        });
        assert!(
            tb.try_acquire(50_000).is_ok(),
            "a newly limited bucket starts full"
        );
    }

    /// Accuracy over simulated time: the token arithmetic, not the scheduler.
    #[test]
    fn long_run_rate_is_exact() {
        let tb = limited(Some(10_000_000), Some(2000));
        let mut s = tb.state.lock().unwrap();
        let start = s.last;
        let mut now = start;
        let (mut bytes, mut ops) = (0u64, 0u64);
        let sample = 102_400u64;
        while now < start + Duration::from_secs(10) {
            s.refill(now);
            let limits = s.limits;
            let wait = s
                .bytes
                .wait_for(limits.bytes_per_s, limits.burst, sample as f64)
                .max(s.ops.wait_for(limits.ops_per_s, limits.burst, 1.0));
            if wait > 0.0 {
                now += Duration::from_secs_f64(wait);
                continue;
            }
            s.bytes.tokens -= sample as f64;
            s.ops.tokens -= 1.0;
            bytes += sample;
            ops += 1;
        }
        let rate = bytes as f64 / 10.0;
        // The byte limit binds (97.6 samples/s < 2000 ops/s); one burst of slack.
        assert!((rate / 10_000_000.0 - 1.0).abs() < 0.02, "{rate}");
        assert!(ops < 2000 * 10);
    }
}
