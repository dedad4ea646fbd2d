//! `sluice-stage`: the data-plane process between training jobs and storage.
//!
//! A stage serves trainers over a UNIX socket (and optionally TCP) with the
//! protocol in `docs/protocol.md`. For each job it knows the epoch's read
//! order, prefetches samples in parallel into a byte-bounded buffer, delivers
//! them in order exactly once, tunes its readers and buffer, and enforces the
//! job's QoS limits. [`Stage::bind`] binds every listener; [`Stage::run`]
//! serves until the cancellation token fires.

mod chunk;
mod config;
mod dataset;
mod engine;
mod http;
mod job_config;
mod metrics;
mod plan;
mod protocol;
mod server;
mod session;
mod settings;
mod shm;
mod storage;
mod token_bucket;
mod tuner;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

pub use config::{Args, StageConfig};
// The trainer protocol's request frames, for tests that speak it to a stage.
pub use protocol::{PlanSpec, Request, TO_END};

use dataset::Dataset;
use engine::Engine;
use metrics::Metrics;

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
    socket_path: PathBuf,
    unix: UnixListener,
    tcp: Option<TcpListener>,
    http: TcpListener,
    controller: Option<(String, session::Identity)>,
}

/// The addresses a bound stage listens on (printed as its ready line).
#[derive(Debug, serde::Serialize)]
pub struct Addresses {
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    pub metrics: SocketAddr,
}

impl Stage {
    /// Opens the datasets and binds the trainer socket, the optional TCP
    /// listener and the metrics listener.
    pub async fn bind(config: StageConfig) -> anyhow::Result<Self> {
        let datasets = config
            .datasets
            .iter()
            .map(|(name, dir)| Dataset::new(name, dir, config.direct_io))
            .collect::<Result<Vec<_>, _>>()?;
        let unix = bind_socket(&config.socket)?;
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
        let engine = Engine::new(
            datasets,
            config.memory_budget,
            config.job,
            config.shared_memory,
            Metrics::new(),
        );
        let controller = config.controller.map(|url| {
            let identity = session::Identity {
                stage_id: config.stage_id.clone(),
                node: config.node,
                labels: config.labels,
                tls: config.controller_tls,
            };
            (url, identity)
        });
        Ok(Self {
            engine,
            stage_id: config.stage_id.into(),
            socket_path: config.socket,
            unix,
            tcp,
            http,
            controller,
        })
    }

    pub fn addresses(&self) -> anyhow::Result<Addresses> {
        Ok(Addresses {
            socket: self.socket_path.clone(),
            tcp: self.tcp.as_ref().map(TcpListener::local_addr).transpose()?,
            metrics: self.http.local_addr()?,
        })
    }

    /// Serves until `cancel` fires, then stops accepting, lets connections
    /// finish for up to a few seconds, and stops the readers.
    pub async fn run(self, cancel: CancellationToken) -> anyhow::Result<()> {
        let Self {
            engine,
            stage_id,
            socket_path,
            unix,
            tcp,
            http,
            controller,
        } = self;
        let tracker = TaskTracker::new();
        if let Some((url, identity)) = controller {
            let session = session::run(Arc::clone(&engine), url, identity, cancel.clone());
            tokio::spawn(session.instrument(info_span!("controller")));
        }

        let app = http::router(Arc::clone(&engine));
        let http_cancel = cancel.clone();
        let http_task = tokio::spawn(
            async move {
                axum::serve(http, app)
                    .with_graceful_shutdown(http_cancel.cancelled_owned())
                    .await
            }
            .instrument(info_span!("http")),
        );
        tokio::spawn(tick(Arc::clone(&engine), cancel.clone()).instrument(info_span!("tuner")));

        let ctx = Accepting {
            engine: Arc::clone(&engine),
            stage_id,
            cancel: cancel.clone(),
            tracker: tracker.clone(),
        };
        let accept_unix = ctx.clone().run(Listener::Unix(unix));
        let accept_tcp = async {
            if let Some(tcp) = tcp {
                ctx.clone().run(Listener::Tcp(tcp)).await;
            }
        };
        tokio::join!(accept_unix, accept_tcp);
        info!("shutting down: draining trainer connections");
        tracker.close();
        if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait())
            .await
            .is_err()
        {
            warn!("some trainer connections did not finish within the drain timeout");
        }
        engine.stop();
        let _ = std::fs::remove_file(&socket_path);
        match http_task.await {
            Ok(result) => result.context("serving /metrics"),
            Err(e) => bail!("the metrics server task failed: {e}"),
        }
    }
}

/// Runs every job's tuner once per tick until `cancel` fires.
async fn tick(engine: Arc<Engine>, cancel: CancellationToken) {
    let mut interval = tokio::time::interval(tuner::TICK);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while cancel.run_until_cancelled(interval.tick()).await.is_some() {
        engine.tick(Instant::now());
    }
}

/// A listener trainers connect through.
enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// What every accepted connection is served with.
#[derive(Clone)]
struct Accepting {
    engine: Arc<Engine>,
    stage_id: Arc<str>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Accepting {
    /// Accepts trainers until cancelled, one task per connection.
    async fn run(self, listener: Listener) {
        loop {
            let accepted = match &listener {
                Listener::Unix(l) => self.cancel.run_until_cancelled(l.accept()).await.map(|r| {
                    r.map(|(s, _)| {
                        let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
                        self.serve(s, "unix".to_owned(), Some(fd));
                    })
                }),
                Listener::Tcp(l) => self.cancel.run_until_cancelled(l.accept()).await.map(|r| {
                    r.map(|(s, peer)| {
                        let _ = s.set_nodelay(true);
                        self.serve(s, peer.to_string(), None);
                    })
                }),
            };
            match accepted {
                None => return,
                Some(Ok(())) => {}
                Some(Err(e)) => accept_failed(&e).await,
            }
        }
    }

    /// Serves one connection; `unix` is its socket's descriptor when it is
    /// a UNIX socket (so a shared-memory region can be passed over it).
    fn serve<S>(&self, stream: S, peer: String, unix: Option<std::os::fd::RawFd>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + std::os::fd::AsFd + Send + 'static,
    {
        widen_send_buffer(&socket2::SockRef::from(&stream));
        let task = server::serve(
            Arc::clone(&self.engine),
            Arc::clone(&self.stage_id),
            stream,
            unix,
            self.cancel.clone(),
        );
        self.tracker
            .spawn(task.instrument(info_span!("trainer", %peer)));
    }
}

/// Sample batches are megabytes: a deep send buffer lets one write move a
/// whole batch, instead of many small writes each waking the trainer.
fn widen_send_buffer(socket: &socket2::SockRef<'_>) {
    let _ = socket.set_send_buffer_size(SEND_BUFFER);
}

/// Accept errors (out of file descriptors, mostly) are transient: back off
/// briefly instead of spinning or giving up.
async fn accept_failed(e: &std::io::Error) {
    warn!(error = %e, "accepting a trainer connection failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Binds the trainer socket with owner/group-only permissions, replacing a
/// stale socket file but never a live stage's.
fn bind_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if path.exists() {
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
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("restricting permissions of {}", path.display()))?;
    Ok(listener)
}
