//! The connection to the controller's `AdminService`, and how its failures
//! read: one line for a controller that cannot be reached, the
//! controller's own message for a request it refused. Every request
//! carries `authorization: Bearer TOKEN` when `--token` (or
//! `SLUICE_TOKEN`) is given.

use std::error::Error as _;
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sluice_proto::AdminServiceClient;
use sluice_proto::tls::TlsFiles;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use crate::exit::Exit;

/// How long to wait for the TCP connection before giving up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one request may take. Generous: an apply stores revisions.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of the controller at one address.
pub type Admin = AdminServiceClient<InterceptedService<Channel, Bearer>>;

/// Where the controller is (`--server`), for an `https://` server the
/// files of the client's mutual TLS (`--tls-cert`, `--tls-key`, `--tls-ca`,
/// or the daemons' `SLUICE_TLS_*` variables), and the admin API's bearer
/// token (`--token`, `SLUICE_TOKEN`).
#[derive(Clone, Default)]
pub struct Controller {
    pub server: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub token: Option<String>,
}

impl fmt::Debug for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Controller")
            .field("server", &self.server)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_ca", &self.tls_ca)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Adds `authorization: Bearer TOKEN` to every request (nothing without
/// a token).
#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl fmt::Debug for Bearer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Bearer(<redacted>)"
        } else {
            "Bearer(none)"
        })
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

impl Bearer {
    /// Returns the header for `token`; an empty one counts as not given.
    fn new(token: Option<&str>) -> Result<Self, CallError> {
        let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(Self(None));
        };
        let mut value: MetadataValue<Ascii> = format!("Bearer {token}")
            .parse()
            .map_err(|_| CallError::BadToken)?;
        value.set_sensitive(true);
        Ok(Self(Some(value)))
    }
}

/// Why a command could not get its answer from the controller.
#[derive(Debug)]
pub enum CallError {
    /// `--server` is not an address like `http://HOST:PORT`: a usage
    /// error.
    BadAddress { server: String },
    /// No connection: nobody listening, a name that does not resolve, a
    /// dropped connection, or a server that is not the controller.
    Unreachable { server: String, reason: String },
    /// An `https://` server without usable TLS files (a usage error).
    Tls { reason: String },
    /// `--token` holds characters a header cannot carry (a usage error).
    BadToken,
    /// The controller answered with an error.
    Refused(Status),
}

/// What a server that is not a gRPC one answered, from tonic's message:
/// the HTTP status when it names one (`it answered HTTP 404 Not Found`).
fn not_grpc(message: &str) -> String {
    match message.rsplit_once("response with status: ") {
        Some((_, status)) => format!("it answered HTTP {}", status.trim()),
        None => message.to_owned(),
    }
}

impl CallError {
    /// Builds the error for a failed call: a transport failure is
    /// `Unreachable`, anything else is the controller refusing.
    pub fn from_status(server: &str, status: Status) -> Self {
        let unreachable = |reason: String| Self::Unreachable {
            server: server.to_owned(),
            reason,
        };
        match status.code() {
            // tonic's own request timeout.
            Code::Cancelled if status.message() == "Timeout expired" => unreachable(format!(
                "the controller did not answer within {} s; check that it is running, not \
                 stopped or overloaded (a stopped process accepts connections but answers \
                 nothing)",
                REQUEST_TIMEOUT.as_secs()
            )),
            // A transport failure; an answer of the controller's own
            // (a standby, a store outage) carries no source and is shown
            // as the controller said it.
            Code::Unavailable if status.source().is_some() || status.message().is_empty() => {
                unreachable(match status.source() {
                    Some(source) => deepest_reason(source),
                    None => status.code().description().to_owned(),
                })
            }
            // Something answered, but not the AdminService: a stage, the
            // controller's HTTP port, some other server.
            Code::Unimplemented => unreachable(format!(
                "the server there does not serve sluice's admin API ({}); \
                 give the controller's gRPC address",
                status.code().description()
            )),
            // An HTTP server's answer (a 404 page) read as gRPC frames.
            Code::Unknown | Code::Internal
                if status.message().starts_with("grpc-status header missing")
                    || status.message().contains("invalid compression flag") =>
            {
                unreachable(format!(
                    "the server there does not speak gRPC ({}); \
                     give the controller's gRPC address",
                    not_grpc(status.message())
                ))
            }
            // The connection failed under the call (the controller did not
            // answer it): say what to check, not just "transport error".
            Code::Unknown | Code::Cancelled | Code::Internal
                if status.source().is_some() || status.message().contains("canceled") =>
            {
                unreachable(transport_failure(server, &status))
            }
            _ => Self::Refused(status),
        }
    }

    /// Returns the lines to print on standard error. A refused request
    /// with INVALID_ARGUMENT carries `FILE:LINE:COLUMN: message` lines,
    /// printed as they are; everything else is one `sluicectl:` line.
    pub fn lines(&self) -> Vec<String> {
        match self {
            Self::Refused(status) if status.code() == Code::InvalidArgument => status
                .message()
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned)
                .collect(),
            _ => vec![format!("sluicectl: {self}")],
        }
    }

    /// Returns the exit code: a malformed `--server` or missing TLS files
    /// are a usage error (2), anything else an error (1).
    pub fn exit(&self) -> Exit {
        match self {
            Self::BadAddress { .. } | Self::Tls { .. } | Self::BadToken => Exit::Usage,
            _ => Exit::Failed,
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadAddress { server } => write!(
                f,
                "--server `{server}` is not an address like http://127.0.0.1:7070"
            ),
            Self::Unreachable { server, reason } => {
                write!(f, "cannot reach the controller at {server}: {reason}")
            }
            Self::Tls { reason } => f.write_str(reason),
            Self::BadToken => f.write_str(
                "--token (or SLUICE_TOKEN) holds a character a header cannot carry: give the \
                 token exactly as the controller's token file has it",
            ),
            Self::Refused(status) if status.code() == Code::Unauthenticated => write!(
                f,
                "{}; give a valid token with --token or SLUICE_TOKEN",
                status.message().trim()
            ),
            Self::Refused(status) if status.code() == Code::PermissionDenied => write!(
                f,
                "{}; give one with --token or SLUICE_TOKEN",
                status.message().trim()
            ),
            Self::Refused(status) => {
                let message = status.message().trim();
                if message.is_empty() {
                    let code = status.code().description();
                    write!(f, "the controller answered: {code}")
                } else {
                    // Several lines would break "one line per error".
                    f.write_str(&message.replace('\n', "; "))
                }
            }
        }
    }
}

/// Reads the mutual TLS files an `https://` controller requires.
fn client_tls(controller: &Controller) -> Result<ClientTlsConfig, CallError> {
    let tls = |reason: String| CallError::Tls { reason };
    // An empty variable counts as not given.
    fn given(path: &Option<PathBuf>) -> Option<&Path> {
        path.as_deref().filter(|p| !p.as_os_str().is_empty())
    }
    let files = [
        ("--tls-cert", given(&controller.tls_cert)),
        ("--tls-key", given(&controller.tls_key)),
        ("--tls-ca", given(&controller.tls_ca)),
    ];
    let [(_, Some(cert)), (_, Some(key)), (_, Some(ca))] = files else {
        let (missing, _) = files
            .iter()
            .find(|(_, path)| path.is_none())
            .expect("one is missing");
        return Err(tls(format!(
            "an https:// --server needs --tls-cert, --tls-key and --tls-ca (or SLUICE_TLS_CERT, \
             SLUICE_TLS_KEY and SLUICE_TLS_CA): the controller requires a client certificate \
             (missing {missing})"
        )));
    };
    TlsFiles::read(cert, key, ca)
        .and_then(TlsFiles::client)
        .map_err(|e| tls(e.to_string()))
}

/// Connects to the controller at `--server` (`http://host:port`, or
/// `https://host:port` with the client's TLS files).
pub async fn connect(controller: &Controller) -> Result<Admin, CallError> {
    let server = controller.server.as_str();
    let unreachable = |reason: String| CallError::Unreachable {
        server: server.to_owned(),
        reason,
    };
    let bad_address = || CallError::BadAddress {
        server: server.to_owned(),
    };
    if !(server.starts_with("http://") || server.starts_with("https://")) {
        return Err(bad_address());
    }
    // A host, and a port that is a number a port can be.
    let authority = server
        .parse::<tonic::codegen::http::Uri>()
        .ok()
        .and_then(|uri| uri.authority().cloned());
    let usable = authority.is_some_and(|a| {
        let after_host = a
            .as_str()
            .rsplit_once(']')
            .map_or(a.as_str(), |(_, rest)| rest);
        !a.host().is_empty()
            && after_host
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.parse::<u16>().is_ok())
    });
    if !usable {
        return Err(bad_address());
    }
    let tls_given = [
        &controller.tls_cert,
        &controller.tls_key,
        &controller.tls_ca,
    ]
    .iter()
    .any(|p| p.as_deref().is_some_and(|p| !p.as_os_str().is_empty()));
    if tls_given && server.starts_with("http://") {
        let rest = server.trim_start_matches("http://");
        return Err(CallError::Tls {
            reason: format!(
                "--tls-* are given but --server `{server}` is plain text: write `https://{rest}` (or leave the TLS files out)"
            ),
        });
    }
    let endpoint = Endpoint::from_shared(server.to_owned())
        .map_err(|_| bad_address())?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT);
    let endpoint = if server.starts_with("https://") {
        let tls = client_tls(controller)?;
        endpoint.tls_config(tls).map_err(|e| CallError::Tls {
            reason: format!("the TLS files cannot be used: {}", deepest_reason(&e)),
        })?
    } else {
        endpoint
    };
    let bearer = Bearer::new(controller.token.as_deref())?;
    // The connect timeout is the TCP connect's: a stopped controller's
    // socket still accepts, and the TLS handshake would wait for ever.
    let channel = tokio::time::timeout(REQUEST_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| {
            unreachable(format!(
                "no connection within {} s (the TLS handshake was not answered); check that \
                 it is running, not stopped or overloaded",
                REQUEST_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| unreachable(deepest_reason(&e)))?;
    // Views of thousands of jobs with their labels run past tonic's
    // default of 4 MiB; the controller is the caller's own.
    Ok(AdminServiceClient::with_interceptor(channel, bearer).max_decoding_message_size(usize::MAX))
}

/// Connects, then runs one request; a failure of either is a [`CallError`].
pub async fn call<T, F, Fut>(controller: &Controller, request: F) -> Result<T, CallError>
where
    F: FnOnce(Admin) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, Status>>,
{
    let admin = connect(controller).await?;
    request(admin)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| CallError::from_status(&controller.server, s))
}

/// Runs `future` on a small runtime of its own: the commands make a few
/// requests in a row, so one thread is plenty.
pub fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a single-threaded tokio runtime")
        .block_on(future)
}

/// Prints a call error on standard error and returns its exit code.
pub fn report(error: &CallError) -> Exit {
    for line in error.lines() {
        eprintln!("{line}");
    }
    error.exit()
}

/// The innermost cause of an error, as a person reads it: "Connection
/// refused" rather than "transport error", without " (os error 111)".
/// Why a call's connection failed, with what to check: a TLS alert from
/// the controller means it refused sluicectl's certificate; a failure
/// against an `http://` server, that the port may want TLS.
fn transport_failure(server: &str, status: &Status) -> String {
    let mut reasons = vec![status.message().to_owned()];
    let mut source = status.source();
    while let Some(e) = source {
        reasons.push(e.to_string());
        source = e.source();
    }
    let reason = reasons
        .iter()
        .rev()
        .find(|r| !r.is_empty())
        .cloned()
        .unwrap_or_default();
    let all = reasons.join(": ");
    let hint = if all.contains("alert") || all.contains("certificate") {
        "the controller refused sluicectl's client certificate: --tls-cert must be signed by the \
         CA the controller trusts (its --tls-ca) and be valid now"
    } else if server.starts_with("http://") {
        // Plain text against a TLS port fails in several ways (an HTTP/2
        // error, a broken pipe, a reset), all without an answer.
        "the connection ended without an answer; if the controller's gRPC port has TLS, use \
         an https:// --server with --tls-cert, --tls-key and --tls-ca"
    } else if server.starts_with("https://") {
        "the connection ended without an answer; check that the controller accepts \
         sluicectl's client certificate (--tls-cert: signed by its --tls-ca, valid now)"
    } else {
        "the connection ended without an answer"
    };
    format!("{reason} ({hint})")
}

fn deepest_reason(error: &(dyn std::error::Error + 'static)) -> String {
    let mut deepest = error;
    while let Some(source) = deepest.source() {
        deepest = source;
    }
    let text = deepest.to_string();
    let text = match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_owned(),
        _ => text,
    };
    if text.is_empty() {
        error.to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_controller_that_does_not_answer_in_time_is_said_to_be_silent() {
        let error = CallError::from_status("http://c:7070", Status::cancelled("Timeout expired"));
        let lines = error.lines();
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].contains("the controller did not answer within 30 s"),
            "{lines:?}"
        );
        assert_eq!(error.exit(), Exit::Failed);
    }

    #[test]
    fn https_needs_the_three_tls_files() {
        let only_cert = Controller {
            tls_cert: Some("/c.crt".into()),
            tls_key: Some("".into()),
            ..Controller::default()
        };
        let error = client_tls(&only_cert).unwrap_err();
        assert!(error.to_string().contains("(missing --tls-key)"), "{error}");
        assert!(matches!(error.exit(), Exit::Usage));
        let missing = "/nonexistent/tls.pem";
        let unreadable = Controller {
            tls_cert: Some(missing.into()),
            tls_key: Some(missing.into()),
            tls_ca: Some(missing.into()),
            ..Controller::default()
        };
        let error = client_tls(&unreadable).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("--tls-cert: cannot read /nonexistent/tls.pem: "),
            "{error}"
        );
    }

    #[test]
    fn invalid_argument_lines_are_printed_as_they_are() {
        let status = Status::invalid_argument(
            "a.yaml:8:3: unknown field `wieght`\nb.yaml:18:16: bad unit\n",
        );
        let error = CallError::from_status("http://x:1", status);
        assert_eq!(
            error.lines(),
            [
                "a.yaml:8:3: unknown field `wieght`",
                "b.yaml:18:16: bad unit"
            ]
        );
    }

    #[test]
    fn other_refusals_are_one_line() {
        let error = CallError::from_status("http://x:1", Status::not_found("no job `x`"));
        assert_eq!(error.lines(), ["sluicectl: no job `x`"]);
        let error = CallError::from_status("http://x:1", Status::internal(""));
        assert_eq!(error.lines().len(), 1);
    }

    #[test]
    fn a_server_that_is_not_the_controller_is_unreachable() {
        let error = CallError::from_status("http://x:1", Status::unimplemented(""));
        assert!(matches!(error, CallError::Unreachable { .. }), "{error}");
        let not_grpc = Status::unknown("grpc-status header missing, mapped from HTTP 404");
        let error = CallError::from_status("http://x:1", not_grpc);
        assert!(error.to_string().contains("does not speak gRPC"), "{error}");
    }

    #[tokio::test]
    async fn an_address_without_a_scheme_is_a_usage_error() {
        let controller = Controller {
            server: "localhost:7070".into(),
            ..Controller::default()
        };
        let error = connect(&controller).await.unwrap_err();
        assert_eq!(error.exit(), Exit::Usage);
        assert_eq!(
            error.lines(),
            ["sluicectl: --server `localhost:7070` is not an address like http://127.0.0.1:7070"]
        );
    }

    #[test]
    fn token_refusals_say_what_to_do() {
        let status = Status::unauthenticated("a bearer token is required");
        let error = CallError::from_status("http://x:1", status);
        assert_eq!(
            error.lines(),
            [
                "sluicectl: a bearer token is required; give a valid token with --token or SLUICE_TOKEN"
            ]
        );
        let status = Status::permission_denied("the token is read-only: X needs an admin token");
        let error = CallError::from_status("http://x:1", status);
        assert_eq!(error.exit(), Exit::Failed);
        assert!(error.lines()[0].ends_with("admin token; give one with --token or SLUICE_TOKEN"));
    }

    #[test]
    fn the_token_goes_in_a_bearer_header() {
        let mut bearer = Bearer::new(Some(" s3cret-token ")).unwrap();
        let request = bearer.call(tonic::Request::new(())).unwrap();
        let sent = request.metadata().get("authorization").unwrap();
        assert_eq!(sent.to_str().unwrap(), "Bearer s3cret-token");
        assert!(!format!("{bearer:?}").contains("s3cret"));
        let mut none = Bearer::new(Some("")).unwrap();
        let request = none.call(tonic::Request::new(())).unwrap();
        assert!(request.metadata().get("authorization").is_none());
        let error = Bearer::new(Some("bad\ntoken")).unwrap_err();
        assert_eq!(error.exit(), Exit::Usage);
    }

    #[test]
    fn a_bad_port_or_tls_files_for_plain_text_are_usage_errors() {
        let at = |server: &str, cert: Option<&str>| Controller {
            server: server.into(),
            tls_cert: cert.map(PathBuf::from),
            ..Controller::default()
        };
        for server in [
            "http://127.0.0.1:99999",
            "http://127.0.0.1:abc",
            "http://:7070",
        ] {
            let e = block_on(connect(&at(server, None))).err().unwrap();
            assert_eq!(e.exit(), Exit::Usage, "{server}: {e}");
            assert!(e.to_string().contains("is not an address"), "{server}: {e}");
        }
        let e = block_on(connect(&at("http://127.0.0.1:7070", Some("c.pem"))))
            .err()
            .unwrap();
        assert!(
            e.to_string().contains("write `https://127.0.0.1:7070`"),
            "{e}"
        );
        assert_eq!(e.exit(), Exit::Usage);
    }

    #[test]
    fn unavailable_is_unreachable_unless_the_controller_said_so() {
        let failed = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "gone");
        let mut lost = Status::unavailable("transport error");
        lost.set_source(std::sync::Arc::new(failed));
        let error = CallError::from_status("http://x:1", lost);
        assert_eq!(
            error.to_string(),
            "cannot reach the controller at http://x:1: gone"
        );
        // The controller's own answer (a store outage, a standby).
        let said = Status::unavailable("store unavailable: the database does not answer");
        let error = CallError::from_status("http://x:1", said);
        assert_eq!(
            error.to_string(),
            "store unavailable: the database does not answer"
        );
        assert_eq!(error.exit(), Exit::Failed);
    }
}
