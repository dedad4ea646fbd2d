//! The control loop: every tick (and when a hello or a policy change asks)
//! it marks silent stages lost, computes the settings each connected stage
//! should run, and publishes a new version only where they changed.
//!
//! For one stage timeout after start the loop publishes nothing new: the
//! stages of a restarted controller reconnect one by one, and computing
//! before they all reported would split limits among too few stages and
//! publish versions that the next tick takes back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::compute::{JobOnStage, StageSettings, stage_settings};
use crate::sessions::push;
use crate::state::{Desired, SessionHandle, Shared, lock, read_policies};
use crate::store::{Labels, Leadership, StoreError};

/// Runs the loop until `cancel` fires (then releases the lease), or until
/// the leader lease is lost: then it fails, and the controller stops
/// rather than push settings another leader may also be pushing.
pub async fn run(
    shared: Arc<Shared>,
    tick: Duration,
    mut leadership: Leadership,
    cancel: CancellationToken,
) -> Result<(), StoreError> {
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
        if shared.started.elapsed() >= shared.stage_timeout {
            publish(&shared).await;
        }
    }
    if let Err(e) = leadership.release().await {
        warn!(error = %e, "cannot release the leader lease (it ends with the connection)");
    }
    Ok(())
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

fn plan(shared: &Shared) -> Vec<Publish> {
    let mut live = lock(&shared.live);
    // How many live stages serve each job, and with which labels.
    let mut jobs: BTreeMap<String, (Labels, usize)> = BTreeMap::new();
    for l in live.values().filter(|l| !l.lost) {
        for (job, sample) in l.telemetry.iter().flat_map(|t| &t.jobs) {
            let entry = jobs
                .entry(job.clone())
                .or_insert_with(|| (sample.labels.clone(), 0));
            entry.1 += 1;
        }
    }
    let policies = read_policies(shared);
    let desired = lock(&shared.desired);
    let mut out = Vec::new();
    for (stage, l) in live.iter_mut() {
        let (Some(session), Some(telemetry)) = (&l.session, &l.telemetry) else {
            continue;
        };
        let on_stage = telemetry.jobs.iter().map(|(job, sample)| {
            let (labels, stages) = jobs.get(job).map_or((&sample.labels, 1), |(l, n)| (l, *n));
            JobOnStage {
                job,
                labels,
                stages,
            }
        });
        let settings = stage_settings(&policies, l.hello.memory_budget_bytes, on_stage);
        let document = settings.encode();
        let current = desired
            .get(stage)
            .map_or_else(|| StageSettings::default().encode(), |d| d.document.clone());
        if document != current || l.force_push {
            l.force_push = false;
            out.push(Publish {
                stage: stage.clone(),
                session: session.clone(),
                settings,
                document,
            });
        }
    }
    out
}

async fn publish(shared: &Shared) {
    for p in plan(shared) {
        let version = match shared
            .store
            .set_desired_settings(&p.stage, &p.document)
            .await
        {
            Ok(v) => v,
            Err(e) => {
                warn!(error = %e, stage = %p.stage, "cannot store desired settings");
                continue;
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
}
