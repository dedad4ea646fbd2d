//! The listener of the stage's HTTP server, bounded so that its clients
//! cannot take what trainers need: at most [`MAX_CONNECTIONS`] at once
//! (more are closed as they come, before they hold a descriptor for long),
//! and a connection that sends nothing for [`IDLE`] is closed (an idle or
//! half-sent request is not held for ever). A Prometheus scrape opens one
//! connection and reuses it well within that.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 128;

/// How long a connection may send nothing.
pub const IDLE: Duration = Duration::from_secs(60);

pub struct Guarded {
    listener: TcpListener,
    open: Arc<Semaphore>,
}

impl Guarded {
    pub fn new(listener: TcpListener) -> Self {
        Self {
            listener,
            open: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
        }
    }
}

impl axum::serve::Listener for Guarded {
    type Io = Connection;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&self.open).try_acquire_owned() else {
                tracing::debug!(%addr, "too many HTTP connections: closed at once");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let idle = Box::pin(tokio::time::sleep(IDLE));
            return (
                Connection {
                    stream,
                    idle,
                    _permit: permit,
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// An accepted connection: its place among [`MAX_CONNECTIONS`] and the
/// time it may still be silent.
pub struct Connection {
    stream: TcpStream,
    idle: Pin<Box<Sleep>>,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(done) => {
                this.idle.as_mut().reset(Instant::now() + IDLE);
                Poll::Ready(done)
            }
            Poll::Pending => match this.idle.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the HTTP client sent nothing for a minute",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
