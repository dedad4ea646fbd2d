//! A job's readers: pick the next entry to fetch, reserve its bytes, look
//! it up in the node cache, and on a miss wait for the limiter, read it
//! from the source (offering it to the cache), and park the result in its
//! plan. A hit, or a read another job already has in flight, costs the
//! source and the limiter nothing.
//!
//! The job's reader count (the tuner's choice) is the number of reads in
//! flight. A read from a local directory is a blocking call, so each
//! takes a thread. A read from an object store is a task on the runtime:
//! a thread that picks one starts it and goes on picking, so a couple of
//! threads keep hundreds of requests outstanding.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Job, JobState, MEMORY_RECHECK, OVER_PATIENCE};
use crate::cache::{Fill, Flight, Lookup, Outcome};
use crate::chunk::Chunk;
use crate::dataset::Dataset;
use crate::engine::Memory;
use crate::engine::plan_run::Fetched;
use crate::metrics::{DatasetMetrics, Metrics};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::storage::whole_footprint;
use crate::sync::{wait, wait_timeout};
use crate::token_bucket::Ticket;

/// Reader threads a job whose plans all read object stores runs (each
/// only picks work and starts reads; the runtime waits for them).
const REMOTE_THREADS: u32 = 2;

/// Reads a stand-in reader makes before it gives its reserve thread a
/// turn for other work (the next tuner tick hands it back).
const STAND_IN_TURN: u32 = 32;

/// One local read in this many is watched for whether it blocked (two
/// system calls), which is enough for the tuner to see whether reads wait
/// for a device or run on the CPU.
const SAMPLE_EVERY: u32 = 8;

thread_local! {
    /// Local reads this reader thread made, for [`SAMPLE_EVERY`].
    static SAMPLE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A fetch a reader has committed to.
pub(super) struct Work {
    plan: u64,
    pos: u32,
    /// Buffer bytes reserved for the result.
    size: u64,
    /// The file's listed size: what the limiter charges.
    file_bytes: u64,
    name: String,
    dataset: Arc<Dataset>,
    metrics: DatasetMetrics,
}

/// Why a reader found nothing to do.
pub(super) enum Idle {
    /// No plan has an entry left to start.
    Nothing,
    /// There are entries, but the job's buffer has no room for them:
    /// delivering (or returning) samples makes room.
    Full,
    /// The node's budget has no room: other jobs may free some, so look
    /// again after a while.
    OverBudget,
}

impl Job {
    /// Starts reader threads until the wanted count runs. Where the OS
    /// refuses the job every one (the stage at its thread limit), a
    /// stand-in reads on one of the threads the stage keeps for this, a
    /// turn at a time, while there is work.
    pub(super) fn ensure_readers(self: &Arc<Self>, st: &mut JobState) {
        while !st.stopped && st.readers_running < st.threads_wanted() {
            let job = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name(format!(
                    "reader-{}",
                    self.id.chars().take(8).collect::<String>()
                ))
                .spawn(move || job.reader_loop(false));
            match spawned {
                Ok(_) => st.readers_running += 1,
                Err(e) => {
                    // The job reads with the readers it has; the next tick
                    // asks again.
                    crate::blocking::refused(&format!("a reader thread of job {}: {e}", self.id));
                    if st.readers_running == 0 {
                        let job = Arc::clone(self);
                        if crate::blocking::on_reserve(move || job.reader_loop(true)) {
                            st.readers_running += 1;
                        }
                    }
                    break;
                }
            }
        }
        self.metrics
            .job
            .reader_threads
            .with_label_values(&[&self.id])
            .set(i64::from(st.readers_target));
    }

    /// A reader's work until the job stops or needs fewer; a `stand_in`
    /// (on a reserve thread) also ends when it finds nothing to do or
    /// made its turn of reads.
    fn reader_loop(self: Arc<Self>, stand_in: bool) {
        let mut turn = 0;
        'next: loop {
            // The limiter's line is taken in the order work is picked, which
            // is plan order, under the job's lock.
            let (work, ticket) = {
                let mut st = self.lock();
                loop {
                    if st.stopped
                        || st.readers_running > st.threads_wanted()
                        || (stand_in && turn == STAND_IN_TURN)
                    {
                        st.readers_running -= 1;
                        return;
                    }
                    let picked = if st.in_flight < st.readers_target {
                        st.pick_work(&self.memory, &self.metrics, &self.id, false)
                    } else {
                        Err(Idle::Nothing)
                    };
                    match picked {
                        Ok(work) => {
                            st.over_waiting = None;
                            st.in_flight += 1;
                            turn += 1;
                            // Wakes are one at a time: pass it on, in case
                            // there is more (each reader that finds work
                            // wakes the next, up to the running count).
                            self.wake_idle_reader(&st);
                            break (work, self.limiter.ticket());
                        }
                        Err(idle) => {
                            // A consumer waits on an entry the budget has no
                            // room for: read-ahead nobody asked for yet (this
                            // job's or others') makes way.
                            if matches!(idle, Idle::OverBudget)
                                && let Some(need) = st.waited_bytes()
                            {
                                drop(st);
                                let freed = self.memory.reclaim(need, &self);
                                st = self.lock();
                                if freed > 0 {
                                    continue;
                                }
                                // Nothing can make way (trainers hold the
                                // rest, or other consumers wait on it): the
                                // waited entry is read over the budget, one
                                // at a time for the job, and while nothing
                                // else is over it (see `may_go_over`).
                                if st.in_flight == 0
                                    && st.may_go_over(&self.memory, Instant::now())
                                    && let Ok(work) =
                                        st.pick_work(&self.memory, &self.metrics, &self.id, true)
                                {
                                    st.over_waiting = None;
                                    st.in_flight += 1;
                                    break (work, self.limiter.ticket());
                                }
                            }
                            if stand_in {
                                // Its thread is not the job's to wait on.
                                st.readers_running -= 1;
                                return;
                            }
                            if matches!(idle, Idle::OverBudget) {
                                self.stats.memory_waits.fetch_add(1, Ordering::Relaxed);
                            }
                            let short = u32::from(!matches!(idle, Idle::Nothing));
                            st.readers_idle += 1;
                            st.readers_short += short;
                            st = if matches!(idle, Idle::OverBudget) {
                                wait_timeout(&self.work, st, MEMORY_RECHECK)
                            } else {
                                wait(&self.work, st)
                            };
                            st.readers_idle -= 1;
                            st.readers_short -= short;
                        }
                    }
                }
            };
            self.stats.active_readers.fetch_add(1, Ordering::Relaxed);
            let remote = work.dataset.source().remote().is_some();
            // A limited job's read is claimed in the cache only once its
            // limiter lets it go (a claim makes other jobs wait for it, and
            // they must not wait out a limit that is not theirs).
            let mut ticket = Some(ticket);
            let fill = loop {
                let claim = ticket.is_none() || self.reads_at_once();
                match self.look_up(&work, claim) {
                    None => break None,
                    Some(None) => {
                        if let Some(ticket) = ticket.take() {
                            self.throttle_while(ticket, work.file_bytes, || true);
                        }
                    }
                    Some(Some(Lookup::Miss(fill))) => break Some(fill),
                    Some(Some(Lookup::Hit(bytes))) => {
                        self.not_read(ticket, work.file_bytes);
                        self.finish_cached(work, Ok(bytes));
                        continue 'next;
                    }
                    // Read straight into the job's buffer: a copy of its
                    // own would be memory outside the budget while read.
                    Some(Some(Lookup::Disk(hit))) => {
                        let len = hit.len();
                        let mut buf = self.buffer(len);
                        if hit.read_into(&mut buf.as_mut_slice()[..len]) {
                            self.not_read(ticket, work.file_bytes);
                            self.finish_hit(work, Ok(Chunk::pooled(buf, 0, len)));
                            continue 'next;
                        }
                        // The file failed its check and is gone: look again.
                    }
                    Some(Some(Lookup::Wait(flight))) => {
                        self.not_read(ticket, work.file_bytes);
                        if remote {
                            self.wait_remote(work, flight);
                        } else {
                            self.finish_cached(work, flight.wait_blocking());
                        }
                        continue 'next;
                    }
                }
            };
            if let Some(ticket) = ticket {
                self.throttle_while(ticket, work.file_bytes, || true);
            }
            if remote {
                self.start_remote(work, fill);
            } else {
                self.fetch(work, fill);
            }
        }
    }

    /// A committed entry the cache (or another job's read) answers: its
    /// place in the limiter's line is given up, or, when it waited its
    /// turn already (`ticket` used), its bytes are given back: a hit costs
    /// the limiter nothing.
    fn not_read(&self, ticket: Option<Ticket<'_>>, bytes: u64) {
        match ticket {
            Some(ticket) => drop(ticket),
            None => self.limiter.refund(bytes),
        }
    }

    /// Whether the job's reads go at once: it has no limit, and is not
    /// waiting for its first settings (which may bring one).
    pub(super) fn reads_at_once(&self) -> bool {
        !self.limiter.limited() && self.gate.is_open()
    }

    /// Looks a committed entry up in the node cache, if there is one
    /// (`None` without): with `claim`, a miss claims its read; without,
    /// it is `Some(None)`.
    fn look_up(&self, work: &Work, claim: bool) -> Option<Option<Lookup>> {
        let cache = self.cache.as_ref()?;
        // A sample changed since the plan's listing is looked up (and
        // kept) under the version it has now, never answered with the
        // bytes cached under its old one. One deleted since is read from
        // its source, which says so; so is one grown past what the plan
        // reserved for it, which the source read refuses the same way (a
        // hit would fill a buffer past the budget: 16 files listed empty
        // and cached at 4 MiB took 50 MiB of a 16 MiB budget).
        let key = work.dataset.current_key(&work.name)?;
        if whole_footprint(key.size) > work.size {
            return None;
        }
        Some(if claim {
            Some(cache.lookup(&work.dataset.name, &key))
        } else {
            cache.lookup_unclaimed(&work.dataset.name, &key)
        })
    }

    /// Reads one committed entry from a local source and hands the result
    /// to its plan (and to the cache, with `fill`).
    fn fetch(&self, work: Work, fill: Option<Fill>) {
        // Every few reads, whether it blocked too (a system call each way).
        let sampled = SAMPLE.with(|n| {
            n.set(n.get().wrapping_add(1));
            n.get() % SAMPLE_EVERY == 0
        });
        let blocked_before = sampled.then(crate::cpu::times_blocked);
        let start = Instant::now();
        // A panic while reading (a bug) becomes this sample's error: the
        // reader thread, and the plan waiting for the entry, go on.
        let data = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            work.dataset
                .read_whole(&work.name, work.file_bytes, &|len| self.buffer(len))
        }))
        .unwrap_or_else(|_| internal_failure(&self.id, &work.name));
        if let Some(before) = blocked_before {
            self.count_sampled_read(crate::cpu::times_blocked() > before);
        }
        offer(fill, &data);
        self.finish(work, start, data);
    }

    /// Hands an entry the cache answered (or another job's read of it) to
    /// its plan, in a buffer of the job's own.
    fn finish_cached(&self, work: Work, outcome: Outcome) {
        let data = outcome.map(|bytes| {
            let mut buf = self.buffer(bytes.len());
            buf.as_mut_slice()[..bytes.len()].copy_from_slice(&bytes);
            Chunk::pooled(buf, 0, bytes.len())
        });
        self.finish_hit(work, data);
    }

    /// Hands an entry the cache answered, in the job's buffer, to its plan.
    fn finish_hit(&self, work: Work, data: Result<Chunk, ProtocolError>) {
        if let Ok(chunk) = &data {
            self.count_cache_hit(chunk.len());
        }
        if let Err(e) = &data {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            work.metrics.error(e.code);
        }
        self.stats.active_readers.fetch_sub(1, Ordering::Relaxed);
        self.park(work, data);
    }

    /// Waits on the runtime for another job's read of a committed entry.
    fn wait_remote(self: &Arc<Self>, work: Work, flight: Arc<Flight>) {
        let Some(remote) = work.dataset.source().remote() else {
            unreachable!("only remote work comes here");
        };
        let runtime = remote.runtime().clone();
        let job = Arc::clone(self);
        runtime.spawn(async move {
            let outcome = flight.wait().await;
            job.finish_cached(work, outcome);
        });
    }

    /// Starts the read of a committed entry from an object store on the
    /// runtime; the task hands the result to its plan (and to the cache,
    /// with `fill`).
    fn start_remote(self: &Arc<Self>, work: Work, fill: Option<Fill>) {
        let job = Arc::clone(self);
        let buf = self.buffer(work.size as usize);
        let source = Arc::clone(&work.dataset);
        let Some(remote) = source.source().remote() else {
            unreachable!("only remote work comes here");
        };
        let runtime = remote.runtime().clone();
        runtime.spawn(async move {
            let start = Instant::now();
            let Some(remote) = source.source().remote() else {
                unreachable!("only remote work comes here");
            };
            let read = remote.read_listed(&work.name, work.file_bytes, buf);
            // As with a reader thread: a panic (a bug) is this sample's
            // error, never a plan that waits forever.
            let data = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(read))
                .await
                .unwrap_or_else(|_| internal_failure(&job.id, &work.name));
            offer(fill, &data);
            job.finish(work, start, data);
        });
    }

    /// Counts a finished source read and parks its result in its plan.
    fn finish(&self, work: Work, start: Instant, data: Result<Chunk, ProtocolError>) {
        self.count_read(&work.metrics, start.elapsed(), &data);
        self.stats.active_readers.fetch_sub(1, Ordering::Relaxed);
        self.park(work, data);
    }

    /// Parks a fetched entry's bytes or error in its plan and wakes its
    /// consumer.
    fn park(&self, work: Work, data: Result<Chunk, ProtocolError>) {
        let actual = data.as_ref().map_or(0, Chunk::footprint);
        let mut st = self.lock();
        st.in_flight -= 1;
        // A read's slot came free: a reader waiting at the in-flight
        // limit may start another.
        self.wake_idle_reader(&st);
        let Some(plan) = st.plans.get_mut(&work.plan) else {
            // The plan was dropped while we read (every consumer left).
            st.reserved -= work.size;
            self.memory.release(work.size);
            self.wake_reader_short(&st);
            return;
        };
        plan.reserved = plan.reserved - work.size + actual;
        plan.fetched.insert(
            work.pos,
            Fetched {
                data,
                reserved: actual,
            },
        );
        if let Some(waiter) = plan.waiters.remove(&work.pos) {
            waiter.notify_one();
        }
        st.reserved = st.reserved - work.size + actual;
        self.memory.adjust(work.size, actual);
        if actual < work.size {
            self.wake_reader_short(&st);
        }
    }

    /// Wakes one waiting reader, if any waits (a notification nobody waits
    /// for still costs a system call). Called with the job's lock held, so
    /// the count is current.
    pub(super) fn wake_idle_reader(&self, st: &JobState) {
        if st.readers_idle > 0 {
            self.work.notify_one();
        }
    }

    /// Wakes one waiting reader when buffer room came free and a reader
    /// waits for room (the one woken may be any idle reader: there is work,
    /// since one was short of room for it).
    pub(super) fn wake_reader_short(&self, st: &JobState) {
        if st.readers_short > 0 {
            self.work.notify_one();
        }
    }

    /// Waits for the job's first settings and the limiter, as
    /// [`Job::throttle_while`] does, for a read a trainer waits on (one no
    /// plan read ahead: `READ`, `FETCH`, a file read through the mount with
    /// no order): the wait is the trainer's stall too, as a plan's consumer
    /// waiting in `NEXT` is, so that the controller sees that the job wants
    /// more than the limit gives (it saw readers throttled and trainers
    /// never stalled, and raised such a job's share a tenth a tick).
    pub(super) fn throttle_for_consumer(&self, bytes: u64, m: &DatasetMetrics) {
        self.throttle_for_consumer_while(self.limiter.ticket(), bytes, m, || true);
    }

    /// [`Job::throttle_for_consumer`] for a caller that may stop wanting
    /// the bytes meanwhile (`wanted` says no: then it returns false, having
    /// taken nothing).
    pub(super) fn throttle_for_consumer_while(
        &self,
        ticket: Ticket<'_>,
        bytes: u64,
        m: &DatasetMetrics,
        wanted: impl FnMut() -> bool,
    ) -> bool {
        let waited = Instant::now();
        let allowed = self.throttle_while(ticket, bytes, wanted);
        self.count_stall(m, waited.elapsed());
        allowed
    }

    /// Waits for the job's first settings (a new job under a controller),
    /// then, in `ticket`'s place in line, for the limiter to allow a read of
    /// `bytes`, counting that wait; gives up when `wanted` says the caller no
    /// longer wants the bytes, returning false, having taken nothing.
    pub(super) fn throttle_while(
        &self,
        ticket: Ticket<'_>,
        bytes: u64,
        wanted: impl FnMut() -> bool,
    ) -> bool {
        if self.gate.wait() {
            self.metrics
                .job_starts
                .with_label_values(&["timeout"])
                .inc();
        }
        self.limiter
            .acquire_blocking_while(ticket, bytes, wanted, |nap| {
                self.stats
                    .throttled_ns
                    .fetch_add(nap.as_nanos() as u64, Ordering::Relaxed);
                self.throttled_metric.inc_by(nap.as_secs_f64());
            })
    }
}

/// Gives the cache (and the jobs waiting on it) what a source read got.
fn offer(fill: Option<Fill>, data: &Result<Chunk, ProtocolError>) {
    match (fill, data) {
        (Some(fill), Ok(chunk)) => fill.complete(chunk),
        (Some(fill), Err(e)) => fill.fail(e),
        (None, _) => {}
    }
}

/// The error of a sample whose read panicked.
fn internal_failure(job: &str, name: &str) -> Result<Chunk, ProtocolError> {
    tracing::error!(job = %job, file = %name, "a read panicked");
    Err(ProtocolError::new(
        ErrorCode::IoError,
        format!("the stage failed internally reading `{name}` (its log has the details)"),
    ))
}

impl JobState {
    /// Reader threads the job needs: one per read in flight while any plan
    /// reads a local source, else a few that start asynchronous reads, and
    /// none while it has no plan (a job kept idle, or one reading by name
    /// only, holds no threads: a node with many such kept 16 each, and ran
    /// into its process limit). A plan's start starts them again.
    pub(super) fn threads_wanted(&self) -> u32 {
        if self.plans.is_empty() {
            return 0;
        }
        let all_remote = self
            .plans
            .values()
            .all(|p| p.dataset.source().remote().is_some());
        if all_remote {
            self.readers_target.min(REMOTE_THREADS)
        } else {
            self.readers_target
        }
    }

    /// Whether a waited entry nothing can make room for may be read over
    /// the budget now: when nothing is over it already, so that the node
    /// goes over by one such sample at a time (samples on their way to
    /// their consumers stacked up, one per waiting consumer: four ranks
    /// reading 95 MiB samples held 384 MiB on a 128 MiB budget), or when
    /// that has kept it waiting for [`OVER_PATIENCE`] (bytes held for long,
    /// a mount's open files, must not stall the job for good).
    pub(super) fn may_go_over(&mut self, memory: &Memory, now: Instant) -> bool {
        if memory.used() <= memory.budget() {
            return true;
        }
        let since = *self.over_waiting.get_or_insert(now);
        now.duration_since(since) >= OVER_PATIENCE
    }

    /// The budget bytes of the next entry of a plan whose consumer waits on
    /// an entry no reader has started, if any plan's does.
    fn waited_bytes(&mut self) -> Option<u64> {
        self.plans.values_mut().find_map(|plan| {
            if !plan.consumer_waiting() {
                return None;
            }
            let pos = plan.next_unstarted()?;
            Some(whole_footprint(plan.size_of(pos)))
        })
    }

    /// Picks the next entry to fetch and reserves its bytes: first in plans a
    /// consumer is waiting on, then in the plan holding the least. With
    /// `over_budget`, only an entry a consumer waits on, reserved whether
    /// the budget has room or not.
    pub(super) fn pick_work(
        &mut self,
        memory: &Memory,
        metrics: &Metrics,
        job: &str,
        over_budget: bool,
    ) -> Result<Work, Idle> {
        let capacity = self.effective_capacity(memory);
        let mut candidates: Vec<(bool, u64, u64)> = self
            .plans
            .values_mut()
            .filter_map(|p| {
                p.next_unstarted()
                    .map(|_| (p.consumer_waiting(), p.reserved, p.id))
            })
            .collect();
        if candidates.is_empty() {
            return Err(Idle::Nothing);
        }
        candidates.sort_unstable_by_key(|&(waiting, reserved, id)| (!waiting, reserved, id));
        let share = capacity / candidates.len() as u64;
        let refill = self.can_refill(memory);
        let mut blocked_on_memory = false;
        let mut no_room = false;
        for (waiting, _, id) in candidates {
            let plan = self.plans.get_mut(&id).expect("candidate exists");
            let pos = plan.next_unstarted().expect("candidate has work");
            let file_bytes = plan.size_of(pos);
            let size = whole_footprint(file_bytes);
            let empty = plan.reserved == 0;
            let fits = refill && self.reserved + size <= capacity && plan.reserved + size <= share;
            if !(fits || waiting || empty) {
                if refill && self.reserved + size > capacity {
                    self.full = true;
                }
                no_room = true;
                continue;
            }
            if over_budget {
                if !waiting {
                    continue;
                }
                memory.reserve_over(size);
            } else if !memory.try_reserve(size, empty) {
                blocked_on_memory = true;
                continue;
            }
            plan.entries[pos as usize].started = true;
            plan.reserved += size;
            self.reserved += size;
            let name = plan.name_of(pos).to_owned();
            let dataset = Arc::clone(&plan.dataset);
            return Ok(Work {
                plan: id,
                pos,
                size,
                file_bytes,
                name,
                metrics: self.dataset_metrics(metrics, job, &dataset.name),
                dataset,
            });
        }
        Err(if blocked_on_memory {
            Idle::OverBudget
        } else if no_room {
            Idle::Full
        } else {
            Idle::Nothing
        })
    }
}
