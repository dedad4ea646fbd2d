//! Sample bytes ([`Chunk`]) and the pool their prefetch buffers return to.
//!
//! A chunk is what storage reads produce and what the protocol sends: a
//! window of an owned buffer. Buffers of delivered prefetched samples go
//! back to a small pool to be read into again.

use std::ops::Deref;
use std::sync::Mutex;

/// Bytes of delivered sample buffers kept for reuse. Reuse saves the
/// allocation, the zeroing and the page faults of a fresh buffer per sample
/// (about a tenth of the stage's CPU at 100 KiB samples); the pool is part of
/// the stage's fixed memory overhead.
const POOL_BYTES: usize = 16 << 20;
/// Buffers shorter than this are not worth keeping (prefetch buffers span
/// at least two 4 KiB alignment blocks).
const MIN_POOLED: usize = 4096;

/// Buffers of delivered samples, ready to be read into again.
static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: Vec::new(),
    bytes: 0,
});

struct Pool {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

/// Returns an initialised buffer of exactly `len` bytes, reused if the pool
/// has one.
pub fn take_buffer(len: usize) -> Vec<u8> {
    {
        let mut pool = POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = pool.buffers.iter().rposition(|b| b.len() == len) {
            let buf = pool.buffers.swap_remove(i);
            pool.bytes -= buf.len();
            return buf;
        }
    }
    vec![0u8; len]
}

/// Keeps `buf` for a later [`take_buffer`] if the pool has room.
pub fn recycle(buf: Vec<u8>) {
    if buf.len() < MIN_POOLED {
        return;
    }
    let mut pool = POOL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if pool.bytes + buf.len() <= POOL_BYTES {
        pool.bytes += buf.len();
        pool.buffers.push(buf);
    }
}

/// Sample bytes: a window of an owned buffer (aligned reads put the data at
/// an offset). Derefs to the sample's bytes. Prefetch buffers go back to a
/// small pool when dropped.
#[derive(Debug, Default)]
pub struct Chunk {
    buf: Vec<u8>,
    start: usize,
    len: usize,
    pooled: bool,
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if self.pooled {
            recycle(std::mem::take(&mut self.buf));
        }
    }
}

impl Chunk {
    /// Wraps a whole vector.
    pub fn from_vec(buf: Vec<u8>) -> Self {
        let len = buf.len();
        Self {
            buf,
            start: 0,
            len,
            pooled: false,
        }
    }

    /// Wraps `len` bytes at `start` of a buffer from [`take_buffer`], which
    /// goes back to the pool when the chunk is dropped.
    pub fn pooled(buf: Vec<u8>, start: usize, len: usize) -> Self {
        Self {
            buf,
            start,
            len,
            pooled: true,
        }
    }

    /// Bytes of memory this chunk holds (what the buffer budget counts).
    pub fn footprint(&self) -> u64 {
        self.buf.capacity() as u64
    }
}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}
