//! One active epoch plan: which entries have been started by readers, which
//! are buffered, and which consumers have claimed. All of it lives under the
//! job's lock; this module is bookkeeping only, no I/O and no waiting.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::dataset::{Dataset, Listing};
use crate::protocol::ProtocolError;

/// Identifies a plan within a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PlanKey {
    pub rank: u32,
    pub epoch: u64,
    /// The trainer run that submitted it (0: none named). A trainer
    /// restarted after a crash is a new run: it does not meet the plans its
    /// predecessor's processes still hold, nor their finished ones.
    pub run: u64,
}

/// The order a rank's share was cut from, for a plan the stage derived
/// from a seed (`SHUFFLE`): every rank of a job must cut the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardOrder {
    pub seed: u64,
    pub shuffle: bool,
    pub world_size: u32,
}

impl ShardOrder {
    /// Whether share `rank` of this order and share `other` of `theirs`
    /// can hold the same entries, or leave some out between them. Shares of
    /// one epoch order whose world sizes divide one another nest: share
    /// `k` of `n * w` is part of share `k mod n` of `n` (a
    /// `SluiceIterableDataset`'s workers beside `SluiceSampler` ranks), so
    /// they are apart where their ranks differ in the smaller world.
    pub fn overlaps(&self, rank: u32, theirs: &Self, other: u32) -> bool {
        let same_order =
            self.shuffle == theirs.shuffle && (!self.shuffle || self.seed == theirs.seed);
        let (small, large) = (
            self.world_size.min(theirs.world_size).max(1),
            self.world_size.max(theirs.world_size),
        );
        !same_order || large % small != 0 || rank % small == other % small
    }
}

impl std::fmt::Display for ShardOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.shuffle {
            "shuffled"
        } else {
            "in listing order"
        };
        write!(
            f,
            "seed {} ({how}) over {} rank{}",
            self.seed,
            self.world_size,
            if self.world_size == 1 { "" } else { "s" }
        )
    }
}

/// The plan rank of order-file plans (see the mount's `orders`), apart
/// from trainers' ranks (below their world size, at most `u32::MAX`).
pub const ORDER_RANK: u32 = u32::MAX;

/// Identifies a plan within a job across data sets: a job's training and
/// validation loaders plan the same ranks and epochs over two of them.
pub type PlanIdentity = (String, PlanKey);

/// What happened to an entry so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Entry {
    /// A reader (or a direct `READ`) has started fetching it.
    pub started: bool,
    /// A consumer owns it: it will not be handed to anyone else.
    pub claimed: bool,
}

/// A fetched entry waiting for its consumer, and the bytes it holds in the
/// buffer accounting.
#[derive(Debug)]
pub(crate) struct Fetched {
    pub data: Result<crate::chunk::Chunk, ProtocolError>,
    pub reserved: u64,
}

/// The state of one plan.
#[derive(Debug)]
pub(crate) struct PlanRun {
    pub id: u64,
    pub key: PlanKey,
    pub fingerprint: u64,
    pub dataset: Arc<Dataset>,
    pub listing: Arc<Listing>,
    /// File index (into `listing`) per plan position.
    pub files: Vec<u32>,
    pub entries: Vec<Entry>,
    pub fetched: HashMap<u32, Fetched>,
    /// Positions ordered by (file index, position), for `READ` by name;
    /// built at the first such read (4 bytes a position, where a map of
    /// queues cost ~100 and a third of a second for a million entries).
    by_file: Option<Vec<u32>>,
    /// Lowest position that may still be unstarted.
    pub fetch: usize,
    /// Lowest position that may still be unclaimed.
    pub claim: usize,
    /// Entries not yet handed to a consumer.
    pub remaining: usize,
    /// Bytes reserved for this plan (in flight and buffered).
    pub reserved: u64,
    /// Connections attached to this plan.
    pub attached: usize,
    /// The consumer waiting for a position, woken when it is fetched.
    pub waiters: HashMap<u32, Arc<Notify>>,
    /// The order its entries were cut from, when the stage cut them.
    pub order: Option<ShardOrder>,
    /// Claimed positions whose consumer left before it took them
    /// ([`PlanRun::orphan`]).
    pub orphaned: BTreeSet<u32>,
    /// Entries claimed by `NEXT`s that wait for them (not yet taken nor
    /// given back), and the wake-up of those waiting for them to settle.
    pub answering: usize,
    pub settled: Arc<tokio::sync::Notify>,
}

impl PlanRun {
    /// This plan's [`PlanIdentity`].
    pub fn identity(&self) -> PlanIdentity {
        (self.dataset.name.clone(), self.key)
    }

    pub fn new(
        id: u64,
        key: PlanKey,
        fingerprint: u64,
        dataset: Arc<Dataset>,
        listing: Arc<Listing>,
        files: Vec<u32>,
    ) -> Self {
        Self {
            id,
            key,
            fingerprint,
            dataset,
            listing,
            entries: vec![Entry::default(); files.len()],
            remaining: files.len(),
            files,
            fetched: HashMap::new(),
            by_file: None,
            fetch: 0,
            claim: 0,
            reserved: 0,
            attached: 0,
            waiters: HashMap::new(),
            order: None,
            orphaned: BTreeSet::new(),
            answering: 0,
            settled: Arc::default(),
        }
    }

    /// Returns the next position a reader should fetch, without starting it.
    pub fn next_unstarted(&mut self) -> Option<u32> {
        while self.fetch < self.entries.len() && self.entries[self.fetch].started {
            self.fetch += 1;
        }
        (self.fetch < self.entries.len()).then_some(self.fetch as u32)
    }

    /// Whether a consumer is waiting on an entry no reader has started.
    pub fn consumer_waiting(&mut self) -> bool {
        self.next_unstarted()
            .is_some_and(|p| self.entries[p as usize].claimed)
    }

    pub fn size_of(&self, pos: u32) -> u64 {
        self.listing.files[self.files[pos as usize] as usize].size
    }

    pub fn name_of(&self, pos: u32) -> &str {
        &self.listing.files[self.files[pos as usize] as usize].name
    }

    /// Claims up to `max` of the next unclaimed positions, stopping once
    /// their planned sizes pass `budget` bytes (at least one is claimed).
    pub fn claim_next(&mut self, max: usize, budget: u64) -> Vec<u32> {
        let mut claimed = Vec::new();
        let mut bytes = 0;
        let mut full = false;
        while claimed.len() < max
            && let Some(&pos) = self.orphaned.first()
        {
            let size = self.size_of(pos);
            full = !claimed.is_empty() && bytes + size > budget;
            if full {
                break;
            }
            bytes += size;
            self.orphaned.pop_first();
            claimed.push(pos);
        }
        while !full && claimed.len() < max && self.claim < self.entries.len() {
            let pos = self.claim;
            self.claim += 1;
            if self.entries[pos].claimed {
                continue;
            }
            let size = self.size_of(pos as u32);
            if !claimed.is_empty() && bytes + size > budget {
                self.claim -= 1;
                break;
            }
            bytes += size;
            self.entries[pos].claimed = true;
            claimed.push(pos as u32);
        }
        self.answering += claimed.len();
        claimed
    }

    /// Gives claimed positions whose `NEXT` was given up before it took
    /// them back to the plan: they stay claimed (readers fetch them first,
    /// and a plan with them is not exhausted), and the next claim takes
    /// them.
    pub fn orphan(&mut self, positions: &[u32]) {
        for &pos in positions {
            if self.entries[pos as usize].claimed {
                self.orphaned.insert(pos);
            }
        }
        self.settle(positions.len());
    }

    /// `n` entries a `NEXT` claimed were taken or given back.
    pub fn settle(&mut self, n: usize) {
        self.answering = self.answering.saturating_sub(n);
        self.settled.notify_waiters();
    }

    /// Opens taken positions whose answer never reached its trainer (the
    /// write failed) again: a reader fetches them anew and the next claim
    /// takes them.
    pub fn reopen(&mut self, positions: &[u32]) {
        for &pos in positions {
            let entry = &mut self.entries[pos as usize];
            if !entry.claimed || self.fetched.contains_key(&pos) {
                continue;
            }
            *entry = Entry::default();
            self.remaining += 1;
            self.claim = self.claim.min(pos as usize);
            self.fetch = self.fetch.min(pos as usize);
        }
    }

    /// The first undelivered position that reads file `file`, if any.
    pub fn unclaimed_of(&mut self, file: u32) -> Option<u32> {
        let files = &self.files;
        let by_file = self.by_file.get_or_insert_with(|| {
            let mut order: Vec<u32> = (0..files.len() as u32).collect();
            order.sort_unstable_by_key(|&pos| (files[pos as usize], pos));
            order
        });
        let first = by_file.partition_point(|&pos| files[pos as usize] < file);
        by_file[first..]
            .iter()
            .take_while(|&&pos| files[pos as usize] == file)
            .copied()
            .find(|pos| !self.entries[*pos as usize].claimed || self.orphaned.contains(pos))
    }

    /// Whether every entry has been claimed (nothing left for `NEXT`).
    pub fn exhausted(&mut self) -> bool {
        while self.claim < self.entries.len() && self.entries[self.claim].claimed {
            self.claim += 1;
        }
        self.claim >= self.entries.len() && self.orphaned.is_empty()
    }

    /// Bytes held by fetched, undelivered entries.
    pub fn buffered_bytes(&self) -> u64 {
        self.fetched.values().map(|f| f.reserved).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::FileEntry;

    #[test]
    fn shares_of_one_order_in_nested_worlds_are_apart_and_others_overlap() {
        let order = |seed, shuffle, world_size| ShardOrder {
            seed,
            shuffle,
            world_size,
        };
        let ranks = order(5, true, 2);
        // Two workers' shares of each of two ranks: shares 0..4 of 4.
        let workers = order(5, true, 4);
        assert!(!ranks.overlaps(0, &workers, 1) && !ranks.overlaps(0, &workers, 3));
        assert!(
            ranks.overlaps(0, &workers, 2),
            "share 2 of 4 is part of share 0 of 2"
        );
        assert!(!workers.overlaps(3, &ranks, 0));
        assert!(ranks.overlaps(0, &order(6, true, 2), 1), "another seed");
        assert!(ranks.overlaps(0, &order(5, false, 2), 1), "unshuffled");
        assert!(
            ranks.overlaps(0, &order(5, true, 3), 1),
            "worlds that do not nest"
        );
        assert!(
            !order(1, false, 2).overlaps(0, &order(2, false, 2), 1),
            "no shuffle: no seed"
        );
        assert!(!ranks.overlaps(0, &ranks, 1));
    }

    fn plan(files: Vec<u32>) -> PlanRun {
        let dir = tempfile::tempdir().unwrap();
        let source = crate::source::DirSource::open("d", dir.path(), false).unwrap();
        let ds = Arc::new(Dataset::new("d", crate::source::Source::Dir(source)));
        let listing = Arc::new(Listing::new(
            (0..4)
                .map(|i| FileEntry::new(format!("f{i}"), 10, 0))
                .collect(),
        ));
        PlanRun::new(
            1,
            PlanKey {
                rank: 0,
                epoch: 0,
                run: 0,
            },
            0,
            ds,
            listing,
            files,
        )
    }

    /// Claims the first undelivered position that reads file `file`, as
    /// a read by name does.
    fn claim_file(p: &mut PlanRun, file: u32) -> Option<u32> {
        let pos = p.unclaimed_of(file)?;
        p.entries[pos as usize].claimed = true;
        p.orphaned.remove(&pos);
        Some(pos)
    }

    #[test]
    fn claims_given_up_are_taken_next_and_answers_lost_are_read_again() {
        let mut p = plan(vec![0, 1, 2, 3]);
        assert_eq!(p.claim_next(3, u64::MAX), [0, 1, 2]);
        assert_eq!(p.claim_next(10, u64::MAX), [3]);
        assert!(p.exhausted());
        // The NEXT of 0..3 was given up: its entries are the next claims,
        // first come first, and still within the byte budget.
        assert_eq!(
            p.answering, 4,
            "four claimed entries wait for their answers"
        );
        p.orphan(&[0, 1, 2]);
        assert_eq!(p.answering, 1);
        assert!(!p.exhausted(), "given-up claims are still to deliver");
        assert!(p.entries[1].claimed, "readers fetch them first");
        assert_eq!(
            claim_file(&mut p, 1),
            Some(1),
            "a read by name takes one too"
        );
        assert_eq!(p.claim_next(10, 15), [0], "within the byte budget");
        assert_eq!(p.claim_next(10, 15), [2]);
        assert!(p.exhausted());
        // The answer with 0 and 2 was taken but never written: both are
        // read again and claimed again; 3, still claimed, is not.
        p.entries[0].started = true;
        p.entries[2].started = true;
        p.remaining -= 2;
        p.reopen(&[0, 2]);
        assert_eq!(p.remaining, 4);
        assert_eq!(p.next_unstarted(), Some(0));
        assert_eq!(p.claim_next(10, u64::MAX), [0, 2]);
    }

    #[test]
    fn claims_in_order_and_skip_what_read_took() {
        let mut p = plan(vec![3, 1, 2, 1, 0]);
        assert_eq!(claim_file(&mut p, 1), Some(1));
        assert_eq!(p.claim_next(2, u64::MAX), [0, 2]);
        assert_eq!(claim_file(&mut p, 1), Some(3));
        assert_eq!(
            claim_file(&mut p, 1),
            None,
            "both entries of file 1 are taken"
        );
        assert!(!p.exhausted());
        assert_eq!(p.claim_next(10, u64::MAX), [4]);
        assert!(p.exhausted());
    }

    #[test]
    fn claims_stop_at_the_byte_budget_but_take_at_least_one() {
        let mut p = plan(vec![0, 1, 2, 3]);
        assert_eq!(p.claim_next(10, 25), [0, 1]);
        assert_eq!(p.claim_next(10, 5), [2]);
    }

    #[test]
    fn readers_skip_started_entries() {
        let mut p = plan(vec![0, 1, 2]);
        p.entries[0].started = true;
        p.entries[1].started = true;
        assert_eq!(p.next_unstarted(), Some(2));
        assert!(!p.consumer_waiting());
        p.entries[2].claimed = true;
        assert!(p.consumer_waiting());
        p.entries[2].started = true;
        assert_eq!(p.next_unstarted(), None);
    }
}
