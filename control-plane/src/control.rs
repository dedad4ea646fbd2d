//! The control loop: every tick (and when a hello, a job arriving or
//! leaving, or a policy change asks) it marks silent stages lost, turns
//! the stages' latest telemetry into windows, asks the policy crate's
//! [`Coordinator`] what every stage should enforce (demand estimation,
//! allocation, loans: all pure, shared with `sluicectl simulate`),
//! publishes a new settings version only where [`to_push`] says a stage's
//! settings changed enough, records the shares for the views and metrics,
//! and announces allocations that changed.
//!
//! Until every stage the store listed as connected has reconnected and
//! reported twice (at most one stage timeout after the loop starts: at
//! start, or when a standby takes over) it publishes nothing new: the
//! stages of a restarted controller reconnect one by one, and computing
//! before they all reported would split limits among too few stages and
//! publish versions that the next tick takes back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sluice_policy::STAGING_LABEL;
use sluice_policy::coordination::demand::Window;
use sluice_policy::coordination::{
    Coordinator, JobReport, JobShare, Shares, StageAssignment, StageReport, cache_assignment,
    to_push,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::metrics::Throughput;
use crate::sessions::push;
use crate::state::{Desired, LiveStage, SessionHandle, Shared, lock, now_ms};
use crate::store::{Labels, Leadership, NewEvent, Record, StageHello, StoreError};

/// How the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// `cancel` fired (the lease was released).
    Cancelled,
    /// The store was unreachable, and once it answered again another
    /// replica held the lease: this one must stand by.
    Deposed,
}

/// Runs the loop until `cancel` fires (then releases the lease). When the
/// lease check fails the store is unreachable: the loop rides the outage
/// out (see [`ride_out`]) and leads on once it holds the lease again.
pub async fn run(
    shared: Arc<Shared>,
    tick: Duration,
    mut leadership: Leadership,
    cancel: CancellationToken,
) -> Ended {
    // Policies loaded at start are not a change: settled rates stand.
    let mut memory = Memory {
        generation: Some(shared.policy_generation.load(Ordering::Relaxed)),
        ..Memory::default()
    };
    // A controller started fresh and a standby taking over alike: leading
    // starts now.
    let leading_since = Instant::now();
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = interval.tick() => {}
            () = shared.recompute.notified() => {}
        }
        if let Err(e) = leadership.check(tick).await {
            match ride_out(&shared, tick, &e, &cancel).await {
                Some(Ok(lease)) => leadership = lease,
                Some(Err(ended)) => return ended,
                None => return Ended::Cancelled,
            }
        }
        let started = Instant::now();
        mark_lost(&shared).await;
        if leading_since.elapsed() >= shared.stage_timeout
            || all_back(&shared)
            || a_job_waits(&shared)
        {
            control(&shared, &mut memory).await;
        }
        shared
            .metrics
            .tick_seconds
            .observe(started.elapsed().as_secs_f64());
    }
    if let Err(e) = leadership.release().await {
        warn!(error = %e, "cannot release the leader lease (it ends with the connection)");
    }
    Ended::Cancelled
}

/// Rides out a store outage. Stage sessions stay open and stages keep
/// their settings; nothing is decided or published (it could not be
/// stored); `/readyz`, the admin API and new sessions answer with the
/// reason. Every tick the lease is tried on a fresh connection: taken,
/// the controller reloads the store and leads on (`Some(Ok)`); held by
/// another replica, it must stand by (`Some(Err(Deposed))`). `None` when
/// `cancel` fires first.
async fn ride_out(
    shared: &Shared,
    tick: Duration,
    error: &StoreError,
    cancel: &CancellationToken,
) -> Option<Result<Leadership, Ended>> {
    let since = Instant::now();
    warn!(error = %error, "the store is unreachable: keeping stage sessions and their settings, refusing changes until it answers");
    let set_reason = |error: &dyn std::fmt::Display| {
        *lock(&shared.outage) = Some(format!(
            "store unavailable: {error}; stages keep their settings, policy changes and new \
             stage sessions are refused until it answers"
        ));
    };
    set_reason(error);
    shared.metrics.store_up.set(0);
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return None,
            _ = interval.tick() => {}
        }
        let attempt = tokio::time::timeout(tick.max(Duration::from_secs(1)), async {
            let lease = shared
                .store
                .try_acquire_leadership()
                .await
                .map_err(|e| e.to_string())?;
            if lease.is_some() {
                // The stages still in session are connected whatever the
                // store says now; then whatever another leader may have
                // changed is loaded.
                for hello in in_session(shared) {
                    shared
                        .store
                        .stage_hello(&hello, now_ms())
                        .await
                        .map_err(|e| e.to_string())?;
                }
                shared.reload().await.map_err(|e| e.to_string())?;
                crate::policies::load(shared).await?;
            }
            Ok::<_, String>(lease)
        })
        .await;
        match attempt {
            Ok(Ok(Some(lease))) => {
                // A session's messages wait while their store writes do
                // (a job's sighting, an event): the stages in session went
                // unheard because of the store, not of their own doing.
                // Their timeout starts over, so the first lost check after
                // the outage does not find them silent.
                for l in lock(&shared.live).values_mut() {
                    if l.session.is_some() {
                        l.last_heard = Instant::now();
                    }
                }
                *lock(&shared.outage) = None;
                shared.metrics.store_up.set(1);
                info!(
                    seconds = since.elapsed().as_secs_f64(),
                    "the store answers again: leading on"
                );
                shared
                    .event(
                        "store.recovered",
                        "controller".to_owned(),
                        format!(
                            "the store answered again after {:.1} s",
                            since.elapsed().as_secs_f64()
                        ),
                    )
                    .await;
                return Some(Ok(lease));
            }
            Ok(Ok(None)) => return Some(Err(Ended::Deposed)),
            Ok(Err(e)) => set_reason(&e),
            Err(_) => set_reason(&"the store does not answer"),
        }
    }
}

/// The hellos of the stages in session now, as the store records them.
fn in_session(shared: &Shared) -> Vec<StageHello> {
    lock(&shared.live)
        .iter()
        .filter(|(_, l)| l.session.is_some())
        .map(|(id, l)| StageHello {
            id: id.clone(),
            node: l.hello.node.clone(),
            labels: l.hello.labels.clone(),
            running_version: l.running_version,
        })
        .collect()
}

/// Whether every stage the store listed as connected at start (and every
/// stage connected since) has reconnected and reported twice, so that its
/// jobs' demand is measured, or was marked lost: then there is nobody left
/// to wait for, and computing now gives what the controller computed
/// before it stopped (a job without a measured window would count as
/// greedy and move everyone's share for a tick). With a fresh store and no
/// stage yet that is at once.
fn all_back(shared: &Shared) -> bool {
    lock(&shared.live)
        .values()
        .all(|l| l.lost || l.stopped() || (l.session.is_some() && l.has_window()))
}

/// Whether a job reads on a stage whose settings do not name it yet: its
/// stage holds it at the gate for at most half a second, then lets it read
/// unlimited, so it is not kept waiting for every stage to be back (a job
/// started right after its stage, within a stage's first reports, waited
/// for the stage's first measured window and read past its limit). Jobs
/// the stages had before the controller started are named in the settings
/// it reloaded.
fn a_job_waits(shared: &Shared) -> bool {
    let live = lock(&shared.live);
    let desired = lock(&shared.desired);
    live.iter()
        .filter(|(_, l)| l.session.is_some())
        .any(|(id, l)| {
            let named = |job: &String| {
                desired.get(id).is_some_and(|d| {
                    d.settings.jobs.contains_key(job) || d.settings.unmanaged.contains(job)
                })
            };
            l.serving().any(|job| !named(job))
        })
}

async fn mark_lost(shared: &Shared) {
    let timeout = shared.stage_timeout;
    let (left, newly_lost) = {
        let mut live = lock(&shared.live);
        // Stages that ended their sessions and did not come back: they
        // left (a sidecar whose training finished, a drained node), and
        // are forgotten rather than counted lost.
        let left: Vec<String> = live
            .iter()
            .filter(|(_, l)| l.session.is_none() && l.left.is_some_and(|t| t.elapsed() > timeout))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &left {
            live.remove(id);
        }
        let mut desired = lock(&shared.desired);
        for id in &left {
            desired.remove(id);
        }
        drop(desired);
        let mut newly = Vec::new();
        for (id, l) in live.iter_mut() {
            // One that ended its session itself is waited for as left
            // (its last report came before its session ended, so its
            // silence would pass the timeout first).
            let ended = l.stopped();
            if !l.lost && !ended && l.last_heard.elapsed() > timeout {
                l.lost = true;
                newly.push(id.clone());
            }
        }
        (left, newly)
    };
    shared.count_stages();
    shared.metrics.jobs.set(running_jobs(shared) as i64);
    for id in left {
        info!(stage = %id, "stage ended its session and did not come back: forgotten");
        if let Err(e) = shared.store.forget_stage(&id).await {
            warn!(error = %e, stage = %id, "cannot forget the stage");
        }
        let message = format!("stage {id} ended its session and left");
        shared
            .event("stage.left", format!("stage/{id}"), message)
            .await;
    }
    forget_unseen(shared).await;
    for id in newly_lost {
        warn!(stage = %id, "stage silent past the timeout: marked lost");
        if let Err(e) = shared.store.mark_stage_lost(&id).await {
            warn!(error = %e, stage = %id, "cannot mark the stage lost");
        }
        let message = format!("stage {id} silent for more than {timeout:?}");
        shared
            .event("stage.lost", format!("stage/{id}"), message)
            .await;
    }
}

/// How many jobs the stages in session serve now (trainers connected).
fn running_jobs(shared: &Shared) -> usize {
    let live = lock(&shared.live);
    let serving = live.values().flat_map(LiveStage::serving);
    serving.collect::<std::collections::BTreeSet<_>>().len()
}

/// How long a lost stage, or a job no stage reports, is remembered.
pub const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// Forgets, once a minute, lost stages and jobs not seen for
/// [`FORGET_AFTER`]: a node drained for good, a job that ended.
async fn forget_unseen(shared: &Shared) {
    {
        let mut last = lock(&shared.forgot_at);
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            return;
        }
        *last = Some(Instant::now());
    }
    let before_ms = crate::state::now_ms() - FORGET_AFTER.as_millis() as i64;
    let forgotten = match shared
        .store
        .forget_unseen(before_ms, crate::store::KEPT_EVENTS)
        .await
    {
        Ok(forgotten) => forgotten,
        Err(e) => {
            warn!(error = %e, "cannot forget stages and jobs not seen for long");
            return;
        }
    };
    {
        let mut live = lock(&shared.live);
        for id in &forgotten.stages {
            if live.get(id).is_some_and(|l| l.lost) {
                live.remove(id);
            }
        }
        let mut known = lock(&shared.known_jobs);
        for id in &forgotten.jobs {
            known.remove(id);
        }
    }
    let after = format!("{} h", FORGET_AFTER.as_secs() / 3600);
    for id in forgotten.stages {
        let message = format!("stage {id} lost for more than {after}: forgotten");
        shared
            .event("stage.forgotten", format!("stage/{id}"), message)
            .await;
    }
    for id in forgotten.jobs {
        let message = format!("job {id} not seen for more than {after}: forgotten");
        shared
            .event("job.forgotten", format!("job/{id}"), message)
            .await;
    }
}

/// A stage whose settings must be published.
struct Publish {
    stage: String,
    session: SessionHandle,
    settings: StageAssignment,
}

/// One tick's outcome: what to publish, the shares behind it, and what
/// each job read from storage.
struct Outcome {
    publish: Vec<Publish>,
    shares: Shares,
    throughput: Throughput,
    pending_stages: usize,
}

/// A reporting stage as the coordinator reads it, copied out of the live
/// state so the decision runs without holding the lock the sessions need.
pub(crate) struct Report {
    id: String,
    node: String,
    memory_budget: u64,
    reader_budget: u32,
    /// Each job reading there: id, labels, its latest window.
    jobs: Vec<(String, Arc<Labels>, Option<Window>)>,
}

impl Report {
    pub(crate) fn view(&self) -> StageReport<'_> {
        StageReport {
            id: &self.id,
            node: &self.node,
            memory_budget: self.memory_budget,
            reader_budget: self.reader_budget,
            jobs: self
                .jobs
                .iter()
                .map(|(id, labels, window)| JobReport {
                    id,
                    labels: labels.as_ref(),
                    window: *window,
                })
                .collect(),
        }
    }
}

/// Returns every reporting stage with its jobs, each with the window
/// between the stage's last two reports, and what each job read from
/// storage over those windows.
pub(crate) fn reports(live: &BTreeMap<String, LiveStage>) -> (Vec<Report>, Throughput) {
    let mut throughput = Throughput::new();
    let mut reports = Vec::with_capacity(live.len());
    // A stage that ended its session (stopped) reads for nobody now: its
    // jobs' shares go to the stages that remain at once, not when it is
    // forgotten.
    for (id, l) in live.iter().filter(|(_, l)| !l.lost && !l.stopped()) {
        let Some(now) = l.latest() else {
            continue;
        };
        let jobs = now
            .reading()
            .map(|(job, sample)| {
                let window = l.window(job).map(|(w, _)| w);
                if let Some(w) = window {
                    *throughput.entry(job.clone()).or_default() += w.read_bytes_per_second;
                }
                (job.clone(), sample.labels.clone(), window)
            })
            .collect();
        let node = if l.hello.node.is_empty() {
            id
        } else {
            &l.hello.node
        };
        reports.push(Report {
            id: id.clone(),
            node: node.clone(),
            memory_budget: l.hello.memory_budget_bytes,
            reader_budget: l.hello.reader_budget,
            jobs,
        });
    }
    (reports, throughput)
}

/// Decides this tick: what every connected stage should run, and which of
/// them must be sent a new version. The live state is locked only to copy
/// the reports out and to compare the decision with what stages run: the
/// decision itself (tens of milliseconds per thousand stages) runs
/// unlocked, so sessions keep being served meanwhile.
fn decide(shared: &Shared, coordinator: &mut Coordinator, exact: bool) -> Outcome {
    let (reports, throughput) = reports(&lock(&shared.live));
    let policies = shared.read_policies().clone();
    let views: Vec<StageReport<'_>> = reports.iter().map(Report::view).collect();
    let decision = coordinator.decide(&policies, &views);
    drop(views);
    drop(reports);
    let rounds = lock(&shared.staging_rounds).clone();
    let mut live = lock(&shared.live);
    let desired = lock(&shared.desired);
    let mut assignments = decision.assignments;
    let mut publish = Vec::new();
    let mut pending_stages = 0;
    for (stage, l) in live.iter_mut().filter(|(_, l)| !l.lost) {
        let in_force = desired.get(stage);
        if in_force.is_some_and(|d| l.running_version < d.version) {
            pending_stages += 1;
        }
        let (Some(session), Some(mut next)) = (&l.session, assignments.remove(stage)) else {
            continue;
        };
        next.cache = cache_assignment(&policies, &l.hello.datasets, trainers_read(l), &rounds);
        let settings = match to_push(in_force.map(|d| &d.settings), next, exact) {
            Some(settings) => settings,
            // The stage runs a version the controller does not know: send
            // the one in force again.
            None if l.force_push => in_force.map(|d| d.settings.clone()).unwrap_or_default(),
            None => continue,
        };
        l.force_push = false;
        publish.push(Publish {
            stage: stage.clone(),
            session: session.clone(),
            settings,
        });
    }
    Outcome {
        publish,
        shares: decision.shares,
        throughput,
        pending_stages,
    }
}

/// Whether trainers read on a stage now (its staging jobs aside).
fn trainers_read(stage: &LiveStage) -> bool {
    stage.latest().is_some_and(|t| {
        t.reading()
            .any(|(_, sample)| !sample.labels.contains_key(STAGING_LABEL))
    })
}

/// What the loop carries from tick to tick.
#[derive(Default)]
struct Memory {
    coordinator: Coordinator,
    /// The allocations last announced, per job.
    announced: BTreeMap<String, JobShare>,
    /// The policy generation last computed with.
    generation: Option<u64>,
}

/// Computes, publishes what changed, and records the allocation.
async fn control(shared: &Shared, memory: &mut Memory) {
    // After a policy change the rates go out as computed: a new limit must
    // hold exactly, not within the tolerance.
    let generation = shared.policy_generation.load(Ordering::Relaxed);
    let exact = memory.generation != Some(generation);
    memory.generation = Some(generation);
    let outcome = decide(shared, &mut memory.coordinator, exact);
    publish(shared, outcome.publish).await;
    let metrics = &shared.metrics.allocation;
    metrics.set(&outcome.shares, &outcome.throughput);
    metrics
        .pending_stages
        .set(i64::try_from(outcome.pending_stages).unwrap_or(i64::MAX));
    let changes = allocation_changes(&mut memory.announced, &outcome.shares.jobs);
    let appeared: Vec<String> = {
        let mut shares = lock(&shared.shares);
        let appeared = outcome
            .shares
            .problems
            .iter()
            .filter(|p| !shares.problems.contains(p))
            .cloned()
            .collect();
        *shares = outcome.shares;
        appeared
    };
    // Each problem once, when it appears (the alert and the pool's view
    // say it is still there).
    for problem in appeared {
        warn!("the allocation cannot follow the policies: {problem}");
    }
    for (job, message) in changes {
        metrics.changes.inc();
        info!(job, "{message}");
        shared
            .event("allocation.changed", format!("job/{job}"), message)
            .await;
    }
}

/// An allocation is announced again when its reason changes or its rate
/// moves by more than this fraction of the one announced.
const ANNOUNCE: f64 = 0.10;

/// Returns the jobs whose allocation changed enough to announce, with a
/// message each, and remembers what was announced.
fn allocation_changes(
    announced: &mut BTreeMap<String, JobShare>,
    jobs: &BTreeMap<String, JobShare>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let describe = |s: &JobShare| {
        let mib = s.bytes_per_second / (1024.0 * 1024.0);
        format!("{mib:.1} MiB/s ({})", s.reason.as_str())
    };
    for (job, share) in jobs {
        let message = match announced.get(job) {
            None => format!("job {job} in pool {}: {}", share.pool, describe(share)),
            Some(before)
                if before.reason != share.reason
                    || before.pool != share.pool
                    || (share.bytes_per_second - before.bytes_per_second).abs()
                        > ANNOUNCE * before.bytes_per_second =>
            {
                format!(
                    "job {job} in pool {}: {}, was {}",
                    share.pool,
                    describe(share),
                    describe(before)
                )
            }
            Some(_) => continue,
        };
        announced.insert(job.clone(), share.clone());
        out.push((job.clone(), message));
    }
    announced.retain(|job, before| {
        let kept = jobs.contains_key(job);
        if !kept {
            let message = format!("job {job} no longer draws from pool {}", before.pool);
            out.push((job.clone(), message));
        }
        kept
    });
    out
}

/// Stores the new desired settings of every stage in `publish` in one
/// transaction, pushes each, and records an event for each.
async fn publish(shared: &Shared, publish: Vec<Publish>) {
    if publish.is_empty() {
        return;
    }
    let writes: Vec<Record> = publish
        .iter()
        .map(|p| Record::Desired {
            stage: p.stage.clone(),
            document: p.settings.encode(),
        })
        .collect();
    let versions = match shared.store.record(&writes).await {
        Ok(versions) => versions,
        Err(e) => {
            warn!(error = %e, stages = publish.len(), "cannot store desired settings");
            return;
        }
    };
    let mut events = Vec::with_capacity(publish.len());
    let mut pushed = 0_usize;
    {
        let mut desired = lock(&shared.desired);
        for (p, version) in publish.into_iter().zip(versions) {
            let version = match version {
                Ok(v) => v,
                Err(e) => {
                    warn!(error = %e, stage = %p.stage, "cannot store desired settings");
                    continue;
                }
            };
            let queued = push(&p.session, version, &p.settings);
            debug!(stage = %p.stage, version, queued, "settings published");
            pushed += 1;
            let message = format!("settings version {version} published to stage {}", p.stage);
            events.push(NewEvent {
                kind: "settings.pushed".into(),
                subject: format!("stage/{}", p.stage),
                message,
                unix_millis: now_ms(),
            });
            desired.insert(
                p.stage,
                Desired {
                    version,
                    settings: p.settings,
                },
            );
        }
    }
    shared.metrics.settings_pushes.inc_by(pushed as u64);
    info!(stages = pushed, "settings published");
    shared.events(events).await;
}
