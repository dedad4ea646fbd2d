//! `sluice.v1.StageService`: one task per stage session. Hello records the
//! stage and re-pushes its desired settings when it runs another version;
//! telemetry is kept in memory (jobs are recorded in the store); acks and
//! nacks are recorded with an event. A failing session ends only itself.
//!
//! A stage id has one session at a time. A hello for an id whose session
//! is open and heard from within the stage timeout is refused with
//! `ALREADY_EXISTS` and a sentence naming where the holder connected from;
//! the holder keeps its session and settings, and the refused stage
//! retries until the holder goes away. A holder silent past the timeout
//! (a dead connection) is replaced.
//!
//! With `--bind-stage-ids` a hello is admitted only for an id the stage's
//! client certificate names (a DNS subject alternative name), so that
//! holding a certificate of the cluster's CA does not let a stage take
//! another's id; a refusal is `PERMISSION_DENIED` with the name to put in
//! the certificate.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls_pki_types::{CertificateDer, ServerName};
use sluice_policy::coordination::demand::{JobCounters, Window};
use sluice_policy::coordination::{JobAssignment, StageAssignment};
use sluice_proto::StageService;
use sluice_proto::v1::{self, ControllerMessage, StageMessage, controller_message, stage_message};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::screen;
use crate::state::{
    Desired, HelloInfo, JobSample, LiveStage, SessionHandle, Shared, Telemetry, lock, now_ms,
};
use crate::store::{JobSighting, Labels, Record, StageHello, check_stage_hello};

/// Messages queued per session before pushes to it are dropped (a stage
/// that does not read its stream cannot hold the control loop up).
const DOWNSTREAM_DEPTH: usize = 16;

/// The largest message a stage may send: a report of a stage serving
/// hundreds of jobs, each with dozens of labels, fits many times over.
pub const MAX_STAGE_MESSAGE: usize = 16 << 20;

/// How often a job a stage keeps reporting is recorded again in the store
/// (its `last_seen`); new jobs and label changes are recorded at once.
const JOB_REFRESH: Duration = Duration::from_secs(60);

/// How often a stage that keeps reporting is recorded as seen in the
/// store (`last_seen`, shown by `sluicectl get stages`; the views add what
/// the controller heard since). A stage that comes back is recorded at once.
const SEEN_REFRESH: Duration = Duration::from_secs(30);

/// How long a hello for a stage id whose session is open waits for that
/// session to end before it is refused: a restarted stage's new
/// connection can overtake the close of its old one.
const TAKEOVER_GRACE: Duration = Duration::from_secs(1);

/// The StageService implementation.
#[derive(Debug, Clone)]
pub struct Sessions {
    shared: Arc<Shared>,
    /// Whether a stage id must be named by the stage's certificate.
    bind_ids: bool,
}

impl Sessions {
    /// Returns the service over the shared state.
    pub fn new(shared: Arc<Shared>, bind_ids: bool) -> Self {
        Self { shared, bind_ids }
    }
}

#[tonic::async_trait]
impl StageService for Sessions {
    type SessionStream = ReceiverStream<Result<ControllerMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<StageMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let peer = request.remote_addr();
        let certs = request.peer_certs();
        let mut inbound = request.into_inner();
        let hello = match inbound.message().await? {
            Some(StageMessage {
                kind: Some(stage_message::Kind::Hello(h)),
            }) => h,
            _ => return Err(Status::invalid_argument("a session must open with a hello")),
        };
        if hello.stage_id.is_empty() {
            return Err(Status::invalid_argument(
                "hello.stage_id is empty: set --stage-id",
            ));
        }
        // Checked before the id is claimed: a refused hello leaves nothing
        // behind (no stage that is then counted lost).
        check_stage_hello(&hello.stage_id, &hello.node).map_err(crate::error::status)?;
        screen::hello(&hello).map_err(Status::invalid_argument)?;
        if self.bind_ids {
            named_by_certificate(certs.as_deref().map(Vec::as_slice), &hello.stage_id)?;
        }
        let (tx, rx) = mpsc::channel(DOWNSTREAM_DEPTH);
        let session = SessionHandle {
            id: self.shared.next_session_id(),
            tx,
            peer,
            ended: CancellationToken::new(),
        };
        // The task keeps no sender: the stream ends once the session is
        // replaced or the controller shuts down.
        let (id, ended) = (session.id, session.ended.clone());
        let stage = hello.stage_id.clone();
        opened(&self.shared, hello, session).await?;
        let shared = self.shared.clone();
        let span = info_span!("session", stage = %stage);
        tokio::spawn(
            async move {
                loop {
                    // At shutdown, dropping the inbound half resets the
                    // stream, so the server can drain.
                    let next = tokio::select! {
                        next = inbound.message() => next,
                        () = shared.shutdown.cancelled() => break,
                        () = ended.cancelled() => break,
                    };
                    match next {
                        Ok(Some(message)) => handle(&shared, &stage, message).await,
                        Ok(None) => {
                            // The stage ended the stream: it is stopping.
                            let current = shared.with_live(&stage, |l| {
                                let current = l.session.as_ref().is_some_and(|s| s.id == id);
                                if current {
                                    l.left = Some(Instant::now());
                                }
                                current
                            });
                            // Stored, so that a leader taking over before the
                            // stage timeout runs out knows it left.
                            if current
                                && let Err(e) = shared.store.record_stage_ended(&stage, now_ms()).await
                            {
                                debug!(error = %e, "cannot record that the stage ended its session");
                            }
                            // Its jobs' shares go to the stages that remain.
                            if current {
                                shared.count_stages();
                                shared.recompute.notify_one();
                            }
                            break;
                        }
                        Err(e) => {
                            refused_stream(&shared, &stage, id, e);
                            break;
                        }
                    }
                }
                closed(&shared, &stage, id);
            }
            .instrument(span),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Records a hello and decides what the stage must be sent; refuses it
/// (changing nothing) when another session holds the stage id.
async fn opened(shared: &Shared, hello: v1::Hello, session: SessionHandle) -> Result<(), Status> {
    let stage = hello.stage_id.clone();
    let running = hello.settings_version;
    let was_lost = claim(shared, &stage, &session).await?;
    let record = StageHello {
        id: stage.clone(),
        node: hello.node.clone(),
        labels: hello.labels.clone(),
        running_version: running,
    };
    if let Err(e) = shared.store.stage_hello(&record, now_ms()).await {
        closed(shared, &stage, session.id);
        return Err(crate::error::status(e));
    }
    let desired = lock(&shared.desired).get(&stage).cloned();
    let known = desired.as_ref().map_or(0, |d| d.version);
    // Settings decided for a larger budget than the stage now has (it was
    // restarted with less, or gave some to its cache) would be refused:
    // a fresh decision goes instead, at the next tick.
    let budget = hello.memory_budget_bytes;
    let fits = |d: &Desired| {
        budget == 0
            || d.settings
                .jobs
                .values()
                .all(|j| j.max_buffer_bytes <= budget)
    };
    let resend = desired.filter(|d| d.version > running && fits(d));
    shared.with_live(&stage, |live| {
        live.hello = HelloInfo::from(hello);
        // The last telemetry stays until the next one: clearing it would
        // make the stage's jobs look gone to the other stages for a tick.
        live.last_heard = Instant::now();
        live.lost = false;
        live.left = None;
        // A version the controller never published (or a newer one than it
        // knows): publish a fresh one over it.
        live.force_push = running != known && resend.is_none();
        live.running_version = running;
    });
    shared.count_stages();
    if let Some(d) = resend {
        push(&session, d.version, &d.settings);
        info!(
            stage,
            version = d.version,
            running,
            "re-pushed the desired settings"
        );
    }
    if was_lost {
        let message = format!("stage {stage} connected (running version {running})");
        shared
            .event("stage.connected", format!("stage/{stage}"), message)
            .await;
    }
    shared.recompute.notify_one();
    Ok(())
}

/// Makes `session` the one of `stage`, replacing a closed or silent one,
/// and returns whether the stage was lost or disconnected. A session that
/// still holds the id is given [`TAKEOVER_GRACE`] to end; then the hello
/// is refused with the sentence the stage logs.
async fn claim(shared: &Shared, stage: &str, session: &SessionHandle) -> Result<bool, Status> {
    let mut waited = false;
    loop {
        let held = shared.with_live(stage, |live| {
            if let Some(holder) = &live.session
                && holder.holds(live.last_heard, shared.stage_timeout)
            {
                return Err((holder.clone(), live.hello.node.clone()));
            }
            let was_lost = live.lost || live.session.is_none();
            if let Some(stale) = live.session.replace(session.clone()) {
                stale.ended.cancel();
            }
            // Heard now: a twin's hello must find this session holding.
            live.last_heard = Instant::now();
            Ok(was_lost)
        });
        let (holder, node) = match held {
            Ok(was_lost) => return Ok(was_lost),
            Err(held) => held,
        };
        if waited {
            let address = |s: &SessionHandle| s.peer.map_or("elsewhere".into(), |p| p.to_string());
            let (from, refused) = (address(&holder), address(session));
            warn!(stage, %from, %refused, "refused a hello: the stage id is connected");
            return Err(Status::already_exists(format!(
                "stage id `{stage}` is already connected from {from} (node {node}); give each \
                 stage on a host its own --stage-id"
            )));
        }
        let _ = tokio::time::timeout(TAKEOVER_GRACE, holder.tx.closed()).await;
        waited = true;
    }
}

/// Forgets a session that ended (a newer one of the same stage stays).
fn closed(shared: &Shared, stage: &str, session: u64) {
    let mut live = lock(&shared.live);
    if let Some(l) = live.get_mut(stage)
        && l.session.as_ref().is_some_and(|s| s.id == session)
    {
        l.session = None;
    }
    info!(stage, "session closed");
}

async fn handle(shared: &Shared, stage: &str, message: StageMessage) {
    let subject = format!("stage/{stage}");
    match message.kind {
        Some(stage_message::Kind::Telemetry(mut t)) => {
            if let Some((dropped, why)) = screen::telemetry(&mut t) {
                dropped_from_report(stage, dropped, &why);
            }
            telemetry(shared, stage, t).await;
        }
        Some(stage_message::Kind::Ack(a)) => {
            let published = lock(&shared.desired).get(stage).map_or(0, |d| d.version);
            if a.version > published {
                // Not a version this controller sent: recording it would
                // show the stage in sync with settings it never had.
                shared.with_live(stage, |l| l.last_heard = Instant::now());
                warn!(
                    stage,
                    version = a.version,
                    published,
                    "an ack of a settings version never published: ignored"
                );
                return;
            }
            shared.with_live(stage, |l| {
                l.last_heard = Instant::now();
                l.acked(a.version);
            });
            shared.metrics.acks.inc();
            shared.recorder.send(Record::Ack {
                stage: stage.to_owned(),
                version: a.version,
            });
            let message = format!("stage {stage} applied settings version {}", a.version);
            shared.event("settings.acked", subject, message).await;
        }
        Some(stage_message::Kind::Nack(n)) => {
            heard(shared, stage);
            shared.metrics.nacks.inc();
            let reason = screen::line(&n.reason);
            if let Err(e) = shared.store.record_nack(stage, n.version, &reason).await {
                warn!(error = %e, "cannot record a nack");
            }
            let message = format!(
                "stage {stage} rejected settings version {}: {reason}",
                n.version
            );
            shared.event("settings.nacked", subject, message).await;
        }
        Some(stage_message::Kind::Hello(_)) | None => {
            warn!("ignored a second hello or an empty message");
        }
    }
}

/// A stage's stream that failed: one the stage reset (it was killed, its
/// connection dropped) is only logged at debug; one that broke because of
/// what the stage sent (a message over [`MAX_STAGE_MESSAGE`], one that
/// does not decode) is warned about, and the stage is told why its
/// session ends.
fn refused_stream(shared: &Shared, stage: &str, session: u64, e: Status) {
    if matches!(e.code(), tonic::Code::Cancelled | tonic::Code::Unknown) {
        debug!(error = %e, "session stream failed");
        return;
    }
    warn!(code = ?e.code(), "the stage's message was refused, ending its session: {}", e.message());
    let tx = lock(&shared.live)
        .get(stage)
        .and_then(|l| l.session.as_ref())
        .filter(|s| s.id == session)
        .map(|s| s.tx.clone());
    if let Some(tx) = tx {
        let _ = tx.try_send(Err(e));
    }
}

/// Warns, at most once a minute, that entries of stages' reports were
/// dropped (see [`screen::telemetry`]).
fn dropped_from_report(stage: &str, dropped: usize, why: &str) {
    static WARNED: Mutex<(Option<Instant>, usize)> = Mutex::new((None, 0));
    let mut warned = lock(&WARNED);
    warned.1 += dropped;
    if warned
        .0
        .is_some_and(|at| at.elapsed() < Duration::from_secs(60))
    {
        return;
    }
    let total = std::mem::take(&mut warned.1);
    warned.0 = Some(Instant::now());
    warn!(
        stage,
        dropped = total,
        "dropped entries of stages' reports that no stage sends (the first: {why}); a stage of this release checks what trainers send"
    );
}

fn heard(shared: &Shared, stage: &str) {
    shared.with_live(stage, |l| l.last_heard = Instant::now());
}

async fn telemetry(shared: &Shared, stage: &str, t: v1::Telemetry) {
    let mut snapshot = from_proto(t);
    let now = now_ms();
    let (was_lost, due, decide_now, seen) = shared.with_live(stage, |l| {
        share_labels(&mut snapshot, l.latest());
        let was_lost = l.lost;
        let seen = was_lost
            || l.seen_recorded
                .is_none_or(|at| at.elapsed() >= SEEN_REFRESH);
        if seen {
            l.seen_recorded = Some(Instant::now());
        }
        l.heard_ms = now;
        // Jobs the store has not heard about from this stage lately (or
        // whose labels changed): telemetry comes twice a second, the store
        // does not need every sighting.
        let due: Vec<(String, Arc<Labels>)> = snapshot
            .jobs
            .iter()
            .filter(|(job, s)| {
                l.recorded_jobs
                    .get(*job)
                    .is_none_or(|(labels, at)| *labels != s.labels || at.elapsed() >= JOB_REFRESH)
            })
            .map(|(job, s)| (job.clone(), s.labels.clone()))
            .collect();
        let before = reading_windows(l);
        l.record(snapshot);
        l.last_heard = Instant::now();
        l.lost = false;
        (was_lost, due, changed(&before, &reading_windows(l)), seen)
    });
    // A job that arrived, left or changed how it reads changes everyone's
    // share: decide now rather than at the next tick (a new job waits for
    // its first settings, a departed one's share should go to the others).
    if decide_now {
        shared.recompute.notify_one();
    }
    if seen {
        shared.recorder.send(Record::Seen {
            stage: stage.to_owned(),
            unix_millis: now,
        });
    }
    if was_lost {
        let message = format!("stage {stage} reports again");
        shared
            .event("stage.connected", format!("stage/{stage}"), message)
            .await;
    }
    for (job, labels) in due {
        let write = Record::Job {
            sighting: JobSighting {
                job: job.clone(),
                labels: Labels::clone(&labels),
                stage: stage.to_owned(),
            },
            unix_millis: now,
        };
        if let Err(e) = shared.recorder.write(write).await {
            warn!(error = %e, job, "cannot record a job");
            continue;
        }
        shared.with_live(stage, |l| {
            let entry = (labels, Instant::now());
            l.recorded_jobs.insert(job.clone(), entry);
        });
        let new = lock(&shared.known_jobs).insert(job.clone());
        if new {
            let message = format!("job {job} appeared on stage {stage}");
            shared
                .event("job.appeared", format!("job/{job}"), message)
                .await;
        }
    }
}

/// Makes a report's labels share the previous report's where they are
/// equal: a stage's jobs keep their labels, and thousands of stages' worth
/// of copies would be kept and copied every tick.
pub(crate) fn share_labels(report: &mut Telemetry, previous: Option<&Telemetry>) {
    let Some(previous) = previous else { return };
    for (job, sample) in &mut report.jobs {
        if let Some(before) = previous.jobs.get(job)
            && before.labels == sample.labels
        {
            sample.labels = before.labels.clone();
        }
    }
}

/// Each job reading on a stage (trainers connected) with its latest window.
fn reading_windows(l: &LiveStage) -> BTreeMap<String, Option<Window>> {
    l.latest()
        .map(|r| {
            r.reading()
                .map(|(job, _)| (job.clone(), l.window(job).map(|(w, _)| w)))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a report changed what the control loop would decide: a job
/// started or stopped reading, or a job's window moved past the demand
/// estimate's hysteresis (see [`Window::moved_from`]).
fn changed(
    before: &BTreeMap<String, Option<Window>>,
    now: &BTreeMap<String, Option<Window>>,
) -> bool {
    !before.keys().eq(now.keys())
        || now.iter().any(|(job, w)| {
            let was = before.get(job).copied().flatten();
            w.is_some_and(|w| w.moved_from(was.as_ref()))
        })
}

/// Sends settings down a session without waiting: a full or closed
/// session drops the push (the stage gets the desired version again when
/// it reconnects). Returns whether the push was queued.
pub fn push(session: &SessionHandle, version: u64, settings: &StageAssignment) -> bool {
    let message = ControllerMessage {
        kind: Some(controller_message::Kind::Settings(to_proto(
            version, settings,
        ))),
    };
    session.tx.try_send(Ok(message)).is_ok()
}

pub(crate) fn from_proto(t: v1::Telemetry) -> Telemetry {
    let jobs = t
        .jobs
        .into_iter()
        .map(|j| {
            let sample = JobSample {
                labels: Arc::new(j.labels),
                counters: JobCounters {
                    storage_read_bytes: j.storage_read_bytes,
                    delivered_bytes: j.delivered_bytes,
                    cache_hit_bytes: j.cache_hit_bytes,
                    delivered_samples: j.delivered_samples,
                    throttled_seconds: seconds(j.throttled_seconds),
                    stall_seconds: seconds(j.stall_seconds),
                    connections: j.connections,
                },
                in_force: (j.bytes_per_second, j.ops_per_second),
            };
            (j.job, sample)
        })
        .collect();
    Telemetry {
        unix_millis: t.unix_millis,
        memory_used_bytes: t.memory_used_bytes,
        jobs,
        cache: t.cache,
    }
}

/// A duration counter as a stage reports it, or 0 when it is not one (not
/// a number, infinite or negative): a stage's telemetry is not trusted to
/// steer the demand estimate with values no clock gives.
fn seconds(reported: f64) -> f64 {
    if reported.is_finite() && reported >= 0.0 {
        reported
    } else {
        0.0
    }
}

/// Returns the wire form of one stage's settings.
pub fn to_proto(version: u64, settings: &StageAssignment) -> v1::Settings {
    let jobs = settings
        .jobs
        .iter()
        .map(|(job, s)| v1::JobSettingsEntry {
            job: job.clone(),
            settings: Some(job_to_proto(s)),
        })
        .collect();
    v1::Settings {
        version,
        defaults: None,
        jobs,
        unmanaged: settings.unmanaged.iter().cloned().collect(),
        cache: settings
            .cache
            .iter()
            .map(|(dataset, c)| v1::DatasetCacheSettings {
                dataset: dataset.clone(),
                policy: c.policy.clone(),
                tenant: c.tenant.clone(),
                tenant_weight: c.tenant_weight,
                weight: c.weight,
                pin_bytes: c.pin_bytes,
                staging_round: c.staging_round,
                staging_bytes_per_second: c.staging_bytes_per_second,
            })
            .collect(),
    }
}

/// Returns the wire form of one job's settings.
pub fn job_to_proto(s: &JobAssignment) -> v1::JobSettings {
    v1::JobSettings {
        bytes_per_second: s.bytes_per_second,
        ops_per_second: s.ops_per_second,
        burst_millis: s.burst_millis,
        tuner: s.tuner,
        min_readers: s.min_readers,
        max_readers: s.max_readers,
        min_buffer_bytes: s.min_buffer_bytes,
        max_buffer_bytes: s.max_buffer_bytes,
        policy: s.policy.clone(),
        pool: s.pool.clone(),
        reason: s.reason.clone(),
    }
}

/// Checks that the stage's client certificate (the first of `certs`)
/// names stage id `id`: a DNS subject alternative name equal to it (or an
/// IP address one, for an id that is an address).
fn named_by_certificate(certs: Option<&[CertificateDer<'_>]>, id: &str) -> Result<(), Status> {
    let Some(leaf) = certs.and_then(<[_]>::first) else {
        return Err(Status::permission_denied(format!(
            "stage id `{id}` must be named by the stage's client certificate \
             (--bind-stage-ids), but the stage presented none"
        )));
    };
    let unnamed = || {
        Status::permission_denied(format!(
            "stage id `{id}` is not named by the stage's client certificate (--bind-stage-ids): \
             give the stage a certificate with the subject alternative name DNS:{id}, or run \
             it with the --stage-id its certificate names"
        ))
    };
    let name = ServerName::try_from(id).map_err(|_| {
        Status::permission_denied(format!(
            "stage id `{id}` is not a DNS name, so no certificate can name it \
             (--bind-stage-ids): give the stage an id of letters, digits, `-` and `.`"
        ))
    })?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|_| unnamed())?;
    cert.verify_is_valid_for_subject_name(&name)
        .map_err(|_| unnamed())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(stall: f64, throttled: f64) -> v1::JobTelemetry {
        v1::JobTelemetry {
            job: "j".into(),
            stall_seconds: stall,
            throttled_seconds: throttled,
            connections: 1,
            ..v1::JobTelemetry::default()
        }
    }

    /// The stall and throttled times the controller reads from a report.
    fn read_as(stall: f64, throttled: f64) -> (f64, f64) {
        let t = v1::Telemetry {
            jobs: vec![job(stall, throttled)],
            ..v1::Telemetry::default()
        };
        let counters = &from_proto(t).jobs["j"].counters;
        (counters.stall_seconds, counters.throttled_seconds)
    }

    #[test]
    fn durations_no_clock_gives_are_read_as_zero() {
        // Found by fuzzing: a NaN stall time passed every check of the
        // demand estimate.
        assert_eq!(read_as(f64::NAN, f64::INFINITY), (0.0, 0.0));
        assert_eq!(read_as(-1.0, f64::NEG_INFINITY), (0.0, 0.0));
        assert_eq!(read_as(2.5, 0.25), (2.5, 0.25));
    }

    #[test]
    fn what_is_shown_is_measured_over_seconds_what_is_decided_over_the_last_report() {
        // A throttled job that gets 64 KiB every two seconds, reported
        // every half second.
        let mut live = LiveStage::new(Instant::now());
        let mut delivered = 0u64;
        let (mut shown, mut decided) = (Vec::new(), Vec::new());
        for i in 0..40 {
            if i % 4 == 0 {
                delivered += 64 << 10;
            }
            let t = v1::Telemetry {
                unix_millis: 1_000_000 + i * 500,
                jobs: vec![v1::JobTelemetry {
                    delivered_bytes: delivered,
                    ..job(0.0, 0.0)
                }],
                ..v1::Telemetry::default()
            };
            live.record(from_proto(t));
            if i >= 12 {
                shown.push(live.shown_window("j").unwrap().0.delivered_bytes_per_second);
                decided.push(live.window("j").unwrap().0.delivered_bytes_per_second);
            }
        }
        let steady = 32.0 * 1024.0;
        assert!(
            shown.iter().all(|r| (r / steady - 1.0).abs() < 0.3),
            "{shown:?}"
        );
        assert!(decided.contains(&0.0), "{decided:?}");
    }

    #[test]
    fn a_job_that_came_within_the_shown_window_is_shown_over_the_time_since() {
        // The same throttled job, come after the stage's first four reports:
        // over the half-second window it read as 0 or twice its rate by
        // turns for its first seconds.
        let mut live = LiveStage::new(Instant::now());
        let mut delivered = 0u64;
        let mut shown = Vec::new();
        for i in 0..24 {
            if i % 4 == 0 {
                delivered += 64 << 10;
            }
            let jobs = if i < 4 {
                vec![]
            } else {
                vec![v1::JobTelemetry {
                    delivered_bytes: delivered,
                    ..job(0.0, 0.0)
                }]
            };
            let t = v1::Telemetry {
                unix_millis: 1_000_000 + i * 500,
                jobs,
                ..v1::Telemetry::default()
            };
            live.record(from_proto(t));
            if i >= 9 {
                shown.push(live.shown_window("j").unwrap().0.delivered_bytes_per_second);
            }
        }
        let steady = 32.0 * 1024.0;
        assert!(
            shown.iter().all(|r| (r / steady - 1.0).abs() < 0.5),
            "{shown:?}"
        );
    }

    #[test]
    fn report_times_at_the_ends_of_the_clock_do_not_overflow() {
        let mut live = LiveStage::new(Instant::now());
        for unix_millis in [i64::MIN, i64::MAX, -1, i64::MIN, 0, i64::MAX] {
            let t = v1::Telemetry {
                unix_millis,
                jobs: vec![job(1.0, 1.0)],
                ..v1::Telemetry::default()
            };
            live.record(from_proto(t));
            let _ = live.window("j");
            let _ = live.has_window();
        }
    }
}
