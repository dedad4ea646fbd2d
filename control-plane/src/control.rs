//! The control loop: every tick (and when a hello, a job arriving or
//! leaving, or a policy change asks) it marks silent stages lost,
//! estimates each job's demand from the stages' telemetry
//! ([`crate::demand`]), runs the allocation engine ([`crate::compute`]),
//! publishes a new settings version only where a stage's settings changed
//! (beyond [`crate::compute::RATE_TOLERANCE`]), records the allocation for
//! the views and metrics, and announces allocations that changed.
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

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::compute::{JobShare, StageInfo, StageSettings, compute, settle};
use crate::demand::{Demands, Window};
use crate::metrics::Throughput;
use crate::sessions::push;
use crate::state::{
    Allocations, Desired, JobSample, SessionHandle, Shared, Telemetry, lock, read_policies,
};
use crate::store::{Leadership, StoreError};

/// Runs the loop until `cancel` fires (then releases the lease), or until
/// the leader lease is lost: then it fails, and the controller stops
/// rather than push settings another leader may also be pushing.
pub async fn run(
    shared: Arc<Shared>,
    tick: Duration,
    mut leadership: Leadership,
    cancel: CancellationToken,
) -> Result<(), StoreError> {
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
        leadership.check(tick * 3 / 4).await?;
        mark_lost(&shared).await;
        if leading_since.elapsed() >= shared.stage_timeout || all_back(&shared) {
            control(&shared, &mut memory).await;
        }
    }
    if let Err(e) = leadership.release().await {
        warn!(error = %e, "cannot release the leader lease (it ends with the connection)");
    }
    Ok(())
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
        .all(|l| l.lost || (l.session.is_some() && l.previous.is_some()))
}

async fn mark_lost(shared: &Shared) {
    let timeout = shared.stage_timeout;
    let (newly_lost, connected, lost) = {
        let mut live = lock(&shared.live);
        let mut newly = Vec::new();
        for (id, l) in live.iter_mut() {
            if !l.lost && l.last_heard.elapsed() > timeout {
                l.lost = true;
                newly.push(id.clone());
            }
        }
        let lost = live.values().filter(|l| l.lost).count();
        (newly, live.len() - lost, lost)
    };
    shared.metrics.set_stages(connected, lost);
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

/// A stage whose settings must be published.
struct Publish {
    stage: String,
    session: SessionHandle,
    settings: StageSettings,
    document: String,
}

/// One tick's decisions: what to publish, the allocation behind it, and
/// what each job read from storage.
struct Plan {
    publish: Vec<Publish>,
    allocations: Allocations,
    throughput: Throughput,
    pending_stages: usize,
}

/// The jobs of a stage's report that have trainers there. A job without
/// trainers on a stage is not reading there; one without trainers anywhere
/// has left and gives its share back.
fn reading(report: &Telemetry) -> impl Iterator<Item = (&String, &JobSample)> {
    report.jobs.iter().filter(|(_, s)| s.connections > 0)
}

fn plan(shared: &Shared, demands: &mut Demands, exact: bool) -> Plan {
    let mut live = lock(&shared.live);
    let reporting = || {
        live.iter()
            .filter(|(_, l)| !l.lost)
            .filter_map(|(id, l)| Some((id.as_str(), l, l.telemetry.as_ref()?)))
    };
    let mut windows = Vec::new();
    let mut throughput = Throughput::new();
    for (id, l, now) in reporting() {
        let before = l.previous.as_ref();
        let seconds = before.map_or(0.0, |b| (now.unix_millis - b.unix_millis) as f64 / 1000.0);
        for (job, sample) in reading(now) {
            let window = before
                .and_then(|b| b.jobs.get(job))
                .and_then(|b| Window::between(b, sample, seconds, now.unix_millis));
            if let Some(w) = window {
                *throughput.entry(job.clone()).or_default() += w.read_bytes_per_second;
            }
            windows.push((job.as_str(), id, window));
        }
    }
    let estimates = demands.update(windows);
    let stages: Vec<StageInfo<'_>> = reporting()
        .map(|(id, l, now)| StageInfo {
            id,
            node: if l.hello.node.is_empty() {
                id
            } else {
                &l.hello.node
            },
            memory_budget: l.hello.memory_budget_bytes,
            reader_budget: l.hello.reader_budget,
            jobs: reading(now).map(|(j, s)| (j.as_str(), &s.labels)).collect(),
        })
        .collect();
    let policies = read_policies(shared);
    let mut computed = compute(&policies, &stages, estimates);
    drop(stages);
    let desired = lock(&shared.desired);
    let mut publish = Vec::new();
    let mut pending_stages = 0;
    for (stage, l) in live.iter_mut().filter(|(_, l)| !l.lost) {
        let current = desired.get(stage);
        if current.is_some_and(|d| l.running_version < d.version) {
            pending_stages += 1;
        }
        let (Some(session), Some(next)) = (&l.session, computed.settings.remove(stage)) else {
            continue;
        };
        let empty = StageSettings::default();
        let settings = if exact {
            next
        } else {
            settle(current.map_or(&empty, |d| &d.settings), next)
        };
        let document = settings.encode();
        let in_force = current.map_or_else(|| empty.encode(), |d| d.document.clone());
        if document != in_force || l.force_push {
            l.force_push = false;
            publish.push(Publish {
                stage: stage.clone(),
                session: session.clone(),
                settings,
                document,
            });
        }
    }
    Plan {
        publish,
        allocations: Allocations {
            jobs: computed.jobs,
            pools: computed.pools,
            problems: computed.problems,
        },
        throughput,
        pending_stages,
    }
}

/// What the loop carries from tick to tick.
#[derive(Default)]
struct Memory {
    demands: Demands,
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
    let plan = plan(shared, &mut memory.demands, exact);
    for p in plan.publish {
        publish(shared, p).await;
    }
    let metrics = &shared.metrics.allocation;
    metrics.set(&plan.allocations, &plan.throughput);
    metrics
        .pending_stages
        .set(i64::try_from(plan.pending_stages).unwrap_or(i64::MAX));
    let changes = allocation_changes(&mut memory.announced, &plan.allocations.jobs);
    *lock(&shared.allocations) = plan.allocations;
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
        format!("{mib:.1} MiB/s ({})", s.reason)
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

async fn publish(shared: &Shared, p: Publish) {
    let version = match shared
        .store
        .set_desired_settings(&p.stage, &p.document)
        .await
    {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e, stage = %p.stage, "cannot store desired settings");
            return;
        }
    };
    let queued = push(&p.session, version, &p.settings);
    lock(&shared.desired).insert(
        p.stage.clone(),
        Desired {
            version,
            document: p.document,
            settings: p.settings,
        },
    );
    shared.metrics.settings_pushes.inc();
    info!(stage = %p.stage, version, queued, "settings published");
    let message = format!("settings version {version} published to stage {}", p.stage);
    shared
        .event("settings.pushed", format!("stage/{}", p.stage), message)
        .await;
}
