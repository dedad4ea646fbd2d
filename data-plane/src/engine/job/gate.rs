//! A new job's first-settings gate: under a controller, a job that appears
//! holds its storage reads until the controller's settings name it (it
//! reports a new job at once and answers within milliseconds), so the job
//! reads at the controller's rate from its first byte instead of filling
//! its buffer unlimited and delivering that burst for seconds after. The
//! hold never outlasts [`SETTINGS_WAIT`]: a slow or unreachable controller
//! delays a job's start by that much at most (fail-static).

use crate::sync::{lock, wait_timeout};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The longest a new job waits for the controller's settings.
pub const SETTINGS_WAIT: Duration = Duration::from_millis(500);

/// Closed until opened or until its deadline passes.
#[derive(Debug)]
pub struct Gate {
    /// `Some(deadline)` while closed.
    closed_until: Mutex<Option<Instant>>,
    opened: Condvar,
}

impl Gate {
    /// Returns a gate closed until `deadline`, or open (`None`).
    pub fn new(deadline: Option<Instant>) -> Self {
        Self {
            closed_until: Mutex::new(deadline),
            opened: Condvar::new(),
        }
    }

    /// Opens the gate for good and wakes every waiter; returns whether
    /// this call opened it (it was closed).
    pub fn open(&self) -> bool {
        let mut closed = lock(&self.closed_until);
        let was_closed = closed.take().is_some();
        if was_closed {
            self.opened.notify_all();
        }
        was_closed
    }

    /// Closes the gate again until `deadline` (a job that comes back under
    /// new labels waits for the settings of those, as a new job does).
    pub fn close(&self, deadline: Instant) {
        *lock(&self.closed_until) = Some(deadline);
    }

    /// Whether a read would pass at once (the gate is open, or its
    /// deadline has passed).
    pub fn is_open(&self) -> bool {
        lock(&self.closed_until).is_none_or(|deadline| Instant::now() >= deadline)
    }

    /// Blocks while the gate is closed, at most until its deadline (then
    /// it stays open). Returns whether this call opened it at the
    /// deadline.
    pub fn wait(&self) -> bool {
        let mut closed = lock(&self.closed_until);
        while let Some(deadline) = *closed {
            let now = Instant::now();
            if now >= deadline {
                *closed = None;
                return true;
            }
            closed = wait_timeout(&self.opened, closed, deadline - now);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn an_open_gate_does_not_wait() {
        let gate = Gate::new(None);
        assert!(!gate.wait());
        assert!(!gate.open());
    }

    #[test]
    fn a_closed_gate_waits_until_opened() {
        let gate = Arc::new(Gate::new(Some(Instant::now() + Duration::from_secs(30))));
        let waiter = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || (Instant::now(), gate.wait(), Instant::now()))
        };
        std::thread::sleep(Duration::from_millis(50));
        let opened_at = Instant::now();
        assert!(gate.open());
        let (started, timed_out, woke) = waiter.join().unwrap();
        assert!(!timed_out);
        assert!(started <= opened_at && woke >= opened_at);
        assert!(!gate.open(), "opened once");
    }

    #[test]
    fn a_closed_gate_opens_by_itself_at_its_deadline() {
        let deadline = Instant::now() + Duration::from_millis(30);
        let gate = Gate::new(Some(deadline));
        assert!(gate.wait());
        assert!(Instant::now() >= deadline);
        assert!(!gate.wait() && !gate.open(), "it stays open");
    }
}
