//! The sluice controller: it keeps one session open to every stage, turns
//! the operators' policies into per-stage settings, pushes them with
//! increasing versions and records which version each stage runs.
//!
//! [`Controller::bind`] opens the [`store`] (SQLite by default, Postgres to
//! scale out), reloads policies and desired settings from it and binds the
//! gRPC listener (`StageService` for stages, `AdminService` for
//! `sluicectl`) and the HTTP listener (REST view, `/metrics`, health);
//! [`Controller::run`] serves them and runs the control loop until
//! cancelled. A replica that cannot take the leader lease (Postgres, another
//! replica leads) serves as a standby until it can: see [`leader`].
//! Modules: [`sessions`] (stage sessions), [`control`] (the loop, on the
//! policy crate's `Coordinator`), [`policies`] (policy changes), [`views`]
//! (the read model), [`admin`] and [`http`] (the edges), [`auth`] (who may
//! use the admin API).

mod admin;
mod auth;
mod config;
mod control;
mod datasets;
mod error;
#[cfg(fuzzing)]
pub mod fuzzing;
mod http;
mod leader;
mod metrics;
mod policies;
mod recorder;
mod screen;
mod sessions;
mod state;
pub mod store;
mod sync;
mod views;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use sluice_proto::{AdminServiceServer, StageServiceServer, fd_limit, listen};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tracing::{Instrument, info, info_span};

use leader::GrpcGate;

pub use auth::{AdminAccess, Auth, Role, TokenFileError, Tokens};
pub use config::{Args, ControllerConfig};
use state::Shared;
use store::{Leadership, Store};

/// Returns the store error behind a start-up failure when the operator's
/// configuration is at fault (`--database-url` names no usable store, or
/// another controller uses it): the binary exits 64 for it, as for an
/// invalid flag.
pub fn configuration_error(e: &anyhow::Error) -> Option<&store::StoreError> {
    e.chain()
        .find_map(|cause| cause.downcast_ref::<store::StoreError>())
        .filter(|store| store.is_configuration())
}

/// `--policies` that cannot be read or hold a document that is not valid
/// on its own: an invalid configuration (exit 64), found before the store
/// is opened.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidPolicies(pub String);

/// How long a shutdown waits for requests in flight.
pub const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A controller with its store open and its listeners bound.
#[derive(Debug)]
pub struct Controller {
    shared: Arc<Shared>,
    config: ControllerConfig,
    /// Who may use the admin API.
    auth: Arc<Auth>,
    grpc: TcpListener,
    http: TcpListener,
    /// The lease, or `None` for a standby.
    leadership: Option<Leadership>,
    /// `--policies`, read at start and applied when a standby takes over.
    pending_policies: Option<Vec<policies::Source>>,
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
    /// store and reads `--policies`, then tries the leader lease. With it,
    /// loads policies and desired settings and applies `--policies`;
    /// without it (another replica leads), prepares a standby that does so
    /// when it takes over.
    pub async fn with_listeners(
        config: ControllerConfig,
        grpc: TcpListener,
        http: TcpListener,
    ) -> anyhow::Result<Self> {
        // Read and checked before the store is opened: a mistake in them
        // leaves no new database behind.
        let sources = match &config.policies {
            Some(path) => Some(
                policies::read_sources(path)
                    .map_err(|e| InvalidPolicies(format!("reading {}: {e}", path.display())))
                    .and_then(|sources| {
                        policies::check_sources(&sources).map_err(InvalidPolicies)?;
                        Ok(sources)
                    })?,
            ),
            None => None,
        };
        let store = Store::open(&config.database_url)
            .await
            .context("opening the store")?;
        let leadership = store
            .try_acquire_leadership()
            .await
            .context("trying the leader lease")?;
        let auth = Arc::new(Auth::new(config.admin.clone()));
        auth.announce(grpc.local_addr()?, http.local_addr()?);
        let shared = Arc::new(Shared::new(store, config.stage_timeout));
        let pending_policies = if leadership.is_some() {
            leader::take_office(&shared, sources).await?;
            None
        } else {
            sources
        };
        Ok(Self {
            shared,
            config,
            auth,
            grpc,
            http,
            leadership,
            pending_policies,
        })
    }

    /// Returns whether this controller started as the leader (`false`: a
    /// standby, until it takes the lease in [`Controller::run`]).
    pub fn is_leader(&self) -> bool {
        self.leadership.is_some()
    }

    /// Returns the admin API's gatekeeper ([`Auth::reload_now`] on SIGHUP).
    pub fn auth(&self) -> Arc<Auth> {
        self.auth.clone()
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
        let control = leader::lead(
            shared.clone(),
            self.config.tick,
            self.leadership,
            self.pending_policies,
            cancel.child_token(),
        );
        tasks.spawn(
            async move { ("control loop", control.await) }.instrument(info_span!("control")),
        );
        let grpc_cancel = cancel.child_token();
        let gate = GrpcGate(shared.clone());
        // Each listener holds a share of the descriptors (raised to the hard
        // limit): the gRPC one, where every stage keeps a session, half;
        // the HTTP one a quarter; the store keeps the rest.
        fd_limit::raise();
        let (grpc_most, http_most) = {
            let quarter = fd_limit::connections_per_listener();
            (quarter.saturating_mul(2), quarter)
        };
        let mut server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(listen::KEEPALIVE))
            .http2_keepalive_timeout(Some(listen::KEEPALIVE));
        if let Some(tls) = self.config.tls {
            server = server.tls_config(tls).context("configuring TLS")?;
        }
        let watch = self.auth.clone().watch(cancel.child_token());
        tasks
            .spawn(async move { ("token file watch", watch.await) }.instrument(info_span!("auth")));
        // Tokens are checked before the leader gate: a caller without one
        // learns nothing, not even that this replica stands by.
        let stages = StageServiceServer::new(sessions::Sessions::new(
            shared.clone(),
            self.config.bind_stage_ids,
        ))
        .max_decoding_message_size(sessions::MAX_STAGE_MESSAGE);
        let routes = Routes::new(InterceptedService::new(stages, gate.clone()))
            .add_service(AdminServiceServer::with_interceptor(
                admin::Admin::new(shared.clone()),
                gate,
            ))
            .into_axum_router()
            .layer(axum::middleware::from_fn_with_state(
                self.auth.clone(),
                auth::grpc_gate,
            ));
        let grpc = server
            .add_routes(routes.into())
            .serve_with_incoming_shutdown(
                listen::Incoming::new(self.grpc, grpc_most),
                async move {
                    grpc_cancel.cancelled().await;
                },
            );
        tasks.spawn(async move { ("gRPC server", grpc.await.map_err(Into::into)) });
        let http_cancel = cancel.child_token();
        let router = http::router(shared.clone())
            .layer(axum::middleware::from_fn_with_state(
                shared.clone(),
                leader::http_gate,
            ))
            .layer(axum::middleware::from_fn_with_state(
                self.auth.clone(),
                auth::http_gate,
            ));
        let http = axum::serve(listen::Incoming::new(self.http, http_most), router)
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
