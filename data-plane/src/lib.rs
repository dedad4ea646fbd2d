//! `sluice-stage`: the data-plane process between training jobs and storage.
//!
//! A stage serves trainers over a UNIX socket (and optionally TCP) with the
//! protocol in `docs/protocol.md`. For each job it knows the epoch's read
//! order, prefetches samples in parallel into a byte-bounded buffer, delivers
//! them in order exactly once, tunes its readers and buffer, and enforces the
//! job's QoS limits. [`Stage::bind`] binds every listener; [`Stage::run`]
//! serves until the cancellation token fires.

mod blocking;
mod cache;
mod chunk;
mod config;
mod cpu;
mod dataset;
mod engine;
mod entry;
#[cfg(debug_assertions)]
mod fault;
mod fs_room;
mod heap;
mod http;
mod job_config;
mod memory_limit;
mod metrics;
mod mount;
mod pace;
mod plain_open;
mod plan;
mod protocol;
mod server;
mod session;
mod settings;
mod shm;
mod source;
mod storage;
mod sync;
mod token_bucket;
mod trust;
mod tuner;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sluice_proto::fd_limit;
use tokio::net::{TcpListener, UnixListener};
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

pub use config::{Args, ConfigError, StageConfig};
pub use mount::detach_at_exit;
// The trainer protocol's request frames, for tests that speak it to a stage.
pub use protocol::{PlanSpec, Request, TO_END};

use cache::Cache;
use dataset::Dataset;
use engine::Engine;
use metrics::Metrics;
use protocol::{ErrorCode, ProtocolError, Response};
use source::Source;
use trust::{Peer, TrainerAccess};

/// Builds the node cache, its disk tier indexed from what a previous stage
/// left, and the data sets' weights.
fn open_cache(
    options: &config::CacheOptions,
    datasets: &[Dataset],
    metrics: &Metrics,
) -> anyhow::Result<Arc<Cache>> {
    let tiers = cache::Tiers {
        memory: options.memory,
        policy: options.policy,
        disk: options.disk.clone(),
    };
    let sources: Vec<_> = datasets
        .iter()
        .map(|d| (Arc::clone(&d.identity), d.name.clone()))
        .collect();
    // A directory it cannot take (someone else's, another stage's, one it
    // may not write or that is not there to make) is the configuration's
    // to change: it exits as an invalid configuration does. Other failures
    // (a disk failing as it is read) are not.
    let cache = Cache::new(&tiers, &sources, metrics.cache.clone()).map_err(|e| {
        let dir = options.disk.as_ref().map(|(d, _)| d.display().to_string());
        let why = format!(
            "opening the cache's disk tier in {}: {e}",
            dir.unwrap_or_default()
        );
        use std::io::ErrorKind::*;
        match e.kind() {
            InvalidInput | PermissionDenied | NotFound | ReadOnlyFilesystem | NotADirectory => {
                anyhow::Error::new(config::ConfigError::new(why))
            }
            _ => anyhow::anyhow!(why),
        }
    })?;
    for dataset in datasets {
        if let Some(&weight) = options.weights.get(&dataset.name) {
            cache.set_weight(&dataset.identity, &dataset.name, weight);
        }
    }
    info!(memory = %sluice_policy::ByteSize(options.memory), disk = ?options.disk, policy = ?options.policy, "node cache");
    Ok(cache)
}

/// How long shutdown waits for connections to finish their current answer.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Requested send buffer of trainer connections (the kernel caps it at
/// `net.core.wmem_max`).
const SEND_BUFFER: usize = 4 << 20;

/// A stage with every listener bound, ready to [`run`](Stage::run).
#[derive(Debug)]
pub struct Stage {
    engine: Arc<Engine>,
    stage_id: Arc<str>,
    socket_file: SocketFile,
    unix: UnixListener,
    tcp: Option<TcpListener>,
    http: TcpListener,
    controller: Option<(String, session::Identity)>,
    access: Arc<TrainerAccess>,
    /// The read-only mount, unmounted at shutdown.
    mount: Option<mount::Mount>,
    /// A descriptor held back for each trainer listener (see [`Reserve`]),
    /// taken before the stage says it is ready.
    reserves: [Reserve; 2],
}

/// The addresses a bound stage listens on (printed as its ready line).
#[derive(Debug, serde::Serialize)]
pub struct Addresses {
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    pub metrics: SocketAddr,
    /// Where the data sets are mounted, if they are.
    pub mount: Option<PathBuf>,
}

/// Logs the settings in force, whichever way each was given (flag,
/// variable or file), so an operator can check them before any trainer
/// comes (the data sets, the cache and the listeners have lines of their
/// own).
fn log_settings(config: &StageConfig) {
    use sluice_policy::ByteSize;
    let (job, bounds) = (&config.job, &config.job.bounds);
    let readers = if job.tuner {
        format!(
            "{}..{}, from {} (tuned)",
            bounds.min_readers, bounds.max_readers, job.initial_readers
        )
    } else {
        format!("{} (fixed)", job.initial_readers)
    };
    let buffer = format!(
        "{}..{}, from {}",
        ByteSize(bounds.min_buffer),
        ByteSize(bounds.max_buffer),
        ByteSize(job.initial_buffer)
    );
    let rate = |per_s: Option<u64>, unit: fn(u64) -> String| per_s.map_or("none".into(), unit);
    info!(
        stage_id = %config.stage_id,
        node = %config.node,
        memory_budget = %ByteSize(config.memory_budget),
        readers = %readers,
        buffer = %buffer,
        rate_limit = %rate(job.limits.bytes_per_s, |b| format!("{}/s", ByteSize(b))),
        ops_limit = %rate(job.limits.ops_per_s, |n| format!("{n}/s")),
        direct_io = config.direct_io,
        shared_memory = config.shared_memory,
        controller = config.controller.as_deref().unwrap_or("none (standalone)"),
        labels = ?config.labels,
        "settings in force"
    );
}

impl Stage {
    /// Opens the datasets and binds the trainer socket, the optional TCP
    /// listener and the metrics listener.
    pub async fn bind(config: StageConfig) -> anyhow::Result<Self> {
        heap::map_large_blocks();
        let descriptors = fd_limit::raise();
        tracing::debug!(descriptors, "open file limit");
        if let Err(e) = blocking::start_reserve(&tokio::runtime::Handle::current(), 2) {
            warn!(error = %e, "cannot start the threads kept for a thread limit: at one, work meant for other threads is done on the threads that ask");
        }
        if let Some(limit) = memory_limit::container()
            && config.memory_budget + memory_limit::OVERHEAD > limit
        {
            warn!(
                budget = config.memory_budget,
                limit,
                "the memory budget leaves less than 64 MiB of the container's memory limit: the kernel will kill the stage when its buffers fill; lower --memory-budget or raise the limit (docs/data-plane.md, \"Memory\")"
            );
        }
        log_settings(&config);
        let metrics = Metrics::new();
        let mut datasets = Vec::new();
        let own_mount = config.mount.as_ref().map(|m| config::resolved(&m.dir));
        for (name, location) in &config.datasets {
            let source = Source::open(
                name,
                location,
                config.direct_io,
                &config.s3,
                own_mount.as_deref(),
                &metrics,
            )
            .await?;
            info!(dataset = %name, source = %source.describe(), "serving a dataset");
            datasets.push(Dataset::new(name, source));
        }
        // Removed again if the stage fails to start from here on.
        let (unix, socket_file) = bind_socket(&config.socket)?;
        let tcp = match config.listen {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the trainer TCP listener on {addr}"))?,
            ),
            None => None,
        };
        let http = TcpListener::bind(config.metrics_addr)
            .await
            .with_context(|| format!("binding the metrics listener on {}", config.metrics_addr))?;
        let cache = if config.cache.enabled() {
            Some(open_cache(&config.cache, &datasets, &metrics)?)
        } else {
            None
        };
        let engine = Engine::new(
            datasets,
            config.prefetch_budget(),
            config.job,
            config.shared_memory,
            metrics,
            cache,
        );
        if config.trainer_access.restricts() {
            info!("trainers may claim only the jobs and labels the `trainers:` rules allow");
        }
        let access = Arc::new(config.trainer_access);
        if config.controller.is_some() {
            // Until the first session attempt fails, a controller is
            // expected: a job that starts before the session is up holds
            // for its settings too (no unlimited first burst at start-up).
            engine.set_controller_live(true);
        }
        let controller = config.controller.map(|url| {
            let identity = session::Identity {
                stage_id: config.stage_id.clone(),
                node: config.node,
                labels: config.labels,
                tls: config.controller_tls,
            };
            (url, identity)
        });
        let mount = match &config.mount {
            Some(options) => Some(mount::mount(
                Arc::clone(&engine),
                options,
                Arc::clone(&access),
                tokio::runtime::Handle::current(),
            )?),
            None => None,
        };
        Ok(Self {
            engine,
            mount,
            stage_id: config.stage_id.into(),
            socket_file,
            unix,
            tcp,
            http,
            controller,
            access,
            reserves: [Reserve::new(), Reserve::new()],
        })
    }

    pub fn addresses(&self) -> anyhow::Result<Addresses> {
        Ok(Addresses {
            socket: self.socket_file.path.clone(),
            tcp: self.tcp.as_ref().map(TcpListener::local_addr).transpose()?,
            metrics: self.http.local_addr()?,
            mount: self.mount.as_ref().map(|m| m.dir().to_owned()),
        })
    }

    /// Serves until `cancel` fires, then stops accepting, lets connections
    /// finish for up to a few seconds, and stops the readers.
    pub async fn run(self, cancel: CancellationToken) -> anyhow::Result<()> {
        let Self {
            engine,
            stage_id,
            socket_file,
            unix,
            tcp,
            http,
            controller,
            access,
            mount,
            reserves: [unix_reserve, tcp_reserve],
        } = self;
        let tracker = TaskTracker::new();
        // The long-lived tasks: each runs until `cancel` fires, so one that
        // ends first (an error or a panic) is a failure of the stage.
        let mut critical = Supervised::default();
        if let Some((url, identity)) = controller {
            let session = session::run(Arc::clone(&engine), url, identity, cancel.clone());
            critical.spawn(
                "controller session",
                async move {
                    session.await;
                    Ok(())
                }
                .instrument(info_span!("controller")),
            );
        }
        let app = http::router(Arc::clone(&engine));
        let http_cancel = cancel.clone();
        critical.spawn(
            "metrics server",
            async move {
                axum::serve(http::listener(http), app)
                    .with_graceful_shutdown(http_cancel.cancelled_owned())
                    .await
                    .context("serving /metrics")
            }
            .instrument(info_span!("http")),
        );
        if let Some(mount) = &mount {
            // Readers of a mount unmounted from outside find an empty
            // directory: the stage stops, to be started again with it.
            let (ended, dir, stopping) = (mount.ended(), mount.dir().to_owned(), cancel.clone());
            critical.spawn("mount", async move {
                tokio::select! {
                    biased;
                    () = stopping.cancelled() => Ok(()),
                    () = ended.cancelled() => Err(anyhow::anyhow!(
                        "the mount at {} ended while the stage ran (unmounted from outside: `umount`, `fusermount3 -u`?), which leaves its readers an empty directory; start the stage again to mount it",
                        dir.display()
                    )),
                }
            });
        }
        let ticking = tick(Arc::clone(&engine), cancel.clone());
        critical.spawn(
            "tuner",
            async move {
                ticking.await;
                Ok(())
            }
            .instrument(info_span!("tuner")),
        );

        let drain = CancellationToken::new();
        let ctx = Accepting {
            engine: Arc::clone(&engine),
            stage_id,
            access,
            cancel: cancel.clone(),
            drain: drain.clone(),
            tracker: tracker.clone(),
        };
        // The trainer listeners together hold at most a quarter of the
        // descriptor limit in connections, each its share (so that peers
        // of one cannot shut out the other's trainers): each connection's
        // job may hold a shared-memory region's beside it, and reads need
        // the rest.
        let listeners = if tcp.is_some() { 2 } else { 1 };
        let most = (fd_limit::connections_per_listener() / listeners).max(1);
        let socket_file = Arc::new(std::sync::Mutex::new(socket_file));
        let accept_unix = ctx.clone().run(
            Listener::Unix(unix, Arc::clone(&socket_file)),
            most,
            unix_reserve,
        );
        let accept_tcp = async {
            if let Some(tcp) = tcp {
                ctx.clone().run(Listener::Tcp(tcp), most, tcp_reserve).await;
            }
        };
        let accepting = async { tokio::join!(accept_unix, accept_tcp) };
        let mut failure = tokio::select! {
            _ = accepting => None,
            Some((name, ended)) = critical.join_next() => task_failure(name, ended, cancel.is_cancelled()),
        };
        if let Some(failure) = &failure {
            tracing::error!("{failure:#}; the stage stops");
        }
        cancel.cancel();
        engine.begin_drain();
        drain.cancel();
        info!("shutting down: draining trainer connections");
        tracker.close();
        if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait())
            .await
            .is_err()
        {
            warn!("some trainer connections did not finish within the drain timeout");
        }
        drop(mount);
        engine.stop();
        drop(socket_file);
        while let Some((name, ended)) = critical.join_next().await {
            failure = failure.or(task_failure(name, ended, true));
        }
        failure.map_or(Ok(()), Err)
    }
}

/// The stage's long-lived tasks, by name.
#[derive(Default)]
struct Supervised {
    tasks: JoinSet<anyhow::Result<()>>,
    names: HashMap<tokio::task::Id, &'static str>,
}

impl Supervised {
    fn spawn(
        &mut self,
        name: &'static str,
        task: impl Future<Output = anyhow::Result<()>> + Send + 'static,
    ) {
        #[cfg(debug_assertions)]
        let task = async move {
            fault::panic_task_if_asked(name);
            task.await
        };
        let id = self.tasks.spawn(task).id();
        self.names.insert(id, name);
    }

    /// The next task to end, with its name.
    async fn join_next(&mut self) -> Option<(&'static str, Result<anyhow::Result<()>, JoinError>)> {
        let ended = self.tasks.join_next_with_id().await?;
        let id = match &ended {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        let name = self.names.remove(&id).unwrap_or("unnamed");
        Some((name, ended.map(|(_, result)| result)))
    }
}

/// Says why a long-lived task's end is a failure: its error, its panic, or
/// that it returned before shutdown (it must run until cancelled). `None`:
/// it finished as asked, during shutdown.
fn task_failure(
    name: &str,
    ended: Result<anyhow::Result<()>, JoinError>,
    shutting_down: bool,
) -> Option<anyhow::Error> {
    match ended {
        Ok(Ok(())) if shutting_down => None,
        Ok(Ok(())) => Some(anyhow::anyhow!("the {name} task stopped on its own")),
        Ok(Err(e)) => Some(e.context(format!("the {name} task failed"))),
        Err(e) if e.is_panic() => Some(anyhow::anyhow!(
            "the {name} task panicked: {}",
            panic_text(e)
        )),
        Err(e) => Some(anyhow::anyhow!("the {name} task was cancelled: {e}")),
    }
}

/// The message of a task's panic, when it has one.
fn panic_text(e: JoinError) -> String {
    let payload = e.into_panic();
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// Runs every job's tuner once per tick until `cancel` fires.
async fn tick(engine: Arc<Engine>, cancel: CancellationToken) {
    let mut interval = tokio::time::interval(tuner::TICK);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while cancel.run_until_cancelled(interval.tick()).await.is_some() {
        engine.tick(Instant::now());
    }
}

/// A listener trainers connect through; the UNIX one with the file it
/// bound, made again if it is removed.
enum Listener {
    Unix(UnixListener, Arc<std::sync::Mutex<SocketFile>>),
    Tcp(TcpListener),
}

impl Listener {
    fn name(&self) -> &'static str {
        match self {
            Self::Unix(..) => "UNIX socket",
            Self::Tcp(_) => "TCP listener",
        }
    }
}

/// How often the trainer socket's file is checked for.
const SOCKET_CHECK: Duration = Duration::from_secs(2);

/// What every accepted connection is served with.
#[derive(Clone)]
struct Accepting {
    engine: Arc<Engine>,
    stage_id: Arc<str>,
    access: Arc<TrainerAccess>,
    cancel: CancellationToken,
    /// Ends the connections: fired after `cancel`, once the engine keeps
    /// every slot its trainers hold ([`Engine::begin_drain`]).
    drain: CancellationToken,
    tracker: TaskTracker,
}

impl Accepting {
    /// Accepts trainers until cancelled, one task per connection, at most
    /// `most` at once: a connection past that is closed as soon as it is
    /// accepted, so that peers which connect and stay (a port scanner, a
    /// client leaking sockets) cannot take the descriptors every job's
    /// reads need. A stage out of descriptors lets a connection wait for
    /// one for a moment, then takes it with its reserve one and tells it
    /// why, instead of leaving it to time out.
    async fn run(self, mut listener: Listener, most: usize, mut reserve: Reserve) {
        let open = Arc::new(tokio::sync::Semaphore::new(most));
        let mut refused = Refusals::default();
        // Since when the connection waiting has found no descriptor free.
        let mut short_since: Option<Instant> = None;
        let name = listener.name();
        loop {
            let accepted = match &mut listener {
                Listener::Unix(l, file) => self.accept_unix(l, file).await.map(|r| {
                    r.map(|s| {
                        let Ok(place) = Arc::clone(&open).try_acquire_owned() else {
                            let _ = s.try_write(&full(most));
                            return refused.count(&self.engine, name, most);
                        };
                        let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
                        let peer = match s.peer_cred() {
                            Ok(c) => Peer::Unix {
                                uid: c.uid(),
                                gid: c.gid(),
                            },
                            Err(_) => Peer::Unknown,
                        };
                        self.serve(s, peer, Some(fd), place);
                    })
                }),
                Listener::Tcp(l) => self.cancel.run_until_cancelled(l.accept()).await.map(|r| {
                    r.map(|(s, peer)| {
                        let Ok(place) = Arc::clone(&open).try_acquire_owned() else {
                            let _ = s.try_write(&full(most));
                            return refused.count(&self.engine, name, most);
                        };
                        let _ = s.set_nodelay(true);
                        self.serve(s, Peer::Tcp(peer), None, place);
                    })
                }),
            };
            match accepted {
                None => return,
                Some(Ok(())) => {
                    reserve.refill();
                    short_since = None;
                }
                // Out of descriptors: the jobs kept idle give theirs back,
                // and reads hold theirs for a moment, so the connection
                // waits in the backlog for one for up to `ACCEPT_WAIT`
                // before it is refused (with the reserve's).
                Some(Err(e))
                    if fd_limit::exhausted(&e)
                        && short_since.get_or_insert_with(Instant::now).elapsed() < ACCEPT_WAIT =>
                {
                    self.engine.forget_idle_jobs();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Some(Err(e)) if fd_limit::exhausted(&e) && reserve.release() => {
                    self.turn_away(&mut listener).await;
                    refused.out_of_descriptors(&self.engine, name);
                    reserve.refill();
                    short_since = None;
                }
                Some(Err(e)) => accept_failed(&e).await,
            }
        }
    }

    /// Takes the connection waiting on `listener` (with the descriptor the
    /// reserve just gave back), tells its trainer that the stage is out of
    /// file descriptors and closes it.
    async fn turn_away(&self, listener: &mut Listener) {
        let answer = unavailable(format!(
            "the stage is out of file descriptors (it may open {}): it takes no connection until some close; try again later, or ask its operator to raise its `nofile` limit",
            fd_limit::soft()
        ));
        let wait = Duration::from_millis(100);
        // A full socket buffer drops the answer; the close still comes.
        match listener {
            Listener::Unix(l, _) => {
                if let Ok(Ok((s, _))) = tokio::time::timeout(wait, l.accept()).await {
                    let _ = s.try_write(&answer);
                }
            }
            Listener::Tcp(l) => {
                if let Ok(Ok((s, _))) = tokio::time::timeout(wait, l.accept()).await {
                    let _ = s.try_write(&answer);
                }
            }
        }
    }

    /// The next trainer on the UNIX socket (`None` once cancelled). Its
    /// file is checked for meanwhile: one removed (a cleanup script, a
    /// mistaken `rm`) left a stage that answered its health checks and
    /// that no new trainer could reach, so it is bound again.
    async fn accept_unix(
        &self,
        listener: &mut UnixListener,
        file: &std::sync::Mutex<SocketFile>,
    ) -> Option<std::io::Result<tokio::net::UnixStream>> {
        // A file that cannot be bound again is retried every check and
        // warned about once a minute (with how many tries failed).
        let mut unbound = crate::pace::Sparse::new();
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return None,
                accepted = listener.accept() => return Some(accepted.map(|(s, _)| s)),
                _ = tokio::time::sleep(SOCKET_CHECK) => {
                    let path = crate::sync::lock(file).path.clone();
                    if std::fs::symlink_metadata(&path).is_ok() {
                        continue;
                    }
                    match bind_socket(&path) {
                        Ok((bound, bound_file)) => {
                            warn!(socket = %path.display(), "the trainer socket's file was removed: bound it again");
                            *listener = bound;
                            // The old file is gone: dropping its record
                            // removes nothing (the path is the new one's).
                            *crate::sync::lock(file) = bound_file;
                        }
                        Err(e) => {
                            if let Some(tries) = unbound.note(Duration::from_secs(60)) {
                                warn!(socket = %path.display(), error = %format!("{e:#}"), tries, "the trainer socket's file was removed and cannot be bound again (tried every {}s)", SOCKET_CHECK.as_secs());
                            }
                        }
                    }
                }
            }
        }
    }

    /// Serves one connection; `unix` is its socket's descriptor when it is
    /// a UNIX socket (so a shared-memory region can be passed over it).
    fn serve<S>(
        &self,
        stream: S,
        peer: Peer,
        unix: Option<std::os::fd::RawFd>,
        place: tokio::sync::OwnedSemaphorePermit,
    ) where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + std::os::fd::AsFd + Send + 'static,
    {
        widen_send_buffer(&socket2::SockRef::from(&stream));
        let task = server::serve(
            Arc::clone(&self.engine),
            Arc::clone(&self.stage_id),
            Arc::clone(&self.access),
            stream,
            peer,
            unix,
            self.drain.clone(),
        );
        self.tracker.spawn(
            async move {
                task.await;
                drop(place);
            }
            .instrument(info_span!("trainer", %peer)),
        );
    }
}

/// How long a connection waits, in a stage out of descriptors, for one to
/// come free (reads give theirs back within milliseconds; connections and
/// regions hold theirs).
const ACCEPT_WAIT: Duration = Duration::from_secs(2);

/// The answer to a connection refused because its listener holds `most`.
fn full(most: usize) -> Vec<u8> {
    unavailable(format!(
        "the stage holds its most trainer connections on this listener ({most}, its share of a quarter of the file descriptors it had left once started): try again once some close, or ask its operator to raise its `nofile` limit"
    ))
}

/// An `ERROR UNAVAILABLE` frame saying `why`, for a connection refused
/// before it is served (sent if the socket takes it at once).
fn unavailable(why: String) -> Vec<u8> {
    Response::Error(ProtocolError::closing(ErrorCode::Unavailable, why)).encode()
}

/// A descriptor held back (`/dev/null`), so that a listener of a stage out
/// of descriptors can still take a waiting connection to refuse it.
#[derive(Debug)]
struct Reserve(Option<std::fs::File>);

impl Reserve {
    fn new() -> Self {
        Self(std::fs::File::open("/dev/null").ok())
    }

    /// Gives the descriptor back for one accept; `false` when none is held.
    fn release(&mut self) -> bool {
        self.0.take().is_some()
    }

    /// Takes a descriptor back when none is held (and one is free).
    fn refill(&mut self) {
        if self.0.is_none() {
            *self = Self::new();
        }
    }
}

/// Connections refused because the listeners held their most, or the
/// stage was out of descriptors: counted, and each logged at most once a
/// minute.
#[derive(Default)]
struct Refusals {
    full: pace::Sparse,
    exhausted: pace::Sparse,
}

impl Refusals {
    fn out_of_descriptors(&mut self, engine: &Engine, listener: &str) {
        engine.metrics().connections_refused.inc();
        if let Some(refused) = self.exhausted.note(Duration::from_secs(60)) {
            warn!(
                listener,
                limit = fd_limit::soft(),
                refused,
                "trainer connections were refused: the stage is out of file descriptors (connections, shared-memory regions, open files); raise its `nofile` limit, or run fewer jobs or connections on it"
            );
        }
    }

    fn count(&mut self, engine: &Engine, listener: &str, most: usize) {
        engine.metrics().connections_refused.inc();
        if let Some(refused) = self.full.note(Duration::from_secs(60)) {
            warn!(
                listener,
                most,
                refused,
                "trainer connections were closed as soon as they were accepted: the listener holds its most connections (its share of a quarter of the stage's file descriptor limit); peers that connect and never say HELLO are closed after 10 s"
            );
        }
    }
}

/// Sample batches are megabytes: a deep send buffer lets one write move a
/// whole batch, instead of many small writes each waking the trainer.
fn widen_send_buffer(socket: &socket2::SockRef<'_>) {
    let _ = socket.set_send_buffer_size(SEND_BUFFER);
}

/// Accept errors (out of file descriptors with no reserve, mostly) are
/// transient: back off briefly instead of spinning or giving up, and warn
/// at most once a minute.
async fn accept_failed(e: &std::io::Error) {
    static FAILED: std::sync::Mutex<pace::Sparse> = std::sync::Mutex::new(pace::Sparse::new());
    if let Some(times) = crate::sync::lock(&FAILED).note(Duration::from_secs(60)) {
        warn!(error = %e, times, "accepting a trainer connection failed");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// The trainer socket's file, removed when dropped (a stage that stops, or
/// one that fails to start after binding) unless another stage has put its
/// own socket at the path since: a stage started while this one drained
/// (this one no longer listens, so it found the file stale) keeps its.
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    /// Device and inode of the file this stage bound.
    identity: (u64, u64),
}

impl SocketFile {
    /// Device and inode of the file at `path`.
    fn identity_at(path: &Path) -> std::io::Result<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path)?;
        Ok((meta.dev(), meta.ino()))
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if SocketFile::identity_at(&self.path).is_ok_and(|found| found == self.identity) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the trainer socket with owner/group-only permissions, replacing a
/// stale socket file but never a live stage's.
fn bind_socket(path: &Path) -> anyhow::Result<(UnixListener, SocketFile)> {
    config::check_socket_path(path).map_err(anyhow::Error::msg)?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            bail!(
                "{} exists and is not a socket: --socket names the socket the stage creates (a stale one is replaced, any other file is left alone)",
                path.display()
            );
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!(
                "another process is already serving on {}: stop it or choose another --socket",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let listener = UnixListener::bind(path)
        .with_context(|| format!("binding the trainer socket {}", path.display()))?;
    let file = SocketFile {
        path: path.to_owned(),
        identity: SocketFile::identity_at(path)
            .with_context(|| format!("reading back the trainer socket {}", path.display()))?,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("restricting permissions of {}", path.display()))?;
    Ok((listener, file))
}
