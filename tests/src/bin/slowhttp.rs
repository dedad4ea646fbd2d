//! `sluice-slowhttp`: an HTTP pass-through proxy that makes an S3-compatible
//! server behave like a remote object store. Every request waits
//! `--latency` before it is forwarded; on request it answers some requests
//! itself with the failures object stores give: `503 SlowDown` (every
//! `--throttle-every`-th request), `403 AccessDenied` (paths containing
//! `--deny`), a dropped connection (every `--reset-every`-th request), or
//! no answer at all, the connection held open (every `--hang-every`-th GET
//! of an object: a stalled store or a half-open connection), or an answer
//! that stops halfway, its connection held open (every
//! `--stall-body-every`-th GET of an object: a transfer that stalls).
//! The stage signs requests for the proxy's address, which the proxy keeps
//! in the `Host` header, so the server behind it checks the signatures.
//!
//! The proxy acknowledges the upstream's packets at once (`TCP_QUICKACK`
//! after every read): a server that writes a response's head and body
//! separately without `TCP_NODELAY` (s3s-fs does) would otherwise wait for
//! a delayed ACK, 20-40 ms per request, on top of the latency asked for.
//!
//! ```text
//! sluice-slowhttp --upstream 127.0.0.1:9000 [--listen 127.0.0.1:0] [--latency 5ms]
//!                 [--throttle-every N] [--reset-every N] [--hang-every N]
//!                 [--stall-body-every N] [--deny SUBSTRING]
//! ```
//!
//! Prints `{"listen": "ADDR", ...}` on stdout once it accepts connections,
//! serves until SIGTERM or SIGINT.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sluice_tests::parse_duration;
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Parser)]
#[command(
    name = "sluice-slowhttp",
    about = "An HTTP pass-through proxy with added latency and injected failures"
)]
struct Args {
    /// The server to forward to, HOST:PORT.
    #[arg(long)]
    upstream: String,
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Added to every request, e.g. 5ms.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    latency: Duration,
    /// Answer every N-th request `503 SlowDown` (0: never).
    #[arg(long, default_value_t = 0)]
    throttle_every: u64,
    /// Drop the connection of every N-th request without an answer (0: never).
    #[arg(long, default_value_t = 0)]
    reset_every: u64,
    /// Never answer every N-th GET of an object (listings and HEADs are
    /// not counted), holding its connection (0: never).
    #[arg(long, default_value_t = 0)]
    hang_every: u64,
    /// Send the head and half the body of every N-th GET of an object,
    /// then nothing more, holding its connection (0: never).
    #[arg(long, default_value_t = 0)]
    stall_body_every: u64,
    /// Answer `403 AccessDenied` to requests whose path contains this.
    #[arg(long)]
    deny: Option<String>,
}

struct Proxy {
    args: Args,
    requests: AtomicU64,
    /// GETs of objects, for `--hang-every`.
    gets: AtomicU64,
    client: Client<Upstream, Incoming>,
}

type Body = BoxBody<Bytes, hyper::Error>;

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    if let Err(e) = runtime.block_on(run(args)) {
        eprintln!("sluice-slowhttp: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), String> {
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(Upstream(args.upstream.clone()));
    println!(
        "{{\"listen\": \"{addr}\", \"upstream\": \"{}\", \"latency_ms\": {}}}",
        args.upstream,
        args.latency.as_secs_f64() * 1e3
    );
    let proxy = Arc::new(Proxy {
        args,
        requests: AtomicU64::new(0),
        gets: AtomicU64::new(0),
        client,
    });
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    eprintln!("sluice-slowhttp: accept: {e}");
                    continue;
                }
            },
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let proxy = Arc::clone(&proxy);
                async move { proxy.handle(req).await }
            });
            // A dropped connection ends here with an error: that is the
            // injected reset.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

impl Proxy {
    async fn handle(&self, req: Request<Incoming>) -> Result<Response<Body>, Dropped> {
        let n = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.args.latency.is_zero() {
            tokio::time::sleep(self.args.latency).await;
        }
        if let Some(deny) = &self.args.deny
            && req.uri().path().contains(deny.as_str())
        {
            return Ok(s3_error(
                StatusCode::FORBIDDEN,
                "AccessDenied",
                "Access Denied",
            ));
        }
        if self.args.throttle_every > 0 && n.is_multiple_of(self.args.throttle_every) {
            return Ok(s3_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "SlowDown",
                "Please reduce your request rate.",
            ));
        }
        if self.args.reset_every > 0 && n.is_multiple_of(self.args.reset_every) {
            return Err(Dropped);
        }
        let mut stall = false;
        if is_object_get(&req) {
            let n = self.gets.fetch_add(1, Ordering::Relaxed) + 1;
            let every = |k: u64| k > 0 && n.is_multiple_of(k);
            if every(self.args.hang_every) {
                // Until the client gives up and closes the connection.
                std::future::pending::<()>().await;
            }
            stall = every(self.args.stall_body_every);
        }
        let (mut parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = match format!("http://{}{path}", self.args.upstream).parse() {
            Ok(uri) => uri,
            Err(_) => return Ok(s3_error(StatusCode::BAD_REQUEST, "InvalidURI", "bad path")),
        };
        match self.client.request(Request::from_parts(parts, body)).await {
            Ok(response) if stall => {
                let (parts, body) = response.into_parts();
                let Ok(whole) = body.collect().await.map(|b| b.to_bytes()) else {
                    return Err(Dropped);
                };
                let half = whole.slice(..whole.len() / 2);
                Ok(Response::from_parts(parts, Stalled(Some(half)).boxed()))
            }
            Ok(response) => Ok(response.map(|b| b.boxed())),
            Err(e) => Ok(s3_error(
                StatusCode::BAD_GATEWAY,
                "BadGateway",
                &format!("upstream {}: {e}", self.args.upstream),
            )),
        }
    }
}

/// A body that gives its bytes and then never ends (its head promised
/// more).
struct Stalled(Option<Bytes>);

impl hyper::body::Body for Stalled {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        match self.0.take() {
            Some(bytes) => std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(bytes)))),
            // Until the client gives up and closes the connection.
            None => std::task::Poll::Pending,
        }
    }
}

/// The error a handler returns to drop its connection unanswered.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped on purpose")
    }
}

impl std::error::Error for Dropped {}

fn s3_error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    let xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    );
    let mut response = Response::new(
        Full::new(Bytes::from(xml))
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        "content-type",
        "application/xml".parse().expect("valid header"),
    );
    response
}

/// Connects to the upstream server (whatever the request's URI says).
#[derive(Debug, Clone)]
struct Upstream(String);

impl tower_service::Service<hyper::Uri> for Upstream {
    type Response = QuickAck;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<QuickAck, std::io::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), std::io::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        let addr = self.0.clone();
        Box::pin(async move {
            let stream = TcpStream::connect(&addr).await?;
            stream.set_nodelay(true)?;
            Ok(QuickAck(TokioIo::new(stream)))
        })
    }
}

/// An upstream connection that acknowledges every read at once.
struct QuickAck(TokioIo<TcpStream>);

impl Connection for QuickAck {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for QuickAck {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let read = std::pin::Pin::new(&mut this.0).poll_read(cx, buf);
        if read.is_ready() {
            // The kernel leaves quick-ACK mode by itself: ask again.
            let _ = socket2::SockRef::from(this.0.inner()).set_tcp_quickack(true);
        }
        read
    }
}

impl hyper::rt::Write for QuickAck {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// Whether `req` reads an object (not a listing, not a HEAD).
fn is_object_get(req: &Request<Incoming>) -> bool {
    req.method() == hyper::Method::GET
        && !req
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p.starts_with("list-type")))
}
