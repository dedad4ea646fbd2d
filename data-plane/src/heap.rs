//! The process heap.
//!
//! Why this module uses `unsafe`: `malloc_trim` and `mallopt` are C
//! functions; they only hand free heap pages back to the system or set
//! where the allocator takes large blocks from, and touch no memory the
//! program holds.
#![allow(unsafe_code)]

/// Blocks this large or larger are mapped on their own, and unmapped when
/// freed.
const MAPPED_FROM: i32 = 4 << 20;

/// Has the allocator map every block of 4 MiB or more on its own. By
/// default it raises that bound to the largest block freed (up to 32 MiB)
/// and serves later ones from its heaps, which keep them once freed: a
/// stage passing 8 MiB samples through the node cache (the copy a read
/// gives the cache, a disk hit read for a range) kept 80 MiB resident
/// that its budget did not count. Call once, at start.
pub fn map_large_blocks() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: see the module documentation.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MAPPED_FROM);
    }
}

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
