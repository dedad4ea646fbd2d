//! Pacing: spreading retries so that many waiters do not come back at
//! once, and warnings about something that happens per sample logged at
//! most every so often, with how many times it happened meanwhile.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `wait` less up to `spread` of it (0 to 1), chosen from the clock: stages
/// that lost one controller, or pages one store throttled together, do not
/// all come back at once.
pub fn jittered(wait: Duration, spread: f64) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    wait.mul_f64(1.0 - spread * f64::from(nanos % 1000) / 1000.0)
}

/// Occurrences of something worth a warning, and when one was last logged.
#[derive(Debug)]
pub struct Sparse {
    since: u64,
    logged: Option<Instant>,
}

impl Sparse {
    pub const fn new() -> Self {
        Self {
            since: 0,
            logged: None,
        }
    }

    /// Counts one occurrence; when no warning was logged within `every`,
    /// returns how many there were since the last one (this one included)
    /// for the caller to log now.
    pub fn note(&mut self, every: Duration) -> Option<u64> {
        self.since += 1;
        if self.logged.is_some_and(|at| at.elapsed() < every) {
            return None;
        }
        self.logged = Some(Instant::now());
        Some(std::mem::take(&mut self.since))
    }
}

impl Default for Sparse {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jittered_wait_stays_within_its_spread() {
        let wait = Duration::from_secs(2);
        for _ in 0..100 {
            let d = jittered(wait, 0.25);
            assert!(d <= wait && d >= wait.mul_f64(0.75), "{d:?}");
        }
    }

    #[test]
    fn the_first_occurrence_is_logged_and_the_next_wait_their_turn() {
        let mut s = Sparse::default();
        assert_eq!(s.note(Duration::from_secs(60)), Some(1));
        assert_eq!(s.note(Duration::from_secs(60)), None);
        assert_eq!(s.note(Duration::from_secs(60)), None);
        assert_eq!(s.note(Duration::ZERO), Some(3));
    }
}
