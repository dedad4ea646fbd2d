//! Samples a job's trainers hold in shared memory: the slots lent to them,
//! by the offset the trainer was told, with the connection that holds each
//! (or none: handed to the job, as a `DataLoader` worker does when it
//! passes its samples to the main process by reference).
//!
//! Any connection of the job may return any of the job's slots: a sample
//! read by one process is often finished with in another. A connection's
//! own slots come back when it ends, however it ends. Slots a connection
//! that named its trainer run (`RUN`) handed off are the run's: they come
//! back when the run's last connection ends (a trainer killed with batches
//! its workers had handed over still unread, once its workers are gone
//! too); other slots handed to the job come back when the job's last
//! connection ends. A connection that takes receipts (`TAKES`) hands
//! off slots *in transit*: the process they went to says it received them
//! (`TAKE`), and they are its connection's from then on; those still in
//! transit when the handing connection has been gone [`IN_TRANSIT_GRACE`]
//! were never received (batches a `DataLoader` stopped early dropped
//! unread) and come back, at the job's next delivery or the engine's next
//! tick, whichever comes first. The job holds at most
//! [`Lending::limit`] bytes of lent slots, and every job's together at most
//! half the node's budget; past that samples travel in the frame, so
//! trainers that keep samples cannot take the job's buffer or the node's
//! budget.
//!
//! A slot taken back without its trainer returning it (its connection
//! ended) may still be mapped by a trainer that holds the sample: the
//! client copies what it holds before it ends a connection itself, and a
//! connection the stage ends hands its slots to the job instead (see
//! `server::shared`). Once the stage is stopping, slots taken back are
//! never reused ([`Lending::keep_reclaimed`]): its trainers go on reading
//! what they hold while they reconnect elsewhere.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::delivery::Lent;
use crate::chunk::Chunk;

/// How long slots in transit may wait for their receipt once the
/// connection that handed them off is gone: the receiving process sends
/// it as it takes the batch, before the worker that sent it is told to
/// end, so it comes within this unless the batch is never taken.
pub const IN_TRANSIT_GRACE: Duration = Duration::from_secs(10);

/// The least a job may hold in slots, whatever its buffer: room for the
/// batches its clients receive ahead.
pub const LENT_MIN: u64 = 64 << 20;

/// Who holds a lent slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// The connection it was lent to.
    Connection(u64),
    /// Handed off by a connection of this trainer run.
    Run(u64),
    /// Handed off to the job.
    Job,
    /// Handed off by connection `by` (to its run `to`, or the job), not
    /// received yet; `gone`: when `by` ended.
    InTransit {
        by: u64,
        to: Option<u64>,
        gone: Option<Instant>,
    },
}

impl Holder {
    /// Whether the slot is its run's `run` (handed off within it).
    fn of_run(self, run: u64) -> bool {
        matches!(self, Self::Run(r) | Self::InTransit { to: Some(r), .. } if r == run)
    }
}

/// A lent slot: its bytes, the budget bytes they hold, and who holds it.
#[derive(Debug)]
struct LentSlot {
    chunk: Chunk,
    budget: Lent,
    holder: Holder,
}

/// The slots a job has lent.
#[derive(Debug, Default)]
pub struct Lending {
    slots: HashMap<u64, LentSlot>,
    bytes: u64,
    /// Connections (with shared memory) of each run named with `RUN`.
    runs: HashMap<u64, usize>,
    /// When the first slots in transit whose sender ended are due back
    /// (see [`Lending::sweep`]); `None` when there are none.
    next_sweep: Option<Instant>,
    /// Set once the stage stops: slots taken back keep their bytes here
    /// (their budget goes back) until the job is dropped.
    keeping: bool,
    kept: Vec<Chunk>,
}

/// Why a slot could not be returned.
#[derive(Debug, PartialEq, Eq)]
pub struct NotLent(pub u64);

/// Slots taken back: their memory and budget go back when this is
/// dropped, which the caller does after letting go of the job's locks.
#[derive(Debug, Default)]
#[must_use]
pub struct Returned(Vec<LentSlot>);

impl Drop for Returned {
    fn drop(&mut self) {
        Lent::return_all(self.0.iter_mut().map(|slot| &mut slot.budget));
    }
}

impl Lending {
    /// The most a job with buffer `capacity` may hold in slots on a node
    /// with memory `budget`: half its buffer, at least [`LENT_MIN`] but never
    /// more than half the budget. Every job's slots together hold at most
    /// half the budget too (`Memory::try_lend`), so that what trainers hold
    /// always leaves the readers room to fetch what they ask for next.
    pub fn limit(capacity: u64, budget: u64) -> u64 {
        (capacity / 2).max(LENT_MIN.min(budget / 2))
    }

    /// Whether `bytes` more may be lent under `limit`.
    pub fn has_room(&self, bytes: u64, limit: u64) -> bool {
        self.bytes + bytes <= limit
    }

    /// Records a slot lent to connection `holder` at `offset`.
    pub fn lend(&mut self, offset: u64, chunk: Chunk, budget: Lent, holder: u64) {
        self.bytes += chunk.footprint();
        let slot = LentSlot {
            chunk,
            budget,
            holder: Holder::Connection(holder),
        };
        if let Some(old) = self.slots.insert(offset, slot) {
            // Cannot happen (a slot is in one chunk at a time); keep the
            // books right if it did.
            self.bytes -= old.chunk.footprint();
        }
    }

    /// Takes back the slots at `offsets` (whoever holds them); takes none
    /// when one of them is not lent, or is named twice.
    pub fn release(&mut self, offsets: &[u64], returned: &mut Returned) -> Result<(), NotLent> {
        // All or nothing: a list naming a slot not lent (or one twice)
        // returns none of them.
        let mut seen = std::collections::HashSet::with_capacity(offsets.len());
        if let Some(&bad) = offsets
            .iter()
            .find(|&&offset| !self.slots.contains_key(&offset) || !seen.insert(offset))
        {
            return Err(NotLent(bad));
        }
        for offset in offsets {
            let slot = self.slots.remove(offset).expect("checked above");
            self.bytes -= slot.chunk.footprint();
            returned.0.push(slot);
        }
        Ok(())
    }

    /// Hands the slots at `offsets` that connection `holder` holds to its
    /// run `run` (when it named one), else to the job; in transit until
    /// received (see [`Lending::receive`]) when the connection takes
    /// `receipts`. Slots already returned (by the process they were
    /// handed to) or held by another connection are left as they are.
    pub fn hand_off(&mut self, offsets: &[u64], holder: u64, run: Option<u64>, receipts: bool) {
        let to = if receipts {
            Holder::InTransit {
                by: holder,
                to: run,
                gone: None,
            }
        } else {
            run.map_or(Holder::Job, Holder::Run)
        };
        for offset in offsets {
            if let Some(slot) = self.slots.get_mut(offset)
                && slot.holder == Holder::Connection(holder)
            {
                slot.holder = to;
            }
        }
    }

    /// Connection `holder` received the slots at `offsets`, handed off by
    /// another process of the job: they are its own from now. That
    /// process's `HAND_OFF` travels on its own connection and may come
    /// after this, so a slot another connection still holds is received
    /// too (its late `HAND_OFF` then leaves it be). Slots not lent
    /// (returned already) are left as they are.
    pub fn receive(&mut self, offsets: &[u64], holder: u64) {
        for offset in offsets {
            if let Some(slot) = self.slots.get_mut(offset)
                && matches!(
                    slot.holder,
                    Holder::InTransit { .. } | Holder::Connection(_)
                )
            {
                slot.holder = Holder::Connection(holder);
            }
        }
    }

    /// Hands every slot connection `holder` holds, or sent and not yet
    /// received, to the job (the stage ended the connection: its trainer,
    /// or the one it sent them to, may still read them).
    pub fn hand_off_all(&mut self, holder: u64) {
        self.hand_over(
            |h| matches!(h, Holder::Connection(c) | Holder::InTransit { by: c, .. } if c == holder),
            Holder::Job,
        );
    }

    fn hand_over(&mut self, from: impl Fn(Holder) -> bool, to: Holder) {
        for slot in self.slots.values_mut() {
            if from(slot.holder) {
                slot.holder = to;
            }
        }
    }

    /// Connection `holder` ended: the slots it sent that are still in
    /// transit have [`IN_TRANSIT_GRACE`] from `now` to be received.
    pub fn sender_gone(&mut self, holder: u64, now: Instant) {
        let mut marked = false;
        for slot in self.slots.values_mut() {
            if let Holder::InTransit { by, gone, .. } = &mut slot.holder
                && *by == holder
                && gone.is_none()
            {
                *gone = Some(now);
                marked = true;
            }
        }
        if marked {
            let due = now + IN_TRANSIT_GRACE;
            self.next_sweep = Some(self.next_sweep.map_or(due, |next| next.min(due)));
        }
    }

    /// Takes back the slots still in transit [`IN_TRANSIT_GRACE`] after
    /// their sender ended (never received: a batch dropped unread). Costs
    /// nothing until some are due.
    pub fn sweep(&mut self, now: Instant) -> Returned {
        if self.next_sweep.is_none_or(|next| now < next) {
            return Returned::default();
        }
        let due = |at: Instant| now.saturating_duration_since(at) >= IN_TRANSIT_GRACE;
        let returned = self.take(
            |slot| matches!(slot.holder, Holder::InTransit { gone: Some(at), .. } if due(at)),
        );
        self.next_sweep = self
            .slots
            .values()
            .filter_map(|slot| match slot.holder {
                Holder::InTransit { gone: Some(at), .. } => Some(at + IN_TRANSIT_GRACE),
                _ => None,
            })
            .min();
        returned
    }

    /// Counts a connection of run `run`.
    pub fn join_run(&mut self, run: u64) {
        *self.runs.entry(run).or_default() += 1;
    }

    /// A connection of run `run` ended (or named another run). When it was
    /// the run's last, the slots handed off within the run come back: no
    /// process of the run is left to read them. With `keep` (the stage
    /// ended the connection, and the run's trainers may still read them)
    /// they go to the job instead.
    pub fn leave_run(&mut self, run: u64, keep: bool) -> Returned {
        let Some(count) = self.runs.get_mut(&run) else {
            return Returned::default();
        };
        *count -= 1;
        if *count > 0 {
            return Returned::default();
        }
        self.runs.remove(&run);
        if keep {
            self.hand_over(|h| h.of_run(run), Holder::Job);
            return Returned::default();
        }
        self.take(|slot| slot.holder.of_run(run))
    }

    /// From now on, slots taken back without a `RELEASE` are never reused
    /// (the stage is stopping).
    pub fn keep_reclaimed(&mut self) {
        self.keeping = true;
    }

    /// Takes back every slot connection `holder` holds (it ended).
    pub fn reclaim(&mut self, holder: u64) -> Returned {
        self.take(|slot| slot.holder == Holder::Connection(holder))
    }

    /// Takes back every slot (the job's last connection ended).
    pub fn reclaim_all(&mut self) -> Returned {
        self.take(|_| true)
    }

    fn take(&mut self, which: impl Fn(&LentSlot) -> bool) -> Returned {
        let offsets: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, slot)| which(slot))
            .map(|(offset, _)| *offset)
            .collect();
        let mut returned = Returned::default();
        // Present by construction.
        let _ = self.release(&offsets, &mut returned);
        if self.keeping {
            self.kept.extend(
                returned
                    .0
                    .iter_mut()
                    .map(|slot| std::mem::take(&mut slot.chunk)),
            );
        }
        returned
    }

    /// Bytes lent now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_half_the_buffer_at_least_the_minimum() {
        assert_eq!(Lending::limit(256 << 20, 1 << 30), 128 << 20);
        assert_eq!(Lending::limit(16 << 20, 1 << 30), LENT_MIN);
        // A small node: never more than half its budget.
        assert_eq!(Lending::limit(8 << 20, 32 << 20), 16 << 20);
        let lending = Lending::default();
        assert!(lending.has_room(LENT_MIN, LENT_MIN));
        assert!(!lending.has_room(LENT_MIN + 1, LENT_MIN));
    }
}
