//! The stage's controller session, end to end: the real `sluice-stage`
//! binary against a scripted controller (a real tonic server in the test).
//! Hello, settings applied and acknowledged, bad settings refused with a
//! reason, telemetry carrying the version in force, fail-static when the
//! controller goes away, and reconnection when it comes back.

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_proto::v1::{
    ControllerMessage, JobSettings, JobSettingsEntry, Settings, StageMessage, controller_message,
    stage_message,
};
use sluice_proto::{StageService, StageServiceServer};
use support::{KillOnDrop, http, trainer};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// The sending half of a session's response stream.
type Push = mpsc::Sender<Result<ControllerMessage, Status>>;

/// A controller that reports every stage message to the test and lets the
/// test push settings down the current session.
#[derive(Clone, Default)]
struct Scripted {
    seen: Arc<Mutex<Option<mpsc::UnboundedSender<StageMessage>>>>,
    push: Arc<Mutex<Option<Push>>>,
    /// How long it takes to answer a session (a controller slow to take a
    /// stage that just started).
    answer_after: Duration,
}

#[tonic::async_trait]
impl StageService for Scripted {
    type SessionStream = ReceiverStream<Result<ControllerMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<StageMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        tokio::time::sleep(self.answer_after).await;
        let mut inbound = request.into_inner();
        let seen = self.seen.lock().unwrap().clone().expect("test listens");
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                let _ = seen.send(message);
            }
        });
        let (tx, rx) = mpsc::channel(8);
        *self.push.lock().unwrap() = Some(tx);
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Controller {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve(controller: Scripted, listener: tokio::net::TcpListener) -> Controller {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(StageServiceServer::new(controller))
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                let _ = stopped.await;
            })
            .await
            .expect("the scripted controller serves");
    });
    Controller {
        stop: Some(stop),
        task,
    }
}

impl Controller {
    /// Stops serving and ends the open session, as a dying controller would.
    async fn kill(mut self, controller: &Scripted) {
        controller.push.lock().unwrap().take();
        let _ = self.stop.take().unwrap().send(());
        self.task.abort();
        let _ = self.task.await;
    }
}

/// Waits for the next stage message that `pick` accepts, skipping others.
async fn next<T>(
    seen: &mut mpsc::UnboundedReceiver<StageMessage>,
    mut pick: impl FnMut(stage_message::Kind) -> Option<T>,
) -> T {
    tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let message = seen.recv().await.expect("the session is open");
            if let Some(found) = message.kind.and_then(&mut pick) {
                return found;
            }
        }
    })
    .await
    .expect("the stage answered in time")
}

/// Pushes settings `version` naming `jobs` (no defaults, no cache).
async fn push(controller: &Scripted, version: u64, jobs: Vec<JobSettingsEntry>) {
    let settings = Settings {
        version,
        defaults: None,
        jobs,
        unmanaged: vec![],
        cache: vec![],
    };
    let tx = controller
        .push
        .lock()
        .unwrap()
        .clone()
        .expect("a session is open");
    tx.send(Ok(ControllerMessage {
        kind: Some(controller_message::Kind::Settings(settings)),
    }))
    .await
    .expect("the session takes the push");
}

fn job_settings(job: &str, settings: JobSettings) -> JobSettingsEntry {
    JobSettingsEntry {
        job: job.into(),
        settings: Some(settings),
    }
}

/// Starts `sluice-stage` (id `stage-e2e`, one small data set) with the
/// controller at `addr`; returns it, its socket and its metrics address.
fn start_stage(
    dir: &std::path::Path,
    addr: SocketAddr,
) -> (KillOnDrop, std::path::PathBuf, String) {
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(dir.join("data/a.bin"), b"abc").unwrap();
    let socket = dir.join("stage.sock");
    let mut child = Command::new(sluice_tests::binary("sluice-stage"))
        .args([
            "--socket",
            socket.to_str().unwrap(),
            "--metrics-addr",
            "127.0.0.1:0",
            "--stage-id",
            "stage-e2e",
        ])
        .args([
            "--node",
            "node-a",
            "--label",
            "zone=z1",
            "--memory-budget",
            "64MiB",
        ])
        .arg(format!("--dataset=train={}", dir.join("data").display()))
        .arg(format!("--controller=http://{addr}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line).unwrap();
    let metrics = ready["metrics"].as_str().unwrap().to_owned();
    (KillOnDrop(child), socket, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_flow_fail_static_and_reconnect() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let controller = Scripted::default();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    *controller.seen.lock().unwrap() = Some(seen_tx);
    let server = serve(controller.clone(), listener).await;

    let dir = tempfile::tempdir().unwrap();
    let (_stage, socket, metrics) = start_stage(dir.path(), addr);

    let hello = next(&mut seen, |k| match k {
        stage_message::Kind::Hello(h) => Some(h),
        _ => None,
    })
    .await;
    assert_eq!(
        (
            hello.stage_id.as_str(),
            hello.node.as_str(),
            hello.settings_version
        ),
        ("stage-e2e", "node-a", 0)
    );
    assert_eq!(hello.labels.get("zone").map(String::as_str), Some("z1"));
    assert_eq!(hello.datasets, ["train"]);
    assert_eq!(hello.memory_budget_bytes, 64 << 20);

    let first_trainer = tokio::task::spawn_blocking({
        let socket = socket.clone();
        move || trainer(&socket, "e2e")
    })
    .await
    .unwrap();
    let limited = JobSettings {
        bytes_per_second: Some(1 << 20),
        ops_per_second: Some(500),
        ..Default::default()
    };
    push(&controller, 1, vec![job_settings("e2e", limited)]).await;
    let acked = next(&mut seen, |k| match k {
        stage_message::Kind::Ack(a) => Some(a.version),
        stage_message::Kind::Nack(n) => panic!("valid settings refused: {}", n.reason),
        _ => None,
    })
    .await;
    assert_eq!(acked, 1);
    let telemetry = next(&mut seen, |k| match k {
        stage_message::Kind::Telemetry(t) if t.settings_version == 1 => Some(t),
        _ => None,
    })
    .await;
    let job = telemetry
        .jobs
        .iter()
        .find(|j| j.job == "e2e")
        .expect("the job is reported");
    assert_eq!(
        (job.bytes_per_second, job.ops_per_second),
        (Some(1 << 20), Some(500))
    );

    // Impossible settings: refused with a reason, nothing changes.
    let impossible = JobSettings {
        min_readers: 9,
        max_readers: 2,
        ..Default::default()
    };
    push(&controller, 2, vec![job_settings("e2e", impossible)]).await;
    let (version, reason) = next(&mut seen, |k| match k {
        stage_message::Kind::Nack(n) => Some((n.version, n.reason)),
        stage_message::Kind::Ack(a) => panic!("impossible settings acknowledged: {}", a.version),
        _ => None,
    })
    .await;
    assert_eq!(version, 2);
    assert!(
        reason.contains("job `e2e`") && reason.contains("reader bounds 9..2"),
        "{reason}"
    );
    // A push older than the version in force (a deposed controller) too.
    push(&controller, 0, vec![]).await;
    let reason = next(&mut seen, |k| match k {
        stage_message::Kind::Nack(n) if n.version == 0 => Some(n.reason),
        stage_message::Kind::Ack(a) => panic!("a stale push acknowledged: {}", a.version),
        _ => None,
    })
    .await;
    assert!(reason.contains("older than version 1"), "{reason}");

    // The job's trainer leaves; the controller's next push names only jobs
    // with trainers. The idle job keeps its limit, so its next trainer
    // does not read unlimited until a push names it again.
    drop(first_trainer);
    tokio::time::sleep(Duration::from_millis(300)).await;
    push(&controller, 3, vec![]).await;
    let acked = next(&mut seen, |k| match k {
        stage_message::Kind::Ack(a) if a.version == 3 => Some(a.version),
        stage_message::Kind::Nack(n) => panic!("valid settings refused: {}", n.reason),
        _ => None,
    })
    .await;
    assert_eq!(acked, 3);

    // The controller goes away: the stage keeps its settings and serves.
    server.kill(&controller).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let jobs = tokio::task::spawn_blocking({
        let metrics = metrics.clone();
        move || http(&metrics, "GET", "/api/v1/jobs", "")
    })
    .await
    .unwrap();
    assert!(
        jobs.contains(r#""bytes_per_second_limit":1048576"#),
        "{jobs}"
    );
    let new_trainer = tokio::task::spawn_blocking({
        let socket = socket.clone();
        move || trainer(&socket, "newcomer")
    })
    .await;
    assert!(
        new_trainer.is_ok(),
        "trainers are served without a controller"
    );

    // It comes back on the same address: the stage reconnects and says
    // which settings it runs.
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let server = serve(controller.clone(), listener).await;
    let hello = next(&mut seen, |k| match k {
        stage_message::Kind::Hello(h) => Some(h),
        _ => None,
    })
    .await;
    assert_eq!(hello.settings_version, 3);
    let metrics_text = tokio::task::spawn_blocking(move || http(&metrics, "GET", "/metrics", ""))
        .await
        .unwrap();
    assert!(
        metrics_text.contains("sluice_stage_settings_version 3"),
        "{metrics_text}"
    );
    assert!(
        metrics_text.contains("sluice_stage_settings_rejected_total 2"),
        "{metrics_text}"
    );
    server.kill(&controller).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_starts_before_the_session_is_up_waits_for_its_settings() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let controller = Scripted {
        answer_after: Duration::from_millis(300),
        ..Scripted::default()
    };
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    *controller.seen.lock().unwrap() = Some(seen_tx);
    let _server = serve(controller.clone(), listener).await;
    let dir = tempfile::tempdir().unwrap();
    let (_stage, socket, metrics) = start_stage(dir.path(), addr);
    // At once, while the controller is still taking the session.
    let _trainer = tokio::task::spawn_blocking(move || trainer(&socket, "early"))
        .await
        .unwrap();
    next(&mut seen, |k| match k {
        stage_message::Kind::Telemetry(t) if t.jobs.iter().any(|j| j.job == "early") => Some(()),
        _ => None,
    })
    .await;
    let limited = JobSettings {
        bytes_per_second: Some(1 << 20),
        ..Default::default()
    };
    push(&controller, 1, vec![job_settings("early", limited)]).await;
    next(&mut seen, |k| match k {
        stage_message::Kind::Ack(a) => Some(a.version),
        _ => None,
    })
    .await;
    let text = tokio::task::spawn_blocking(move || http(&metrics, "GET", "/metrics", ""))
        .await
        .unwrap();
    assert!(
        text.contains("sluice_stage_job_starts_total{how=\"settings\"} 1"),
        "the job read before its settings came: {}",
        text.lines()
            .filter(|l| l.starts_with("sluice_stage_job_starts_total"))
            .collect::<Vec<_>>()
            .join("; ")
    );
}
