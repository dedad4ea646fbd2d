//! The stage's session with the controller (`--controller URL`): one
//! `StageService.Session` stream carrying hello and telemetry up and
//! versioned settings down, each answered with an ack or a nack.
//!
//! Fail-static: when the controller is unreachable the stage keeps the last
//! settings it accepted and keeps serving trainers; it reconnects with capped
//! exponential backoff and jitter, and says in its hello which settings
//! version it runs, so a restarted controller knows what is in force.

mod convert;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_proto::v1::{
    Ack, ControllerMessage, Hello, Nack, StageMessage, controller_message, stage_message,
};
use sluice_proto::{StageServiceClient, error_chain};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::{info, warn};

use crate::engine::Engine;
use crate::pace::jittered;

/// How often telemetry goes up (and at once when a job starts or leaves):
/// the controller's windows are at least 400 ms long, so a change in how
/// a job reads is seen within a second.
pub const TELEMETRY_INTERVAL: Duration = Duration::from_millis(500);
/// First reconnection delay; doubled per failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A session that lasted this long resets the backoff.
const STABLE_SESSION: Duration = Duration::from_secs(10);

/// How long a stopping stage waits for the controller to close the
/// session it ended.
const LEAVE_GRACE: Duration = Duration::from_secs(1);

/// How long a connection to the controller may take, TLS handshake
/// included.
const CONNECT_WITHIN: Duration = Duration::from_secs(10);

/// Who this stage is, as its hello (and, with mutual TLS, its
/// certificate) tells the controller.
#[derive(Debug, Clone)]
pub struct Identity {
    pub stage_id: String,
    pub node: String,
    pub labels: BTreeMap<String, String>,
    /// The certificate presented and the CA the controller is checked
    /// against (`https://` controller URLs).
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("the controller URL `{url}` is invalid: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("connecting to the controller: {}", error_chain(.0))]
    Connect(#[from] tonic::transport::Error),
    #[error("connecting to the controller: no connection (TLS handshake included) within {0:?}")]
    ConnectTimedOut(Duration),
    #[error("{}", refusal(.0))]
    Refused(#[from] tonic::Status),
    #[error("the controller closed the session")]
    Closed,
    #[error(
        "the server at {url} does not speak gRPC (it answered with content-type `{content_type}`): give the controller's gRPC address (its --grpc-addr, port 7070 by default), not its HTTP or metrics port"
    )]
    NotGrpc { url: String, content_type: String },
}

/// Keeps a session with the controller at `url` until `cancel` fires,
/// reconnecting after every failure.
pub async fn run(engine: Arc<Engine>, url: String, identity: Identity, cancel: CancellationToken) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let started = tokio::time::Instant::now();
        // The session ends itself when `cancel` fires (see `session`).
        let result = Some(session(&engine, &url, &identity, &cancel).await)
            .filter(|_| !cancel.is_cancelled());
        engine.metrics().controller_connected.set(0);
        engine.set_controller_live(false);
        // A session that lasted starts the backoff over; the wait is drawn
        // before it is logged, so the log says what is waited.
        if started.elapsed() >= STABLE_SESSION {
            backoff = MIN_BACKOFF;
        }
        // Between half and all of it: stages that lost one controller do
        // not reconnect in lockstep.
        let delay = jittered(backoff, 0.5);
        match result {
            None => return,
            Some(Err(e @ SessionError::BadUrl { .. })) => {
                tracing::error!(error = %e, "no controller session: fix --controller");
                return;
            }
            Some(Err(e)) if e.is_transport() => {
                let hint = if url.starts_with("https://") {
                    "the controller is unreachable, or the TLS handshake failed: the controller's \
                     --tls-ca must have signed this stage's --tls-cert, and this stage's --tls-ca \
                     the controller's certificate"
                } else {
                    "the controller is unreachable, or it requires TLS: then give an https:// URL \
                     with --tls-cert, --tls-key and --tls-ca"
                };
                warn!(error = %e, hint, retry_in = ?delay, "controller session ended; keeping the last settings")
            }
            // Another stage holds this id: say so in its words (it names
            // the holder and the fix) and retry, to take over once it goes.
            Some(Err(SessionError::Refused(status))) if status.code() == Code::AlreadyExists => {
                warn!(retry_in = ?delay, "{}; retrying until that session ends", status.message())
            }
            Some(Err(e)) => {
                warn!(error = %e, retry_in = ?delay, "controller session ended; keeping the last settings")
            }
            Some(Ok(())) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
        if cancel
            .run_until_cancelled(tokio::time::sleep(delay))
            .await
            .is_none()
        {
            return;
        }
    }
}

impl SessionError {
    /// Whether the connection failed below gRPC (nothing answered as a
    /// controller), as opposed to a controller refusing the session.
    fn is_transport(&self) -> bool {
        match self {
            Self::Connect(_) | Self::ConnectTimedOut(_) => true,
            Self::Refused(status) => {
                std::error::Error::source(status).is_some_and(|e| e.is::<tonic::transport::Error>())
            }
            Self::BadUrl { .. } | Self::Closed | Self::NotGrpc { .. } => false,
        }
    }
}

/// Says why a session was refused: the controller's answer, or what broke
/// the connection before any answer.
fn refusal(status: &tonic::Status) -> String {
    match std::error::Error::source(status) {
        Some(source) => format!("the session's connection failed: {}", error_chain(source)),
        None => format!(
            "the controller refused the session: {:?}: {}",
            status.code(),
            status.message()
        ),
    }
}

/// One session: connect, hello, then telemetry every half second (and at
/// once when a job starts or leaves) and an answer to every settings push, until either
/// side ends it.
async fn session(
    engine: &Arc<Engine>,
    url: &str,
    identity: &Identity,
    stopping: &CancellationToken,
) -> Result<(), SessionError> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| SessionError::BadUrl {
            url: url.to_owned(),
            reason: e.to_string(),
        })?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5));
    let endpoint = match &identity.tls {
        Some(tls) => endpoint.tls_config(tls.clone())?,
        None => endpoint,
    };
    // The connect timeout above is the TCP connect's: a TLS handshake
    // through a path that went silent (a partition) would wait for ever.
    let connect = tokio::time::timeout(CONNECT_WITHIN, endpoint.connect());
    let Some(channel) = stopping.run_until_cancelled(connect).await else {
        return Ok(());
    };
    let channel = channel.map_err(|_| SessionError::ConnectTimedOut(CONNECT_WITHIN))?;
    let (tx, rx) = mpsc::channel::<StageMessage>(16);
    let send = |kind| StageMessage { kind: Some(kind) };
    tx.send(send(stage_message::Kind::Hello(hello(engine, identity))))
        .await
        .map_err(|_| SessionError::Closed)?;
    let mut client = StageServiceClient::new(channel?);
    // A stage stopping while its hello is answered still ends the session
    // it opened (below), unless the answer takes longer than the grace.
    let opened = tokio::select! {
        opened = client.session(ReceiverStream::new(rx)) => opened,
        () = async {
            stopping.cancelled().await;
            tokio::time::sleep(LEAVE_GRACE).await;
        } => return Ok(()),
    };
    let opened = opened?;
    // An HTTP server (the controller's REST port, say) answers the call
    // with its own page: no session, whatever the stream seems to open.
    let content_type = opened
        .metadata()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("application/grpc") {
        return Err(SessionError::NotGrpc {
            url: url.to_owned(),
            content_type: content_type.to_owned(),
        });
    }
    let mut inbound = opened.into_inner();
    info!(%url, version = engine.settings_version(), "controller session up");
    engine.metrics().controller_connected.set(1);
    engine.set_controller_live(true);
    let mut ticker = tokio::time::interval(TELEMETRY_INTERVAL);
    // The stage stops: the session is ended from this side (the end of
    // the stream, which tells the controller the stage left rather than
    // went silent), and the controller's end of it awaited a moment.
    loop {
        let reply = tokio::select! {
            biased;
            () = stopping.cancelled() => {
                drop(tx);
                let closed = async { while let Ok(Some(_)) = inbound.message().await {} };
                let _ = tokio::time::timeout(LEAVE_GRACE, closed).await;
                return Ok(());
            }
            _ = ticker.tick() => send(stage_message::Kind::Telemetry(convert::telemetry(engine))),
            () = engine.jobs_changed() => send(stage_message::Kind::Telemetry(convert::telemetry(engine))),
            message = inbound.message() => {
                let Some(ControllerMessage { kind: Some(controller_message::Kind::Settings(pushed)) }) = message? else {
                    return Err(SessionError::Closed);
                };
                let version = pushed.version;
                match convert::settings(pushed).and_then(|s| engine.apply_settings(s)) {
                    Ok(()) => {
                        info!(version, "settings applied");
                        send(stage_message::Kind::Ack(Ack { version }))
                    }
                    Err(reason) => {
                        warn!(version, %reason, "settings refused; keeping the ones in force");
                        engine.metrics().settings_rejected.inc();
                        send(stage_message::Kind::Nack(Nack { version, reason }))
                    }
                }
            }
        };
        tx.send(reply).await.map_err(|_| SessionError::Closed)?;
    }
}

fn hello(engine: &Engine, identity: &Identity) -> Hello {
    Hello {
        stage_id: identity.stage_id.clone(),
        node: identity.node.clone(),
        labels: identity.labels.clone().into_iter().collect(),
        capabilities: vec![
            "prefetch".into(),
            "qos".into(),
            "tuner".into(),
            "direct-io".into(),
        ],
        settings_version: engine.settings_version(),
        datasets: engine.dataset_names(),
        memory_budget_bytes: engine.memory().budget(),
        reader_budget: 0,
        software_version: env!("CARGO_PKG_VERSION").into(),
    }
}
