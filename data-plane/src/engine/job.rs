//! One job: its plans, byte-bounded buffer, reader threads, limiter and tuner.
//!
//! Readers are plain threads doing blocking reads (see docs/data-plane.md for
//! why not io_uring). They pick the next unstarted entry, preferring plans a
//! consumer is already waiting on, reserve its bytes against the job's
//! capacity and the node budget, wait for the QoS limiter, read, and park the
//! result in the plan. Consumers (async connection tasks) claim entries in
//! plan order under the job lock and wait on the plan's `Notify` until their
//! entries are fetched. Every entry is claimed once, so it is delivered once,
//! however many connections share the plan.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{debug, info};

use super::Memory;
use super::plan_run::{PlanIdentity, PlanRun};
use crate::cache::Cache;
use crate::chunk::{Buffer, Chunk};
use crate::job_config::JobConfig;
use crate::metrics::{DatasetMetrics, Metrics};
use crate::protocol::{Payload, ProtocolError, Sample};
use crate::shm::Region;
use crate::token_bucket::TokenBucket;
use crate::tuner::{Observation, Tuner};

mod delivery;
mod gate;
mod lending;
mod readers;

use crate::sync::lock;
pub use delivery::{PlanHandle, PlannedClaim, Presence, Reservation};
use gate::Gate;
pub use gate::SETTINGS_WAIT;
pub use lending::{Lending, NotLent};

/// Completed plans remembered per job, so a late worker that submits an
/// already finished plan gets `end` instead of a second epoch.
const COMPLETED_MEMORY: usize = 256;
/// How long a reader blocked on the node budget waits before looking again
/// (another job's consumer may have freed memory).
const MEMORY_RECHECK: Duration = Duration::from_millis(5);
/// How long a waited entry waits to be read over the budget while
/// something else is over it, before it goes over all the same.
const OVER_PATIENCE: Duration = Duration::from_secs(2);
/// How long a read by name waits for other trainers to take their answers
/// (see [`Job::hold_answer`]): twice the 30 s a trainer has to take one,
/// so only answers asked for again and again outlast it.
const ANSWER_WAIT: Duration = Duration::from_secs(60);
/// The least a full buffer drains before its readers refill it.
const REFILL_MIN: u64 = 4 << 20;

/// Cumulative counters the tuner and the telemetry snapshot read.
#[derive(Debug, Default)]
struct Stats {
    delivered_bytes: AtomicU64,
    delivered_samples: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    cache_hit_bytes: AtomicU64,
    read_ns: AtomicU64,
    /// Local reads sampled for whether they blocked, and those that did.
    sampled_reads: AtomicU64,
    sampled_blocked: AtomicU64,
    stall_ns: AtomicU64,
    throttled_ns: AtomicU64,
    /// Times a reader found work but no room in the node's memory budget.
    memory_waits: AtomicU64,
    errors: AtomicU64,
    active_readers: AtomicU32,
}

#[derive(Debug, Clone, Copy, Default)]
struct StatsSample {
    delivered_bytes: u64,
    reads: u64,
    read_ns: u64,
    sampled_reads: u64,
    sampled_blocked: u64,
    /// Requests the object stores of the job's plans throttled (every
    /// job's reads of them: the store slows down for all).
    store_throttled: u64,
    stall_ns: u64,
    throttled_ns: u64,
    memory_waits: u64,
}

#[derive(Debug)]
struct JobState {
    plans: HashMap<u64, PlanRun>,
    /// Whether the job is counted among those holding plans (the budget's
    /// shares; see [`JobState::count_plans`]).
    planning: bool,
    /// Entries of its plans counted in the node's planned entries.
    planned: u64,
    by_key: HashMap<PlanIdentity, u64>,
    completed: VecDeque<(PlanIdentity, u64)>,
    next_id: u64,
    reserved: u64,
    capacity: u64,
    /// Set when a reader found the buffer full: readers then wait until it
    /// drains below the low-water mark ([`JobState::can_refill`]), so they
    /// refill in bursts rather than waking once per delivered sample.
    full: bool,
    config: JobConfig,
    tuner: Tuner,
    /// Reads in flight the job may have (the tuner's reader count).
    readers_target: u32,
    /// Reads in flight now.
    in_flight: u32,
    /// Reader threads running.
    readers_running: u32,
    /// Readers waiting for work: a wake-up is only worth its system call
    /// when one is.
    readers_idle: u32,
    /// Of those, readers that have work but no buffer room: freed memory
    /// only matters to them (waking a reader that has nothing to fetch,
    /// once per delivered sample, is most of a hot stage's CPU).
    readers_short: u32,
    connections: usize,
    idle_since: Option<Instant>,
    stopped: bool,
    last_tick: Option<(Instant, StatsSample)>,
    datasets: HashMap<String, DatasetMetrics>,
    /// Since when a waited entry has waited to be read over the budget
    /// while something else was over it ([`JobState::may_go_over`]).
    over_waiting: Option<Instant>,
}

/// A training job as the stage sees it.
#[derive(Debug)]
pub struct Job {
    id: String,
    labels: Mutex<BTreeMap<String, String>>,
    state: Mutex<JobState>,
    work: Condvar,
    /// Closed while a new job waits for the controller's first settings.
    gate: Gate,
    /// Where its prefetch buffers live when its trainers may map them.
    region: Option<Arc<Region>>,
    /// The samples its trainers hold in shared memory. Locked before the
    /// state when both are (lending a sample moves its bytes out of the
    /// plan's buffer), never after.
    lending: Mutex<Lending>,
    /// The bytes in the book, as the job's gauge shows them (set whenever
    /// the book changes).
    lent_gauge: prometheus::IntGauge,
    /// The free bytes its region keeps resident (set every tuner tick).
    kept_gauge: prometheus::IntGauge,
    limiter: TokenBucket,
    stats: Stats,
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    /// The node cache, when the stage has one.
    cache: Option<Arc<Cache>>,
    throttled_metric: prometheus::Counter,
    /// Woken when the last trainer leaves (see [`super::Engine::jobs_changed`]).
    jobs_changed: Arc<tokio::sync::Notify>,
}

/// How `PLAN` went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanState {
    Created = 0,
    Joined = 1,
    AlreadyComplete = 2,
}

/// A connection's membership in a job; the job goes idle when the last one
/// is dropped.
#[derive(Debug)]
pub struct JobHandle {
    job: Arc<Job>,
}

impl JobHandle {
    pub(super) fn new(job: Arc<Job>) -> Self {
        {
            let mut st = job.lock();
            st.connections += 1;
            st.idle_since = None;
        }
        Self { job }
    }

    pub fn job(&self) -> &Arc<Job> {
        &self.job
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        let mut st = self.job.lock();
        st.connections -= 1;
        let last = st.connections == 0;
        if last {
            st.idle_since = Some(Instant::now());
            self.job.jobs_changed.notify_one();
        }
        drop(st);
        if last {
            // Samples handed to the job by its trainers come back once none
            // is left to hold them.
            let returned = self.job.lend_book().reclaim_all();
            drop(returned);
        }
    }
}

/// A job's book of lent slots, locked; records its total when dropped.
pub struct LendBook<'a> {
    book: MutexGuard<'a, Lending>,
    gauge: &'a prometheus::IntGauge,
}

impl std::ops::Deref for LendBook<'_> {
    type Target = Lending;

    fn deref(&self) -> &Lending {
        &self.book
    }
}

impl std::ops::DerefMut for LendBook<'_> {
    fn deref_mut(&mut self) -> &mut Lending {
        &mut self.book
    }
}

impl Drop for LendBook<'_> {
    fn drop(&mut self) {
        self.gauge
            .set(i64::try_from(self.book.bytes()).unwrap_or(i64::MAX));
    }
}

/// Per-job telemetry, as the controller session sends it.
#[derive(Debug, Clone, Serialize)]
pub struct JobSnapshot {
    pub job: String,
    pub labels: BTreeMap<String, String>,
    pub delivered_bytes: u64,
    pub delivered_samples: u64,
    pub storage_reads: u64,
    pub storage_read_bytes: u64,
    pub cache_hit_bytes: u64,
    pub read_seconds: f64,
    pub stall_seconds: f64,
    pub throttled_seconds: f64,
    pub errors: u64,
    pub buffer_used_bytes: u64,
    pub buffer_capacity_bytes: u64,
    pub readers: u32,
    pub active_readers: u32,
    pub connections: usize,
    pub plans: usize,
    pub bytes_per_second_limit: Option<u64>,
    pub ops_per_second_limit: Option<u64>,
}

/// What a new job gets from the engine besides its own configuration.
pub(super) struct Start {
    /// Where its buffers live for shared-memory delivery, if anywhere.
    pub region: Option<Arc<Region>>,
    /// Until when its storage reads wait for the controller's settings.
    pub hold: Option<Instant>,
    pub jobs_changed: Arc<tokio::sync::Notify>,
    pub memory: Arc<Memory>,
    pub metrics: Arc<Metrics>,
    pub cache: Option<Arc<Cache>>,
}

impl Job {
    /// Starts a job; with `start.hold`, its storage reads wait until
    /// [`Job::start_reading`] or that deadline (see [`SETTINGS_WAIT`]).
    pub(super) fn start(
        id: &str,
        labels: BTreeMap<String, String>,
        config: JobConfig,
        start: Start,
    ) -> Arc<Self> {
        let Start {
            region,
            hold,
            jobs_changed,
            memory,
            metrics,
            cache,
        } = start;
        let tuner = Tuner::new(config.bounds, config.initial_readers, config.initial_buffer);
        let job = Arc::new(Self {
            id: id.to_owned(),
            labels: Mutex::new(labels),
            state: Mutex::new(JobState {
                plans: HashMap::new(),
                by_key: HashMap::new(),
                completed: VecDeque::new(),
                next_id: 1,
                reserved: 0,
                capacity: tuner.buffer(),
                full: false,
                readers_target: tuner.readers(),
                in_flight: 0,
                readers_running: 0,
                readers_idle: 0,
                readers_short: 0,
                config,
                tuner,
                connections: 0,
                idle_since: Some(Instant::now()),
                stopped: false,
                planning: false,
                planned: 0,
                last_tick: None,
                datasets: HashMap::new(),
                over_waiting: None,
            }),
            work: Condvar::new(),
            gate: Gate::new(hold),
            region,
            lending: Mutex::new(Lending::default()),
            lent_gauge: metrics.job.shared_lent.with_label_values(&[id]),
            kept_gauge: metrics.job.shared_kept.with_label_values(&[id]),
            limiter: TokenBucket::new(config.limits),
            stats: Stats::default(),
            throttled_metric: metrics.throttled(id),
            jobs_changed,
            memory,
            metrics,
            cache,
        });
        if hold.is_none() {
            job.metrics
                .job_starts
                .with_label_values(&["no-controller"])
                .inc();
        }
        {
            let st = job.lock();
            job.publish_gauges(&st);
            info!(job = %id, readers = st.readers_target, "job started");
        }
        job
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Sets the job's labels; returns whether they changed.
    pub(super) fn set_labels(&self, labels: BTreeMap<String, String>) -> bool {
        let mut current = lock(&self.labels);
        let changed = *current != labels;
        *current = labels;
        changed
    }

    /// Holds the job's storage reads again until the controller's settings
    /// name it or `deadline` passes (see [`Job::start_reading`]).
    pub(super) fn hold_reads(&self, deadline: Instant) {
        self.gate.close(deadline);
    }

    /// The labels the job runs under.
    pub fn labels(&self) -> BTreeMap<String, String> {
        lock(&self.labels).clone()
    }

    /// Whether a trainer (or mount reader) is attached now.
    pub fn connected(&self) -> bool {
        self.lock().connections > 0
    }

    /// Panics while holding this job's lock (a test's injected fault: see
    /// `crate::fault`).
    #[cfg(debug_assertions)]
    pub fn panic_holding_lock(&self) {
        let _held = self.lock();
        panic!(
            "injected fault: a panic while holding job `{}`'s lock",
            self.id
        );
    }

    fn lock(&self) -> MutexGuard<'_, JobState> {
        lock(&self.state)
    }

    /// Returns how long the job has had no connection, if it has none.
    pub(super) fn idle_since(&self, now: Instant) -> Option<Duration> {
        self.lock()
            .idle_since
            .map(|t| now.saturating_duration_since(t))
    }

    /// Stops the readers and forgets the job's metric series.
    pub(super) fn stop(&self) {
        let datasets: Vec<String> = {
            let mut st = self.lock();
            st.stopped = true;
            if std::mem::take(&mut st.planning) {
                self.memory.planning(false);
            }
            self.memory.unplan(std::mem::take(&mut st.planned));
            st.datasets.keys().cloned().collect()
        };
        self.work.notify_all();
        self.metrics.forget_job(&self.id, &datasets);
    }

    /// The book of the samples its trainers hold in shared memory; its
    /// total shows in the gauges when the guard goes.
    pub fn lend_book(&self) -> LendBook<'_> {
        LendBook {
            book: lock(&self.lending),
            gauge: &self.lent_gauge,
        }
    }

    /// Counts samples handed to trainers in shared memory.
    pub fn count_shared(&self, samples: u64) {
        if samples > 0 {
            self.metrics
                .job
                .shared_samples
                .with_label_values(&[self.id.as_str()])
                .inc_by(samples);
        }
    }

    /// Takes back the slots at `offsets`, from whichever of the job's
    /// connections holds them.
    pub fn release_slots(&self, offsets: &[u64]) -> Result<(), NotLent> {
        let mut returned = lending::Returned::default();
        let result = self.lend_book().release(offsets, &mut returned);
        drop(returned);
        result
    }

    /// Whether the job holds a plan of rank `rank` over `dataset`.
    pub fn plans_of(&self, dataset: &str, rank: u32) -> bool {
        self.lock()
            .plans
            .values()
            .any(|p| p.dataset.name == dataset && p.key.rank == rank)
    }

    /// Whether one of the job's plans over `dataset` has a rank other
    /// than `rank` (a trainer's plan, beside an order file's).
    pub fn plans_other_than(&self, dataset: &str, rank: u32) -> bool {
        self.lock()
            .plans
            .values()
            .any(|p| p.dataset.name == dataset && p.key.rank != rank)
    }

    /// The bytes the job holds of the node's budget (buffered, in flight
    /// and lent).
    pub fn reserved(&self) -> u64 {
        self.lock().reserved
    }

    /// Drops up to about `want` bytes of fetched entries no consumer has
    /// claimed yet, the furthest ahead first, to be read again when their
    /// turn comes, and returns the bytes given back to the node budget.
    pub fn give_back_read_ahead(&self, want: u64) -> u64 {
        let mut dropped = Vec::new();
        let mut freed = 0;
        {
            let mut st = self.lock();
            let mut ahead: Vec<(usize, u64, u32)> = st
                .plans
                .values()
                .flat_map(|plan| {
                    plan.fetched
                        .iter()
                        .filter(|(pos, f)| f.reserved > 0 && !plan.entries[**pos as usize].claimed)
                        .map(|(pos, _)| ((*pos as usize).saturating_sub(plan.claim), plan.id, *pos))
                })
                .collect();
            ahead.sort_unstable_by_key(|&(distance, ..)| std::cmp::Reverse(distance));
            for (_, id, pos) in ahead {
                if freed >= want {
                    break;
                }
                let Some(plan) = st.plans.get_mut(&id) else {
                    continue;
                };
                let Some(fetched) = plan.fetched.remove(&pos) else {
                    continue;
                };
                plan.entries[pos as usize].started = false;
                plan.fetch = plan.fetch.min(pos as usize);
                plan.reserved -= fetched.reserved;
                freed += fetched.reserved;
                st.reserved -= fetched.reserved;
                dropped.push(fetched);
            }
        }
        // Their buffers go back before the budget does.
        drop(dropped);
        self.memory.release(freed);
        freed
    }

    /// The node's memory budget, which every job's buffer comes out of.
    pub fn memory_budget(&self) -> u64 {
        self.memory.budget()
    }

    /// The job's buffer capacity now (after the node budget's share).
    pub fn buffer_capacity(&self) -> u64 {
        self.lock().effective_capacity(&self.memory)
    }

    /// The shared-memory region its buffers live in, if any.
    pub fn region(&self) -> Option<&Arc<Region>> {
        self.region.as_ref()
    }

    /// Gives the free pages its region keeps back to the kernel once the
    /// job has handed out no slot for `idle`, and shows what it keeps.
    pub fn give_back_idle_pages(&self, idle: Duration) {
        if let Some(region) = &self.region {
            let kept = region.give_back_if_idle(idle);
            self.kept_gauge.set(i64::try_from(kept).unwrap_or(i64::MAX));
        }
    }

    /// Returns a buffer of `len` bytes for a prefetch read: a slot of the
    /// job's region while it has room, else from the heap pool.
    fn buffer(&self, len: usize) -> Buffer {
        self.region
            .as_ref()
            .and_then(|r| r.alloc(len))
            .map_or_else(|| Buffer::heap(len), Buffer::Shared)
    }

    /// Lets the job's storage reads start, `how` says why (`settings`: the
    /// controller's settings for it are in force; `no-controller`: there
    /// is no controller to wait for).
    pub fn start_reading(&self, how: &str) {
        if self.gate.open() {
            self.metrics.job_starts.with_label_values(&[how]).inc();
        }
    }

    /// Applies new limits and tuner bounds (from the controller's pushed
    /// settings) without disturbing reads in flight.
    pub fn apply_config(self: &Arc<Self>, config: JobConfig) {
        self.limiter.set_limits(config.limits);
        let mut st = self.lock();
        st.config = config;
        if let Some(change) = st.tuner.set_bounds(config.bounds) {
            st.readers_target = change.readers;
            st.capacity = change.buffer;
        }
        self.ensure_readers(&mut st);
        drop(st);
        self.work.notify_all();
    }

    /// Returns the hot-path metric handles for a dataset of this job.
    fn dataset_metrics(&self, st: &mut JobState, dataset: &str) -> DatasetMetrics {
        st.dataset_metrics(&self.metrics, &self.id, dataset)
    }

    fn count_read(
        &self,
        m: &DatasetMetrics,
        latency: Duration,
        data: &Result<Chunk, ProtocolError>,
    ) {
        self.count_storage_read(m, latency, data.as_ref().map(|d| d.len() as u64));
    }

    /// Counts a sampled local read, and whether it blocked (see
    /// [`Observation::reads_blocked`]).
    fn count_sampled_read(&self, blocked: bool) {
        self.stats.sampled_reads.fetch_add(1, Ordering::Relaxed);
        if blocked {
            self.stats.sampled_blocked.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a storage read of `bytes` (or its error).
    fn count_storage_read(
        &self,
        m: &DatasetMetrics,
        latency: Duration,
        bytes: Result<u64, &ProtocolError>,
    ) {
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .read_ns
            .fetch_add(latency.as_nanos() as u64, Ordering::Relaxed);
        m.storage_reads.inc();
        m.read_latency.observe(latency.as_secs_f64());
        match bytes {
            Ok(bytes) => {
                self.stats.read_bytes.fetch_add(bytes, Ordering::Relaxed);
                m.storage_read_bytes.inc_by(bytes);
            }
            Err(e) => self.count_failed(m, e),
        }
    }

    /// Counts a failed sample or read (a storage read's error, or one
    /// found before any: a name that is not there).
    pub(super) fn count_failed(&self, m: &DatasetMetrics, e: &ProtocolError) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        m.error(e.code);
    }

    fn count_delivered(&self, m: &DatasetMetrics, samples: &[Sample]) {
        let bytes: u64 = samples
            .iter()
            .map(|s| s.data.as_ref().map_or(0, Payload::len))
            .sum();
        self.count_delivered_bytes(m, bytes, samples.len() as u64);
    }

    /// Counts `bytes` the node cache (or another reader's read of the same
    /// sample) answered for the job: storage was not asked for them, and
    /// the controller's demand estimate leaves them out.
    pub(crate) fn count_cache_hit(&self, bytes: usize) {
        self.stats
            .cache_hit_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts `bytes` of `samples` delivered (a read through the mount
    /// counts each answer's bytes, and its file once).
    pub fn count_delivered_bytes(&self, m: &DatasetMetrics, bytes: u64, samples: u64) {
        self.stats
            .delivered_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        self.stats
            .delivered_samples
            .fetch_add(samples, Ordering::Relaxed);
        m.delivered_bytes.inc_by(bytes);
        m.delivered_samples.inc_by(samples);
    }

    fn count_stall(&self, m: &DatasetMetrics, stall: Duration) {
        if !stall.is_zero() {
            self.stats
                .stall_ns
                .fetch_add(stall.as_nanos() as u64, Ordering::Relaxed);
            m.stall_seconds.inc_by(stall.as_secs_f64());
        }
    }

    /// Counts a read refused before storage was asked (a name that is no
    /// name of a data set: absolute, or with `..`), as a failed read of
    /// `dataset` under its code, as a name that is not there is counted.
    pub fn count_refused(&self, dataset: &str, e: &ProtocolError) {
        self.count_failed(&self.metrics_for(dataset), e);
    }

    /// Returns the metric handles for this job reading `dataset`.
    pub fn metrics_for(&self, dataset: &str) -> DatasetMetrics {
        let mut st = self.lock();
        self.dataset_metrics(&mut st, dataset)
    }

    /// Counts a delivered random-access read.
    pub fn delivered(&self, m: &DatasetMetrics, sample: &Sample) {
        self.count_delivered(m, std::slice::from_ref(sample));
    }

    /// One tuner tick: observe the last window, apply any change, update the
    /// job's gauges.
    pub(super) fn tune(self: &Arc<Self>, now: Instant) {
        let mut st = self.lock();
        // Each object store the job's plans read, once.
        let mut stores: Vec<&str> = Vec::new();
        let mut store_throttled = 0;
        for plan in st.plans.values() {
            if let Some(remote) = plan.dataset.source().remote()
                && !stores.contains(&plan.dataset.name.as_str())
            {
                stores.push(&plan.dataset.name);
                store_throttled += remote.throttled_total();
            }
        }
        let sample = StatsSample {
            delivered_bytes: self.stats.delivered_bytes.load(Ordering::Relaxed),
            reads: self.stats.reads.load(Ordering::Relaxed),
            read_ns: self.stats.read_ns.load(Ordering::Relaxed),
            sampled_reads: self.stats.sampled_reads.load(Ordering::Relaxed),
            sampled_blocked: self.stats.sampled_blocked.load(Ordering::Relaxed),
            store_throttled,
            stall_ns: self.stats.stall_ns.load(Ordering::Relaxed),
            throttled_ns: self.stats.throttled_ns.load(Ordering::Relaxed),
            memory_waits: self.stats.memory_waits.load(Ordering::Relaxed),
        };
        let previous = st.last_tick.replace((now, sample));
        if let Some((at, before)) = previous {
            let obs = Observation {
                elapsed: now.saturating_duration_since(at),
                stall: Duration::from_nanos(sample.stall_ns - before.stall_ns),
                consumers: st.plans.values().map(|p| p.attached as u32).sum(),
                delivered_bytes: sample.delivered_bytes - before.delivered_bytes,
                reads: sample.reads - before.reads,
                read_time: Duration::from_nanos(sample.read_ns - before.read_ns),
                reads_blocked: blocked_share(&before, &sample),
                store_throttled: sample
                    .store_throttled
                    .saturating_sub(before.store_throttled),
                throttled: Duration::from_nanos(sample.throttled_ns - before.throttled_ns),
                memory_short: sample.memory_waits > before.memory_waits,
                buffer_used: st.reserved,
                buffer_room: st.effective_capacity(&self.memory),
                has_work: st.plans.values().any(|p| p.remaining > 0),
            };
            if st.config.tuner
                && let Some(change) = st.tuner.observe(&obs)
            {
                debug!(job = %self.id, readers = change.readers, buffer = change.buffer, reason = ?change.reason, "tuned");
                self.metrics
                    .job
                    .tuner_changes
                    .with_label_values(&[self.id.as_str(), change.reason.name()])
                    .inc();
                st.readers_target = change.readers;
                st.capacity = change.buffer;
                self.ensure_readers(&mut st);
                self.work.notify_all();
            }
        }
        // Readers past what the job needs (its last plan finished while
        // they waited for work) are woken to stop; readers the OS refused
        // (the stage at its thread limit) are asked for again.
        if st.readers_running > st.threads_wanted() && st.readers_idle > 0 {
            self.work.notify_all();
        } else if st.readers_running < st.threads_wanted() {
            self.ensure_readers(&mut st);
        }
        self.publish_gauges(&st);
    }

    /// Sets the job's gauges from its state.
    fn publish_gauges(&self, st: &JobState) {
        let id = [self.id.as_str()];
        let m = &self.metrics.job;
        m.buffer_used.with_label_values(&id).set(st.reserved as i64);
        m.buffer_capacity
            .with_label_values(&id)
            .set(st.effective_capacity(&self.memory) as i64);
        m.reader_threads
            .with_label_values(&id)
            .set(i64::from(st.readers_target));
        m.readers_active
            .with_label_values(&id)
            .set(i64::from(self.stats.active_readers.load(Ordering::Relaxed)));
        m.job_connections
            .with_label_values(&id)
            .set(i64::try_from(st.connections).unwrap_or(i64::MAX));
    }

    /// Returns this job's telemetry.
    pub fn snapshot(&self) -> JobSnapshot {
        let st = self.lock();
        let limits = self.limiter.limits();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        JobSnapshot {
            job: self.id.clone(),
            labels: lock(&self.labels).clone(),
            delivered_bytes: load(&self.stats.delivered_bytes),
            delivered_samples: load(&self.stats.delivered_samples),
            storage_reads: load(&self.stats.reads),
            storage_read_bytes: load(&self.stats.read_bytes),
            cache_hit_bytes: load(&self.stats.cache_hit_bytes),
            read_seconds: load(&self.stats.read_ns) as f64 / 1e9,
            stall_seconds: load(&self.stats.stall_ns) as f64 / 1e9,
            throttled_seconds: load(&self.stats.throttled_ns) as f64 / 1e9,
            errors: load(&self.stats.errors),
            buffer_used_bytes: st.reserved,
            buffer_capacity_bytes: st.effective_capacity(&self.memory),
            readers: st.readers_target,
            active_readers: self.stats.active_readers.load(Ordering::Relaxed),
            connections: st.connections,
            plans: st.plans.len(),
            bytes_per_second_limit: limits.bytes_per_s,
            ops_per_second_limit: limits.ops_per_s,
        }
    }
}

impl JobState {
    /// Returns the hot-path metric handles for job `job` reading `dataset`,
    /// created on first use.
    fn dataset_metrics(&mut self, metrics: &Metrics, job: &str, dataset: &str) -> DatasetMetrics {
        self.datasets
            .entry(dataset.to_owned())
            .or_insert_with(|| metrics.dataset(job, dataset))
            .clone()
    }

    /// The job's buffer capacity after the node budget's fair share.
    fn effective_capacity(&self, memory: &Memory) -> u64 {
        self.capacity.min(memory.job_share())
    }

    /// Whether readers may fill the buffer now: it is not marked full, or
    /// it drained below the low-water mark (an eighth of the capacity, at
    /// least 4 MiB, below it), which clears the mark.
    fn can_refill(&mut self, memory: &Memory) -> bool {
        if self.full {
            let capacity = self.effective_capacity(memory);
            let margin = (capacity / 8).max(REFILL_MIN).min(capacity / 2);
            self.full = self.reserved > capacity - margin;
        }
        !self.full
    }

    /// Counts the job among those holding plans while it holds one (and
    /// is not stopped). Call after the plans change.
    /// Its planned entries are given back as its plans go.
    fn count_plans(&mut self, memory: &Memory) {
        let holds = !self.plans.is_empty() && !self.stopped;
        if holds != self.planning {
            self.planning = holds;
            memory.planning(holds);
        }
        let planned: u64 = self.plans.values().map(|p| p.files.len() as u64).sum();
        if planned < self.planned {
            memory.unplan(self.planned - planned);
            self.planned = planned;
        }
    }

    /// Forgets a fully delivered plan and remembers that it completed.
    fn finish_plan(&mut self, id: u64) {
        if let Some(plan) = self.plans.remove(&id) {
            let identity = plan.identity();
            self.by_key.remove(&identity);
            self.completed.push_back((identity, plan.fingerprint));
            if self.completed.len() > COMPLETED_MEMORY {
                self.completed.pop_front();
            }
        }
    }
}

/// The share of the local reads sampled between two snapshots that
/// blocked; `None` below a handful of samples.
fn blocked_share(before: &StatsSample, now: &StatsSample) -> Option<f64> {
    const ENOUGH: u64 = 4;
    let sampled = now.sampled_reads - before.sampled_reads;
    (sampled >= ENOUGH)
        .then(|| (now.sampled_blocked - before.sampled_blocked) as f64 / sampled as f64)
}
