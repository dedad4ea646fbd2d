//! The prefetch engine: jobs, their plans, buffers and readers, under one
//! node memory budget.
//!
//! Each job has its own reader threads, byte-bounded buffer, QoS limiter and
//! tuner. A job's plans share its buffer; all jobs share the node budget,
//! which no reservation may exceed (the only exception: a plan with nothing
//! buffered may always fetch one sample when the node holds nothing, or one
//! sample larger than the whole budget, so such a sample is still served
//! instead of hanging).

mod job;
mod plan_run;
mod staging;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use job::{
    Job, JobHandle, JobSnapshot, Lending, NotLent, PlanHandle, PlannedClaim, Presence, Reservation,
    SETTINGS_WAIT,
};
pub use plan_run::{ORDER_RANK, PlanKey, ShardOrder};
use staging::Round;
pub use staging::Staging;

use crate::cache::{Cache, Terms};
use crate::dataset::Dataset;
use crate::job_config::JobConfig;
use crate::metrics::Metrics;
use crate::protocol::{ErrorCode, ProtocolError};
use crate::settings::PushedSettings;
use crate::shm::{Kept, Region, allowance_for_budget};
use crate::sync::lock;
use crate::trust::{Peer, TrainerAccess, show_labels};

/// How long a job with no connections is kept (tuned settings, counters)
/// before it is forgotten.
pub const JOB_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Jobs kept with nothing attached, at most: a new job past that makes the
/// stage forget the one idle longest, so that a client naming job after
/// job cannot make it keep their regions (a descriptor each) and readers
/// for a minute each.
pub const MAX_IDLE_JOBS: usize = 128;

/// Jobs kept with nothing attached under the process's descriptor limit:
/// [`MAX_IDLE_JOBS`], and at most an eighth of the limit under a low one
/// (32 of 256), at least 8.
fn most_idle_jobs() -> usize {
    (sluice_proto::fd_limit::soft() / 8).clamp(8, MAX_IDLE_JOBS)
}

/// Jobs a stage holds at once, attached or idle: each that reads takes
/// reader threads (16 to start), a region descriptor and metric series,
/// so a client naming job after job (a connection or an `@<job>` path
/// each) would otherwise take the stage's threads until it aborted (at
/// about 1,000 jobs here). A node runs a handful of jobs.
pub const MAX_JOBS: usize = 256;

/// How long a job's shared-memory region hands out no slot before the free
/// pages it keeps for reuse go back to the system: jobs that went quiet do
/// not each keep theirs (with many jobs, many times the budget).
const REGION_IDLE: Duration = Duration::from_secs(5);

/// The node-wide memory budget shared by every job's buffer.
#[derive(Debug)]
pub struct Memory {
    budget: u64,
    /// Shared with the account of the free pages shared-memory regions
    /// keep ([`Kept`]), which fills what it leaves.
    used: Arc<AtomicU64>,
    /// Every job's buffer comes out of this budget: the jobs, so that one
    /// whose consumer waits can have others give back read-ahead.
    members: Mutex<Vec<std::sync::Weak<Job>>>,
    /// The part of `used` that trainers hold in shared memory, every job's.
    lent: AtomicU64,
    /// Bytes of the entries claimed by `NEXT`s not yet answered and taken,
    /// every job's: at most half the budget (beyond one entry each), so
    /// that trainers that claim and never read their answers cannot take
    /// the buffer of every job.
    claimed: AtomicU64,
    /// The jobs that hold a plan, among which the budget is shared (a
    /// job that only said `HELLO` takes no share).
    planning: AtomicUsize,
    /// Entries of every job's active plans: their bookkeeping (about 10
    /// bytes an entry) is held outside the budget, so it is bounded too
    /// ([`Memory::most_planned`]).
    planned: AtomicU64,
    /// Listed bytes of the answers to reads by name (`READ`, `FETCH`)
    /// from before they are read until they are written, every job's: at
    /// most half the budget (see [`Memory::try_hold_answer`]).
    answering: AtomicU64,
    /// The same of the one answer larger than half the budget that may be
    /// on its way (0: none).
    oversized: AtomicU64,
}

impl Memory {
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            used: Arc::new(AtomicU64::new(0)),
            members: Mutex::new(Vec::new()),
            lent: AtomicU64::new(0),
            claimed: AtomicU64::new(0),
            planning: AtomicUsize::new(0),
            planned: AtomicU64::new(0),
            answering: AtomicU64::new(0),
            oversized: AtomicU64::new(0),
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Reserves `n` bytes if the budget allows, or regardless when `force`
    /// is set (the caller's plan holds nothing) and either nothing at all
    /// is reserved, or `n` is more than the whole budget and nothing is
    /// reserved beyond the budget yet. Such a sample could wait forever for
    /// room (trainers holding shared-memory samples keep the node from ever
    /// being empty), so it is read over the budget, one at a time on the
    /// node: every plan reading one at once took the budget many times
    /// over.
    fn try_reserve(&self, n: u64, force: bool) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let alone = used == 0 || (n > self.budget && used <= self.budget);
                (used + n <= self.budget || (force && alone)).then_some(used + n)
            })
            .is_ok()
    }

    /// Reserves `n` bytes for a read a trainer waits on outside the readers
    /// (a whole file a `FETCH`, `READ` or mount open asked for): within the
    /// budget when it has room, else over it while nothing else is over
    /// it, else once that has lasted `patience` (bytes held for long must
    /// not stall it). Blocking: it waits in steps of `recheck`. Before,
    /// such reads went to the heap outside the budget whenever it had no
    /// room: four map-style workers reading 48 MiB samples took a stage
    /// with a 32 MiB budget to 261 MiB.
    fn reserve_waiting(&self, n: u64, patience: Duration, recheck: Duration) {
        let start = Instant::now();
        loop {
            // Room for it, or nothing over the budget: either way `used`
            // is within the budget now. Answers to reads by name are not
            // counted as over it: they are bounded on their own (see
            // [`Memory::try_hold_answer`]), and one a trainer never took
            // held every other read outside the readers 2 s, for the 30 s
            // until it was cut (a map-style loader beside it: 30 s for an
            // epoch of 0.3 s).
            let by_name =
                self.answering.load(Ordering::Acquire) + self.oversized.load(Ordering::Acquire);
            let alone = self
                .used
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    (used.saturating_sub(by_name) <= self.budget).then_some(used + n)
                })
                .is_ok();
            if alone {
                return;
            }
            if start.elapsed() >= patience {
                self.reserve_over(n);
                return;
            }
            std::thread::sleep(recheck);
        }
    }

    /// Reserves `n` bytes whether the budget has room or not (an entry a
    /// consumer waits on that nothing can make room for).
    fn reserve_over(&self, n: u64) {
        self.used.fetch_add(n, Ordering::AcqRel);
    }

    fn release(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// Grows or shrinks a reservation that turned out to need `to` bytes
    /// instead of `from` (a file whose size changed since it was listed).
    fn adjust(&self, from: u64, to: u64) {
        if to > from {
            self.used.fetch_add(to - from, Ordering::AcqRel);
        } else {
            self.release(from - to);
        }
    }

    /// Counts `n` reserved bytes as held by a trainer, if every job's
    /// trainers together hold at most half the budget then: the other
    /// half always leaves the readers room, however many jobs keep their
    /// samples.
    fn try_lend(&self, n: u64) -> bool {
        self.lent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |lent| {
                (lent + n <= self.budget / 2).then_some(lent + n)
            })
            .is_ok()
    }

    /// Bytes a trainer held came back (and leave the budget with `release`).
    fn unlend(&self, n: u64) {
        self.lent.fetch_sub(n, Ordering::AcqRel);
    }

    /// Counts `job` among those whose buffers come out of this budget.
    fn register(&self, job: &Arc<Job>) {
        let mut members = lock(&self.members);
        members.retain(|m| m.strong_count() > 0);
        members.push(Arc::downgrade(job));
    }

    /// Frees at least `need` bytes for `requester`, whose consumer waits
    /// on an entry no reader can fetch for want of budget, if read-ahead
    /// nobody has asked for yet holds them: first the excess of jobs over
    /// their share (a job that prefetched the budget before others came,
    /// then stopped asking), then any job's. Returns the bytes freed. The
    /// entries given back are read again when their turn comes (from the
    /// node cache, if it kept them). Call with no job's lock held.
    pub(crate) fn reclaim(&self, need: u64, requester: &Job) -> u64 {
        let members: Vec<Arc<Job>> = lock(&self.members)
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        let share = self.job_share();
        let mut over: Vec<(u64, &Arc<Job>)> = members
            .iter()
            .filter(|job| !std::ptr::eq(Arc::as_ptr(job), requester))
            .map(|job| (job.reserved().saturating_sub(share), job))
            .filter(|(excess, _)| *excess > 0)
            .collect();
        over.sort_unstable_by_key(|(excess, _)| std::cmp::Reverse(*excess));
        let mut freed = 0;
        for (excess, job) in over {
            if freed >= need {
                return freed;
            }
            freed += job.give_back_read_ahead((need - freed).min(excess));
        }
        for job in &members {
            if freed >= need {
                break;
            }
            freed += job.give_back_read_ahead(need - freed);
        }
        freed
    }

    /// The share of the budget one job may use while the jobs that hold
    /// plans now are active.
    fn job_share(&self) -> u64 {
        self.budget / self.planning.load(Ordering::Relaxed).max(1) as u64
    }

    /// A job starts (`true`) or stops holding plans.
    fn planning(&self, holds: bool) {
        if holds {
            self.planning.fetch_add(1, Ordering::Relaxed);
        } else {
            self.planning.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Bytes `NEXT` claims may still take before every job's claims hold
    /// half the budget.
    fn claim_room(&self) -> u64 {
        (self.budget / 2).saturating_sub(self.claimed.load(Ordering::Acquire))
    }

    /// Entries every job's active plans may hold together: a quarter of
    /// the budget's bytes at about 10 bytes an entry, and at least 8 Mi
    /// (six ImageNet epochs). Forty idle connections with a plan of 4 Mi
    /// entries each took a stage with a 256 MiB budget to 1.2 GiB.
    fn most_planned(&self) -> u64 {
        (self.budget / 40).max(8 << 20)
    }

    /// Counts `n` more planned entries if they fit in
    /// [`Memory::most_planned`]; else says how many are planned.
    fn try_plan(&self, n: u64) -> Result<(), u64> {
        let most = self.most_planned();
        self.planned
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |planned| {
                (planned + n <= most).then_some(planned + n)
            })
            .map(drop)
    }

    fn unplan(&self, n: u64) {
        self.planned.fetch_sub(n, Ordering::AcqRel);
    }

    fn hold_claim(&self, n: u64) {
        self.claimed.fetch_add(n, Ordering::AcqRel);
    }

    fn drop_claim(&self, n: u64) {
        self.claimed.fetch_sub(n, Ordering::AcqRel);
    }

    /// Counts an answer of `n` listed bytes to a read by name if every
    /// job's answers leave room for it in half the budget (one larger than
    /// that: if no other such is on its way); else returns what they hold.
    /// Answers by name are read outside the readers, over the budget when
    /// it is full, and held until their trainer takes them: without this
    /// bound, six connections each reading a 150 MiB file whole and never
    /// taking it held 900 MiB of a stage with a 128 MiB budget.
    fn try_hold_answer(&self, n: u64) -> Result<(), u64> {
        let half = self.budget / 2;
        self.answers_of(n)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |on_way| {
                let room = if n > half {
                    on_way == 0
                } else {
                    on_way + n <= half
                };
                room.then_some(on_way + n)
            })
            .map(drop)
    }

    fn drop_answer(&self, n: u64) {
        self.answers_of(n).fetch_sub(n, Ordering::AcqRel);
    }

    /// The count an answer of `n` listed bytes is held in: the one larger
    /// than half the budget goes alone, in a count of its own.
    fn answers_of(&self, n: u64) -> &AtomicU64 {
        if n > self.budget / 2 {
            &self.oversized
        } else {
            &self.answering
        }
    }
}

/// The stage's datasets and jobs.
#[derive(Debug)]
pub struct Engine {
    datasets: HashMap<String, Arc<Dataset>>,
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    memory: Arc<Memory>,
    /// The free pages the jobs' shared-memory regions keep for reuse.
    kept: Arc<Kept>,
    /// The job configuration from the stage's own flags.
    base: JobConfig,
    /// The controller's last accepted push, kept while it is unreachable
    /// (fail-static).
    pushed: Mutex<Option<Arc<PushedSettings>>>,
    /// Whether a controller session is up: new jobs then wait (briefly)
    /// for its settings before reading.
    controller_live: AtomicBool,
    /// Whether jobs keep their prefetch buffers in shared memory, for the
    /// trainers that ask (cleared when the system refuses a region).
    shared_memory: AtomicBool,
    metrics: Arc<Metrics>,
    /// The node cache every job reads through, when the stage has one.
    cache: Option<Arc<Cache>>,
    /// Rounds of loading data sets into the cache.
    staging: Staging,
    /// Woken when a job starts or its last trainer leaves, so the
    /// controller session reports it at once rather than at the next
    /// telemetry tick: a new job waits for its settings, and a departed
    /// job's share should go to the others.
    jobs_changed: Arc<tokio::sync::Notify>,
    /// Set once the stage stops taking trainers ([`Engine::begin_drain`]).
    draining: AtomicBool,
}

impl Engine {
    /// Builds the engine; `memory_budget` is what prefetch buffers may
    /// use (the cache's memory is apart from it).
    pub fn new(
        datasets: Vec<Dataset>,
        memory_budget: u64,
        base: JobConfig,
        shared_memory: bool,
        metrics: Arc<Metrics>,
        cache: Option<Arc<Cache>>,
    ) -> Arc<Self> {
        metrics.memory_budget.set(memory_budget as i64);
        if let Some(cache) = &cache {
            for dataset in &datasets {
                dataset.keep_cache_listed(Arc::clone(cache));
            }
        }
        let memory = Arc::new(Memory::new(memory_budget));
        let kept = Kept::new(
            Arc::clone(&memory.used),
            memory_budget,
            allowance_for_budget(memory_budget),
        );
        Arc::new(Self {
            datasets: datasets
                .into_iter()
                .map(|d| (d.name.clone(), Arc::new(d)))
                .collect(),
            jobs: Mutex::new(HashMap::new()),
            memory,
            kept,
            base,
            pushed: Mutex::new(None),
            controller_live: AtomicBool::new(false),
            shared_memory: AtomicBool::new(shared_memory),
            metrics,
            cache,
            staging: Staging::default(),
            jobs_changed: Arc::new(tokio::sync::Notify::new()),
            draining: AtomicBool::new(false),
        })
    }

    pub fn dataset(&self, name: &str) -> Option<Arc<Dataset>> {
        self.datasets.get(name).cloned()
    }

    /// How many data sets the stage serves.
    pub fn dataset_count(&self) -> usize {
        self.datasets.len()
    }

    pub fn dataset_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.datasets.keys().cloned().collect();
        names.sort();
        names
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The node cache, when the stage has one.
    pub fn cache(&self) -> Option<&Arc<Cache>> {
        self.cache.as_ref()
    }

    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// The staging rounds.
    pub fn staging(&self) -> &Staging {
        &self.staging
    }

    /// Completes when a job has started, or lost its last trainer, since
    /// the last call completed.
    pub async fn jobs_changed(&self) {
        self.jobs_changed.notified().await;
    }

    /// Attaches `peer` to job `id` if the `trainers:` rules let it claim
    /// the job: with the `labels` it names, or, naming none, with those
    /// the job runs under (it joins the job as it runs, without clearing
    /// them). Under rules, labels change only while nothing is attached
    /// to the job: a peer's labels would otherwise apply to connections
    /// whose peers were never checked against them. The check and the
    /// attach are one step under the job table's lock, so two claims of
    /// one new job cannot both set its labels. Refusals say why in one
    /// sentence: `CLAIM_REFUSED` by the rules, `UNAVAILABLE` when the
    /// stage holds [`MAX_JOBS`] jobs, none idle.
    pub fn claim(
        &self,
        access: &TrainerAccess,
        peer: &Peer,
        id: &str,
        labels: Option<BTreeMap<String, String>>,
    ) -> Result<job::JobHandle, ProtocolError> {
        let mut jobs = lock(&self.jobs);
        if access.restricts() {
            let current = jobs.get(id).map(|job| (job.labels(), job.connected()));
            check_claim(access, peer, id, labels.as_ref(), current)
                .map_err(|why| ProtocolError::new(ErrorCode::ClaimRefused, why))?;
        }
        if !jobs.contains_key(id) && jobs.len() >= MAX_JOBS {
            // Full: the idle jobs go first, however recently they read.
            self.forget_idle_beyond(&mut jobs, 0);
            if jobs.len() >= MAX_JOBS {
                return Err(ProtocolError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the stage serves {MAX_JOBS} jobs, the most it holds at once, and none of them is idle: job `{id}` can start once one of them ends"
                    ),
                ));
            }
        }
        let (handle, started) = self.attach_locked(&mut jobs, id, labels, true);
        drop(jobs);
        if started {
            // After the handle exists: the report shows the connection.
            self.jobs_changed.notify_one();
        }
        Ok(handle)
    }

    /// Whether `peer` may act as job `id` without declaring labels (a
    /// read through the mount, once its job is attached): the `trainers:`
    /// rules, checked against the labels the job runs under.
    pub fn may_join(&self, access: &TrainerAccess, peer: &Peer, id: &str) -> Result<(), String> {
        if !access.restricts() {
            return Ok(());
        }
        let current = lock(&self.jobs)
            .get(id)
            .map(|job| (job.labels(), job.connected()));
        check_claim(access, peer, id, None, current)
    }

    /// Returns the job called `id`, creating it with the configuration in
    /// force for it, and sets its `labels` when given; its buffers are in
    /// shared memory only when `shared` (a job nobody outside the stage
    /// reads needs none). The caller holds a connection to it until the
    /// handle is dropped.
    fn attach_with(
        &self,
        id: &str,
        labels: Option<BTreeMap<String, String>>,
        shared: bool,
    ) -> job::JobHandle {
        let mut jobs = lock(&self.jobs);
        let (handle, started) = self.attach_locked(&mut jobs, id, labels, shared);
        drop(jobs);
        if started {
            self.jobs_changed.notify_one();
        }
        handle
    }

    /// [`Engine::attach_with`] on the locked job table; says whether the
    /// controller is to hear of the job at once: it started, or came back
    /// under new labels (the caller tells `jobs_changed` once the lock is
    /// released).
    fn attach_locked(
        &self,
        jobs: &mut HashMap<String, Arc<Job>>,
        id: &str,
        labels: Option<BTreeMap<String, String>>,
        shared: bool,
    ) -> (job::JobHandle, bool) {
        if !jobs.contains_key(id) {
            self.forget_idle_beyond(jobs, most_idle_jobs() - 1);
        }
        let mut started = false;
        let job = jobs
            .entry(id.to_owned())
            .or_insert_with(|| {
                started = true;
                self.metrics.jobs.inc();
                let config = self.config_for(id);
                let hold = self
                    .controller_live
                    .load(Ordering::Acquire)
                    .then(|| Instant::now() + SETTINGS_WAIT);
                let start = job::Start {
                    region: if shared { self.region_for(id) } else { None },
                    hold,
                    jobs_changed: Arc::clone(&self.jobs_changed),
                    memory: Arc::clone(&self.memory),
                    metrics: Arc::clone(&self.metrics),
                    cache: self.cache.clone(),
                };
                let job = Job::start(id, labels.clone().unwrap_or_default(), config, start);
                self.memory.register(&job);
                if self.draining.load(Ordering::Acquire) {
                    job.lend_book().keep_reclaimed();
                }
                job
            })
            .clone();
        // A job kept idle that comes back under other labels (a new job
        // given the name of one that ended a moment ago) is held as a new
        // one until the settings for its labels come: it read a first
        // burst under the old job's limits.
        let idle = job.idle_since(Instant::now()).is_some();
        if let Some(labels) = labels
            && job.set_labels(labels)
            && !started
            && idle
        {
            if self.controller_live.load(Ordering::Acquire) {
                job.hold_reads(Instant::now() + SETTINGS_WAIT);
            }
            started = true;
        }
        (job::JobHandle::new(job), started)
    }

    /// Forgets every job with nothing attached, returning how many: what
    /// they hold (a shared-memory region's descriptor each) is needed now
    /// (the stage ran out of descriptors).
    pub fn forget_idle_jobs(&self) -> usize {
        let mut jobs = lock(&self.jobs);
        let before = jobs.len();
        self.forget_idle_beyond(&mut jobs, 0);
        before - jobs.len()
    }

    /// Forgets the jobs idle longest until at most `most` are idle.
    fn forget_idle_beyond(&self, jobs: &mut HashMap<String, Arc<Job>>, most: usize) {
        let now = Instant::now();
        let mut idle: Vec<(Duration, String)> = jobs
            .iter()
            .filter_map(|(id, job)| job.idle_since(now).map(|idle| (idle, id.clone())))
            .collect();
        if idle.len() <= most {
            return;
        }
        let over = idle.len() - most;
        idle.sort_unstable_by_key(|(idle, _)| std::cmp::Reverse(*idle));
        for (_, id) in idle.into_iter().take(over) {
            if let Some(job) = jobs.remove(&id) {
                self.forget(&job);
            }
        }
    }

    /// Stops a job taken out of the table and uncounts it.
    fn forget(&self, job: &Job) {
        job.stop();
        self.metrics.jobs.dec();
    }

    /// Returns a shared-memory region for a new job's buffers (as large as
    /// the node budget: only the pages its slots touch take memory), or
    /// `None` when shared memory is off or the system refuses it (then it
    /// is turned off, with one warning).
    fn region_for(&self, id: &str) -> Option<Arc<Region>> {
        if !self.shared_memory.load(Ordering::Relaxed) {
            return None;
        }
        let budget = self.memory.budget() as usize;
        match Region::new(id, budget, &self.kept) {
            Ok(region) => Some(region),
            // Out of descriptors for now: this job goes through the socket,
            // and the next one tries again.
            Err(e) if sluice_proto::fd_limit::exhausted(&e) => {
                tracing::debug!(job = id, error = %e, "no shared-memory region for this job: out of file descriptors");
                None
            }
            Err(e) => {
                if self.shared_memory.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "cannot create a shared-memory region: delivering through the socket only");
                }
                None
            }
        }
    }

    /// Returns the configuration job `id` runs with now.
    fn config_for(&self, id: &str) -> JobConfig {
        match lock(&self.pushed).as_ref() {
            Some(pushed) => self.resolve(pushed, id),
            None => self.capped(id, self.base),
        }
    }

    /// The configuration `settings` give job `id`, a staging job's rate
    /// capped at its staging rate.
    fn resolve(&self, settings: &PushedSettings, id: &str) -> JobConfig {
        self.capped(id, settings.resolve(id, self.base))
    }

    fn capped(&self, id: &str, mut config: JobConfig) -> JobConfig {
        if let Some(cap) = self.staging.cap(id) {
            let rate = config.limits.bytes_per_s.map_or(cap, |r| r.min(cap));
            config.limits.bytes_per_s = Some(rate);
        }
        config
    }

    /// Applies a push from the controller to every job, current and future,
    /// or refuses all of it (nothing changes) with the reason.
    pub fn apply_settings(&self, settings: PushedSettings) -> Result<(), String> {
        settings.validate(self.base, self.memory.budget())?;
        let version = settings.version;
        let current = self.settings_version();
        if version < current {
            // A controller that lost its lease may still be pushing.
            return Err(format!(
                "version {version} is older than version {current} in force"
            ));
        }
        if let Some(unknown) = settings
            .cache
            .keys()
            .find(|d| !self.datasets.contains_key(d.as_str()))
        {
            return Err(format!(
                "cache settings name data set `{unknown}`, which this stage does not serve"
            ));
        }
        let settings = Arc::new(settings);
        *lock(&self.pushed) = Some(Arc::clone(&settings));
        let rounds = self.steer_cache(&settings);
        let now = Instant::now();
        for job in self.jobs() {
            let named = settings.names(job.id());
            // The controller names the jobs with trainers: an idle job it
            // leaves out keeps what it had, so that a capped job's next
            // trainer does not read unlimited until a push names it again.
            if named || job.idle_since(now).is_none() {
                job.apply_config(self.resolve(&settings, job.id()));
            }
            if named {
                job.start_reading("settings");
            }
        }
        self.metrics.settings_version.set(version as i64);
        for round in rounds {
            round.job.job().start_reading("settings");
            self.staging.start(round, self.metrics.cache.clone());
        }
        Ok(())
    }

    /// Gives the cache each data set's terms from `settings` (the stage's
    /// own for data sets they do not name), and returns the staging rounds
    /// they ask for that have not run.
    fn steer_cache(&self, settings: &PushedSettings) -> Vec<Round> {
        let Some(cache) = &self.cache else {
            return Vec::new();
        };
        let mut rounds = Vec::new();
        for (name, dataset) in &self.datasets {
            let wanted = settings.cache.get(name);
            let terms = wanted.map(|c| Terms {
                tenant: c.tenant.clone(),
                tenant_weight: c.tenant_weight,
                weight: c.weight,
                pin: c.pin,
            });
            let size = dataset.listed().map(|l| l.total_bytes);
            cache.steer(&dataset.identity, name, terms, size);
            let Some(c) = wanted else {
                self.staging.unwanted(name);
                continue;
            };
            if self
                .staging
                .wants(name, c.staging_round, c.staging_bytes_per_s)
            {
                let (id, labels) = Staging::job(name);
                rounds.push(Round {
                    dataset: Arc::clone(dataset),
                    cache: Arc::clone(cache),
                    job: self.attach_with(&id, Some(labels), false),
                    round: c.staging_round,
                });
            }
        }
        rounds
    }

    /// Lists again, in the background, each data set whose readers met a
    /// stale listing (see [`Dataset::latest`]): a sample changed in place
    /// gets its new version, and so its new bytes, without a new `OPEN`.
    fn refresh_listings(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for dataset in self.datasets.values() {
            if dataset.refresh_wanted() {
                let (ours, dataset) = (dataset, Arc::clone(dataset));
                let relist = move || {
                    if let Err(e) = dataset.listing() {
                        tracing::debug!(dataset = %dataset.name, error = %e, "listing again in the background failed");
                    }
                    dataset.refreshed();
                };
                if let Err((_, why)) = crate::blocking::spawn(&runtime, relist) {
                    // A later read asks again.
                    tracing::debug!(dataset = %ours.name, error = %why, "no thread to list the data set again");
                    ours.refreshed();
                }
            }
        }
    }

    /// Says whether a controller session is up (or, at start-up, about to
    /// be). While it is, a new job holds its reads until the controller's
    /// settings name it (at most [`SETTINGS_WAIT`]); when it goes down,
    /// nobody waits for it.
    pub fn set_controller_live(&self, live: bool) {
        self.controller_live.store(live, Ordering::Release);
        if !live {
            for job in self.jobs() {
                job.start_reading("no-controller");
            }
        }
    }

    /// The version of the controller's settings in force (0: none yet).
    pub fn settings_version(&self) -> u64 {
        lock(&self.pushed).as_ref().map_or(0, |s| s.version)
    }

    /// Returns every job known now.
    pub fn jobs(&self) -> Vec<Arc<Job>> {
        let mut jobs: Vec<Arc<Job>> = lock(&self.jobs).values().cloned().collect();
        jobs.sort_by(|a, b| a.id().cmp(b.id()));
        jobs
    }

    /// Runs the auto-tuner of every job once and forgets jobs idle past the
    /// timeout. Called every tuner tick.
    pub fn tick(&self, now: Instant) {
        for job in self.jobs() {
            job.tune(now);
            // The free pages a quiet job's region keeps go back.
            job.give_back_idle_pages(REGION_IDLE);
            // Slots handed off and never received come back even when the
            // job delivers nothing more; their memory goes back once the
            // book's lock is let go.
            let swept = job.lend_book().sweep(now);
            drop(swept);
        }
        self.refresh_listings();
        // Reads that waited for a descriptor: the idle jobs' go back.
        let short = crate::storage::descriptors_were_short();
        let mut jobs = lock(&self.jobs);
        jobs.retain(|_, job| {
            let keep = job
                .idle_since(now)
                .is_none_or(|idle| idle < JOB_IDLE_TIMEOUT && !short);
            if !keep {
                self.forget(job);
            }
            keep
        });
        self.metrics.memory_used.set(self.memory.used() as i64);
    }

    /// Returns the per-job telemetry snapshot (what the controller receives).
    pub fn snapshot(&self) -> Vec<JobSnapshot> {
        self.jobs().iter().map(|j| j.snapshot()).collect()
    }

    /// The stage is stopping: from now on no job reuses a slot its
    /// trainers did not return, since they go on reading what they hold
    /// while they reconnect to another stage (the slots' memory stays
    /// until the stage exits; their budget goes back so that the
    /// connections still draining are served).
    pub fn begin_drain(&self) {
        let jobs = lock(&self.jobs);
        self.draining.store(true, Ordering::Release);
        for job in jobs.values() {
            job.lend_book().keep_reclaimed();
        }
    }

    /// Stops every job's readers (shutdown).
    pub fn stop(&self) {
        for job in lock(&self.jobs).values() {
            job.stop();
        }
    }
}

/// The `trainers:` check of a claim of job `id` by `peer`, naming `labels`
/// or none, against the job as it is (`current`: its labels and whether
/// anything is attached to it), if it exists.
fn check_claim(
    access: &TrainerAccess,
    peer: &Peer,
    id: &str,
    labels: Option<&BTreeMap<String, String>>,
    current: Option<(BTreeMap<String, String>, bool)>,
) -> Result<(), String> {
    let running = current.as_ref().map(|(labels, _)| labels);
    let runs_under = labels.or(running).cloned().unwrap_or_default();
    access.check(peer, id, &runs_under).map_err(|why| match labels {
        None if !runs_under.is_empty() => format!(
            "{why} (job `{id}` runs under {}: a trainer or reader that names no labels joins it under them)",
            show_labels(&runs_under)
        ),
        _ => why,
    })?;
    match (labels, current) {
        (Some(labels), Some((running, true))) if *labels != running => Err(format!(
            "job `{id}` runs under {}: a trainer joining it claims the same labels, or none (a job's labels are set by the first of its trainers, mount readers or order files, and change only once none is attached)",
            if running.is_empty() {
                "no labels".to_owned()
            } else {
                format!("other labels ({})", show_labels(&running))
            }
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_join_says_the_labels_are_the_running_jobs() {
        let access = TrainerAccess::new(
            serde_yaml_ng::from_str("- gids: [2000]\n  jobs: ['*']\n  labels: {team: [a]}")
                .unwrap(),
        );
        let peer = Peer::Unix {
            uid: 1000,
            gid: 2000,
        };
        let running: BTreeMap<String, String> = [("team", "a"), ("priority", "low")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let e = check_claim(&access, &peer, "x", None, Some((running.clone(), true))).unwrap_err();
        assert!(
            e.contains("may not claim label `priority=low`")
                && e.contains("(job `x` runs under {priority=low, team=a}: a trainer or reader that names no labels joins it under them)"),
            "{e}"
        );
        // Labels the trainer named are its own: no note.
        let e = check_claim(&access, &peer, "x", Some(&running), None).unwrap_err();
        assert!(!e.contains("runs under"), "{e}");
        // Other labels than a running job's, and none while it runs without.
        let team_a = BTreeMap::from([("team".to_owned(), "a".to_owned())]);
        let e = check_claim(
            &access,
            &peer,
            "x",
            Some(&team_a),
            Some((BTreeMap::new(), true)),
        )
        .unwrap_err();
        assert!(e.starts_with("job `x` runs under no labels: "), "{e}");
        assert!(
            check_claim(
                &access,
                &peer,
                "x",
                Some(&team_a),
                Some((BTreeMap::new(), false))
            )
            .is_ok()
        );
    }

    #[test]
    fn samples_larger_than_the_budget_are_read_over_it_one_at_a_time() {
        let memory = Memory::new(100);
        assert!(!memory.try_reserve(150, false));
        assert!(memory.try_reserve(150, true), "alone, over the budget");
        assert!(
            !memory.try_reserve(150, true),
            "a second waits for the first to go"
        );
        assert!(!memory.try_reserve(1, false));
        memory.release(150);
        assert!(memory.try_reserve(60, false));
        assert!(
            memory.try_reserve(150, true),
            "within the budget, one may go over it"
        );
        assert!(
            !memory.try_reserve(30, true),
            "a sample the budget can hold waits for room"
        );
        assert_eq!(memory.used(), 210);
    }

    #[test]
    fn answers_by_name_hold_half_the_budget_or_one_larger_alone() {
        let memory = Memory::new(100);
        assert_eq!(memory.try_hold_answer(30), Ok(()));
        assert_eq!(memory.try_hold_answer(20), Ok(()));
        assert_eq!(
            memory.try_hold_answer(1),
            Err(50),
            "half the budget is on its way: the next waits"
        );
        assert_eq!(memory.try_hold_answer(0), Ok(()));
        assert_eq!(
            memory.try_hold_answer(150),
            Ok(()),
            "a larger answer goes alone, beside the others"
        );
        assert_eq!(memory.try_hold_answer(51), Err(150));
        memory.drop_answer(150);
        memory.drop_answer(30);
        assert_eq!(memory.try_hold_answer(51), Ok(()));
        assert_eq!(memory.try_hold_answer(30), Ok(()));
    }

    #[test]
    fn a_read_outside_the_readers_goes_over_the_budget_alone_or_after_waiting() {
        let memory = Memory::new(100);
        let (patience, recheck) = (Duration::from_millis(50), Duration::from_millis(1));
        memory.reserve_waiting(60, patience, recheck);
        memory.reserve_waiting(60, patience, recheck);
        assert_eq!(
            memory.used(),
            120,
            "the second went over, nothing else being over"
        );
        let start = Instant::now();
        memory.reserve_waiting(10, patience, recheck);
        assert!(
            start.elapsed() >= patience,
            "the third waited for the first two"
        );
        assert_eq!(memory.used(), 130);
    }

    #[test]
    fn answers_by_name_over_the_budget_hold_no_other_read_back() {
        let memory = Memory::new(100);
        let (patience, recheck) = (Duration::from_secs(60), Duration::from_millis(1));
        // An answer by name of 150 bytes, read and never taken.
        assert_eq!(memory.try_hold_answer(150), Ok(()));
        memory.reserve_over(150);
        let start = Instant::now();
        memory.reserve_waiting(10, patience, recheck);
        assert!(
            start.elapsed() < patience,
            "waited for the answer nobody takes"
        );
        memory.reserve_waiting(95, patience, recheck);
        assert_eq!(
            memory.used(),
            255,
            "went over the budget, nothing else being over it"
        );
        memory.drop_answer(150);
        memory.release(150);
        let start = Instant::now();
        memory.reserve_waiting(1, Duration::from_millis(50), recheck);
        assert!(
            start.elapsed() >= Duration::from_millis(50),
            "waited for the read over the budget"
        );
    }
}
