//! A connection's shared-memory delivery (protocol version 2): the job's
//! region handed over once with `WELCOME`, the samples lent to the trainer
//! by slot, and their return (`RELEASE`) or hand-over to the job
//! (`HAND_OFF`), and the receipt of slots another process handed off
//! (`TAKE`). The book of lent slots is the job's
//! ([`crate::engine::Lending`]): any connection of the job may return any
//! of them, and the job holds at most [`Lending::limit`] in them; past
//! that samples come in the frame. What this connection holds goes back
//! when the trainer ends it; when the stage ends it, the job keeps it
//! until its last connection ends.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::engine::{Job, Lending, NotLent, Reservation};
use crate::protocol::{ErrorCode, Payload, ProtocolError, Sample};
use crate::shm::{Region, send_with_fd};

/// How often a `WELCOME` whose descriptor the socket cannot take yet is
/// tried again, and for how long.
const FD_RETRY: Duration = Duration::from_millis(2);
const FD_ATTEMPTS: u32 = 500;

/// Distinguishes connections in a job's book of lent slots.
static NEXT_HOLDER: AtomicU64 = AtomicU64::new(1);

/// What a connection that negotiated shared memory holds.
#[derive(Debug)]
pub struct Shared {
    job: Arc<Job>,
    region: Arc<Region>,
    /// This connection in the job's book.
    holder: u64,
    /// The trainer run the connection named (`RUN`), counted in the book.
    run: Option<u64>,
    /// Whether the process its slots are handed off to says it received
    /// them (`TAKES`): they are in transit until then.
    receipts: bool,
}

impl Shared {
    pub fn new(job: Arc<Job>, region: Arc<Region>) -> Self {
        Self {
            job,
            region,
            holder: NEXT_HOLDER.fetch_add(1, Ordering::Relaxed),
            run: None,
            receipts: false,
        }
    }

    /// The connection takes receipts (`TAKES`): its hand-offs are in
    /// transit until received, and it may say what it received (`TAKE`).
    pub fn take_receipts(&mut self) {
        self.receipts = true;
    }

    /// Whether the connection takes receipts.
    pub fn receipts(&self) -> bool {
        self.receipts
    }

    /// The connection now reads for trainer run `run` (0: none): the slots
    /// it hands off are the run's.
    pub fn name_run(&mut self, run: u64) {
        let run = (run != 0).then_some(run);
        if run == self.run {
            return;
        }
        self.leave_run(false);
        if let Some(run) = run {
            self.job.lend_book().join_run(run);
        }
        self.run = run;
    }

    /// Leaves the connection's run, if it named one (see
    /// [`Lending::leave_run`]).
    fn leave_run(&mut self, keep: bool) {
        if let Some(run) = self.run.take() {
            // Dropped once the book's lock is let go.
            let returned = self.job.lend_book().leave_run(run, keep);
            drop(returned);
        }
    }

    /// The region's size (what the trainer maps).
    pub fn region_bytes(&self) -> u64 {
        self.region.size() as u64
    }

    /// Returns the read-only descriptor the trainer maps.
    pub fn descriptor(&self) -> io::Result<OwnedFd> {
        self.region.read_only_fd()
    }

    /// Lends every sample whose bytes lie in the job's region, while the job
    /// has room in its book: its payload becomes the slot's offset and
    /// length, and its chunk and budget bytes (taken from
    /// `reservations[holder(i)]` for sample `i`) wait for a `RELEASE`.
    pub fn lend(
        &self,
        samples: &mut [Sample],
        reservations: &mut [Reservation],
        holder: impl Fn(usize) -> Option<usize>,
    ) {
        let limit = Lending::limit(self.job.buffer_capacity(), self.job.memory_budget());
        let mut book = self.job.lend_book();
        // Slots sent long ago and never received make room first.
        let swept = book.sweep(Instant::now());
        let mut lent = 0;
        for (i, sample) in samples.iter_mut().enumerate() {
            // Empty files go in the frame: a slot would hold a page for nothing.
            let Ok(Payload::Bytes(chunk)) = &sample.data else {
                continue;
            };
            if chunk.is_empty() {
                continue;
            }
            let Some((slot, offset)) = chunk.shared() else {
                continue;
            };
            let footprint = chunk.footprint();
            if !slot.is_in(&self.region) || !book.has_room(footprint, limit) {
                continue;
            }
            let Some(held) = holder(i).and_then(|h| reservations.get_mut(h)) else {
                continue;
            };
            let len = chunk.len() as u64;
            let Some(budget) = held.lend(footprint) else {
                continue;
            };
            let Ok(Payload::Bytes(chunk)) =
                std::mem::replace(&mut sample.data, Ok(Payload::Shared { offset, len }))
            else {
                unreachable!("matched above");
            };
            book.lend(offset, chunk, budget, self.holder);
            lent += 1;
        }
        drop(book);
        drop(swept);
        self.job.count_shared(lent);
    }

    /// Takes back the slots at `offsets`; one the job did not lend, or one
    /// named twice, is a fatal error (a client that lost track of its
    /// slots).
    pub fn release(&self, offsets: &[u64]) -> Result<(), ProtocolError> {
        self.job.release_slots(offsets).map_err(|NotLent(offset)| {
            let twice = offsets.iter().filter(|&&o| o == offset).count() > 1;
            let why = if twice {
                "more than once (each slot is returned once)"
            } else {
                "which the job does not hold"
            };
            ProtocolError::new(
                ErrorCode::BadRelease,
                format!("RELEASE names offset {offset} {why}; none of its slots was returned"),
            )
        })
    }

    /// Hands this connection's slots at `offsets` to its run, or to the
    /// job when it named none.
    pub fn hand_off(&self, offsets: &[u64]) {
        self.job
            .lend_book()
            .hand_off(offsets, self.holder, self.run, self.receipts);
    }

    /// This connection's process received the slots at `offsets` that
    /// another process of the job handed off: they are this connection's
    /// now (see [`Lending::receive`]).
    pub fn receive(&self, offsets: &[u64]) {
        self.job.lend_book().receive(offsets, self.holder);
    }

    /// The connection ended: its slots go back, or, when the stage ended
    /// it (`keep`), are handed to the job, so that a trainer still reading
    /// them never sees another sample written there; they come back when
    /// the job's last connection ends. The same goes for its run's
    /// handed-off slots when it was the run's last connection.
    pub fn end(mut self, keep: bool) {
        if keep {
            self.job.lend_book().hand_off_all(self.holder);
            self.leave_run(true);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let returned = {
            let mut book = self.job.lend_book();
            book.sender_gone(self.holder, Instant::now());
            book.reclaim(self.holder)
        };
        drop(returned);
        self.leave_run(false);
    }
}

/// Sends the start of `frame` on the UNIX socket `socket` with `fd`
/// attached to its first byte, waiting while the socket has no room.
/// Returns how many bytes went: the caller writes the rest as usual.
pub async fn send_with_descriptor(socket: RawFd, frame: &[u8], fd: &OwnedFd) -> io::Result<usize> {
    for _ in 0..FD_ATTEMPTS {
        match send_with_fd(socket, frame, fd.as_raw_fd()) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => tokio::time::sleep(FD_RETRY).await,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other("the socket took no data for a second"))
}
