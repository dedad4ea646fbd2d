//! The per-job QoS limiter: two token buckets, one for bytes and one for
//! operations, refilled continuously, with a burst of `rate x window`.
//!
//! A read asks for its size in bytes and one operation. It waits until both
//! buckets hold enough, then takes from both. A request larger than a whole
//! burst is let through once the bucket is full and drives the balance
//! negative, so the long-run rate stays exact for any sample size. Limits can
//! change at any time; readers already waiting re-check within a few
//! milliseconds and see the new rate.
//!
//! While a limit is in force, reads go through in the order they took their
//! [`Ticket`]s: a job's readers take theirs as they pick work in plan order,
//! so the sample the trainer waits for first is not passed over by a later
//! one whose reader happened to reach the limiter first (with a bucket that
//! lets one sample through a minute, that later sample took the minute and
//! the trainer waited two).

use crate::sync::lock;
use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard};
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

impl Limits {
    fn unlimited(&self) -> bool {
        self.bytes_per_s.is_none() && self.ops_per_s.is_none()
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

/// The line of tickets: `head` is the oldest not yet through (or given
/// up); tickets done before their turn wait in `done_early` for it.
#[derive(Debug, Default)]
struct Line {
    next: u64,
    head: u64,
    done_early: BTreeSet<u64>,
    /// Readers waiting for their turn (woken when the head moves).
    waiting: usize,
}

impl Line {
    /// Marks ticket `n` done; true when the head moved.
    fn done(&mut self, n: u64) -> bool {
        if n != self.head {
            self.done_early.insert(n);
            return false;
        }
        self.head += 1;
        while self.done_early.remove(&self.head) {
            self.head += 1;
        }
        true
    }
}

#[derive(Debug)]
struct State {
    limits: Limits,
    bytes: Bucket,
    ops: Bucket,
    last: Instant,
    line: Line,
}

/// A live-adjustable limiter on bytes/s and operations/s.
#[derive(Debug)]
pub struct TokenBucket {
    state: Mutex<State>,
    turn: Condvar,
}

/// A read's place in the limiter's line, taken when the read is chosen and
/// given back (through, or given up) when dropped. Taken while the job is
/// unlimited, it holds no place: such reads go in any order.
#[derive(Debug)]
pub struct Ticket<'a> {
    bucket: &'a TokenBucket,
    place: Option<u64>,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let Some(n) = self.place else { return };
        let mut s = lock(&self.bucket.state);
        if s.line.done(n) && s.line.waiting > 0 {
            self.bucket.turn.notify_all();
        }
    }
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
                line: Line::default(),
            }),
            turn: Condvar::new(),
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
        if limits.unlimited() && s.line.waiting > 0 {
            self.turn.notify_all();
        }
    }

    /// Gives back what a read took and did not make (by its turn, its
    /// sample had come into the node cache): `bytes` and one operation, up
    /// to what the buckets hold when full.
    pub fn refund(&self, bytes: u64) {
        let mut s = lock(&self.state);
        let limits = s.limits;
        if limits.unlimited() {
            return;
        }
        s.refill(Instant::now());
        if let Some(rate) = limits.bytes_per_s {
            s.bytes.tokens = (s.bytes.tokens + bytes as f64).min(capacity(rate, limits.burst));
        }
        if let Some(rate) = limits.ops_per_s {
            s.ops.tokens = (s.ops.tokens + 1.0).min(capacity(rate, limits.burst));
        }
        if s.line.waiting > 0 {
            self.turn.notify_all();
        }
    }

    /// Whether limits are in force (a read may have to wait).
    pub fn limited(&self) -> bool {
        !lock(&self.state).limits.unlimited()
    }

    /// Takes a place in line for a read about to ask for its bytes.
    pub fn ticket(&self) -> Ticket<'_> {
        let mut s = lock(&self.state);
        let place = (!s.limits.unlimited()).then(|| {
            s.line.next += 1;
            s.line.next - 1
        });
        Ticket {
            bucket: self,
            place,
        }
    }

    /// Takes `bytes` and one operation if both are available now; otherwise
    /// returns how long to wait before asking again, out of line.
    #[cfg(test)]
    fn try_acquire(&self, bytes: u64) -> Result<(), Duration> {
        lock(&self.state).take(bytes)
    }

    /// Blocks the calling (reader) thread until it is `ticket`'s turn and
    /// `bytes` and one operation may go, telling `napped` of each nap as it
    /// ends (a wait that outlasts the tuner's window counts in that window,
    /// not only once it is over); asks `wanted` between naps and gives up,
    /// taking nothing, when it says no (false): a caller that may stop
    /// wanting the bytes meanwhile. Either way the ticket's place goes to
    /// the next in line.
    pub fn acquire_blocking_while(
        &self,
        ticket: Ticket<'_>,
        bytes: u64,
        mut wanted: impl FnMut() -> bool,
        mut napped: impl FnMut(Duration),
    ) -> bool {
        loop {
            let wait = {
                let mut s = lock(&self.state);
                match ticket.place {
                    Some(n) if n != s.line.head && !s.limits.unlimited() => None,
                    _ => match s.take(bytes) {
                        Ok(()) => return true,
                        Err(wait) => Some(wait.min(MAX_NAP)),
                    },
                }
            };
            // `wanted` may take the job's lock, which is held while tickets
            // are taken: never call it with the limiter's lock held.
            if !wanted() {
                return false;
            }
            let nap = Instant::now();
            match wait {
                Some(wait) => std::thread::sleep(wait),
                None => self.wait_for_turn(lock(&self.state), ticket.place),
            }
            napped(nap.elapsed());
        }
    }

    /// Sleeps until the head of the line moves (or the limit is lifted),
    /// for at most [`MAX_NAP`].
    fn wait_for_turn(&self, mut s: MutexGuard<'_, State>, place: Option<u64>) {
        if place == Some(s.line.head) || s.limits.unlimited() {
            return;
        }
        s.line.waiting += 1;
        let (mut s, _) = self
            .turn
            .wait_timeout(s, MAX_NAP)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        s.line.waiting -= 1;
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

    /// Takes `bytes` and one operation if both buckets hold enough now.
    fn take(&mut self, bytes: u64) -> Result<(), Duration> {
        let limits = self.limits;
        if limits.unlimited() {
            return Ok(());
        }
        self.refill(Instant::now());
        let wait = self
            .bytes
            .wait_for(limits.bytes_per_s, limits.burst, bytes as f64)
            .max(self.ops.wait_for(limits.ops_per_s, limits.burst, 1.0));
        if wait > 0.0 {
            return Err(Duration::from_secs_f64(wait));
        }
        if limits.bytes_per_s.is_some() {
            self.bytes.tokens -= bytes as f64;
        }
        if limits.ops_per_s.is_some() {
            self.ops.tokens -= 1.0;
        }
        Ok(())
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
    fn a_refund_gives_back_up_to_a_full_bucket() {
        // 1,000 B/s with a 100 ms burst: the bucket holds 100 bytes.
        let tb = limited(Some(1000), Some(10));
        assert!(tb.try_acquire(100).is_ok());
        assert!(tb.try_acquire(50).is_err());
        tb.refund(100);
        assert!(
            tb.try_acquire(100).is_ok(),
            "the bytes and the operation came back"
        );
        tb.refund(10_000);
        assert!(tb.try_acquire(100).is_ok());
        assert!(
            tb.try_acquire(50).is_err(),
            "no more than a full bucket came back"
        );
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
            tb.ticket(),
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
    fn limited_reads_go_through_in_ticket_order() {
        // One read a minute: the first ticket's read takes the full bucket
        // even when the second's reaches the limiter first.
        let tb = limited(Some(1000), None);
        let (first, second) = (tb.ticket(), tb.ticket());
        let through = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let stop = Instant::now() + Duration::from_secs(2);
                let taken =
                    tb.acquire_blocking_while(second, 60_000, || Instant::now() < stop, |_| {});
                through.store(taken, std::sync::atomic::Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                tb.acquire_blocking_while(first, 60_000, || false, |_| {}),
                "the head of the line goes on the full bucket"
            );
        });
        assert!(
            !std::sync::atomic::AtomicBool::into_inner(through),
            "the second read waits for the minute the first one's bytes take"
        );
        // A ticket given up passes its turn on; one taken unlimited has none.
        let tb = limited(Some(1000), None);
        drop(tb.ticket());
        assert!(tb.acquire_blocking_while(tb.ticket(), 10, || false, |_| {}));
        let unlimited = TokenBucket::new(Limits::default());
        let early = unlimited.ticket();
        assert!(unlimited.acquire_blocking_while(unlimited.ticket(), 1 << 30, || false, |_| {}));
        drop(early);
    }

    #[test]
    fn lifting_the_limit_lets_the_line_go_at_once() {
        let tb = limited(Some(1000), None);
        let head = tb.ticket();
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let stop = Instant::now() + Duration::from_secs(5);
                tb.acquire_blocking_while(tb.ticket(), 1 << 20, || Instant::now() < stop, |_| {})
            });
            std::thread::sleep(Duration::from_millis(50));
            tb.set_limits(Limits::default());
            assert!(waiter.join().unwrap(), "lifted while waiting its turn");
        });
        drop(head);
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
