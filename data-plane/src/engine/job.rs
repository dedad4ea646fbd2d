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

use super::plan_run::{Fetched, PlanKey, PlanRun};
use super::{JobSettings, Memory};
use crate::dataset::{Dataset, Listing};
use crate::metrics::{DatasetMetrics, Metrics};
use crate::protocol::{ErrorCode, ProtocolError, SAMPLES_FRAME_BUDGET, Sample, TO_END};
use crate::storage::{Chunk, io_error, read_range};
use crate::token_bucket::{Limits, TokenBucket};
use crate::tuner::{Observation, Tuner};

/// Completed plans remembered per job, so a late worker that submits an
/// already finished plan gets `end` instead of a second epoch.
const COMPLETED_MEMORY: usize = 256;
/// How long a reader blocked on the node budget waits before looking again
/// (another job's consumer may have freed memory).
const MEMORY_RECHECK: Duration = Duration::from_millis(5);

/// Cumulative counters the tuner and the telemetry snapshot read.
#[derive(Debug, Default)]
struct Stats {
    delivered_bytes: AtomicU64,
    delivered_samples: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    read_ns: AtomicU64,
    stall_ns: AtomicU64,
    throttled_ns: AtomicU64,
    errors: AtomicU64,
    active_readers: AtomicU32,
}

#[derive(Debug, Clone, Copy, Default)]
struct StatsSample {
    delivered_bytes: u64,
    reads: u64,
    read_ns: u64,
    stall_ns: u64,
    throttled_ns: u64,
}

#[derive(Debug)]
struct JobState {
    plans: HashMap<u64, PlanRun>,
    by_key: HashMap<PlanKey, u64>,
    completed: VecDeque<(PlanKey, u64)>,
    next_id: u64,
    reserved: u64,
    capacity: u64,
    settings: JobSettings,
    tuner: Tuner,
    readers_target: u32,
    readers_running: u32,
    connections: usize,
    idle_since: Option<Instant>,
    stopped: bool,
    last_tick: Option<(Instant, StatsSample)>,
    datasets: HashMap<String, DatasetMetrics>,
}

/// A fetch a reader has committed to.
struct Work {
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
enum Idle {
    NoWork,
    NoMemory,
}

/// A training job as the stage sees it.
#[derive(Debug)]
pub struct Job {
    id: String,
    labels: Mutex<BTreeMap<String, String>>,
    state: Mutex<JobState>,
    work: Condvar,
    limiter: TokenBucket,
    stats: Stats,
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    throttled_metric: prometheus::Counter,
}

/// How `PLAN` went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanState {
    Created = 0,
    Joined = 1,
    AlreadyComplete = 2,
}

/// A connection's attachment to a plan; detaches on drop.
#[derive(Debug)]
pub struct PlanHandle {
    job: Arc<Job>,
    id: Option<u64>,
    pub length: u32,
}

/// What `NEXT` returns: the samples, whether the plan is exhausted, and the
/// buffer bytes they hold until written out.
#[derive(Debug)]
pub struct NextBatch {
    pub samples: Vec<Sample>,
    pub end: bool,
    pub reservation: Reservation,
}

/// Buffer bytes held by data on its way to a trainer; released on drop.
#[derive(Debug)]
pub struct Reservation {
    job: Arc<Job>,
    plan: u64,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.job.release(self.plan, self.bytes);
        }
    }
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
        if st.connections == 0 {
            st.idle_since = Some(Instant::now());
        }
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

impl Job {
    pub(super) fn start(
        id: &str,
        labels: BTreeMap<String, String>,
        settings: JobSettings,
        memory: Arc<Memory>,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        let tuner = Tuner::new(
            settings.bounds,
            settings.initial_readers,
            settings.initial_buffer,
        );
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
                readers_target: tuner.readers(),
                readers_running: 0,
                settings,
                tuner,
                connections: 0,
                idle_since: Some(Instant::now()),
                stopped: false,
                last_tick: None,
                datasets: HashMap::new(),
            }),
            work: Condvar::new(),
            limiter: TokenBucket::new(settings.limits),
            stats: Stats::default(),
            throttled_metric: metrics.throttled(id),
            memory,
            metrics,
        });
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

    pub(super) fn set_labels(&self, labels: BTreeMap<String, String>) {
        *self.labels.lock().expect("labels lock") = labels;
    }

    fn lock(&self) -> MutexGuard<'_, JobState> {
        self.state.lock().expect("job lock poisoned")
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
            st.datasets.keys().cloned().collect()
        };
        self.work.notify_all();
        self.metrics.forget_job(&self.id, &datasets);
    }

    /// Applies new limits and tuner bounds (from flags today, from the
    /// controller's settings later) without disturbing reads in flight.
    pub fn apply_settings(self: &Arc<Self>, settings: JobSettings) {
        self.limiter.set_limits(settings.limits);
        let mut st = self.lock();
        st.settings = settings;
        if let Some(change) = st.tuner.set_bounds(settings.bounds) {
            st.readers_target = change.readers;
            st.capacity = change.buffer;
        }
        self.ensure_readers(&mut st);
        drop(st);
        self.work.notify_all();
    }

    pub fn limits(&self) -> Limits {
        self.limiter.limits()
    }

    /// Returns the hot-path metric handles for a dataset of this job.
    fn dataset_metrics(&self, st: &mut JobState, dataset: &str) -> DatasetMetrics {
        st.datasets
            .entry(dataset.to_owned())
            .or_insert_with(|| self.metrics.dataset(&self.id, dataset))
            .clone()
    }

    /// Starts reader threads until the target count runs.
    fn ensure_readers(self: &Arc<Self>, st: &mut JobState) {
        while !st.stopped && st.readers_running < st.readers_target {
            let job = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name(format!(
                    "reader-{}",
                    self.id.chars().take(8).collect::<String>()
                ))
                .spawn(move || job.reader_loop());
            match spawned {
                Ok(_) => st.readers_running += 1,
                Err(e) => {
                    tracing::error!(job = %self.id, error = %e, "cannot start a reader thread");
                    break;
                }
            }
        }
        self.metrics
            .reader_threads
            .with_label_values(&[&self.id])
            .set(i64::from(st.readers_target));
    }

    fn reader_loop(self: Arc<Self>) {
        loop {
            let work = {
                let mut st = self.lock();
                loop {
                    if st.stopped || st.readers_running > st.readers_target {
                        st.readers_running -= 1;
                        return;
                    }
                    match st.pick_work(&self.memory, &self.metrics, &self.id) {
                        Ok(work) => break work,
                        Err(Idle::NoWork) => st = self.work.wait(st).expect("job lock poisoned"),
                        Err(Idle::NoMemory) => {
                            st = self
                                .work
                                .wait_timeout(st, MEMORY_RECHECK)
                                .expect("job lock poisoned")
                                .0;
                        }
                    }
                }
            };
            self.fetch(work);
        }
    }

    /// Reads one committed entry and hands the result to its plan.
    fn fetch(&self, work: Work) {
        self.stats.active_readers.fetch_add(1, Ordering::Relaxed);
        self.throttle(work.file_bytes);
        let start = Instant::now();
        let data = work.dataset.read_whole(&work.name);
        self.count_read(&work.metrics, start.elapsed(), &data);
        self.stats.active_readers.fetch_sub(1, Ordering::Relaxed);

        let actual = data.as_ref().map_or(0, Chunk::footprint);
        let mut st = self.lock();
        let Some(plan) = st.plans.get_mut(&work.plan) else {
            // The plan was dropped while we read (every consumer left).
            st.reserved -= work.size;
            self.memory.release(work.size);
            drop(st);
            self.work.notify_one();
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
        drop(st);
        if actual < work.size {
            self.work.notify_one();
        }
    }

    /// Waits for the limiter to allow a read of `bytes`, counting the wait.
    fn throttle(&self, bytes: u64) {
        let waited = self.limiter.acquire_blocking(bytes);
        if !waited.is_zero() {
            self.stats
                .throttled_ns
                .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
            self.throttled_metric.inc_by(waited.as_secs_f64());
        }
    }

    fn count_read(
        &self,
        m: &DatasetMetrics,
        latency: Duration,
        data: &Result<Chunk, ProtocolError>,
    ) {
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .read_ns
            .fetch_add(latency.as_nanos() as u64, Ordering::Relaxed);
        m.storage_reads.inc();
        m.read_latency.observe(latency.as_secs_f64());
        match data {
            Ok(d) => {
                self.stats
                    .read_bytes
                    .fetch_add(d.len() as u64, Ordering::Relaxed);
                m.storage_read_bytes.inc_by(d.len() as u64);
            }
            Err(e) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                m.error(e.code);
            }
        }
    }

    fn count_delivered(&self, m: &DatasetMetrics, samples: &[Sample]) {
        let bytes: u64 = samples
            .iter()
            .map(|s| s.data.as_ref().map_or(0, |d| d.len() as u64))
            .sum();
        self.stats
            .delivered_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        self.stats
            .delivered_samples
            .fetch_add(samples.len() as u64, Ordering::Relaxed);
        m.delivered_bytes.inc_by(bytes);
        m.delivered_samples.inc_by(samples.len() as u64);
    }

    fn count_stall(&self, m: &DatasetMetrics, stall: Duration) {
        if !stall.is_zero() {
            self.stats
                .stall_ns
                .fetch_add(stall.as_nanos() as u64, Ordering::Relaxed);
            m.stall_seconds.inc_by(stall.as_secs_f64());
        }
    }

    /// Returns `bytes` of a delivered batch to the buffer and the node budget.
    fn release(&self, plan: u64, bytes: u64) {
        let mut st = self.lock();
        st.reserved -= bytes;
        if let Some(p) = st.plans.get_mut(&plan) {
            p.reserved -= bytes;
        }
        self.memory.release(bytes);
        drop(st);
        self.work.notify_all();
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
        if let Some(&id) = st.by_key.get(&key) {
            let plan = st.plans.get_mut(&id).expect("by_key points at a live plan");
            if plan.fingerprint != fingerprint || plan.dataset.name != dataset.name {
                return Err(ProtocolError::new(
                    ErrorCode::PlanConflict,
                    format!(
                        "job `{}` already has a different active plan for rank {} epoch {}; submit the same plan to share it, or use another epoch number",
                        self.id, key.rank, key.epoch
                    ),
                ));
            }
            plan.attached += 1;
            return Ok((handle(Some(id)), PlanState::Joined));
        }
        if let Some(i) = st.completed.iter().position(|(k, _)| *k == key) {
            if st.completed[i].1 == fingerprint {
                return Ok((handle(None), PlanState::AlreadyComplete));
            }
            st.completed.remove(i);
        }
        let id = st.next_id;
        st.next_id += 1;
        let mut plan = PlanRun::new(id, key, fingerprint, dataset, listing, files);
        plan.attached = 1;
        let complete = plan.remaining == 0;
        st.plans.insert(id, plan);
        st.by_key.insert(key, id);
        if complete {
            st.finish_plan(id);
        }
        self.ensure_readers(&mut st);
        drop(st);
        self.work.notify_all();
        debug!(job = %self.id, rank = key.rank, epoch = key.epoch, length, "plan created");
        Ok((handle(Some(id)), PlanState::Created))
    }

    fn detach(&self, id: u64) {
        let mut st = self.lock();
        let Some(plan) = st.plans.get_mut(&id) else {
            return;
        };
        plan.attached -= 1;
        if plan.attached > 0 {
            return;
        }
        let plan = st.plans.remove(&id).expect("present");
        st.by_key.remove(&plan.key);
        // In-flight reads release their own bytes when they find the plan gone.
        let buffered = plan.buffered_bytes();
        st.reserved -= buffered;
        self.memory.release(buffered);
        drop(st);
        self.work.notify_all();
        debug!(job = %self.id, rank = plan.key.rank, epoch = plan.key.epoch, freed = buffered, "plan abandoned");
    }

    /// Claims the next entries of the plan and waits until they are fetched.
    pub async fn next(self: &Arc<Self>, handle: &PlanHandle, max: usize) -> NextBatch {
        let empty = |end| NextBatch {
            samples: Vec::new(),
            end,
            reservation: Reservation {
                job: Arc::clone(self),
                plan: 0,
                bytes: 0,
            },
        };
        let Some(id) = handle.id else {
            return empty(true);
        };
        let (positions, metrics, waiting) = {
            let mut st = self.lock();
            let Some(plan) = st.plans.get_mut(&id) else {
                return empty(true);
            };
            let positions = plan.claim_next(max, SAMPLES_FRAME_BUDGET);
            let waiting = plan.consumer_waiting();
            let dataset = plan.dataset.name.clone();
            (positions, self.dataset_metrics(&mut st, &dataset), waiting)
        };
        if positions.is_empty() {
            return empty(true);
        }
        if waiting {
            // A claimed entry nobody fetches yet may go past the buffer cap:
            // make sure a reader looks.
            self.work.notify_one();
        }
        // The connection holds the plan, so it cannot be dropped under us.
        let Some((samples, end, bytes)) = self.wait_for(id, &positions, &metrics).await else {
            return empty(true);
        };
        self.count_delivered(&metrics, &samples);
        NextBatch {
            samples,
            end,
            reservation: Reservation {
                job: Arc::clone(self),
                plan: id,
                bytes,
            },
        }
    }

    /// Waits until every claimed position is fetched, then takes them.
    /// Returns the samples, whether the plan is exhausted, and their bytes;
    /// `None` if the plan was dropped meanwhile (every attached connection
    /// left, which a map-style `READ` does not hold off).
    async fn wait_for(
        &self,
        id: u64,
        positions: &[u32],
        metrics: &DatasetMetrics,
    ) -> Option<(Vec<Sample>, bool, u64)> {
        let start = Instant::now();
        let mut waited = false;
        loop {
            let wake = {
                let mut st = self.lock();
                let plan = st.plans.get_mut(&id)?;
                match positions.iter().find(|p| !plan.fetched.contains_key(p)) {
                    // Wait for the first missing entry only: one wake-up per
                    // gap instead of one per fetched entry.
                    Some(&missing) => Arc::clone(plan.waiters.entry(missing).or_default()),
                    None => {
                        let mut bytes = 0;
                        let mut samples = Vec::with_capacity(positions.len());
                        for &p in positions {
                            if let Some(fetched) = plan.fetched.remove(&p) {
                                bytes += fetched.reserved;
                                samples.push(Sample {
                                    position: p,
                                    name: plan.name_of(p).to_owned(),
                                    data: fetched.data,
                                });
                            }
                        }
                        plan.remaining -= positions.len();
                        let end = plan.exhausted();
                        if plan.remaining == 0 {
                            st.finish_plan(id);
                        }
                        drop(st);
                        if waited {
                            self.count_stall(metrics, start.elapsed());
                        }
                        return Some((samples, end, bytes));
                    }
                }
            };
            waited = true;
            // notify_one leaves a permit if it fired before we got here.
            wake.notified().await;
        }
    }

    /// Serves a whole-file `READ` of `name` from an active plan of this job
    /// when one still has it undelivered: from the buffer, by waiting for the
    /// reader already fetching it, or by reading it now in its place.
    /// Returns `None` when no plan holds the name.
    pub async fn read_planned(
        self: &Arc<Self>,
        dataset: &str,
        name: &str,
    ) -> Option<(Sample, Reservation)> {
        enum Claimed {
            Buffered(u64, u32, DatasetMetrics),
            Direct(u64, u32, DatasetMetrics, Arc<Dataset>),
        }
        let claimed = {
            let mut st = self.lock();
            let found = st.plans.values_mut().find_map(|plan| {
                if plan.dataset.name != dataset {
                    return None;
                }
                let file = plan.listing.position(name)?;
                let pos = plan.claim_file(file)?;
                let started = std::mem::replace(&mut plan.entries[pos as usize].started, true);
                Some((plan.id, pos, started, Arc::clone(&plan.dataset)))
            });
            let (id, pos, started, ds) = found?;
            let m = self.dataset_metrics(&mut st, dataset);
            if started {
                Claimed::Buffered(id, pos, m)
            } else {
                Claimed::Direct(id, pos, m, ds)
            }
        };
        match claimed {
            Claimed::Buffered(id, pos, m) => {
                // None: the plan was abandoned meanwhile; the caller reads directly.
                let (mut samples, _, bytes) = self.wait_for(id, &[pos], &m).await?;
                self.count_delivered(&m, &samples);
                let sample = samples.pop()?;
                Some((
                    sample,
                    Reservation {
                        job: Arc::clone(self),
                        plan: id,
                        bytes,
                    },
                ))
            }
            Claimed::Direct(id, pos, m, ds) => {
                let job = Arc::clone(self);
                let owned = name.to_owned();
                let metrics = m.clone();
                let data = tokio::task::spawn_blocking(move || {
                    job.read_now(&ds, &owned, 0, TO_END, &metrics)
                })
                .await
                .unwrap_or_else(|e| {
                    Err(ProtocolError::new(
                        ErrorCode::IoError,
                        format!("read task failed: {e}"),
                    ))
                });
                let sample = Sample {
                    position: pos,
                    name: name.to_owned(),
                    data,
                };
                {
                    let mut st = self.lock();
                    if let Some(plan) = st.plans.get_mut(&id) {
                        plan.remaining -= 1;
                        if plan.remaining == 0 {
                            st.finish_plan(id);
                        }
                    }
                }
                self.count_delivered(&m, std::slice::from_ref(&sample));
                Some((
                    sample,
                    Reservation {
                        job: Arc::clone(self),
                        plan: id,
                        bytes: 0,
                    },
                ))
            }
        }
    }

    /// Reads straight from storage (random access outside any plan), under
    /// the job's limiter and counted like any storage read. Blocking.
    pub fn read_now(
        &self,
        dataset: &Dataset,
        name: &str,
        offset: u64,
        length: u64,
        m: &DatasetMetrics,
    ) -> Result<Chunk, ProtocolError> {
        let path = dataset.resolve(name)?;
        let size = std::fs::metadata(&path)
            .map(|meta| meta.len().saturating_sub(offset).min(length))
            .unwrap_or(0);
        self.throttle(size);
        let start = Instant::now();
        let data = read_range(&path, offset, length).map_err(|e| io_error(name, &e));
        self.count_read(m, start.elapsed(), &data);
        data
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
        let sample = StatsSample {
            delivered_bytes: self.stats.delivered_bytes.load(Ordering::Relaxed),
            reads: self.stats.reads.load(Ordering::Relaxed),
            read_ns: self.stats.read_ns.load(Ordering::Relaxed),
            stall_ns: self.stats.stall_ns.load(Ordering::Relaxed),
            throttled_ns: self.stats.throttled_ns.load(Ordering::Relaxed),
        };
        let mut st = self.lock();
        let previous = st.last_tick.replace((now, sample));
        if let Some((at, before)) = previous {
            let obs = Observation {
                elapsed: now.saturating_duration_since(at),
                stall: Duration::from_nanos(sample.stall_ns - before.stall_ns),
                consumers: st.plans.values().map(|p| p.attached as u32).sum(),
                delivered_bytes: sample.delivered_bytes - before.delivered_bytes,
                reads: sample.reads - before.reads,
                read_time: Duration::from_nanos(sample.read_ns - before.read_ns),
                throttled: Duration::from_nanos(sample.throttled_ns - before.throttled_ns),
                buffer_used: st.reserved,
                has_work: st.plans.values().any(|p| p.remaining > 0),
            };
            if st.settings.tuner
                && let Some(change) = st.tuner.observe(&obs)
            {
                debug!(job = %self.id, readers = change.readers, buffer = change.buffer, reason = ?change.reason, "tuned");
                self.metrics
                    .tuner_changes
                    .with_label_values(&[self.id.as_str(), change.reason.name()])
                    .inc();
                st.readers_target = change.readers;
                st.capacity = change.buffer;
                self.ensure_readers(&mut st);
                self.work.notify_all();
            }
        }
        self.publish_gauges(&st);
    }

    /// Sets the job's gauges from its state.
    fn publish_gauges(&self, st: &JobState) {
        let id = [self.id.as_str()];
        let m = &self.metrics;
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
    }

    /// Returns this job's telemetry.
    pub fn snapshot(&self) -> JobSnapshot {
        let st = self.lock();
        let limits = self.limiter.limits();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        JobSnapshot {
            job: self.id.clone(),
            labels: self.labels.lock().expect("labels lock").clone(),
            delivered_bytes: load(&self.stats.delivered_bytes),
            delivered_samples: load(&self.stats.delivered_samples),
            storage_reads: load(&self.stats.reads),
            storage_read_bytes: load(&self.stats.read_bytes),
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

impl PlanHandle {
    /// Whether this handle joined a plan that had already been delivered.
    pub fn is_complete(&self) -> bool {
        self.id.is_none()
    }
}

impl Drop for PlanHandle {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.job.detach(id);
        }
    }
}

impl JobState {
    /// The job's buffer capacity after the node budget's fair share.
    fn effective_capacity(&self, memory: &Memory) -> u64 {
        self.capacity.min(memory.job_share())
    }

    /// Picks the next entry to fetch and reserves its bytes: first in plans a
    /// consumer is waiting on, then in the plan holding the least.
    fn pick_work(&mut self, memory: &Memory, metrics: &Metrics, job: &str) -> Result<Work, Idle> {
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
            return Err(Idle::NoWork);
        }
        candidates.sort_unstable_by_key(|&(waiting, reserved, id)| (!waiting, reserved, id));
        let share = capacity / candidates.len() as u64;
        let mut blocked_on_memory = false;
        for (waiting, _, id) in candidates {
            let plan = self.plans.get_mut(&id).expect("candidate exists");
            let pos = plan.next_unstarted().expect("candidate has work");
            let file_bytes = plan.size_of(pos);
            let size = plan.dataset.footprint(file_bytes);
            let empty = plan.reserved == 0;
            let fits = self.reserved + size <= capacity && plan.reserved + size <= share;
            if !(fits || waiting || empty) {
                continue;
            }
            if !memory.try_reserve(size, empty) {
                blocked_on_memory = true;
                continue;
            }
            plan.entries[pos as usize].started = true;
            plan.reserved += size;
            self.reserved += size;
            let name = plan.name_of(pos).to_owned();
            let dataset = Arc::clone(&plan.dataset);
            let ds_name = dataset.name.clone();
            let m = self
                .datasets
                .entry(ds_name.clone())
                .or_insert_with(|| metrics.dataset(job, &ds_name))
                .clone();
            return Ok(Work {
                plan: id,
                pos,
                size,
                file_bytes,
                name,
                dataset,
                metrics: m,
            });
        }
        Err(if blocked_on_memory {
            Idle::NoMemory
        } else {
            Idle::NoWork
        })
    }

    /// Forgets a fully delivered plan and remembers that it completed.
    fn finish_plan(&mut self, id: u64) {
        if let Some(plan) = self.plans.remove(&id) {
            self.by_key.remove(&plan.key);
            self.completed.push_back((plan.key, plan.fingerprint));
            if self.completed.len() > COMPLETED_MEMORY {
                self.completed.pop_front();
            }
        }
    }
}
