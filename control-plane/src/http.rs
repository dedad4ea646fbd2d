//! The HTTP surface: a read-only REST view (`GET /api/v1/{stages,jobs,
//! pools,datasets,policies}`, `GET /api/v1/datasets/NAME`), `POST
//! /api/v1/policies` (a YAML body), `/metrics` (Prometheus text),
//! `/healthz` and `/readyz`. Every `/api/` endpoint
//! refuses query parameters it does not take (see [`query`]).

mod query;

use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::StringRejection;
use axum::extract::{DefaultBodyLimit, Path, RawQuery, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;

use crate::error::ApiError;
use crate::leader;
use crate::policies::{self, Source};
use crate::state::Shared;
use crate::views;
use query::Query;

/// The largest policy body accepted.
const MAX_BODY: usize = 4 << 20;

/// Returns the router over the shared state.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/v1/stages", get(stages))
        .route("/api/v1/jobs", get(jobs))
        .route("/api/v1/pools", get(pools))
        .route("/api/v1/datasets", get(datasets))
        .route("/api/v1/datasets/{name}", get(dataset))
        .route("/api/v1/policies", get(list_policies).post(apply_policies))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(refuse_declared_too_large))
        .with_state(shared)
}

/// Refuses a request whose `Content-Length` is over [`MAX_BODY`] before
/// its body is sent (it was read up to the limit first, however slowly it
/// came).
async fn refuse_declared_too_large(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match declared {
        Some(size) if size > MAX_BODY as u64 => too_large(&format!("{size} bytes")).into_response(),
        _ => next.run(request).await,
    }
}

/// A body larger than one apply takes.
fn too_large(size: &str) -> ApiError {
    ApiError::TooLarge(format!(
        "the body is {size}: one apply takes at most 4 MiB ({MAX_BODY} bytes) of policies; \
         apply them in several parts"
    ))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, text) = self.http();
        let mut text = text;
        text.push('\n');
        (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            text,
        )
            .into_response()
    }
}

/// What the HTTP surface serves, for the answer to a path it does not.
const ENDPOINTS: &str = "GET /api/v1/stages, /api/v1/jobs, /api/v1/pools, /api/v1/datasets, \
     /api/v1/datasets/NAME, /api/v1/policies, /metrics, /healthz, /readyz; POST /api/v1/policies";

/// The paths [`ENDPOINTS`] names, but `/api/v1/datasets/NAME`.
const SERVED: [&str; 8] = [
    "/api/v1/stages",
    "/api/v1/jobs",
    "/api/v1/pools",
    "/api/v1/datasets",
    "/api/v1/policies",
    "/metrics",
    "/healthz",
    "/readyz",
];

/// A path the HTTP surface does not serve: a 404 that says what it does
/// serve (and the path without its trailing slash, where that is one).
async fn no_such_endpoint(uri: axum::http::Uri) -> Response {
    let path = uri.path();
    let trimmed = path.trim_end_matches('/');
    let served = |p: &str| {
        SERVED.contains(&p)
            || p.strip_prefix("/api/v1/datasets/")
                .is_some_and(|name| !name.is_empty() && !name.contains('/') && name != "..")
    };
    let hint = if trimmed.len() < path.len() && served(trimmed) {
        format!(" (did you mean `{trimmed}`, without the trailing slash?)")
    } else {
        String::new()
    };
    ApiError::NotFound(format!(
        "no endpoint at `{path}`{hint}: this controller serves {ENDPOINTS}"
    ))
    .into_response()
}

/// A method a served path does not take: a 405 that says what it does.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let path = uri.path();
    let (allowed, allow) = if path == "/api/v1/policies" {
        ("GET and POST", "GET,HEAD,POST")
    } else {
        ("GET", "GET,HEAD")
    };
    (
        StatusCode::METHOD_NOT_ALLOWED,
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::ALLOW, allow),
        ],
        format!("`{path}` takes {allowed}, not {method}\n"),
    )
        .into_response()
}

/// What an `/api/` handler answers: a refused query is a 400.
type ApiResponse = Result<Response, ApiError>;

fn json<T: Serialize>(result: Result<T, ApiError>) -> Response {
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        shared.metrics.render(),
    )
}

/// `/readyz`: 200 once this controller leads and has loaded its state;
/// 503 with the reason otherwise (a standby, or a leader still loading).
async fn readyz(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    match leader::unready_reason(&shared) {
        None => (StatusCode::OK, "ready\n".to_owned()),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
    }
}

async fn stages(State(shared): State<Arc<Shared>>, RawQuery(q): RawQuery) -> ApiResponse {
    Query::parse(q.as_deref(), &[])?;
    Ok(json(views::stages(&shared).await))
}

async fn jobs(State(shared): State<Arc<Shared>>, RawQuery(q): RawQuery) -> ApiResponse {
    Query::parse(q.as_deref(), &[])?;
    Ok(json(views::jobs(&shared).await))
}

async fn pools(State(shared): State<Arc<Shared>>, RawQuery(q): RawQuery) -> ApiResponse {
    Query::parse(q.as_deref(), &[])?;
    Ok(json(views::pools(&shared).await))
}

async fn datasets(State(shared): State<Arc<Shared>>, RawQuery(q): RawQuery) -> ApiResponse {
    Query::parse(q.as_deref(), &[])?;
    Ok(axum::Json(crate::datasets::datasets(&shared)).into_response())
}

async fn dataset(
    State(shared): State<Arc<Shared>>,
    Path(name): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResponse {
    Query::parse(q.as_deref(), &[])?;
    Ok(json(crate::datasets::dataset(&shared, &name)))
}

/// `GET /api/v1/policies[?history=true]`.
async fn list_policies(State(shared): State<Arc<Shared>>, RawQuery(q): RawQuery) -> ApiResponse {
    let history = Query::parse(q.as_deref(), &["history"])?.flag("history")?;
    Ok(json(views::policies(&shared, history).await))
}

/// `POST /api/v1/policies[?dry_run=true][&source=NAME]` with a YAML body;
/// errors are named after `source` (default `body`). A bad query changes
/// nothing.
async fn apply_policies(
    State(shared): State<Arc<Shared>>,
    RawQuery(q): RawQuery,
    body: Result<String, StringRejection>,
) -> ApiResponse {
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => too_large("larger than 4 MiB"),
        _ => ApiError::Invalid(e.body_text()),
    })?;
    let query = Query::parse(q.as_deref(), &["dry_run", "source"])?;
    let source = Source {
        name: query.text("source")?.unwrap_or("body").to_owned(),
        yaml: body,
    };
    let dry_run = query.flag("dry_run")?;
    Ok(json(policies::apply(&shared, vec![source], dry_run).await))
}
