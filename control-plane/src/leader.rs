//! The controller's two roles. The replica holding the leader lease serves
//! stages and the admin API and runs the control loop. A replica that
//! cannot take it (another one leads on the same Postgres) starts as a
//! standby: its HTTP server answers `/healthz` and `/metrics`, `/readyz`
//! and `/api/` answer 503, its gRPC services answer `UNAVAILABLE`, and it
//! tries the lease every tick. Once it holds the lease it reloads the store
//! and leads as a controller started fresh does, so the stages, routed to
//! it once it turns ready, reconnect and converge.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::control::{self, Ended};
use crate::policies::{self, Source};
use crate::state::Shared;
use crate::store::Leadership;
use crate::sync::lock;

/// Why a standby refuses work, for `/readyz`, `/api/` and gRPC callers.
const STANDBY: &str =
    "standby: another sluice controller holds the leader lease and serves stages and the admin API";
/// Why a new leader refuses work while it reloads the store.
const STARTING: &str = "starting: loading policies and settings from the store";

/// Returns why this controller cannot serve yet, or `None` once it leads,
/// has loaded its state and reaches its store.
pub fn unready_reason(shared: &Shared) -> Option<String> {
    if let Some(outage) = lock(&shared.outage).as_ref() {
        Some(outage.clone())
    } else if shared.ready.load(Ordering::Acquire) {
        None
    } else if shared.metrics.leader.get() == 0 {
        Some(STANDBY.to_owned())
    } else {
        Some(STARTING.to_owned())
    }
}

/// Makes this controller the leader in memory: marks it leader, reloads
/// stages, jobs, desired settings and policies from the store, applies the
/// `--policies` documents, then turns ready.
pub async fn take_office(shared: &Shared, policies: Option<Vec<Source>>) -> anyhow::Result<()> {
    shared.metrics.leader.set(1);
    shared.reload().await.context("reloading stages and jobs")?;
    policies::load(shared)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("loading the stored policies")?;
    if let Some(sources) = policies {
        policies::apply_at_start(shared, sources)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("applying --policies")?;
    }
    shared.ready.store(true, Ordering::Release);
    Ok(())
}

/// Leads for as long as this controller runs: a standby (`leadership`
/// `None`) first waits for the lease and takes office with `policies` (the
/// loop then lets the stages reconnect before it publishes, as for a
/// controller started fresh). A leader that lost its store and, once the
/// store answered again, found another replica in office stands by again.
/// Returns when `cancel` fires.
pub async fn lead(
    shared: Arc<Shared>,
    tick: Duration,
    mut leadership: Option<Leadership>,
    mut policies: Option<Vec<Source>>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let lease = match leadership.take() {
            Some(lease) => lease,
            None => {
                info!("another controller holds the leader lease: standing by");
                // While the store cannot be reached, a standby says so
                // rather than that another controller leads.
                let reached = |error: Option<&crate::store::StoreError>| {
                    *lock(&shared.outage) = error.map(|e| match e {
                        crate::store::StoreError::Newer { .. } => {
                            format!("standby, and will not lead: {e}")
                        }
                        e => {
                            format!("standby: cannot reach the store to try the leader lease ({e})")
                        }
                    });
                    shared.metrics.store_up.set(i64::from(error.is_none()));
                };
                let Some(lease) = Leadership::wait(&shared.store, tick, &cancel, reached).await
                else {
                    return Ok(());
                };
                info!("took the leader lease: taking over");
                // The stored policies are what the leader before served:
                // `--policies` that no longer fit them must not leave the
                // stages without any leader.
                let sources = policies.take();
                if let Err(e) = take_office(&shared, sources.clone()).await {
                    if sources.is_none() {
                        return Err(e);
                    }
                    tracing::error!(error = %format!("{e:#}"), "--policies cannot be applied over the stored policies: leading with the stored ones (fix the files, or apply them with `sluicectl apply` to see why)");
                    take_office(&shared, None).await?;
                }
                info!("leading: serving stages");
                lease
            }
        };
        match control::run(shared.clone(), tick, lease, cancel.clone()).await {
            Ended::Cancelled => return Ok(()),
            Ended::Deposed => step_down(&shared),
        }
    }
}

/// Stops leading: not ready, its stages' sessions ended (they reconnect,
/// through the Service, to the leader) and its view of them forgotten,
/// and its gauges as a standby's (the leader's figures are the new
/// leader's to give: kept, they stayed at their last values for good).
fn step_down(shared: &Shared) {
    warn!("another controller took the leader lease while the store was unreachable: standing by");
    shared.ready.store(false, Ordering::Release);
    shared.metrics.leader.set(0);
    *lock(&shared.outage) = None;
    shared.metrics.store_up.set(1);
    shared.forget_stages();
    shared.count_stages();
    shared.metrics.jobs.set(0);
    shared.metrics.policies.set(0);
    shared.metrics.allocation.clear();
}

/// A gRPC interceptor that answers `UNAVAILABLE` until this controller
/// leads and is ready, so stages and `sluicectl` retry elsewhere or later.
#[derive(Debug, Clone)]
pub struct GrpcGate(pub Arc<Shared>);

impl tonic::service::Interceptor for GrpcGate {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        match unready_reason(&self.0) {
            None => Ok(request),
            Some(reason) => Err(tonic::Status::unavailable(reason)),
        }
    }
}

/// HTTP middleware: `/api/` answers 503 until this controller leads and is
/// ready (a standby's store view could be stale, and its writes would be
/// unseen by the leader); health and metrics are always served.
pub async fn http_gate(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    match unready_reason(&shared) {
        Some(reason) if request.uri().path().starts_with("/api/") => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response()
        }
        _ => next.run(request).await,
    }
}
