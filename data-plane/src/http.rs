//! The stage's HTTP surface: `/metrics` (Prometheus text format),
//! `/healthz`, `/readyz`, `/api/v1/jobs` (the telemetry snapshot as JSON)
//! and `/api/v1/cache` (the node cache's capacity and use by data set).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::engine::Engine;

/// The HTTP listener, bounded so that its clients cannot take what
/// trainers need: at most 128 connections at once, and at most a
/// sixteenth of the descriptor limit under a low one (16 of 256), each
/// closed after a minute without a byte (a Prometheus scrape reuses its
/// connection well within that).
pub fn listener(listener: tokio::net::TcpListener) -> sluice_proto::listen::Incoming {
    let most = (sluice_proto::fd_limit::soft() / 16).clamp(4, 128);
    sluice_proto::listen::Incoming::new(listener, most).with_idle(Duration::from_secs(60))
}

pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ready\n" }))
        .route("/api/v1/jobs", get(jobs))
        .route("/api/v1/cache", get(cache))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(no_such_endpoint)
        .with_state(engine)
}

/// A path or method the stage does not serve: a 404 or 405 that says what
/// it serves (it was a 404 with an empty body).
async fn no_such_endpoint(method: axum::http::Method, uri: axum::http::Uri) -> impl IntoResponse {
    let served = [
        "/metrics",
        "/healthz",
        "/readyz",
        "/api/v1/jobs",
        "/api/v1/cache",
    ];
    let path = uri.path();
    let status = if served.contains(&path) {
        axum::http::StatusCode::METHOD_NOT_ALLOWED
    } else {
        axum::http::StatusCode::NOT_FOUND
    };
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!(
            "no {method} {path} here: this stage serves GET {}\n",
            served.join(", ")
        ),
    )
}

async fn metrics(State(engine): State<Arc<Engine>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        engine.metrics().render(),
    )
}

async fn jobs(State(engine): State<Arc<Engine>>) -> impl IntoResponse {
    axum::Json(engine.snapshot())
}

async fn cache(State(engine): State<Arc<Engine>>) -> impl IntoResponse {
    axum::Json(engine.cache().map(|c| c.report()))
}
