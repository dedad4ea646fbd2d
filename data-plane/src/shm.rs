//! Shared-memory delivery: a job's prefetch buffers live in a [`Region`], a
//! `memfd` the stage maps read-write and hands to the job's local trainers
//! read-only over the UNIX socket ([`send_with_fd`]). A prefetched sample is
//! read from storage straight into a [`Slot`] of the region, and a trainer
//! that negotiated shared memory receives only the slot's offset and length:
//! no byte is copied into the socket or out of it.
//!
//! Why this module uses `unsafe`: mapping memory (`mmap`), viewing a mapped
//! range as a slice, and passing a file descriptor (`sendmsg` with
//! `SCM_RIGHTS`) have no safe interface in `std`. Each unsafe block states
//! the invariant it relies on. The ones that matter: the mapping lives as
//! long as the `Region` (slots hold an `Arc` of it); slots never overlap
//! (the allocator hands each range to one slot until it is dropped); and no
//! other process can write the region (trainers get a read-only descriptor,
//! and a private mapping of it at most), so a slice over a slot only
//! changes when its owner writes it.
#![allow(unsafe_code)]

use crate::sync::lock;
use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Slot sizes are multiples of this (a page: `O_DIRECT` and the trainers'
/// page-granular mappings both need it).
pub const PAGE: usize = 4096;

/// The most bytes of free slots the node's regions keep resident beyond
/// the budget's room (see [`Kept`]); the allowance is the smaller of this
/// and an eighth of the budget ([`allowance_for_budget`]).
const RETAIN: u64 = 256 << 20;

/// What the node's regions may keep resident of their free slots beyond
/// the part of a budget of `budget` bytes that nothing has reserved.
pub fn allowance_for_budget(budget: u64) -> u64 {
    (budget / 8).min(RETAIN)
}

/// The node's account of the free slots its regions keep resident for
/// reuse. A slot handed out again costs nothing but the copy into it; one
/// whose pages went back to the kernel (a hole punched in the memfd) is
/// faulted in and zeroed page by page on its next use, which on a warm
/// data set cost a quarter of the stage's CPU. So freed slots stay
/// resident while the bytes reserved from the node budget and the kept
/// ones together fit in the budget plus a small allowance: between
/// epochs, when a job's buffer drains, all of them, and while buffers are
/// full, the allowance. A region that needs new pages while the node is
/// at that bound has the others (and itself) give kept pages back first,
/// so the regions' resident memory stays within it whichever job reads. A
/// region that hands out no slot for a while gives all of its back
/// ([`Region::give_back_if_idle`]), so that jobs gone quiet keep none.
#[derive(Debug)]
pub struct Kept {
    /// The bytes reserved from the node budget now (the engine's count).
    reserved: Arc<AtomicU64>,
    /// Reserved and kept bytes together stay within this.
    limit: u64,
    /// Bytes of free slots the node's regions keep, together.
    bytes: AtomicU64,
    /// The node's regions (those still alive).
    regions: Mutex<Vec<Weak<Region>>>,
}

impl Kept {
    /// An account for a node budget of `budget` bytes, whose reservations
    /// `reserved` counts, that lets kept slots go `allowance` bytes past it.
    pub fn new(reserved: Arc<AtomicU64>, budget: u64, allowance: u64) -> Arc<Self> {
        Arc::new(Self {
            reserved,
            limit: budget + allowance,
            bytes: AtomicU64::new(0),
            regions: Mutex::new(Vec::new()),
        })
    }

    /// Bytes of free slots the node's regions keep now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// By how much reserved and kept bytes together are past the bound.
    fn excess(&self) -> u64 {
        (self.reserved.load(Ordering::Acquire) + self.bytes()).saturating_sub(self.limit)
    }

    /// Has the regions give kept slots back until reserved and kept bytes
    /// fit the bound again. Call with no region's lock held.
    fn trim(&self) {
        if self.excess() == 0 {
            return;
        }
        let regions: Vec<Arc<Region>> = {
            let mut regions = lock(&self.regions);
            regions.retain(|r| r.strong_count() > 0);
            regions.iter().filter_map(Weak::upgrade).collect()
        };
        for region in regions {
            let want = self.excess();
            if want == 0 {
                return;
            }
            region.give_back(want);
        }
    }
}

/// A shared-memory region: a `memfd` mapped read-write, carved into slots.
#[derive(Debug)]
pub struct Region {
    fd: OwnedFd,
    base: NonNull<u8>,
    size: usize,
    free: Mutex<Free>,
    /// The node's account of kept free slots.
    kept: Arc<Kept>,
}

// SAFETY: the mapping is plain memory owned by the region for its whole
// life; every access goes through a `Slot`, which owns its range alone.
unsafe impl Send for Region {}
// SAFETY: as above; the allocator's state is behind a mutex.
unsafe impl Sync for Region {}

/// The allocator's state: never-used space from `bump` on, and freed slots
/// by size (resident ones first in line, then ones whose pages went back to
/// the kernel).
#[derive(Debug, Default)]
struct Free {
    bump: usize,
    resident: HashMap<usize, Vec<usize>>,
    released: HashMap<usize, Vec<usize>>,
    resident_bytes: usize,
    /// When a slot was last handed out (`None`: never).
    last_alloc: Option<Instant>,
}

impl Region {
    /// Creates a region of `size` bytes (rounded up to a page). Only the
    /// pages slots touch take memory; its free slots stay resident as the
    /// node's account `kept` allows.
    pub fn new(name: &str, size: usize, kept: &Arc<Kept>) -> io::Result<Arc<Self>> {
        let size = size.div_ceil(PAGE).max(1) * PAGE;
        let name = CString::new(format!("sluice-{name}"))
            .map_err(|_| io::Error::other("a region name holds a NUL byte"))?;
        // SAFETY: `name` is a valid C string; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let file = File::from(fd.try_clone()?);
        file.set_len(size as u64)?;
        // A trainer holds a descriptor of the region, which it could open
        // again through /proc: readable by the stage's user alone, another
        // user's trainer cannot open it for writing, and sealed, no holder
        // can change its size (a region cut short under the stage's own
        // mapping made its next copy into it a SIGBUS, the whole stage's
        // end).
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o400))?;
        // SAFETY: F_ADD_SEALS on a memfd made with MFD_ALLOW_SEALING.
        let sealed = unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if sealed < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh shared mapping of the whole memfd; the result is
        // checked below and unmapped only in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        let region = Arc::new(Self {
            fd,
            base,
            size,
            free: Mutex::new(Free::default()),
            kept: Arc::clone(kept),
        });
        let mut regions = lock(&kept.regions);
        regions.retain(|r| r.strong_count() > 0);
        regions.push(Arc::downgrade(&region));
        drop(regions);
        Ok(region)
    }

    /// The region's size in bytes (what a trainer maps).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Returns a new descriptor of the region that can only be read: what a
    /// trainer receives, so it can never write what the stage reads.
    pub fn read_only_fd(&self) -> io::Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let file = std::fs::OpenOptions::new().read(true).open(path)?;
        Ok(OwnedFd::from(file))
    }

    /// Takes a slot of `len` bytes (rounded up to a page), or `None` when
    /// the region has no room for it.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<Slot> {
        let len = len.div_ceil(PAGE).max(1) * PAGE;
        let mut trimmed = false;
        let offset = loop {
            let mut free = self.lock();
            free.last_alloc = Some(Instant::now());
            if let Some(offset) = free.resident.get_mut(&len).and_then(Vec::pop) {
                free.resident_bytes -= len;
                self.kept.bytes.fetch_sub(len as u64, Ordering::AcqRel);
                break offset;
            }
            let released = free.released.get(&len).is_some_and(|v| !v.is_empty());
            if !released && free.bump + len > self.size {
                return None;
            }
            // The slot takes new pages: first make room for them among
            // the pages the node's regions keep.
            if !trimmed && self.kept.excess() > 0 {
                drop(free);
                self.kept.trim();
                trimmed = true;
                continue;
            }
            if let Some(offset) = free.released.get_mut(&len).and_then(Vec::pop) {
                break offset;
            }
            if free.bump + len > self.size {
                return None;
            }
            free.bump += len;
            break free.bump - len;
        };
        Some(Slot {
            region: Arc::clone(self),
            offset,
            len,
        })
    }

    /// Returns a slot's range to the allocator, keeping its pages resident
    /// while the node's account allows (see [`Kept`]).
    fn release(&self, offset: usize, len: usize) {
        let mut free = self.lock();
        // The slot's bytes are usually still reserved when it comes back
        // (the budget lets go of them after): so reserved and kept bytes
        // within the bound, counting them once, leave room for it.
        if self.kept.excess() == 0 || !self.punch(offset, len) {
            free.resident_bytes += len;
            free.resident.entry(len).or_default().push(offset);
            self.kept.bytes.fetch_add(len as u64, Ordering::AcqRel);
        } else {
            free.released.entry(len).or_default().push(offset);
        }
    }

    /// Gives kept free slots back to the kernel until about `want` bytes
    /// have gone (or none is left); returns the bytes given back.
    fn give_back(&self, want: u64) -> u64 {
        let mut free = self.lock();
        let mut given = 0;
        let lens: Vec<usize> = free.resident.keys().copied().collect();
        'lens: for len in lens {
            while given < want {
                let Some(offset) = free.resident.get_mut(&len).and_then(Vec::pop) else {
                    continue 'lens;
                };
                if self.punch(offset, len) {
                    free.resident_bytes -= len;
                    free.released.entry(len).or_default().push(offset);
                    given += len as u64;
                } else {
                    free.resident.entry(len).or_default().push(offset);
                    continue 'lens;
                }
            }
            break;
        }
        self.kept.bytes.fetch_sub(given, Ordering::AcqRel);
        given
    }

    /// Gives the pages of every free slot it keeps back to the kernel when
    /// it has handed out no slot for `idle` (its job went quiet); returns
    /// the bytes of free slots it keeps resident after.
    pub fn give_back_if_idle(&self, idle: Duration) -> usize {
        {
            let free = self.lock();
            if free.last_alloc.is_some_and(|at| at.elapsed() < idle) {
                return free.resident_bytes;
            }
        }
        self.give_back(u64::MAX);
        self.lock().resident_bytes
    }

    /// Frees the pages of a range (they read as zeros afterwards).
    fn punch(&self, offset: usize, len: usize) -> bool {
        // SAFETY: the range lies inside the memfd; punching keeps its size.
        let rc = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        rc == 0
    }

    fn lock(&self) -> MutexGuard<'_, Free> {
        lock(&self.free)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let kept = self.lock().resident_bytes;
        self.kept.bytes.fetch_sub(kept as u64, Ordering::AcqRel);
        // SAFETY: the mapping made in `new`; no slot outlives the region
        // (each holds an `Arc` of it).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.size);
        }
    }
}

/// A range of a [`Region`] owned by one chunk of sample bytes; returned to
/// the region when dropped.
#[derive(Debug)]
pub struct Slot {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

impl Slot {
    /// The slot's offset in its region.
    pub fn offset(&self) -> u64 {
        self.offset as u64
    }

    /// The slot's length (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slot lies in `region`.
    pub fn is_in(&self, region: &Arc<Region>) -> bool {
        Arc::ptr_eq(&self.region, region)
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range is inside the live mapping and owned by this
        // slot alone; no other process can write it (see the module doc).
        unsafe { std::slice::from_raw_parts(self.region.base.as_ptr().add(self.offset), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe {
            std::slice::from_raw_parts_mut(self.region.base.as_ptr().add(self.offset), self.len)
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.region.release(self.offset, self.len);
    }
}

/// Sends `bytes` on the UNIX socket `socket` with `fd` attached as
/// `SCM_RIGHTS` ancillary data. Returns how many bytes went out (the
/// descriptor travels with the first of them). `EAGAIN` comes back as
/// [`io::ErrorKind::WouldBlock`]: the caller waits for the socket to be
/// writable and tries again.
pub fn send_with_fd(socket: RawFd, bytes: &[u8], fd: RawFd) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `control` holds room for one cmsg with one descriptor, so the
    // first header and its data lie inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: `msg` describes valid buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node account with nothing reserved and a budget of `pages`.
    fn account(pages: usize) -> (Arc<AtomicU64>, Arc<Kept>) {
        let reserved = Arc::new(AtomicU64::new(0));
        let budget = (pages * PAGE) as u64;
        let kept = Kept::new(Arc::clone(&reserved), budget, allowance_for_budget(budget));
        (reserved, kept)
    }

    #[test]
    fn slots_are_disjoint_reused_and_bounded() {
        let region = Region::new("t", 64 * PAGE, &account(64).1).unwrap();
        let mut a = region.alloc(100).unwrap();
        let mut b = region.alloc(3 * PAGE).unwrap();
        assert_eq!((a.len(), b.len()), (PAGE, 3 * PAGE));
        assert_ne!(a.offset(), b.offset());
        a.as_mut_slice().fill(1);
        b.as_mut_slice().fill(2);
        assert!(a.as_slice().iter().all(|&x| x == 1));
        assert!(b.as_slice().iter().all(|&x| x == 2));
        let at = a.offset();
        drop(a);
        assert_eq!(
            region.alloc(PAGE).unwrap().offset(),
            at,
            "a freed slot is reused"
        );
        // No room: `None`, not a panic.
        assert!(region.alloc(65 * PAGE).is_none());
    }

    /// Resident pages of a region (what its mapping has in memory).
    fn resident_pages(region: &Region) -> usize {
        let pages = region.size / PAGE;
        let mut vec = vec![0u8; pages];
        // SAFETY: the region's own mapping and a vector of one byte a page.
        let rc =
            unsafe { libc::mincore(region.base.as_ptr().cast(), region.size, vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        vec.iter().filter(|&&v| v & 1 == 1).count()
    }

    #[test]
    fn regions_keep_free_pages_within_the_budget_until_they_go_quiet() {
        // A budget of 128 pages; an eighth of it (16 pages) may be kept
        // beyond what nothing has reserved.
        let (reserved, kept) = account(128);
        let a = Region::new("a", 128 * PAGE, &kept).unwrap();
        let b = Region::new("b", 128 * PAGE, &kept).unwrap();
        let pages = |n: usize| (n * PAGE) as u64;
        // As the engine does: reserve, then take slots; a slot comes back,
        // then its bytes leave the budget.
        let take = |region: &Arc<Region>, slots: usize| -> Vec<Slot> {
            reserved.fetch_add(pages(slots * 4), Ordering::AcqRel);
            (0..slots)
                .map(|_| {
                    let mut slot = region.alloc(4 * PAGE).unwrap();
                    slot.as_mut_slice().fill(7);
                    slot
                })
                .collect()
        };
        let give = |slots: Vec<Slot>| {
            for slot in slots {
                let len = slot.len() as u64;
                drop(slot);
                reserved.fetch_sub(len, Ordering::AcqRel);
            }
        };
        let resident = || resident_pages(&a) + resident_pages(&b);

        // A's buffer drains (an epoch's end): the budget has room for all
        // of its pages, so they stay for the next epoch, and are reused.
        give(take(&a, 8));
        assert_eq!((resident_pages(&a), kept.bytes()), (32, pages(32)));
        give(take(&a, 8));
        assert_eq!(
            resident_pages(&a),
            32,
            "kept slots are reused, not added to"
        );

        // B fills the budget: the pages A keeps go back as B needs new
        // ones, down to the allowance.
        let mut held = take(&b, 32);
        assert_eq!(resident_pages(&b), 128);
        assert_eq!(
            resident_pages(&a),
            16,
            "beyond the budget, the allowance only"
        );
        assert_eq!(kept.bytes(), pages(16));

        // Half of B's buffer drains: its slots stay as the budget lets go
        // of them. A fills the room again: its kept slots first, then new
        // pages, for which the others give theirs back.
        give(held.split_off(16));
        assert_eq!((resident(), kept.bytes()), (144, pages(80)));
        let more = take(&a, 16);
        assert_eq!((resident(), kept.bytes()), (144, pages(16)));
        give(more);
        give(held);
        assert_eq!((resident(), kept.bytes()), (144, pages(144)));

        a.give_back_if_idle(Duration::from_secs(60));
        assert_eq!(resident(), 144, "a region in use keeps them");
        a.give_back_if_idle(Duration::ZERO);
        b.give_back_if_idle(Duration::ZERO);
        assert_eq!(
            (resident(), kept.bytes()),
            (0, 0),
            "quiet regions give them back"
        );
        // Their slots are still handed out (their pages come back zeroed).
        let again = a.alloc(4 * PAGE).unwrap();
        assert!(again.as_slice().iter().all(|&b| b == 0));
        drop(again);
        assert_eq!(kept.bytes(), pages(4));
        drop(a);
        assert_eq!(kept.bytes(), 0, "a dropped region keeps nothing");
    }

    #[test]
    fn a_read_only_descriptor_cannot_be_mapped_for_writing() {
        let region = Region::new("t", 4 * PAGE, &account(4).1).unwrap();
        let ro = region.read_only_fd().unwrap();
        // SAFETY: a throwaway mapping attempt, unmapped if it succeeds.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                ro.as_raw_fd(),
                0,
            )
        };
        assert_eq!(ptr, libc::MAP_FAILED);
    }

    #[test]
    fn a_descriptor_travels_over_a_unix_socket() {
        use std::io::{Read, Seek, Write};
        use std::os::unix::net::UnixStream;
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"shared").unwrap();
        assert_eq!(
            send_with_fd(a.as_raw_fd(), b"x", file.as_raw_fd()).unwrap(),
            1
        );
        let mut byte = [0u8; 1];
        let mut space = vec![0u8; 64];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        };
        // SAFETY: test-only recvmsg into buffers that outlive the call.
        let received = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = space.as_mut_ptr().cast();
            msg.msg_controllen = space.len() as _;
            assert_eq!(libc::recvmsg(b.as_raw_fd(), &mut msg, 0), 1);
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            File::from_raw_fd(std::ptr::read_unaligned(
                libc::CMSG_DATA(cmsg).cast::<RawFd>(),
            ))
        };
        let mut text = String::new();
        let mut received = received;
        received.rewind().unwrap();
        received.read_to_string(&mut text).unwrap();
        assert_eq!((byte[0], text.as_str()), (b'x', "shared"));
    }
}
