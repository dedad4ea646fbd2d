//! Sample bytes ([`Chunk`]) and the buffers they live in.
//!
//! A chunk is what storage reads produce and what the protocol sends: a
//! window of an owned [`Buffer`], either on the heap or a slot of a job's
//! shared-memory region ([`crate::shm`]). Heap buffers of delivered
//! prefetched samples go back to a small pool to be read into again; slots
//! go back to their region.

use std::ops::Deref;
use std::sync::Mutex;

use crate::shm::Slot;
use crate::sync::lock;

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
        let mut pool = lock(&POOL);
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
    let mut pool = lock(&POOL);
    if pool.bytes + buf.len() <= POOL_BYTES {
        pool.bytes += buf.len();
        pool.buffers.push(buf);
    }
}

/// Memory a prefetch read lands in.
#[derive(Debug)]
pub enum Buffer {
    /// An ordinary allocation (from the pool when one fits).
    Heap(Vec<u8>),
    /// A slot of a job's shared-memory region.
    Shared(Slot),
}

impl Buffer {
    /// Returns a heap buffer of exactly `len` bytes, from the pool if it
    /// has one.
    pub fn heap(len: usize) -> Self {
        Self::Heap(take_buffer(len))
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::Shared(s) => s.as_slice(),
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(v) => v,
            Self::Shared(s) => s.as_mut_slice(),
        }
    }

    /// Gives the memory back: a heap buffer to the pool, a slot to its
    /// region (a slot goes back when dropped anyway).
    pub fn recycle(self) {
        if let Self::Heap(v) = self {
            recycle(v);
        }
    }
}

/// Sample bytes: a window of an owned buffer (aligned reads put the data at
/// an offset). Derefs to the sample's bytes. Prefetch buffers go back to
/// the pool or their region when dropped.
#[derive(Debug)]
pub struct Chunk {
    buf: Option<Buffer>,
    start: usize,
    len: usize,
    /// Whether a heap buffer goes back to the pool (only prefetch buffers,
    /// whose sizes are the pool's size classes, are worth keeping).
    pooled: bool,
}

impl Default for Chunk {
    fn default() -> Self {
        Self::from_vec(Vec::new())
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take()
            && self.pooled
        {
            buf.recycle();
        }
    }
}

impl Chunk {
    /// Wraps a whole vector (not pooled when dropped).
    pub fn from_vec(buf: Vec<u8>) -> Self {
        let len = buf.len();
        Self {
            buf: Some(Buffer::Heap(buf)),
            start: 0,
            len,
            pooled: false,
        }
    }

    /// Wraps `len` bytes at `start` of a prefetch buffer, which goes back to
    /// the pool or its region when the chunk is dropped.
    pub fn pooled(buf: Buffer, start: usize, len: usize) -> Self {
        Self {
            buf: Some(buf),
            start,
            len,
            pooled: true,
        }
    }

    /// Bytes of memory this chunk holds (what the buffer budget counts).
    pub fn footprint(&self) -> u64 {
        match &self.buf {
            Some(Buffer::Heap(v)) => v.capacity() as u64,
            Some(Buffer::Shared(s)) => s.len() as u64,
            None => 0,
        }
    }

    /// Where the bytes lie when they are in a shared-memory region: the
    /// slot, and the bytes' offset in the region.
    pub fn shared(&self) -> Option<(&Slot, u64)> {
        match &self.buf {
            Some(Buffer::Shared(s)) => Some((s, s.offset() + self.start as u64)),
            _ => None,
        }
    }
}

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let buf = self.buf.as_ref().map_or(&[][..], Buffer::as_slice);
        &buf[self.start..self.start + self.len]
    }
}
