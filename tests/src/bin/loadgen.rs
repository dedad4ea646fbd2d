//! `sluice-loadgen`: many simulated stages in one process, to measure the
//! controller at scale. Each simulated stage opens its own connection and
//! session (`sluice.v1.StageService/Session`) as a real stage does: a hello
//! with its id, node and settings version, then telemetry every
//! `--telemetry` for a few jobs it serves, and an `Ack` for every settings
//! version pushed to it. A job reads at `--demand` on every stage it runs
//! on, or at the limit the controller set for it there when that is lower
//! (the rest of the time counts as throttled), so the controller's demand
//! estimation and allocation see what real stages would report.
//!
//! ```text
//! sluice-loadgen --controller http://127.0.0.1:7070 --stages 1000
//!                [--jobs-per-stage 3] [--stages-per-job 16] [--telemetry 1s]
//!                [--demand 20MiB/s] [--connect-rate 2000] [--prefix sim]
//! ```
//!
//! It prints one JSON object per line on stdout: `{"event": "connected",
//! ...}` once every stage has opened its session, and answers commands read
//! from stdin, one per line:
//!
//! - `mark LABEL TIMEOUT_SECONDS`: waits until every stage has acknowledged
//!   a settings version received after the command, then prints
//!   `{"event": "acked", "mark": LABEL, "stages": n, "acked": n, "p50_ms":
//!   x, "p99_ms": x, "max_ms": x}` with the time from the command to each
//!   stage's acknowledgement (stages still missing at the timeout are
//!   counted in `"missing"`).
//! - `stats`: prints `{"event": "stats", "open": n, "sessions": n,
//!   "settings": n, "failures": n, "last_failure": "..."}`.
//!
//! Ends at end of input, SIGTERM or SIGINT.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use sluice_policy::ByteRate;
use sluice_proto::StageServiceClient;
use sluice_proto::v1::{
    Ack, Hello, JobTelemetry, StageMessage, Telemetry, controller_message, stage_message,
};
use sluice_tests::parse_duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

#[derive(Debug, Parser)]
#[command(
    name = "sluice-loadgen",
    about = "Many simulated stages in one process, to measure the controller at scale"
)]
struct Args {
    /// The controller's gRPC address, http://HOST:PORT.
    #[arg(long)]
    controller: String,
    /// How many stages to simulate.
    #[arg(long)]
    stages: usize,
    /// Jobs each stage serves.
    #[arg(long, default_value_t = 3)]
    jobs_per_stage: usize,
    /// Stages each job spans (on average).
    #[arg(long, default_value_t = 16)]
    stages_per_job: usize,
    /// How often each stage reports.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    telemetry: Duration,
    /// What each job asks of storage on each of its stages.
    #[arg(long, default_value = "20MiB/s", value_parser = parse_rate)]
    demand: f64,
    /// Sessions opened per second at start.
    #[arg(long, default_value_t = 2000)]
    connect_rate: u32,
    /// Stage ids are PREFIX-00000, PREFIX-00001, ...
    #[arg(long, default_value = "sim")]
    prefix: String,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    s.parse::<ByteRate>()
        .map(|r| r.0 as f64)
        .map_err(|e| e.to_string())
}

/// What the whole fleet shares: counters, and the mark being measured.
struct Fleet {
    started: Instant,
    stages: Vec<StageShared>,
    /// Sessions open now.
    open: AtomicUsize,
    /// Sessions opened since start (reconnections included).
    sessions: AtomicU64,
    /// Settings messages received.
    settings: AtomicU64,
    /// Sessions that failed (to open or later).
    failures: AtomicU64,
    last_failure: Mutex<String>,
    /// The current mark's number; 0 before the first.
    mark: AtomicU64,
}

/// What one simulated stage shares with the fleet.
#[derive(Default)]
struct StageShared {
    /// The last mark this stage acknowledged settings after, and when
    /// (microseconds since the fleet started).
    acked_mark: AtomicU64,
    acked_at_us: AtomicU64,
    /// Whether the first session has opened.
    connected: std::sync::atomic::AtomicBool,
}

impl Fleet {
    fn micros(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn failed(&self, error: String) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) = error;
    }
}

/// One job on one simulated stage: what it read so far.
#[derive(Debug, Default, Clone)]
struct JobState {
    labels: BTreeMap<String, String>,
    limit: Option<f64>,
    read_bytes: f64,
    throttled_seconds: f64,
}

/// One simulated stage's own state, kept across its sessions.
struct Stage {
    index: usize,
    id: String,
    jobs: BTreeMap<String, JobState>,
    version: u64,
    last_report: Instant,
}

impl Stage {
    fn new(args: &Args, index: usize) -> Self {
        let total_jobs = (args.stages * args.jobs_per_stage / args.stages_per_job.max(1)).max(1);
        let jobs = (0..args.jobs_per_stage)
            .map(|k| {
                let job = (index * args.jobs_per_stage + k) % total_jobs;
                let labels = BTreeMap::from([
                    ("sim".to_owned(), "true".to_owned()),
                    ("team".to_owned(), format!("t{}", job % 4)),
                ]);
                let state = JobState {
                    labels,
                    ..JobState::default()
                };
                (format!("job-{job:05}"), state)
            })
            .collect();
        Self {
            index,
            id: format!("{}-{index:05}", args.prefix),
            jobs,
            version: 0,
            last_report: Instant::now(),
        }
    }

    fn hello(&self) -> StageMessage {
        message(stage_message::Kind::Hello(Hello {
            stage_id: self.id.clone(),
            node: format!("node-{:05}", self.index),
            labels: Default::default(),
            capabilities: vec!["prefetch".into(), "qos".into(), "tuner".into()],
            settings_version: self.version,
            datasets: vec!["train".into()],
            memory_budget_bytes: 8 << 30,
            reader_budget: 0,
            software_version: env!("CARGO_PKG_VERSION").into(),
        }))
    }

    /// Advances every job to now and returns the report.
    fn report(&mut self, demand: f64) -> StageMessage {
        let seconds = self.last_report.elapsed().as_secs_f64();
        self.last_report = Instant::now();
        for job in self.jobs.values_mut() {
            let rate = job.limit.map_or(demand, |l| l.min(demand));
            job.read_bytes += rate * seconds;
            job.throttled_seconds += seconds * (1.0 - rate / demand);
        }
        let jobs = self
            .jobs
            .iter()
            .map(|(id, j)| {
                let bytes = j.read_bytes as u64;
                JobTelemetry {
                    job: id.clone(),
                    labels: j.labels.clone().into_iter().collect(),
                    delivered_bytes: bytes,
                    delivered_samples: bytes / (100 << 10),
                    storage_reads: bytes / (100 << 10),
                    storage_read_bytes: bytes,
                    throttled_seconds: j.throttled_seconds,
                    connections: 1,
                    readers: 4,
                    ..JobTelemetry::default()
                }
            })
            .collect();
        let unix_millis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        message(stage_message::Kind::Telemetry(Telemetry {
            unix_millis,
            settings_version: self.version,
            jobs,
            ..Telemetry::default()
        }))
    }

    /// Takes pushed settings: the jobs' limits.
    fn apply(&mut self, settings: &sluice_proto::v1::Settings) {
        for job in self.jobs.values_mut() {
            job.limit = None;
        }
        for entry in &settings.jobs {
            if let Some(job) = self.jobs.get_mut(&entry.job) {
                job.limit = entry
                    .settings
                    .as_ref()
                    .and_then(|s| s.bytes_per_second)
                    .map(|b| b as f64);
            }
        }
        self.version = settings.version;
    }
}

fn message(kind: stage_message::Kind) -> StageMessage {
    StageMessage { kind: Some(kind) }
}

/// Runs one simulated stage for ever: a session, and a new one with
/// capped backoff whenever it fails.
async fn simulate(fleet: Arc<Fleet>, args: Arc<Args>, mut stage: Stage) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let opened = Instant::now();
        if let Err(e) = session(&fleet, &args, &mut stage).await {
            fleet.failed(format!("{}: {e}", stage.id));
        }
        if opened.elapsed() > Duration::from_secs(10) {
            backoff = Duration::from_millis(200);
        }
        // Spread reconnections: each stage waits a share of the backoff.
        let jitter = backoff.mul_f64(0.5 + (stage.index % 100) as f64 / 200.0);
        tokio::time::sleep(jitter).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn session(fleet: &Fleet, args: &Args, stage: &mut Stage) -> Result<(), String> {
    let channel = Endpoint::from_shared(args.controller.clone())
        .map_err(|e| e.to_string())?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| sluice_proto::error_chain(&e))?;
    let (tx, rx) = mpsc::channel(8);
    tx.send(stage.hello()).await.map_err(|e| e.to_string())?;
    let mut inbound = StageServiceClient::new(channel)
        .session(ReceiverStream::new(rx))
        .await
        .map_err(|s| format!("{}: {}", s.code(), s.message()))?
        .into_inner();
    fleet.open.fetch_add(1, Ordering::Relaxed);
    fleet.sessions.fetch_add(1, Ordering::Relaxed);
    fleet.stages[stage.index]
        .connected
        .store(true, Ordering::Relaxed);
    let result = serve(fleet, args, stage, &tx, &mut inbound).await;
    fleet.open.fetch_sub(1, Ordering::Relaxed);
    result
}

/// Reports on the stage's beat and acknowledges every push until the
/// session ends.
async fn serve(
    fleet: &Fleet,
    args: &Args,
    stage: &mut Stage,
    tx: &mpsc::Sender<StageMessage>,
    inbound: &mut tonic::Streaming<sluice_proto::v1::ControllerMessage>,
) -> Result<(), String> {
    // Stages report at evenly spread phases of the period.
    let phase = args
        .telemetry
        .mul_f64(stage.index as f64 / args.stages as f64);
    let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + phase, args.telemetry);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    stage.last_report = Instant::now();
    let closed = || "the session's stream closed".to_owned();
    loop {
        tokio::select! {
            _ = beat.tick() => {
                tx.send(stage.report(args.demand)).await.map_err(|_| closed())?;
            }
            next = inbound.message() => {
                let Some(pushed) = next.map_err(|s| format!("{}: {}", s.code(), s.message()))? else {
                    return Err("the controller ended the session".into());
                };
                let Some(controller_message::Kind::Settings(settings)) = pushed.kind else {
                    continue;
                };
                fleet.settings.fetch_add(1, Ordering::Relaxed);
                stage.apply(&settings);
                let ack = message(stage_message::Kind::Ack(Ack { version: settings.version }));
                tx.send(ack).await.map_err(|_| closed())?;
                let shared = &fleet.stages[stage.index];
                let mark = fleet.mark.load(Ordering::Acquire);
                if shared.acked_mark.load(Ordering::Relaxed) < mark {
                    shared.acked_at_us.store(fleet.micros(), Ordering::Relaxed);
                    shared.acked_mark.store(mark, Ordering::Release);
                }
            }
        }
    }
}

/// Waits for every stage to acknowledge settings after a new mark and
/// prints the latencies.
async fn measure(fleet: &Fleet, label: &str, timeout: Duration) {
    let at = fleet.micros();
    let mark = fleet.mark.fetch_add(1, Ordering::AcqRel) + 1;
    let deadline = Instant::now() + timeout;
    let acked = |s: &StageShared| s.acked_mark.load(Ordering::Acquire) >= mark;
    while !fleet.stages.iter().all(acked) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut latencies: Vec<f64> = fleet
        .stages
        .iter()
        .filter(|s| acked(s))
        .map(|s| s.acked_at_us.load(Ordering::Relaxed).saturating_sub(at) as f64 / 1000.0)
        .collect();
    latencies.sort_by(f64::total_cmp);
    let quantile = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q).ceil() as usize).saturating_sub(1))
            .copied()
    };
    let line = serde_json::json!({
        "event": "acked",
        "mark": label,
        "stages": fleet.stages.len(),
        "acked": latencies.len(),
        "missing": fleet.stages.len() - latencies.len(),
        "p50_ms": quantile(0.5),
        "p99_ms": quantile(0.99),
        "max_ms": latencies.last(),
    });
    println!("{line}");
}

fn stats(fleet: &Fleet) {
    let line = serde_json::json!({
        "event": "stats",
        "open": fleet.open.load(Ordering::Relaxed),
        "sessions": fleet.sessions.load(Ordering::Relaxed),
        "settings": fleet.settings.load(Ordering::Relaxed),
        "failures": fleet.failures.load(Ordering::Relaxed),
        "last_failure": *fleet.last_failure.lock().unwrap_or_else(|e| e.into_inner()),
    });
    println!("{line}");
}

/// Reads commands from stdin (on a thread: stdin blocks) until it ends.
fn commands() -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

async fn run(args: Args) {
    let args = Arc::new(args);
    let fleet = Arc::new(Fleet {
        started: Instant::now(),
        stages: (0..args.stages).map(|_| StageShared::default()).collect(),
        open: AtomicUsize::new(0),
        sessions: AtomicU64::new(0),
        settings: AtomicU64::new(0),
        failures: AtomicU64::new(0),
        last_failure: Mutex::new(String::new()),
        mark: AtomicU64::new(0),
    });
    let pace = Duration::from_secs(1) / args.connect_rate.max(1);
    {
        let (fleet, args) = (fleet.clone(), args.clone());
        tokio::spawn(async move {
            for index in 0..args.stages {
                let stage = Stage::new(&args, index);
                tokio::spawn(simulate(fleet.clone(), args.clone(), stage));
                tokio::time::sleep(pace).await;
            }
            let connected = |s: &StageShared| s.connected.load(Ordering::Relaxed);
            while !fleet.stages.iter().all(connected) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let line = serde_json::json!({
                "event": "connected",
                "stages": args.stages,
                "seconds": fleet.started.elapsed().as_secs_f64(),
            });
            println!("{line}");
        });
    }
    let mut commands = commands();
    loop {
        let command = tokio::select! {
            c = commands.recv() => c,
            _ = tokio::signal::ctrl_c() => None,
            () = terminated() => None,
        };
        let Some(command) = command else { break };
        let words: Vec<&str> = command.split_whitespace().collect();
        match words.as_slice() {
            ["mark", label, timeout] => {
                let timeout = timeout.parse::<f64>().unwrap_or(30.0);
                // Measured beside the commands: a second mark waits.
                measure(&fleet, label, Duration::from_secs_f64(timeout)).await;
            }
            ["stats"] => stats(&fleet),
            [] => {}
            _ => eprintln!(
                "unknown command {command:?}: use `mark LABEL TIMEOUT_SECONDS` or `stats`"
            ),
        }
    }
}

async fn terminated() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

fn main() {
    let args = Args::parse();
    if args.stages == 0 || args.jobs_per_stage == 0 {
        eprintln!("sluice-loadgen: --stages and --jobs-per-stage must be at least 1");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(run(args));
}
