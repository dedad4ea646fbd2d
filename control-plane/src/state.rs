//! What the controller holds in memory, shared by the stage sessions, the
//! control loop, the admin API and the HTTP view: the policy set (mirror of
//! the store's current policies), each stage's live session and latest
//! telemetry (never stored), and each stage's desired settings (mirror of
//! the store's, reloaded at start).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_policy::PolicySet;
use sluice_proto::v1::ControllerMessage;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::compute::{JobShare, PoolShare, StageSettings};
use crate::metrics::Metrics;
use crate::store::{Labels, NewEvent, Store, StoreError};

/// The sending half of one session's downstream.
pub type Downstream = mpsc::Sender<Result<ControllerMessage, tonic::Status>>;

/// One open session.
#[derive(Debug, Clone)]
pub struct SessionHandle {
    /// Distinguishes successive sessions of one stage.
    pub id: u64,
    /// Where settings go.
    pub tx: Downstream,
}

/// What a stage's hello said beyond what the store keeps.
#[derive(Debug, Clone, Default)]
pub struct HelloInfo {
    pub software_version: String,
    pub capabilities: Vec<String>,
    pub datasets: Vec<String>,
    pub memory_budget_bytes: u64,
    pub reader_budget: u32,
    pub node: String,
}

/// One job in one telemetry snapshot.
#[derive(Debug, Clone, Default)]
pub struct JobSample {
    pub labels: Labels,
    pub delivered_bytes: u64,
    pub delivered_samples: u64,
    pub stall_seconds: f64,
    pub connections: u32,
    pub storage_read_bytes: u64,
    pub throttled_seconds: f64,
}

/// One telemetry snapshot of a stage, as the control loop needs it.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    pub unix_millis: i64,
    pub settings_version: u64,
    pub memory_used_bytes: u64,
    pub jobs: BTreeMap<String, JobSample>,
}

/// A stage as the controller sees it now.
#[derive(Debug, Clone)]
pub struct LiveStage {
    /// The open session, if any.
    pub session: Option<SessionHandle>,
    pub hello: HelloInfo,
    /// The latest snapshot.
    pub telemetry: Option<Telemetry>,
    /// The one before it (for rates).
    pub previous: Option<Telemetry>,
    pub last_heard: Instant,
    /// Jobs last recorded in the store for this stage: labels, when.
    pub recorded_jobs: BTreeMap<String, (Labels, Instant)>,
    pub lost: bool,
    /// Push a new version even if the settings did not change (the stage
    /// runs a version the controller does not know).
    pub force_push: bool,
    /// The settings version the stage runs: from its hello, then its acks.
    pub running_version: u64,
}

impl LiveStage {
    fn new(now: Instant) -> Self {
        Self {
            session: None,
            hello: HelloInfo::default(),
            telemetry: None,
            previous: None,
            last_heard: now,
            recorded_jobs: BTreeMap::new(),
            lost: false,
            force_push: false,
            running_version: 0,
        }
    }
}

/// Desired settings of a stage under their version.
#[derive(Debug, Clone)]
pub struct Desired {
    pub version: u64,
    pub document: String,
    pub settings: StageSettings,
}

/// The allocation in force: what the last tick computed, for the views
/// and the metrics.
#[derive(Debug, Clone, Default)]
pub struct Allocations {
    /// Per managed job.
    pub jobs: BTreeMap<String, JobShare>,
    /// Per pool.
    pub pools: BTreeMap<String, PoolShare>,
    /// What the engine could not do as the policies say.
    pub problems: Vec<String>,
}

/// The controller's shared state. Its locks are held briefly and never
/// across an `.await`; when several are needed they are taken in the order
/// `live`, `policies`, `desired`, `allocations`.
#[derive(Debug)]
pub struct Shared {
    pub store: Store,
    pub policies: RwLock<PolicySet>,
    /// Counts policy-set swaps (the control loop pushes exact rates, not
    /// settled ones, after a change).
    pub policy_generation: AtomicU64,
    /// Serializes policy changes (validate against the set, store, swap).
    pub policy_changes: tokio::sync::Mutex<()>,
    pub live: Mutex<BTreeMap<String, LiveStage>>,
    pub desired: Mutex<BTreeMap<String, Desired>>,
    pub allocations: Mutex<Allocations>,
    pub known_jobs: Mutex<BTreeSet<String>>,
    /// Woken on every event appended (for WatchEvents).
    pub events: Notify,
    /// Woken when settings should be recomputed before the next tick.
    pub recompute: Notify,
    pub metrics: Metrics,
    pub ready: AtomicBool,
    pub stage_timeout: Duration,
    /// Fired at shutdown: ends event watches.
    pub shutdown: CancellationToken,
    next_session: AtomicU64,
}

impl Shared {
    /// Returns the state around an opened store.
    pub fn new(store: Store, stage_timeout: Duration) -> Self {
        Self {
            store,
            policies: RwLock::new(PolicySet::new()),
            policy_generation: AtomicU64::new(0),
            policy_changes: tokio::sync::Mutex::new(()),
            live: Mutex::new(BTreeMap::new()),
            desired: Mutex::new(BTreeMap::new()),
            allocations: Mutex::new(Allocations::default()),
            known_jobs: Mutex::new(BTreeSet::new()),
            events: Notify::new(),
            recompute: Notify::new(),
            metrics: Metrics::new(),
            ready: AtomicBool::new(false),
            stage_timeout,
            shutdown: CancellationToken::new(),
            next_session: AtomicU64::new(1),
        }
    }

    /// Reloads desired settings and known stages and jobs from the store.
    /// Stages the store calls connected get a live entry without a session,
    /// so they are marked lost if they do not come back in time.
    pub async fn reload(&self) -> Result<(), StoreError> {
        let stages = self.store.stages().await?;
        let jobs = self.store.jobs().await?;
        let now = Instant::now();
        // Lock order everywhere: live, then policies, then desired.
        let mut live = lock(&self.live);
        let mut desired = lock(&self.desired);
        for s in stages {
            if let Some(d) = s.desired {
                let settings = StageSettings::decode(&d.document).unwrap_or_default();
                desired.insert(
                    s.id.clone(),
                    Desired {
                        version: d.version,
                        document: d.document,
                        settings,
                    },
                );
            }
            if s.state == crate::store::StageState::Connected {
                live.insert(s.id, LiveStage::new(now));
            }
        }
        self.metrics.jobs.set(jobs.len() as i64);
        *lock(&self.known_jobs) = jobs.into_iter().map(|j| j.id).collect();
        Ok(())
    }

    /// Replaces the policy set.
    pub fn set_policies(&self, next: PolicySet) {
        *self
            .policies
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        self.policy_generation.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops every session's sender, which ends its response stream.
    pub fn close_sessions(&self) {
        for l in lock(&self.live).values_mut() {
            l.session = None;
        }
    }

    /// Returns a fresh session id.
    pub fn next_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Returns the live entry of `stage`, created if absent.
    pub fn with_live<T>(&self, stage: &str, f: impl FnOnce(&mut LiveStage) -> T) -> T {
        let mut live = lock(&self.live);
        let entry = live
            .entry(stage.to_owned())
            .or_insert_with(|| LiveStage::new(Instant::now()));
        f(entry)
    }

    /// Appends an event (logging, not failing, when the store refuses) and
    /// wakes the watchers.
    pub async fn event(&self, kind: &str, subject: String, message: String) {
        let event = NewEvent {
            kind: kind.to_owned(),
            subject,
            message,
            unix_millis: now_ms(),
        };
        if let Err(e) = self.store.append_event(&event).await {
            warn!(error = %e, kind, "cannot record an event");
        }
        self.events.notify_waiters();
    }
}

/// Locks a mutex, ignoring poisoning (state stays usable after a panic in
/// another task).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Returns the wall clock in Unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Reads the policy set (never poisoned for long: writers only swap).
pub fn read_policies(shared: &Shared) -> std::sync::RwLockReadGuard<'_, PolicySet> {
    shared
        .policies
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
