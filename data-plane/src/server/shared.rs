//! A connection's shared-memory delivery (protocol version 2): the job's
//! region handed over once with `WELCOME`, the samples lent to the trainer
//! by slot, and their return. A trainer holds at most [`LENT_MAX`] bytes of
//! slots at a time; past that its samples come in the frame, so a trainer
//! that stops returning slots cannot take the job's buffer or the node's
//! budget. Everything it holds goes back when its connection ends, however
//! it ends.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::chunk::Chunk;
use crate::engine::{Lent, Reservation};
use crate::protocol::{ErrorCode, Payload, ProtocolError, Sample};
use crate::shm::{Region, send_with_fd};

/// The most bytes of slots one connection may hold unreturned.
pub const LENT_MAX: u64 = 64 << 20;

/// How often a `WELCOME` whose descriptor the socket cannot take yet is
/// tried again, and for how long.
const FD_RETRY: Duration = Duration::from_millis(2);
const FD_ATTEMPTS: u32 = 500;

/// What a connection that negotiated shared memory holds.
#[derive(Debug)]
pub struct Shared {
    region: Arc<Region>,
    /// Slots lent, by the offset the trainer was told.
    lent: HashMap<u64, (Chunk, Lent)>,
    lent_bytes: u64,
}

impl Shared {
    pub fn new(region: Arc<Region>) -> Self {
        Self {
            region,
            lent: HashMap::new(),
            lent_bytes: 0,
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

    /// Lends every sample whose bytes lie in this connection's region, while
    /// the connection holds less than [`LENT_MAX`]: its payload becomes the
    /// slot's offset and length, and its chunk and budget bytes (taken from
    /// `reservations[holder(i)]` for sample `i`) wait for the trainer's
    /// `RELEASE`.
    pub fn lend(
        &mut self,
        samples: &mut [Sample],
        reservations: &mut [Reservation],
        holder: impl Fn(usize) -> Option<usize>,
    ) {
        for (i, sample) in samples.iter_mut().enumerate() {
            let Ok(Payload::Bytes(chunk)) = &sample.data else {
                continue;
            };
            let Some((slot, offset)) = chunk.shared() else {
                continue;
            };
            let footprint = chunk.footprint();
            if !slot.is_in(&self.region) || self.lent_bytes + footprint > LENT_MAX {
                continue;
            }
            let Some(held) = holder(i).and_then(|h| reservations.get_mut(h)) else {
                continue;
            };
            let len = chunk.len() as u64;
            let lent = held.lend(footprint);
            let Ok(Payload::Bytes(chunk)) =
                std::mem::replace(&mut sample.data, Ok(Payload::Shared { offset, len }))
            else {
                unreachable!("matched above");
            };
            self.lent_bytes += footprint;
            self.lent.insert(offset, (chunk, lent));
        }
    }

    /// Takes back the slots at `offsets`; one the trainer does not hold is a
    /// fatal error (a client that lost track of its slots).
    pub fn release(&mut self, offsets: &[u64]) -> Result<(), ProtocolError> {
        for offset in offsets {
            let Some((chunk, lent)) = self.lent.remove(offset) else {
                return Err(ProtocolError::new(
                    ErrorCode::BadRelease,
                    format!("RELEASE names offset {offset}, which this connection does not hold"),
                ));
            };
            self.lent_bytes -= chunk.footprint();
            drop((chunk, lent));
        }
        Ok(())
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
