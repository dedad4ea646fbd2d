//! Locks that outlive a panic. A panic while a lock is held (a bug in one
//! connection's handling, say) must not turn every later use of that lock
//! into another panic: the stage would stop serving every job. So a
//! poisoned lock is taken as it is. What a lock guards here is counters and
//! queues that each critical section leaves consistent before it can
//! panic, or whose drift is bounded (a byte count off until the job's plans
//! end); serving on is the better failure.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Locks `m`, taking it as it is if a panicking thread held it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `cv` with `guard`, ignoring poisoning as [`lock`] does.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `cv` with `guard` for at most `timeout`, ignoring poisoning.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, timeout)
        .map_or_else(|e| e.into_inner().0, |(g, _)| g)
}
