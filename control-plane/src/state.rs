//! What the controller holds in memory, shared by the stage sessions, the
//! control loop, the admin API and the HTTP view: the policy set (mirror of
//! the store's current policies), each stage's live session and latest
//! telemetry (never stored), and each stage's desired settings (mirror of
//! the store's, reloaded at start).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_policy::PolicySet;
use sluice_policy::coordination::demand::{JobCounters, Window};
use sluice_policy::coordination::{PRELOAD_ROUND, Shares, StageAssignment};
use sluice_proto::v1::ControllerMessage;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::metrics::Metrics;
use crate::recorder::Recorder;
use crate::store::{Labels, NewEvent, Record, Store, StoreError};
pub use crate::sync::lock;

/// The sending half of one session's downstream.
pub type Downstream = mpsc::Sender<Result<ControllerMessage, tonic::Status>>;

/// One open session.
#[derive(Debug, Clone)]
pub struct SessionHandle {
    /// Distinguishes successive sessions of one stage.
    pub id: u64,
    /// Where settings go.
    pub tx: Downstream,
    /// Where the stage connected from, when known.
    pub peer: Option<SocketAddr>,
    /// Cancelled to end the session (a silent one that a new hello of its
    /// stage replaced).
    pub ended: CancellationToken,
}

impl SessionHandle {
    /// Whether the session still holds its stage id: its stream is open
    /// and the stage was heard from within `timeout` (a session silent
    /// longer is likely a dead connection nobody closed).
    pub fn holds(&self, last_heard: Instant, timeout: Duration) -> bool {
        !self.tx.is_closed() && last_heard.elapsed() < timeout
    }
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
    pub labels: Labels,
}

impl From<sluice_proto::v1::Hello> for HelloInfo {
    fn from(hello: sluice_proto::v1::Hello) -> Self {
        Self {
            software_version: hello.software_version,
            capabilities: hello.capabilities,
            datasets: hello.datasets,
            memory_budget_bytes: hello.memory_budget_bytes,
            reader_budget: hello.reader_budget,
            node: hello.node,
            labels: hello.labels,
        }
    }
}

/// One job in one telemetry snapshot.
#[derive(Debug, Clone, Default)]
pub struct JobSample {
    /// Shared with the stage's earlier reports while they do not change.
    pub labels: Arc<Labels>,
    /// What demand estimation compares from one report to the next.
    pub counters: JobCounters,
    /// The limits in force on the stage (bytes and operations per second;
    /// `None`: unlimited), as it reported them: its own (`--rate-limit`)
    /// where the controller pushed none for the job.
    pub in_force: (Option<u64>, Option<u64>),
}

/// One telemetry snapshot of a stage, as the control loop needs it.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    pub unix_millis: i64,
    pub memory_used_bytes: u64,
    pub jobs: BTreeMap<String, JobSample>,
    /// The stage's node cache, as it reported it.
    pub cache: Option<sluice_proto::v1::CacheTelemetry>,
}

impl Telemetry {
    /// The jobs of the report that have trainers on the stage. A job
    /// without trainers on a stage is not reading there; one without
    /// trainers anywhere has left and gives its share back.
    pub fn reading(&self) -> impl Iterator<Item = (&String, &JobSample)> {
        self.jobs.iter().filter(|(_, s)| s.counters.connections > 0)
    }
}

/// A stage as the controller sees it now.
#[derive(Debug, Clone)]
pub struct LiveStage {
    /// The open session, if any.
    pub session: Option<SessionHandle>,
    pub hello: HelloInfo,
    /// Recent reports, oldest first: the latest and every one back to the
    /// newest that is at least [`MIN_WINDOW_MS`] older (see
    /// [`LiveStage::window`]).
    reports: VecDeque<Telemetry>,
    pub last_heard: Instant,
    /// When telemetry last came (Unix milliseconds, the controller's clock).
    pub heard_ms: i64,
    /// When the stage was last recorded as seen in the store.
    pub seen_recorded: Option<Instant>,
    /// Jobs last recorded in the store for this stage: labels, when.
    pub recorded_jobs: BTreeMap<String, (Arc<Labels>, Instant)>,
    pub lost: bool,
    /// When the stage ended its session itself (a stage that stops ends
    /// its stream; one that dies or is cut off goes silent): if it does
    /// not come back within the stage timeout it left, and is forgotten.
    pub left: Option<Instant>,
    /// Push a new version even if the settings did not change (the stage
    /// runs a version the controller does not know).
    pub force_push: bool,
    /// The settings version the stage runs: from its hello, then its acks.
    pub running_version: u64,
}

/// Reports are compared over at least this long. A stage reports every
/// half second and at once when a job starts or leaves; a window between a
/// periodic report and one sent a few milliseconds later says nothing
/// about a rate, so a window ends at the latest report and starts at the
/// newest one at least this much older.
pub const MIN_WINDOW_MS: i64 = 400;

/// What `sluicectl` and the REST API show is measured over about this
/// long: a throttled job that gets a sample a second would otherwise show
/// as idle in one half-second window and as twice its rate in the next.
pub const SHOWN_WINDOW_MS: i64 = 5000;

impl LiveStage {
    /// Returns the latest report.
    pub fn latest(&self) -> Option<&Telemetry> {
        self.reports.back()
    }

    /// Whether the stage ended its session itself and has not opened a
    /// new one (it is stopping or restarting; shown as `stopped`).
    pub fn stopped(&self) -> bool {
        self.session.is_none() && self.left.is_some()
    }

    /// The jobs the stage serves now: those its latest report shows
    /// reading, unless it was lost or ended its session (its last report
    /// is then no longer true).
    pub fn serving(&self) -> impl Iterator<Item = &String> {
        self.latest()
            .filter(|_| !self.lost && self.left.is_none())
            .into_iter()
            .flat_map(|t| t.reading().map(|(job, _)| job))
    }

    /// Whether the stage serves `job` now (see [`LiveStage::serving`]).
    pub fn serves(&self, job: &str) -> bool {
        self.serving().any(|j| j == job)
    }

    /// Keeps a new report, forgetting those no window will start at.
    pub fn record(&mut self, report: Telemetry) {
        self.reports.push_back(report);
        let newest = self.reports.back().map_or(0, |r| r.unix_millis);
        while self
            .reports
            .get(1)
            .is_some_and(|r| newest.saturating_sub(r.unix_millis) >= SHOWN_WINDOW_MS)
        {
            self.reports.pop_front();
        }
    }

    /// Returns the reports a window ends and starts at: the latest, and the
    /// newest at least [`MIN_WINDOW_MS`] older; `None` until there are two.
    fn window_reports(&self) -> Option<(&Telemetry, &Telemetry)> {
        let latest = self.reports.back()?;
        let start = self
            .reports
            .iter()
            .rev()
            .find(|r| latest.unix_millis.saturating_sub(r.unix_millis) >= MIN_WINDOW_MS)?;
        Some((latest, start))
    }

    /// Whether the stage's reports span a window yet.
    pub fn has_window(&self) -> bool {
        self.window_reports().is_some()
    }

    /// Returns what `job` did over the stage's latest window, with the
    /// job's sample in the latest report; the window is `None` when it
    /// cannot be measured (the job is new there, no window yet, or the
    /// stage restarted).
    pub fn window(&self, job: &str) -> Option<(Window, &JobSample)> {
        let (latest, start) = self.window_reports()?;
        Self::between(latest, start, job)
    }

    /// [`LiveStage::window`] over the reports of the last
    /// [`SHOWN_WINDOW_MS`] (at least [`MIN_WINDOW_MS`]), for what people
    /// read: the control loop reacts to the short window, people to a
    /// steady one. Falls back to the short window across a restart of the
    /// stage (its counters start again).
    pub fn shown_window(&self, job: &str) -> Option<(Window, &JobSample)> {
        let (latest, short) = self.window_reports()?;
        // The oldest report the latest compares with: a job that came (or a
        // restart of its stage) within the window is shown over the time
        // since, not over the short window, whose few samples of a slow job
        // read as 0 or twice its rate by turns.
        self.reports
            .iter()
            .take_while(|r| r.unix_millis <= short.unix_millis)
            .find_map(|r| Self::between(latest, r, job))
    }

    fn between<'a>(
        latest: &'a Telemetry,
        start: &Telemetry,
        job: &str,
    ) -> Option<(Window, &'a JobSample)> {
        let now = latest.jobs.get(job)?;
        let before = start.jobs.get(job)?;
        let seconds = latest.unix_millis.saturating_sub(start.unix_millis) as f64 / 1000.0;
        let window = Window::between(&before.counters, &now.counters, seconds, latest.unix_millis)?;
        Some((window, now))
    }

    /// Records the stage's acknowledgement of settings `version` (acks of
    /// older versions may arrive late and change nothing).
    pub fn acked(&mut self, version: u64) {
        self.running_version = self.running_version.max(version);
    }

    pub(crate) fn new(now: Instant) -> Self {
        Self {
            session: None,
            hello: HelloInfo::default(),
            reports: VecDeque::new(),
            last_heard: now,
            heard_ms: 0,
            seen_recorded: None,
            recorded_jobs: BTreeMap::new(),
            lost: false,
            left: None,
            force_push: false,
            running_version: 0,
        }
    }
}

/// Desired settings of a stage under their version.
#[derive(Debug, Clone)]
pub struct Desired {
    pub version: u64,
    pub settings: StageAssignment,
}

/// The controller's shared state. Its locks are held briefly and never
/// across an `.await`; when several are needed they are taken in the order
/// `live`, `policies`, `desired`, `shares`.
#[derive(Debug)]
pub struct Shared {
    pub store: Store,
    /// Batches what sessions report into the store (see [`Recorder`]).
    pub recorder: Recorder,
    pub policies: RwLock<PolicySet>,
    /// Counts policy-set swaps (the control loop pushes exact rates, not
    /// settled ones, after a change).
    pub policy_generation: AtomicU64,
    /// Serializes policy changes (validate against the set, store, swap).
    pub policy_changes: tokio::sync::Mutex<()>,
    pub live: Mutex<BTreeMap<String, LiveStage>>,
    pub desired: Mutex<BTreeMap<String, Desired>>,
    /// What the last tick computed, for the views and the metrics.
    pub shares: Mutex<Shares>,
    pub known_jobs: Mutex<BTreeSet<String>>,
    /// When stages and jobs not seen for long were last forgotten.
    pub forgot_at: Mutex<Option<Instant>>,
    /// The staging round operators last asked for, per data set (kept in
    /// memory: stages remember the rounds they ran).
    pub staging_rounds: Mutex<BTreeMap<String, u64>>,
    /// Woken on every event appended (for WatchEvents).
    pub events: Notify,
    /// Woken when settings should be recomputed before the next tick.
    pub recompute: Notify,
    pub metrics: Metrics,
    pub ready: AtomicBool,
    /// While the leader cannot reach its store: why, for `/readyz`, the
    /// admin API and new sessions (stage sessions already open are kept).
    pub outage: Mutex<Option<String>>,
    pub stage_timeout: Duration,
    /// Fired at shutdown: ends event watches.
    pub shutdown: CancellationToken,
    next_session: AtomicU64,
}

impl Shared {
    /// Returns the state around an opened store.
    /// Starts the recorder's task, so it must run inside the runtime.
    pub fn new(store: Store, stage_timeout: Duration) -> Self {
        Self {
            recorder: Recorder::start(store.clone()),
            store,
            policies: RwLock::new(PolicySet::new()),
            policy_generation: AtomicU64::new(0),
            policy_changes: tokio::sync::Mutex::new(()),
            live: Mutex::new(BTreeMap::new()),
            desired: Mutex::new(BTreeMap::new()),
            shares: Mutex::new(Shares::default()),
            known_jobs: Mutex::new(BTreeSet::new()),
            forgot_at: Mutex::new(None),
            staging_rounds: Mutex::new(BTreeMap::new()),
            events: Notify::new(),
            recompute: Notify::new(),
            metrics: Metrics::new(),
            ready: AtomicBool::new(false),
            outage: Mutex::new(None),
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
        // The staging rounds asked before: each stage's settings carry the
        // round of every data set it stages (a leader that starts over
        // showed "never", and sent new stages no round).
        let mut rounds: BTreeMap<String, u64> = BTreeMap::new();
        for s in stages {
            if let Some(d) = s.desired {
                let settings = StageAssignment::decode(&d.document).unwrap_or_default();
                for (name, cache) in &settings.cache {
                    if cache.staging_round > PRELOAD_ROUND {
                        let round = rounds.entry(name.clone()).or_default();
                        *round = (*round).max(cache.staging_round);
                    }
                }
                desired.insert(
                    s.id.clone(),
                    Desired {
                        version: d.version,
                        settings,
                    },
                );
            }
            // A stage with a session (a leader that rode out a store
            // outage) keeps it.
            if s.state == crate::store::StageState::Connected {
                // One that ended its session itself (a stop the leader before
                // saw) left unless it comes back within the stage timeout,
                // counted from when it ended.
                // A mark older than the stage's last sighting is stale (a
                // hello to a replica of an earlier release, which does not
                // clear it).
                let ended = s.ended_ms.filter(|&ms| ms >= s.last_seen_ms).map(|ms| {
                    let ago = u64::try_from(now_ms().saturating_sub(ms)).unwrap_or(0);
                    now.checked_sub(Duration::from_millis(ago)).unwrap_or(now)
                });
                let stage = live.entry(s.id).or_insert_with(|| LiveStage::new(now));
                if stage.session.is_none() {
                    stage.left = stage.left.or(ended);
                }
            } else if s.state == crate::store::StageState::Lost {
                // Still lost (until it comes back or is forgotten): counted
                // so in the stage gauges, which a restart had at none (the
                // `SluiceStageLost` alert cleared and started over).
                live.entry(s.id).or_insert_with(|| LiveStage {
                    lost: true,
                    ..LiveStage::new(now)
                });
            }
        }
        *lock(&self.known_jobs) = jobs.into_iter().map(|j| j.id).collect();
        drop(desired);
        drop(live);
        let mut asked = lock(&self.staging_rounds);
        for (name, round) in rounds {
            let known = asked.entry(name).or_default();
            *known = (*known).max(round);
        }
        Ok(())
    }

    /// Reads the policy set.
    pub fn read_policies(&self) -> std::sync::RwLockReadGuard<'_, PolicySet> {
        crate::sync::read(&self.policies)
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

    /// Ends every stage session and forgets the stages and their desired
    /// settings: a leader that finds another one in office stands by, and
    /// its stages reconnect to the leader.
    pub fn forget_stages(&self) {
        let mut live = lock(&self.live);
        for l in live.values() {
            if let Some(session) = &l.session {
                session.ended.cancel();
            }
        }
        live.clear();
        lock(&self.desired).clear();
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

    /// Sets the stage gauges (`sluice_controller_stages{state}`) from the
    /// live stages: at every tick, and at once when a session starts or
    /// ends, so that a stage stopped is not shown connected for a tick.
    pub fn count_stages(&self) {
        let (connected, stopped, lost) = {
            let live = lock(&self.live);
            let lost = live.values().filter(|l| l.lost).count();
            let stopped = live.values().filter(|l| !l.lost && l.stopped()).count();
            (live.len() - lost - stopped, stopped, lost)
        };
        self.metrics.set_stages(connected, stopped, lost);
    }

    /// Appends events in order (logging, not failing, when the store
    /// refuses) and wakes the watchers once they are committed.
    pub async fn events(&self, mut events: Vec<NewEvent>) {
        let Some(last) = events.pop() else {
            return;
        };
        // Committed in queue order: once the last is, so are the others.
        for event in events {
            self.recorder.send(Record::Event(event));
        }
        let kind = last.kind.clone();
        if let Err(e) = self.recorder.write(Record::Event(last)).await {
            warn!(error = %e, kind, "cannot record an event");
        }
        self.events.notify_waiters();
    }

    /// Appends an event (logging, not failing, when the store refuses) and
    /// wakes the watchers once it is committed.
    pub async fn event(&self, kind: &str, subject: String, message: String) {
        let event = NewEvent {
            kind: kind.to_owned(),
            subject,
            message,
            unix_millis: now_ms(),
        };
        self.events(vec![event]).await;
    }
}

/// Returns the wall clock in Unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
