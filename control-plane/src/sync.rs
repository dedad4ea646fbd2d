//! Lock helpers shared by every module: state stays usable after a panic
//! in another task, so a poisoned lock is taken as it is.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard};

/// Locks a mutex, ignoring poisoning.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reads a read-write lock, ignoring poisoning (writers only swap).
pub fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}
