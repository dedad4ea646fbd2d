//! The process heap.
//!
//! Why this module uses `unsafe`: `malloc_trim` is a C function; it only
//! hands free heap pages back to the system and touches no memory the
//! program holds.
#![allow(unsafe_code)]

/// Returns the heap's free memory to the system. A listing parses and
/// drops far more than it keeps (every page of an object store's answer,
/// on several threads at once), and the allocator would otherwise keep
/// those pages as the stage's resident memory for good.
pub fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: see the module documentation.
    unsafe {
        libc::malloc_trim(0);
    }
}
