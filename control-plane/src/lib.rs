//! The sluice controller: it keeps one session open to every stage, turns
//! the operators' policies into per-stage settings, pushes them with
//! increasing versions and records which version each stage runs.
//!
//! [`Controller::bind`] opens the [`store`] (SQLite by default, Postgres to
//! scale out), reloads policies and desired settings from it and binds the
//! gRPC listener (`StageService` for stages, `AdminService` for
//! `sluicectl`) and the HTTP listener (REST view, `/metrics`, health);
//! [`Controller::run`] serves them and runs the control loop until
//! cancelled. Modules: [`sessions`] (stage sessions), [`control`] (the
//! loop), [`compute`] (static settings from policies), [`policies`] (policy
//! changes), [`views`] (the read model), [`admin`] and [`http`] (the edges).

pub mod admin;
pub mod compute;
pub mod config;
pub mod control;
pub mod demand;
pub mod error;
pub mod http;
pub mod metrics;
pub mod policies;
pub mod sessions;
pub mod state;
pub mod store;
pub mod views;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::Context;
use sluice_proto::{AdminServiceServer, StageServiceServer};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tracing::{Instrument, info, info_span};

pub use config::{Args, ControllerConfig};
use state::Shared;
use store::{Leadership, Store};

/// How long a shutdown waits for requests in flight.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A controller with its store open and its listeners bound.
#[derive(Debug)]
pub struct Controller {
    shared: Arc<Shared>,
    config: ControllerConfig,
    grpc: TcpListener,
    http: TcpListener,
    leadership: Leadership,
}

/// Where a bound controller listens.
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    /// The gRPC server.
    pub grpc: SocketAddr,
    /// The HTTP server.
    pub http: SocketAddr,
}

impl Controller {
    /// Binds the configured addresses (port 0 picks a free port) and
    /// prepares the controller.
    pub async fn bind(config: ControllerConfig) -> anyhow::Result<Self> {
        let grpc = TcpListener::bind(config.grpc_addr)
            .await
            .with_context(|| format!("binding the gRPC address {}", config.grpc_addr))?;
        let http = TcpListener::bind(config.http_addr)
            .await
            .with_context(|| format!("binding the HTTP address {}", config.http_addr))?;
        Self::with_listeners(config, grpc, http).await
    }

    /// Prepares the controller on listeners bound by the caller: opens the
    /// store, takes the leader lease, loads policies and desired settings,
    /// and applies `--policies`.
    pub async fn with_listeners(
        config: ControllerConfig,
        grpc: TcpListener,
        http: TcpListener,
    ) -> anyhow::Result<Self> {
        let store = Store::open(&config.database_url)
            .await
            .context("opening the store")?;
        let leadership = store
            .try_acquire_leadership()
            .await
            .context("taking the leader lease")?
            .context("another controller holds the leader lease (standby mode is not built yet)")?;
        let shared = Arc::new(Shared::new(store, config.stage_timeout));
        shared.reload().await.context("reloading stages and jobs")?;
        policies::load(&shared)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("loading the stored policies")?;
        if let Some(path) = &config.policies {
            let sources = policies::read_sources(path)
                .with_context(|| format!("reading policies from {}", path.display()))?;
            policies::apply(&shared, sources, false)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))
                .context("applying --policies")?;
        }
        shared.ready.store(true, Ordering::Release);
        Ok(Self {
            shared,
            config,
            grpc,
            http,
            leadership,
        })
    }

    /// Returns the bound addresses.
    pub fn addresses(&self) -> std::io::Result<Addresses> {
        Ok(Addresses {
            grpc: self.grpc.local_addr()?,
            http: self.http.local_addr()?,
        })
    }

    /// Serves until `cancel` fires, then ends every stage session and
    /// event watch, drains both servers (at most [`DRAIN_TIMEOUT`]) and
    /// closes the store. Fails if a server or the control loop dies.
    pub async fn run(self, cancel: CancellationToken) -> anyhow::Result<()> {
        let shared = self.shared;
        let mut tasks: JoinSet<(&'static str, anyhow::Result<()>)> = JoinSet::new();
        let control = control::run(
            shared.clone(),
            self.config.tick,
            self.leadership,
            cancel.child_token(),
        );
        tasks.spawn(
            async move { ("control loop", control.await.map_err(Into::into)) }
                .instrument(info_span!("control")),
        );
        let grpc_cancel = cancel.child_token();
        let grpc = tonic::transport::Server::builder()
            .add_service(StageServiceServer::new(sessions::Sessions::new(
                shared.clone(),
            )))
            .add_service(AdminServiceServer::new(admin::Admin::new(shared.clone())))
            .serve_with_incoming_shutdown(TcpIncoming::from(self.grpc), async move {
                grpc_cancel.cancelled().await;
            });
        tasks.spawn(async move { ("gRPC server", grpc.await.map_err(Into::into)) });
        let http_cancel = cancel.child_token();
        let http = axum::serve(self.http, http::router(shared.clone()))
            .with_graceful_shutdown(async move { http_cancel.cancelled().await });
        tasks.spawn(async move { ("HTTP server", http.await.map_err(Into::into)) });
        let failure = tokio::select! {
            biased;
            () = cancel.cancelled() => None,
            Some(done) = tasks.join_next() => Some(match done {
                Ok((task, Ok(()))) => anyhow::anyhow!("the {task} stopped unexpectedly"),
                Ok((task, Err(e))) => e.context(format!("the {task} failed")),
                Err(e) => anyhow::anyhow!("a controller task panicked: {e}"),
            }),
        };
        cancel.cancel();
        // Open sessions and watches are endless streams: end them so the
        // servers can drain.
        shared.shutdown.cancel();
        shared.close_sessions();
        let drain = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(DRAIN_TIMEOUT, drain).await.is_err() {
            tracing::warn!(timeout = ?DRAIN_TIMEOUT, "drain timed out: stopping anyway");
            tasks.abort_all();
        }
        shared.store.close().await;
        info!("controller stopped");
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
