//! Who may use the admin API: bearer tokens from `--token-file` (see
//! [`token_file`] for the format), each with a role. A `read` token may
//! list, get and watch; an `admin` token may also apply and delete
//! policies. The gRPC `AdminService` and the REST API are checked here, in
//! one middleware each; `StageService` (stages, authenticated by mutual
//! TLS) and `/healthz`, `/readyz` and `/metrics` stay open.
//!
//! A request without a token, or with one the file does not hold, is
//! refused as unauthenticated (gRPC `UNAUTHENTICATED`, HTTP 401); a read
//! token on a change as forbidden (`PERMISSION_DENIED`, 403). Nothing runs
//! for a refused request. Without `--token-file` every caller is admin,
//! which the configuration allows only on loopback addresses unless
//! `--insecure-admin` is given.
//!
//! The file is read again every [`POLL`] and at once on
//! [`Auth::reload_now`] (SIGHUP): tokens rotate by editing it (a
//! Kubernetes Secret volume is updated in place). A file that no longer
//! parses keeps the tokens in force, with a warning. Tokens are never
//! logged.

mod token_file;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sluice_proto::AdminServiceServer;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::server::NamedService;
use tracing::{info, warn};

use crate::admin::Admin;
use crate::error::ApiError;
use crate::sync::read;

pub use token_file::{Role, TokenFileError, Tokens};

/// How often the token file is read again.
pub const POLL: Duration = Duration::from_secs(2);

/// `AdminService` methods a read token may call; every other one needs
/// an admin token, so a method added later is closed until listed here.
const READ_METHODS: &[&str] = &[
    "ListPolicies",
    "ListStages",
    "GetStage",
    "ListJobs",
    "GetJob",
    "ListPools",
    "GetDataset",
    "ListDatasets",
    "GetPool",
    "WatchEvents",
];

/// HTTP paths served to everyone (probes and Prometheus).
const OPEN_PATHS: &[&str] = &["/healthz", "/readyz", "/metrics"];

/// How the admin API admits callers, as configured.
#[derive(Debug, Clone)]
pub enum AdminAccess {
    /// Bearer tokens from this file, as read at start.
    Tokens { path: PathBuf, tokens: Tokens },
    /// Every caller is admin (loopback listeners, or `--insecure-admin`).
    Open,
}

/// The admin API's gatekeeper, shared by both servers' middleware.
#[derive(Debug)]
pub struct Auth {
    /// The token file, `None` when the API is open.
    path: Option<PathBuf>,
    tokens: RwLock<Tokens>,
    reload: Notify,
}

impl Auth {
    /// Returns the gatekeeper for a configured access.
    pub fn new(access: AdminAccess) -> Self {
        let (path, tokens) = match access {
            AdminAccess::Tokens { path, tokens } => (Some(path), tokens),
            AdminAccess::Open => (None, Tokens::default()),
        };
        Self {
            path,
            tokens: RwLock::new(tokens),
            reload: Notify::new(),
        }
    }

    /// Says at start-up how callers are admitted: a warning when every
    /// caller is admin.
    pub fn announce(&self, grpc: SocketAddr, http: SocketAddr) {
        match &self.path {
            Some(path) => {
                let tokens = read(&self.tokens);
                let (admin, readers) = (tokens.count(Role::Admin), tokens.count(Role::Read));
                let file = path.display();
                info!(%file, admin, read = readers, "the admin API requires bearer tokens");
            }
            None if grpc.ip().is_loopback() && http.ip().is_loopback() => warn!(
                %grpc, %http,
                "no --token-file: every caller of the admin API is admin; it listens on loopback \
                 addresses only"
            ),
            None => warn!(
                %grpc, %http,
                "--insecure-admin: every caller that reaches these addresses may change policies; \
                 give --token-file to require tokens"
            ),
        }
    }

    /// Checks the `authorization` header of a request that needs `need`;
    /// `what` names the operation in the refusal.
    pub fn check(
        &self,
        authorization: Option<&HeaderValue>,
        need: Role,
        what: &str,
    ) -> Result<(), ApiError> {
        if self.path.is_none() {
            return Ok(());
        }
        let unauthenticated = |m: &str| Err(ApiError::Unauthenticated(m.to_owned()));
        let Some(value) = authorization else {
            return unauthenticated("a bearer token is required (`Authorization: Bearer TOKEN`)");
        };
        let Some(token) = bearer(value) else {
            return unauthenticated("the authorization header is not `Bearer TOKEN`");
        };
        match read(&self.tokens).role_of(token) {
            None => unauthenticated("the bearer token is not one this controller accepts"),
            Some(role) if role < need => Err(ApiError::Forbidden(format!(
                "the token is read-only: {what} needs an admin token"
            ))),
            Some(_) => Ok(()),
        }
    }

    /// Asks the watcher to read the token file now (SIGHUP).
    pub fn reload_now(&self) {
        self.reload.notify_one();
    }

    /// Reads the token file every [`POLL`] and on [`Auth::reload_now`]
    /// until `cancel` fires, swapping in the tokens when they change.
    pub async fn watch(self: Arc<Self>, cancel: CancellationToken) -> anyhow::Result<()> {
        let Some(path) = self.path.clone() else {
            cancel.cancelled().await;
            return Ok(());
        };
        // What the last read gave, so a change (or a new error) is logged
        // once, not every poll.
        let mut last: Result<Tokens, TokenFileError> = Ok(read(&self.tokens).clone());
        // The file as the last read found it: a poll that finds it the same
        // does not parse it again (a file of many tokens is hashed whole).
        let mut seen = FileStamp::of(&path);
        loop {
            let asked = tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = self.reload.notified() => true,
                () = tokio::time::sleep(POLL) => false,
            };
            let file = path.clone();
            let before = seen.clone();
            let Some((stamp, now)) = tokio::task::spawn_blocking(move || {
                let stamp = FileStamp::of(&file);
                let same = stamp
                    .as_ref()
                    .is_some_and(|s| s.settled() && Some(s) == before.as_ref());
                (asked || !same).then(|| (stamp, Tokens::read(&file)))
            })
            .await?
            else {
                continue;
            };
            seen = stamp;
            // Every token deleted (revoked after a leak, say) is applied:
            // keeping them in force would keep the leaked ones.
            let now = now.or_else(|e| {
                if e.holds_no_token() {
                    Ok(Tokens::default())
                } else {
                    Err(e)
                }
            });
            let changed = last != now;
            match &now {
                Ok(tokens) if changed => {
                    *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = tokens.clone();
                    let (admin, readers) = (tokens.count(Role::Admin), tokens.count(Role::Read));
                    let file = path.display();
                    if admin + readers == 0 {
                        warn!(%file, "the token file holds no token: every call that needs one is refused until one is written");
                    } else {
                        info!(%file, admin, read = readers, "admin tokens read");
                    }
                }
                Err(e) if changed || asked => {
                    warn!(error = %e, "cannot use the token file; keeping the tokens in force");
                }
                _ if asked => info!(file = %path.display(), "admin tokens unchanged"),
                _ => {}
            }
            last = now;
        }
    }
}

/// What tells one version of the token file from another without reading
/// it: the file its path leads to now (a Secret volume swaps a link to a
/// new one), its size and when it was last written.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    device: u64,
    inode: u64,
    size: u64,
    modified: Option<std::time::SystemTime>,
}

impl FileStamp {
    /// Whether the file was last written long enough ago that a write
    /// since would show in its time: file systems keep that time at the
    /// clock's tick (milliseconds), so a write in the same tick as the one
    /// before can leave it unchanged.
    fn settled(&self) -> bool {
        self.modified
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age > POLL)
    }

    fn of(path: &std::path::Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Self {
            device: m.dev(),
            inode: m.ino(),
            size: m.len(),
            modified: m.modified().ok(),
        })
    }
}

/// Returns the token of an `authorization: Bearer TOKEN` header.
fn bearer(value: &HeaderValue) -> Option<&[u8]> {
    let value = value.as_bytes();
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, token) = value.split_at(space);
    let token = token.trim_ascii();
    (scheme.eq_ignore_ascii_case(b"bearer") && !token.is_empty()).then_some(token)
}

/// gRPC middleware: checks `AdminService` calls (`read` for the methods in
/// [`READ_METHODS`], `admin` for the others) and lets stage sessions
/// through; a refusal is a gRPC status.
pub async fn grpc_gate(State(auth): State<Arc<Auth>>, request: Request, next: Next) -> Response {
    let service = <AdminServiceServer<Admin> as NamedService>::NAME;
    let method = request
        .uri()
        .path()
        .strip_prefix('/')
        .and_then(|p| p.strip_prefix(service))
        .and_then(|p| p.strip_prefix('/'));
    let Some(method) = method else {
        return next.run(request).await;
    };
    let need = if READ_METHODS.contains(&method) {
        Role::Read
    } else {
        Role::Admin
    };
    match auth.check(request.headers().get(header::AUTHORIZATION), need, method) {
        Ok(()) => next.run(request).await,
        Err(e) => tonic::Status::from(e).into_http(),
    }
}

/// HTTP middleware: `GET` and `HEAD` need `read`, other methods `admin`;
/// the probes and `/metrics` are open. A refusal is 401 (with
/// `WWW-Authenticate: Bearer`) or 403 and a one-line body.
pub async fn http_gate(State(auth): State<Arc<Auth>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if OPEN_PATHS.contains(&path) {
        return next.run(request).await;
    }
    let method = request.method();
    let need = if method == Method::GET || method == Method::HEAD {
        Role::Read
    } else {
        Role::Admin
    };
    let what = format!("{method} {path}");
    match auth.check(request.headers().get(header::AUTHORIZATION), need, &what) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            let mut response = e.into_response();
            if response.status() == StatusCode::UNAUTHORIZED {
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"sluice\""),
                );
            }
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADMIN: &str = "admin-token-0123456789";
    const READ: &str = "read-token-0123456789";

    fn auth() -> Auth {
        let text = format!("admin {ADMIN}\nread {READ}\n");
        let tokens = Tokens::parse(&text, "t".as_ref()).unwrap();
        Auth::new(AdminAccess::Tokens {
            path: "t".into(),
            tokens,
        })
    }

    fn header(value: &str) -> HeaderValue {
        HeaderValue::from_str(value).unwrap()
    }

    #[test]
    fn roles_and_refusals() {
        let auth = auth();
        let check = |h: Option<&str>, need| auth.check(h.map(header).as_ref(), need, "Apply");
        assert!(check(Some(&format!("Bearer {ADMIN}")), Role::Admin).is_ok());
        assert!(check(Some(&format!("bearer  {READ} ")), Role::Read).is_ok());
        let refused = [
            (None, Role::Read, "a bearer token is required"),
            (Some(READ.to_owned()), Role::Read, "not `Bearer TOKEN`"),
            (
                Some(format!("Basic {READ}")),
                Role::Read,
                "not `Bearer TOKEN`",
            ),
            (Some("Bearer ".to_owned()), Role::Read, "not `Bearer TOKEN`"),
            (
                Some(format!("Bearer {ADMIN}x")),
                Role::Read,
                "not one this controller",
            ),
            (
                Some(format!("Bearer {READ}")),
                Role::Admin,
                "read-only: Apply needs an admin token",
            ),
        ];
        for (h, need, expected) in refused {
            let e = check(h.as_deref(), need).unwrap_err();
            let status = tonic::Status::from(e);
            assert!(status.message().contains(expected), "{h:?}: {status:?}");
            let code = if expected.contains("read-only") {
                tonic::Code::PermissionDenied
            } else {
                tonic::Code::Unauthenticated
            };
            assert_eq!(status.code(), code, "{h:?}");
            assert!(!status.message().contains("0123456789"), "{status:?}");
        }
    }

    #[test]
    fn without_a_token_file_everyone_is_admin() {
        let open = Auth::new(AdminAccess::Open);
        assert!(open.check(None, Role::Admin, "Apply").is_ok());
    }
}
