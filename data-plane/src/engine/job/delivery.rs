//! Handing a job's plans to trainers: creating and joining plans, claiming
//! entries for `NEXT` and `READ`, waiting for them, and returning their
//! bytes to the budget once written.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tracing::debug;

use super::{ANSWER_WAIT, Job, MEMORY_RECHECK, OVER_PATIENCE, PlanState};
use crate::cache::{Fill, Lookup};
use crate::chunk::Chunk;
use crate::dataset::{Dataset, Listing};
use crate::engine::Memory;
use crate::engine::plan_run::{PlanIdentity, PlanKey, PlanRun, ShardOrder};
use crate::metrics::DatasetMetrics;
use crate::protocol::{ErrorCode, Payload, ProtocolError, SAMPLES_FRAME_BUDGET, Sample, TO_END};
use crate::source::{Pinned, Source};
use crate::storage::{MAX_FILE_BYTES, clamp_range, io_error, open_regular};

/// The plan of reservations that belong to none: whole files read for a
/// trainer outside the readers.
const NO_PLAN: u64 = u64::MAX;

/// A trainer's wait for data is counted as stall at least this often while
/// it lasts (the tuner's tick), not only once it ends.
const STALL_SLICE: std::time::Duration = crate::tuner::TICK;

/// A connection's attachment to a plan; detaches on drop.
#[derive(Debug)]
pub struct PlanHandle {
    job: Arc<Job>,
    id: Option<u64>,
    pub length: u32,
}

/// Whether the trainer that asked is still there, for a wait on its
/// behalf ([`Job::next`]): the wait is its stall while it is, and gives up
/// as soon as it left.
#[derive(Debug)]
pub struct Presence {
    here: AtomicBool,
    gone: tokio::sync::Notify,
}

impl Default for Presence {
    fn default() -> Self {
        Self {
            here: AtomicBool::new(true),
            gone: tokio::sync::Notify::new(),
        }
    }
}

impl Presence {
    /// The trainer left: a wait on its behalf wakes and gives up.
    pub fn leave(&self) {
        self.here.store(false, Ordering::Relaxed);
        self.gone.notify_one();
    }

    pub fn here(&self) -> bool {
        self.here.load(Ordering::Relaxed)
    }

    /// Resolves when the trainer of `present` leaves; never for a wait on
    /// no trainer's behalf, or on one that left already.
    async fn leaving(present: Option<&Self>) {
        match present {
            Some(p) if p.here() => p.gone.notified().await,
            _ => std::future::pending().await,
        }
    }
}

/// What `NEXT` returns: the samples, whether the plan is exhausted, and the
/// buffer bytes they hold until written out.
#[derive(Debug)]
pub struct NextBatch {
    pub samples: Vec<Sample>,
    pub end: bool,
    pub reservation: Reservation,
}

/// The positions a waiting `NEXT` claimed, given back to its plan when
/// the wait is dropped before it took (or gave back) them.
struct GivenUp<'a> {
    job: &'a Job,
    id: u64,
    positions: &'a [u32],
}

impl Drop for GivenUp<'_> {
    fn drop(&mut self) {
        if self.positions.is_empty() {
            return;
        }
        if let Some(plan) = self.job.lock().plans.get_mut(&self.id) {
            plan.orphan(self.positions);
        }
    }
}

/// An entry a whole-file `READ` claimed in a plan: one a reader has already
/// started (wait for it), or one nobody has (read it in the reader's place).
enum Claimed {
    Buffered(u64, u32, DatasetMetrics),
    Direct(u64, u32, DatasetMetrics, Arc<Dataset>),
}

/// A plan entry claimed by name and not yet delivered
/// ([`Job::claim_planned`]); [`Job::deliver_claimed`] delivers it (a claim
/// dropped undelivered leaves its plan one entry short).
pub struct PlannedClaim(Claimed);

/// Buffer bytes held by data on its way to a trainer; released on drop
/// (with one lock of the job for the whole batch).
#[derive(Debug)]
pub struct Reservation {
    job: Arc<Job>,
    plan: u64,
    bytes: u64,
    /// Bytes moved to samples lent in shared memory: they leave the plan's
    /// share on drop, and the job's when the trainer returns them.
    lent: u64,
    /// The bound on answers not yet taken that the data counts in (a
    /// `NEXT`'s claim, a read by name) until it goes.
    _untaken: Option<Untaken>,
}

/// Bytes of an answer not yet taken, counted in one of the node's bounds
/// on them until the answer goes or is given up: every job's `NEXT`
/// claims ([`Memory::claim_room`]) or answers to reads by name
/// ([`Job::hold_answer`]).
#[derive(Debug)]
pub struct Untaken {
    memory: Arc<Memory>,
    bytes: u64,
    of: Answers,
}

#[derive(Debug, Clone, Copy)]
enum Answers {
    Claims,
    ByName,
}

impl Drop for Untaken {
    fn drop(&mut self) {
        match self.of {
            Answers::Claims => self.memory.drop_claim(self.bytes),
            Answers::ByName => self.memory.drop_answer(self.bytes),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 || self.lent > 0 {
            self.job.settle(self.plan, self.bytes, self.lent);
        }
    }
}

impl Reservation {
    /// Keeps `untaken` counted until this reservation goes (with the
    /// answer that carries its data).
    pub fn keep_untaken(&mut self, untaken: Untaken) {
        self._untaken = Some(untaken);
    }

    /// Moves `bytes` of this reservation to a sample lent to a trainer in
    /// shared memory: they leave the plan's buffer when the reservation
    /// goes, and the node budget when the trainer releases the slot (or
    /// its connection ends).
    /// `None` when trainers already hold as much as the node allows
    /// (half the node budget, every job's together): the sample then
    /// travels in the frame.
    pub fn lend(&mut self, bytes: u64) -> Option<Lent> {
        let bytes = bytes.min(self.bytes);
        if !self.job.memory.try_lend(bytes) {
            return None;
        }
        self.bytes -= bytes;
        self.lent += bytes;
        Some(Lent {
            job: Arc::clone(&self.job),
            bytes,
        })
    }
}

/// Budget bytes of a sample lent to a trainer; returned on drop, or with
/// others in one step by [`Lent::return_all`].
#[derive(Debug)]
pub struct Lent {
    job: Arc<Job>,
    bytes: u64,
}

impl Drop for Lent {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.job.return_lent(self.bytes);
        }
    }
}

impl Lent {
    /// Returns the bytes of many lent samples of one job with one lock of
    /// it (a `RELEASE` names dozens).
    pub fn return_all<'a>(lent: impl IntoIterator<Item = &'a mut Lent>) {
        let mut job = None;
        let mut total = 0;
        for l in lent {
            total += std::mem::take(&mut l.bytes);
            job.get_or_insert_with(|| Arc::clone(&l.job));
        }
        if let Some(job) = job
            && total > 0
        {
            job.return_lent(total);
        }
    }
}

impl Job {
    /// Returns a delivered batch's bytes to the buffer and the node budget
    /// (`released`), and takes the bytes it lent in shared memory off the
    /// plan's share (`lent`: they stay the job's until returned).
    fn settle(&self, plan: u64, released: u64, lent: u64) {
        let mut st = self.lock();
        st.reserved -= released;
        if let Some(p) = st.plans.get_mut(&plan) {
            p.reserved -= released + lent;
        }
        self.memory.release(released);
        self.wake_reader(st);
    }

    /// Wakes one reader when the buffer may be refilled: it wakes the next
    /// if there is more to do (see `reader_loop`), instead of every reader
    /// racing for one slot; a buffer marked full waits for its low-water
    /// mark.
    fn wake_reader(&self, mut st: std::sync::MutexGuard<'_, super::JobState>) {
        if st.can_refill(&self.memory) {
            self.wake_reader_short(&st);
        }
    }

    /// Returns the bytes of lent samples to the job and the node budget.
    fn return_lent(&self, bytes: u64) {
        let mut st = self.lock();
        st.reserved -= bytes;
        self.memory.unlend(bytes);
        self.memory.release(bytes);
        self.wake_reader(st);
    }

    /// Creates the plan `key` or joins the identical one already active.
    pub fn attach_plan(
        self: &Arc<Self>,
        key: PlanKey,
        fingerprint: u64,
        dataset: Arc<Dataset>,
        listing: Arc<Listing>,
        files: Vec<u32>,
    ) -> Result<(PlanHandle, PlanState), ProtocolError> {
        let length = files.len() as u32;
        let handle = |id| PlanHandle {
            job: Arc::clone(self),
            id,
            length,
        };
        let mut st = self.lock();
        let full: PlanIdentity = (dataset.name.clone(), key);
        if let Some(&id) = st.by_key.get(&full) {
            let plan = st.plans.get_mut(&id).expect("by_key points at a live plan");
            if plan.fingerprint != fingerprint {
                return Err(ProtocolError::new(
                    ErrorCode::PlanConflict,
                    format!(
                        "job `{}` already has a different active plan over data set `{}` for rank {} epoch {}{}; submit the same plan to share it, or use another epoch number",
                        self.id,
                        dataset.name,
                        key.rank,
                        key.epoch,
                        if key.run == 0 {
                            String::new()
                        } else {
                            format!(" run {:016x}", key.run)
                        }
                    ),
                ));
            }
            plan.attached += 1;
            return Ok((handle(Some(id)), PlanState::Joined));
        }
        if let Some(i) = st.completed.iter().position(|(k, _)| *k == full) {
            if st.completed[i].1 == fingerprint {
                return Ok((handle(None), PlanState::AlreadyComplete));
            }
            st.completed.remove(i);
        }
        if let Err(planned) = self.memory.try_plan(u64::from(length)) {
            return Err(ProtocolError::new(
                ErrorCode::TooLarge,
                format!(
                    "a plan of {length} entries does not fit: the stage's plans hold {planned} entries, and its memory budget allows {} (a quarter of it, at about 10 bytes an entry); plan fewer at a time, or end plans no longer read",
                    self.memory.most_planned()
                ),
            ));
        }
        st.planned += u64::from(length);
        let id = st.next_id;
        st.next_id += 1;
        let mut plan = PlanRun::new(id, key, fingerprint, dataset, listing, files);
        plan.attached = 1;
        let complete = plan.remaining == 0;
        st.plans.insert(id, plan);
        st.by_key.insert(full, id);
        if complete {
            st.finish_plan(id);
        }
        st.count_plans(&self.memory);
        self.ensure_readers(&mut st);
        drop(st);
        self.work.notify_all();
        debug!(job = %self.id, rank = key.rank, epoch = key.epoch, length, "plan created");
        Ok((handle(Some(id)), PlanState::Created))
    }

    /// Records the order the plan of `handle` was cut from and returns
    /// another rank's live plan of the same data set and epoch whose share
    /// can overlap this one's (its rank and order), if any: cut from a
    /// different order, or from a world that does not nest with this one's
    /// (see [`ShardOrder::overlaps`]).
    pub fn note_order(&self, handle: &PlanHandle, order: ShardOrder) -> Option<(u32, ShardOrder)> {
        let id = handle.id?;
        let mut st = self.lock();
        let plan = st.plans.get_mut(&id)?;
        plan.order = Some(order);
        let (dataset, key) = (plan.dataset.name.clone(), plan.key);
        st.plans.values().find_map(|other| {
            let theirs = other.order?;
            (other.key.rank != key.rank
                && other.key.epoch == key.epoch
                && other.dataset.name == dataset
                && order.overlaps(key.rank, &theirs, other.key.rank))
            .then_some((other.key.rank, theirs))
        })
    }

    pub(super) fn detach(&self, id: u64) {
        let mut st = self.lock();
        let Some(plan) = st.plans.get_mut(&id) else {
            return;
        };
        plan.attached -= 1;
        if plan.attached > 0 {
            return;
        }
        let plan = st.plans.remove(&id).expect("present");
        st.by_key.remove(&plan.identity());
        st.count_plans(&self.memory);
        // In-flight reads release their own bytes when they find the plan gone.
        let buffered = plan.buffered_bytes();
        st.reserved -= buffered;
        self.memory.release(buffered);
        drop(st);
        // Whole-file reads waiting for one of its entries (a map-style
        // worker's, which do not hold the plan) find it gone and read the
        // file themselves.
        for waiter in plan.waiters.values() {
            waiter.notify_one();
        }
        self.work.notify_all();
        debug!(job = %self.id, rank = plan.key.rank, epoch = plan.key.epoch, freed = buffered, "plan abandoned");
    }

    /// Claims the next entries of the plan and waits until they are
    /// fetched; the wait is the trainer's stall while `present` (when
    /// given) says the trainer that asked is still there. `None` when
    /// `present` said it left before the entries were taken: they go back
    /// to the plan, fetched (the reads it started go on, as a trainer that
    /// gives up on a slow answer and asks again, on a new connection,
    /// wants them), for the job's next trainer.
    pub async fn next(
        self: &Arc<Self>,
        handle: &PlanHandle,
        max: usize,
        present: Option<&Presence>,
    ) -> Option<NextBatch> {
        let empty = |end| NextBatch {
            samples: Vec::new(),
            end,
            reservation: self.reservation(0, 0),
        };
        let Some(id) = handle.id else {
            return Some(empty(true));
        };
        let (positions, metrics, waiting, claim) = loop {
            let settled = {
                let mut st = self.lock();
                let Some(plan) = st.plans.get_mut(&id) else {
                    return Some(empty(true));
                };
                // At most a quarter of the node's budget at once, half the
                // job's share of it, and what every job's unanswered claims
                // leave of half the budget (at least one entry): the answer
                // waits for every claimed entry, and what the budget cannot
                // hold at once would never all be fetched, nor would every
                // job's claims together (read-ahead nobody claimed makes
                // way for them). The shares alone did not bound the claims:
                // each is cut from the jobs of its moment, and trainers that
                // claim and never read their answers keep them.
                let cap = (self.memory.budget() / 4)
                    .min(self.memory.job_share() / 2)
                    .min(self.memory.claim_room());
                let positions = plan.claim_next(max, SAMPLES_FRAME_BUDGET.min(cap));
                if positions.is_empty() && plan.answering > 0 {
                    Arc::clone(&plan.settled)
                } else {
                    let bytes = positions.iter().map(|&p| plan.size_of(p)).sum();
                    let waiting = plan.consumer_waiting();
                    let dataset = plan.dataset.name.clone();
                    self.memory.hold_claim(bytes);
                    let claim = Untaken {
                        memory: Arc::clone(&self.memory),
                        bytes,
                        of: Answers::Claims,
                    };
                    break (
                        positions,
                        self.dataset_metrics(&mut st, &dataset),
                        waiting,
                        claim,
                    );
                }
            };
            // Another connection's NEXT waits for the plan's last entries:
            // they come back if its trainer leaves, so the end is not told
            // before they are taken.
            if !present.is_none_or(Presence::here) {
                return None;
            }
            let _ = tokio::time::timeout(STALL_SLICE, async {
                tokio::select! {
                    () = settled.notified() => {}
                    () = Presence::leaving(present) => {}
                }
            })
            .await;
        };
        if positions.is_empty() {
            return Some(empty(true));
        }
        if waiting {
            // A claimed entry nobody fetches yet may go past the buffer cap:
            // make sure a reader looks.
            self.work.notify_one();
        }
        // The connection holds the plan, so it cannot be dropped under us.
        let Some((samples, end, bytes)) = self.wait_for(id, &positions, &metrics, present).await
        else {
            return present.is_none_or(Presence::here).then(|| empty(true));
        };
        self.count_delivered(&metrics, &samples);
        let mut reservation = self.reservation(id, bytes);
        reservation._untaken = Some(claim);
        Some(NextBatch {
            samples,
            end,
            reservation,
        })
    }

    /// Opens the entries of a `NEXT`'s answer that never reached its
    /// trainer (writing it failed) again, so that the job's next trainer
    /// gets them. Those of a plan delivered to its end meanwhile are lost
    /// to it (a new plan of that epoch reads them all again).
    pub fn reopen(&self, handle: &PlanHandle, positions: &[u32]) {
        let Some(id) = handle.id else { return };
        let mut st = self.lock();
        let Some(plan) = st.plans.get_mut(&id) else {
            debug!(job = %self.id, lost = positions.len(), "an unwritten answer's plan ended meanwhile");
            return;
        };
        plan.reopen(positions);
        drop(st);
        self.work.notify_all();
    }

    /// Waits until every claimed position is fetched, then takes them.
    /// Returns the samples, whether the plan is exhausted, and their bytes;
    /// `None` if the plan was dropped meanwhile (every attached connection
    /// left, which a map-style `READ` does not hold off) or `present`
    /// says the trainer left. The wait counts as the trainer's stall while
    /// `present` (when given) says its trainer is still there.
    ///
    /// A trainer that left takes nothing: its claims go back to the plan
    /// at once, for the job's next trainer, and the wait (which holds the
    /// plan) goes on until those nobody took since are fetched: a trainer
    /// that gave up on a slow answer and asks again wants them. A wait
    /// dropped before it took its entries gives them back too.
    async fn wait_for(
        &self,
        id: u64,
        positions: &[u32],
        metrics: &DatasetMetrics,
        present: Option<&Presence>,
    ) -> Option<(Vec<Sample>, bool, u64)> {
        let stalled = || present.is_none_or(Presence::here);
        let mut claims = GivenUp {
            job: self,
            id,
            positions,
        };
        // Since when the stall is not counted yet.
        let mut uncounted = Instant::now();
        let mut waited = false;
        loop {
            let wake = {
                let mut st = self.lock();
                let plan = st.plans.get_mut(&id)?;
                let left = !stalled();
                if left && !claims.positions.is_empty() {
                    plan.orphan(positions);
                    claims.positions = &[];
                }
                let pending = |p: &&u32| {
                    !plan.fetched.contains_key(p) && (!left || plan.orphaned.contains(p))
                };
                match positions.iter().find(pending) {
                    // Wait for the first missing entry only: one wake-up per
                    // gap instead of one per fetched entry.
                    Some(&missing) => Arc::clone(plan.waiters.entry(missing).or_default()),
                    None if left => return None,
                    None => {
                        claims.positions = &[];
                        plan.settle(positions.len());
                        let mut bytes = 0;
                        let mut samples = Vec::with_capacity(positions.len());
                        for &p in positions {
                            if let Some(fetched) = plan.fetched.remove(&p) {
                                bytes += fetched.reserved;
                                samples.push(Sample {
                                    position: p,
                                    name: plan.name_of(p).to_owned(),
                                    data: fetched.data.map(Payload::Bytes),
                                });
                            }
                        }
                        plan.remaining -= positions.len();
                        let end = plan.exhausted();
                        if plan.remaining == 0 {
                            st.finish_plan(id);
                            st.count_plans(&self.memory);
                        }
                        drop(st);
                        if waited && stalled() {
                            self.count_stall(metrics, uncounted.elapsed());
                        }
                        return Some((samples, end, bytes));
                    }
                }
            };
            waited = true;
            // notify_one leaves a permit if it fired before we got here.
            // A long wait is counted as it goes, so that every window it
            // spans (the tuner's, the telemetry's) sees a stalled trainer:
            // at least every STALL_SLICE, whether it passed in silence or
            // in wake-ups for entries that came one by one (a throttled job
            // fills a batch of 32 over seconds, a wake-up each).
            let _ = tokio::time::timeout(STALL_SLICE, async {
                tokio::select! {
                    () = wake.notified() => {}
                    () = Presence::leaving(present) => {}
                }
            })
            .await;
            let now = Instant::now();
            if now - uncounted >= STALL_SLICE {
                if stalled() {
                    self.count_stall(metrics, now - uncounted);
                }
                uncounted = now;
            }
        }
    }

    /// Serves a whole-file `READ` of `name` from an active plan of this job
    /// (of trainer run `run` when given, 0 being plans that name none) when
    /// one still has it undelivered: from the buffer, by waiting for the
    /// reader already fetching it, or by reading it now in its place.
    /// Returns `None` when no such plan holds the name.
    pub async fn read_planned(
        self: &Arc<Self>,
        dataset: &str,
        name: &str,
        run: Option<u64>,
    ) -> Option<(Sample, Reservation)> {
        let claim = self.claim_planned(dataset, name, run)?;
        self.deliver_claimed(claim, name).await
    }

    /// The first half of [`Job::read_planned`], which never waits: claims
    /// `name`'s undelivered entry in an active plan (of run `run` when
    /// given), or `None` when no plan holds it (so a caller can answer at
    /// once without a task).
    pub fn claim_planned(
        &self,
        dataset: &str,
        name: &str,
        run: Option<u64>,
    ) -> Option<PlannedClaim> {
        self.claim_by_name(dataset, name, run, false)
            .map(PlannedClaim)
    }

    /// [`Job::claim_planned`] of an entry a reader has started (buffered
    /// or on its way), or `None`: its bytes are the plan's, counted in
    /// the budget already, so its answer waits for no room (see
    /// [`Job::hold_answer`]); a read by name that waited for room while
    /// its planned entry sat in the buffer kept the buffer full for the
    /// other reads' 2 s.
    pub fn claim_buffered(
        &self,
        dataset: &str,
        name: &str,
        run: Option<u64>,
    ) -> Option<PlannedClaim> {
        self.claim_by_name(dataset, name, run, true)
            .map(PlannedClaim)
    }

    /// The second half of [`Job::read_planned`]: the claimed entry, from the
    /// buffer, by waiting for the reader fetching it, or read now.
    pub async fn deliver_claimed(
        self: &Arc<Self>,
        claim: PlannedClaim,
        name: &str,
    ) -> Option<(Sample, Reservation)> {
        match claim.0 {
            Claimed::Buffered(id, pos, m) => {
                // None: the plan was abandoned meanwhile; the caller reads directly.
                let (mut samples, _, bytes) = self.wait_for(id, &[pos], &m, None).await?;
                self.count_delivered(&m, &samples);
                let sample = samples.pop()?;
                Some((sample, self.reservation(id, bytes)))
            }
            Claimed::Direct(id, pos, m, ds) => {
                let (sample, reservation) = self.read_whole_now(ds, name, pos, &m).await;
                self.delivered_outside_readers(id);
                self.count_delivered(&m, std::slice::from_ref(&sample));
                Some((sample, reservation))
            }
        }
    }

    /// Delivers the claimed entry without reading it when no reader has
    /// started it (a mount's open of a large file reads it in windows
    /// instead), returning `None`; gives the claim back when one has (the
    /// entry is buffered or on its way: [`Job::deliver_claimed`] takes it).
    pub fn deliver_unread(&self, claim: PlannedClaim) -> Option<PlannedClaim> {
        match claim.0 {
            Claimed::Direct(id, ..) => {
                self.delivered_outside_readers(id);
                None
            }
            started => Some(PlannedClaim(started)),
        }
    }

    /// Whether trainer run `run` has plans on `dataset` undelivered, none
    /// of them made over the listing of digest `digest`: a reader holding
    /// that listing (a `DataLoader` worker kept from an earlier epoch)
    /// would name other files by the indices its trainer's sampler planned.
    pub fn plans_over_another_listing(&self, dataset: &str, run: u64, digest: u64) -> bool {
        let st = self.lock();
        let mut plans = st
            .plans
            .values()
            .filter(|p| p.dataset.name == dataset && p.key.run == run && p.remaining > 0)
            .peekable();
        plans.peek().is_some() && plans.all(|p| p.listing.digest != digest)
    }

    /// Claims the first undelivered entry of `name` in an active plan on
    /// `dataset` (of run `run` when given), marking it started; only one
    /// a reader started already when `started_only`.
    fn claim_by_name(
        &self,
        dataset: &str,
        name: &str,
        run: Option<u64>,
        started_only: bool,
    ) -> Option<Claimed> {
        let mut st = self.lock();
        let found = st.plans.values_mut().find_map(|plan| {
            if plan.dataset.name != dataset || run.is_some_and(|r| plan.key.run != r) {
                return None;
            }
            let file = plan.listing.position(name)?;
            let pos = plan.unclaimed_of(file)?;
            let entry = &mut plan.entries[pos as usize];
            if started_only && !entry.started {
                return None;
            }
            entry.claimed = true;
            plan.orphaned.remove(&pos);
            let started = std::mem::replace(&mut entry.started, true);
            Some((plan.id, pos, started, Arc::clone(&plan.dataset)))
        });
        let (id, pos, started, ds) = found?;
        let m = self.dataset_metrics(&mut st, dataset);
        Some(if started {
            Claimed::Buffered(id, pos, m)
        } else {
            Claimed::Direct(id, pos, m, ds)
        })
    }

    /// Reads file `name` whole now, outside the readers (a plan entry no
    /// reader started, or a `FETCH` of a file no plan holds), under the
    /// limiter. Its bytes count in the node budget, held by the returned
    /// reservation (in the job's region while it has room, so that a
    /// shared-memory connection can lend them), over the budget only as
    /// [`crate::engine::Memory`]'s `reserve_waiting` allows.
    pub async fn read_whole_now(
        self: &Arc<Self>,
        dataset: Arc<Dataset>,
        name: &str,
        position: u32,
        m: &DatasetMetrics,
    ) -> (Sample, Reservation) {
        let job = Arc::clone(self);
        let owned = name.to_owned();
        let metrics = m.clone();
        let (data, reserved) =
            crate::blocking::run(move || job.read_whole_blocking(&dataset, &owned, &metrics))
                .await
                .unwrap_or_else(|e| (Err(e.to_protocol(&format!("reading `{name}`"))), 0));
        let sample = Sample {
            position,
            name: name.to_owned(),
            data: data.map(Payload::Bytes),
        };
        (sample, self.reservation(NO_PLAN, reserved))
    }

    /// [`Job::read_whole_now`]'s read; returns the data and the budget
    /// bytes it holds. Blocking.
    fn read_whole_blocking(
        &self,
        dataset: &Dataset,
        name: &str,
        m: &DatasetMetrics,
    ) -> (Result<Chunk, ProtocolError>, u64) {
        let source = dataset.source();
        let reserved = Cell::new(0);
        let alloc = |len: usize| {
            let bytes = len as u64;
            self.memory
                .reserve_waiting(bytes, OVER_PATIENCE, MEMORY_RECHECK);
            self.lock().reserved += bytes;
            reserved.set(reserved.get() + bytes);
            self.buffer(len)
        };
        // What the cache (or another reader's read) answers costs storage
        // nothing, and is counted so.
        let copied = |bytes: &[u8]| {
            let mut buf = alloc(bytes.len());
            buf.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
            self.count_cache_hit(bytes.len());
            Chunk::pooled(buf, 0, bytes.len())
        };
        // The limiter's wait for the read (before the cache is asked to
        // claim it: see `Cache::lookup_unclaimed`).
        let throttled = || {
            let size = charged_size(dataset, name).inspect_err(|e| self.count_failed(m, e))?;
            self.throttle_for_consumer(size, m);
            Ok::<_, ProtocolError>(size)
        };
        // A listed sample the node cache holds, or that another reader is
        // reading now, is not read again.
        let mut size = None;
        let fill = loop {
            let claim = size.is_some() || self.reads_at_once();
            match self
                .cache_lookup(dataset, name, 0, TO_END, None, claim)
                .map(|(l, _)| l)
            {
                Some(Cached::Whole(Lookup::Hit(bytes))) => {
                    self.refund(size);
                    return (Ok(copied(&bytes)), reserved.get());
                }
                Some(Cached::Range(bytes)) => {
                    self.refund(size);
                    return (Ok(copied(&bytes)), reserved.get());
                }
                Some(Cached::Whole(Lookup::Wait(flight))) => {
                    self.refund(size);
                    let data = flight.wait_blocking().map(|bytes| copied(&bytes));
                    return (data, reserved.get());
                }
                Some(Cached::Whole(Lookup::Disk(hit))) => {
                    let len = hit.len();
                    let mut buf = alloc(len);
                    if hit.read_into(&mut buf.as_mut_slice()[..len]) {
                        self.refund(size);
                        self.count_cache_hit(len);
                        return (Ok(Chunk::pooled(buf, 0, len)), reserved.get());
                    }
                    break None; // the file failed its check and is gone: read the source
                }
                Some(Cached::Absent) => match throttled() {
                    Ok(charged) => size = Some(charged),
                    Err(e) => return (Err(e), 0),
                },
                Some(Cached::Whole(Lookup::Miss(fill))) => break Some(fill),
                None => break None,
            }
        };
        // Charged (the limiter waited) by the listed size, or the one the
        // source gave.
        if let Err(e) = size.map_or_else(throttled, Ok) {
            if let Some(fill) = fill {
                fill.fail(&e);
            }
            return (Err(e), 0);
        }
        let start = Instant::now();
        let data = source.read_unlisted(name, &alloc);
        self.count_read(m, start.elapsed(), &data);
        offer_whole(fill, data.as_ref());
        match (data, reserved.get()) {
            (Err(e), bytes) if bytes > 0 => {
                self.settle(NO_PLAN, bytes, 0);
                (Err(e), 0)
            }
            (data, bytes) => (data, bytes),
        }
    }

    /// Counts an entry of plan `id` delivered without a reader, finishing
    /// the plan if it was the last.
    fn delivered_outside_readers(&self, id: u64) {
        let mut st = self.lock();
        if let Some(plan) = st.plans.get_mut(&id) {
            plan.remaining -= 1;
            if plan.remaining == 0 {
                st.finish_plan(id);
                st.count_plans(&self.memory);
            }
        }
    }

    /// Reserves `bytes` of the node budget for data the job keeps outside
    /// its plans (a window of a file open through the mount), if the
    /// budget has room; with `reclaim` (a reader waits on the data) room
    /// is first made from read-ahead nobody has asked for yet (see
    /// [`crate::engine::Memory::reclaim`]). `None` when there is none: the
    /// caller reads what it needs without keeping it.
    pub fn try_hold(self: &Arc<Self>, bytes: u64, reclaim: bool) -> Option<Reservation> {
        let held = self.memory.try_reserve(bytes, false)
            || (reclaim
                && self.memory.reclaim(bytes, self) > 0
                && self.memory.try_reserve(bytes, false));
        if !held {
            return None;
        }
        self.lock().reserved += bytes;
        Some(self.reservation(NO_PLAN, bytes))
    }

    /// Waits until every job's answers to reads by name (`READ`,
    /// `FETCH`) leave room for one of the listed bytes `unheld` gives (see
    /// [`crate::engine::Memory`]'s `try_hold_answer`), asking it again at
    /// each look (what it names may have been started by a reader since),
    /// and counts them until the returned hold goes; `IO_ERROR` when none
    /// was taken for [`ANSWER_WAIT`] (their trainers do not read them).
    pub async fn hold_answer(
        &self,
        mut unheld: impl FnMut() -> u64,
    ) -> Result<Untaken, ProtocolError> {
        let (memory, start) = (&self.memory, Instant::now());
        loop {
            let bytes = unheld();
            let on_way = match memory.try_hold_answer(bytes) {
                Ok(()) => {
                    return Ok(Untaken {
                        memory: Arc::clone(memory),
                        bytes,
                        of: Answers::ByName,
                    });
                }
                Err(on_way) => on_way,
            };
            if start.elapsed() >= ANSWER_WAIT {
                return Err(ProtocolError::new(
                    ErrorCode::IoError,
                    format!(
                        "this answer of {bytes} bytes was not read: answers to reads by name that \
                         their trainers have not taken hold {on_way} bytes of the stage's {}-byte \
                         memory budget (half of it, or one answer larger than that, at most), and \
                         none was taken for {} s; ask again",
                        memory.budget(),
                        ANSWER_WAIT.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(MEMORY_RECHECK).await;
        }
    }

    /// Counts `bytes` read now for a `READ` in the node budget, over it if
    /// need be (how many such answers are on their way at once is bounded
    /// by [`Job::hold_answer`]), until the returned reservation goes.
    pub fn hold_read(self: &Arc<Self>, bytes: u64) -> Reservation {
        self.memory.reserve_over(bytes);
        self.lock().reserved += bytes;
        self.reservation(NO_PLAN, bytes)
    }

    /// Holds `bytes` of plan `plan` until dropped.
    fn reservation(self: &Arc<Self>, plan: u64, bytes: u64) -> Reservation {
        Reservation {
            job: Arc::clone(self),
            plan,
            bytes,
            lent: 0,
            _untaken: None,
        }
    }

    /// Reads straight from storage (random access outside any plan), under
    /// the job's limiter and counted like any storage read; a range of a
    /// listed sample the node cache holds comes from the cache. A read of
    /// a whole listed sample (a file the mount reads in one window, a
    /// `READ` of all of it) is offered to the cache, and one that another
    /// reader has under way waits for its bytes. Blocking.
    pub fn read_now(
        &self,
        dataset: &Dataset,
        name: &str,
        offset: u64,
        length: u64,
        pin: Option<&Pinned>,
        m: &DatasetMetrics,
    ) -> Result<(Chunk, Pinned), ProtocolError> {
        let source = dataset.source();
        // The limiter's wait for the read (before the cache is asked to
        // claim it: see `Cache::lookup_unclaimed`).
        let throttled = || {
            let size = charged_size(dataset, name)
                .map_err(|e| dataset.explained(e))
                .inspect_err(|e| self.count_failed(m, e))?
                .saturating_sub(offset)
                .min(length);
            self.throttle_for_consumer(size, m);
            Ok::<_, ProtocolError>(size)
        };
        let mut fill = None;
        let mut size = None;
        while let Some((lookup, cached)) = self.cache_lookup(
            dataset,
            name,
            offset,
            length,
            pin,
            size.is_some() || self.reads_at_once(),
        ) {
            let range = |bytes: &[u8]| {
                let (start, len) = clamp_range(bytes.len() as u64, offset, length);
                let chunk = Chunk::from_vec(bytes[start as usize..(start + len) as usize].to_vec());
                (chunk, cached.clone())
            };
            // What the cache (or another reader's read) answered costs
            // storage nothing: counted so, as a prefetched hit is, so that
            // the controller does not take it for demand on the pool.
            let hit = |answer: (Chunk, Pinned)| {
                self.count_cache_hit(answer.0.len());
                answer
            };
            match lookup {
                Cached::Range(bytes) => {
                    self.refund(size);
                    return Ok(hit((Chunk::from_vec(bytes), cached)));
                }
                Cached::Whole(Lookup::Hit(bytes)) => {
                    self.refund(size);
                    return Ok(hit(range(&bytes)));
                }
                Cached::Whole(Lookup::Wait(flight)) => {
                    self.refund(size);
                    return flight.wait_blocking().map(|b| hit(range(&b)));
                }
                Cached::Whole(Lookup::Disk(hit_on_disk)) => {
                    // A whole lookup is of the whole sample: no range to cut.
                    let mut bytes = vec![0; hit_on_disk.len()];
                    if hit_on_disk.read_into(&mut bytes) {
                        self.refund(size);
                        return Ok(hit((Chunk::from_vec(bytes), cached)));
                    }
                    break; // the file failed its check and is gone
                }
                Cached::Absent => size = Some(throttled()?),
                Cached::Whole(Lookup::Miss(miss)) => {
                    fill = Some((miss, cached));
                    break;
                }
            }
        }
        size.map_or_else(throttled, Ok)?;
        let start = Instant::now();
        let data = source
            .read_range(name, offset, length, pin)
            .map_err(|e| dataset.explained(e));
        let read = data.as_ref().map(|(chunk, _)| chunk);
        self.count_storage_read(m, start.elapsed(), read.map(|c| c.len() as u64));
        // Only the version the cache was asked for goes into it.
        let fill = fill
            .filter(|(_, cached)| data.as_ref().map_or(true, |(_, read)| read.same(cached)))
            .map(|(fill, _)| fill);
        offer_whole(fill, read);
        data
    }

    /// The node cache's answer for listed sample `name`, and the version it
    /// answers of: a lookup (which may make this reader the one to read
    /// it) when the read of `length` bytes from `offset` is the whole
    /// sample, else the bytes of the range if it holds them. `None` without a
    /// cache, a listing of `name`, or (with `pin`) that version of it.
    fn cache_lookup(
        &self,
        dataset: &Dataset,
        name: &str,
        offset: u64,
        length: u64,
        pin: Option<&Pinned>,
        claim: bool,
    ) -> Option<(Cached, Pinned)> {
        let cache = self.cache.as_ref()?;
        // The sample as last listed (a local file as it is now), which may
        // be newer than the listing the caller's connection holds: a
        // sample changed since is answered under its new version, one
        // deleted since is read from its source, which says so. An open
        // file's reads are pinned to the file it opened, which decides: a
        // local one is not asked again each read.
        let key = match pin {
            Some(_) => dataset.latest_key(name)?,
            None => dataset.current_key(name)?,
        };
        let cached = Pinned::cached(key.version, key.size);
        if pin.is_some_and(|p| !p.same(&cached)) {
            return None;
        }
        if offset == 0 && length >= key.size && key.size <= MAX_FILE_BYTES {
            let found = if claim {
                Cached::Whole(cache.lookup(&dataset.name, &key))
            } else {
                cache
                    .lookup_unclaimed(&dataset.name, &key)
                    .map_or(Cached::Absent, Cached::Whole)
            };
            return Some((found, cached));
        }
        let (start, len) = clamp_range(key.size, offset, length);
        let bytes = cache.peek_range(&dataset.name, &key, start, len)?;
        Some((Cached::Range(bytes), cached))
    }
}

impl Job {
    /// Gives the limiter back the `paid` bytes of a read the cache answered
    /// once its turn came (see [`crate::cache::Cache::lookup_unclaimed`]).
    fn refund(&self, paid: Option<u64>) {
        if let Some(bytes) = paid {
            self.limiter.refund(bytes);
        }
    }
}

/// What the node cache answers a read: a lookup of the whole sample, or
/// the bytes of a range within it; or, to a lookup that claims nothing,
/// that the sample is neither cached nor being read.
enum Cached {
    Whole(Lookup),
    Range(Vec<u8>),
    Absent,
}

impl Job {
    /// Opens file `name` of a local data set for a reader that the kernel
    /// serves from it directly (the mount's passthrough of large files):
    /// the whole file is charged to the job's limiter and counted as one
    /// storage read and one delivery, as the reader is about to read it,
    /// unless `charged` (a plan entry of it was delivered for this open).
    /// `None` when the data set is not a local directory. Blocking; while
    /// the limiter holds it, gives up (`UNAVAILABLE`, nothing charged) once
    /// `wanted` says the opener no longer waits.
    pub fn open_passthrough(
        &self,
        dataset: &Dataset,
        name: &str,
        m: &DatasetMetrics,
        wanted: impl FnMut() -> bool,
        charged: bool,
    ) -> Option<Result<std::fs::File, ProtocolError>> {
        let Source::Dir(dir) = dataset.source() else {
            return None;
        };
        let start = Instant::now();
        let opened = dir
            .resolve(name)
            .and_then(|path| open_regular(&path).map_err(|e| io_error(name, &e)));
        if charged {
            return Some(opened.map(|(file, _)| file));
        }
        let opened = opened.and_then(|(file, size)| {
            if !self.throttle_for_consumer_while(self.limiter.ticket(), size, m, wanted) {
                return Err(ProtocolError::new(
                    ErrorCode::Unavailable,
                    format!("the open of `{name}` was given up while the job's limiter held it"),
                ));
            }
            Ok((file, size))
        });
        self.count_storage_read(m, start.elapsed(), opened.as_ref().map(|(_, size)| *size));
        Some(opened.map(|(file, size)| {
            self.count_delivered_bytes(m, size, 1);
            file
        }))
    }
}

impl PlanHandle {
    /// The plan's entries not yet delivered; `None` once all were.
    pub fn remaining(&self) -> Option<usize> {
        let id = self.id?;
        self.job.lock().plans.get(&id).map(|p| p.remaining)
    }
}

impl Drop for PlanHandle {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.job.detach(id);
        }
    }
}

/// Offers a whole read of a listed sample to the node cache (and to
/// whoever waits for it). Bytes of another size than the version the fill
/// was claimed for (the file changed while it was read) are handed to the
/// waiters but not kept ([`Fill::complete`]); the waiters were failed with
/// an internal error when the size differed from the listing's, which the
/// fill's version (the file as it is now) no longer is.
fn offer_whole(fill: Option<Fill>, data: Result<&Chunk, &ProtocolError>) {
    match (fill, data) {
        (Some(fill), Ok(chunk)) => fill.complete(chunk),
        (Some(fill), Err(e)) => fill.fail(e),
        (None, _) => {}
    }
}

/// The size of file `name` that a read of it is charged by: the listing's
/// when it lists the name (an object store is not asked again: a HEAD
/// costs a round trip), else the source's answer, which also says whether
/// the file exists.
fn charged_size(dataset: &Dataset, name: &str) -> Result<u64, ProtocolError> {
    let listed = dataset.listed().and_then(|l| l.size_of(name));
    match listed {
        Some(size) => Ok(size),
        None => dataset.source().stat(name),
    }
}
