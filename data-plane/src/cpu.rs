//! Whether the calling thread blocked: a read served from memory (the page
//! cache) runs on the CPU from start to end, while one that waits for a
//! device or a server gives the CPU up. The count of voluntary context
//! switches tells them apart however busy the cores are (wall and CPU time
//! do not: a thread that waits its turn on an oversubscribed core looks
//! like one that waits for a disk).

#![allow(unsafe_code)]

/// The voluntary context switches of the calling thread so far (times it
/// blocked), or 0 where the system cannot say.
pub fn times_blocked() -> u64 {
    // SAFETY: `getrusage` fills the zeroed struct it is given.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut usage) != 0 {
            return 0;
        }
        usage.ru_nvcsw as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_thread_that_sleeps_blocks_and_one_that_computes_does_not() {
        let before = times_blocked();
        std::thread::sleep(Duration::from_millis(5));
        assert!(times_blocked() > before);
        let before = times_blocked();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(5) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert_eq!(times_blocked(), before);
    }
}
