//! Listeners kept from losing their descriptors to connections that
//! never speak (the controller's gRPC and HTTP ports, a stage's HTTP
//! port): each holds at most so many connections at once, and a
//! connection that carried nothing for [`IDLE`] is closed. A live gRPC
//! connection answers the server's keepalive pings (every [`KEEPALIVE`]
//! without traffic), so the ones closed never began their TLS handshake
//! or HTTP/2 preface, or went silent: a few hundred such connections used
//! to take every descriptor of a controller, and with them stage sessions,
//! `sluicectl` and `/healthz`. A listener
//! that holds as many as it may makes room by closing the oldest that has
//! not sent a byte yet, so that such connections cannot shut others out;
//! with none of those, the new one is closed (said once a minute).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How often the gRPC server pings a connection that carried nothing.
pub const KEEPALIVE: Duration = Duration::from_secs(10);

/// How long a connection may carry nothing before it is closed.
pub const IDLE: Duration = Duration::from_secs(30);

/// One listener's accepted connections, each [`Guarded`].
pub struct Incoming {
    listener: TcpListener,
    live: Arc<AtomicUsize>,
    most: usize,
    idle: Duration,
    /// The connections accepted that had not spoken yet, oldest first.
    silent: VecDeque<Weak<Slot>>,
    /// Connections refused since the last warning, and when that was.
    refused: u64,
    said: Option<Instant>,
}

impl Incoming {
    /// Accepts on `listener`, at most `most` connections at once, each
    /// closed after [`IDLE`] without a byte.
    pub fn new(listener: TcpListener, most: usize) -> Self {
        Self {
            listener,
            live: Arc::default(),
            most: most.max(1),
            idle: IDLE,
            silent: VecDeque::new(),
            refused: 0,
            said: None,
        }
    }

    /// Closes connections after `idle` without a byte instead.
    #[must_use]
    pub fn with_idle(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<(Guarded, SocketAddr)>> {
        loop {
            let (stream, peer) = ready!(self.listener.poll_accept(cx))?;
            if self.live.load(Ordering::Relaxed) >= self.most {
                self.evict_silent();
            }
            if self.live.load(Ordering::Relaxed) >= self.most {
                drop(stream);
                self.refused += 1;
                if self
                    .said
                    .is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
                {
                    tracing::warn!(
                        listener = ?self.listener.local_addr().ok(),
                        open = self.most,
                        refused = self.refused,
                        "connections refused: the listener holds as many as it may, all of which have spoken (a share of the descriptor limit; raise `ulimit -n`, or look for a client that opens connections and leaves them)"
                    );
                    self.said = Some(Instant::now());
                    self.refused = 0;
                }
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.live.fetch_add(1, Ordering::Relaxed);
            let guarded = Guarded::new(stream, Arc::clone(&self.live), self.idle);
            if self.silent.len() >= self.most {
                self.silent
                    .retain(|slot| slot.upgrade().is_some_and(|s| s.is(SILENT)));
            }
            self.silent.push_back(Arc::downgrade(&guarded.slot));
            return Poll::Ready(Ok((guarded, peer)));
        }
    }

    /// Closes the oldest connection that has not spoken, if any.
    fn evict_silent(&mut self) {
        while let Some(slot) = self.silent.pop_front() {
            if let Some(slot) = slot.upgrade()
                && slot.evict()
            {
                self.live.fetch_sub(1, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// A connection has sent nothing yet.
const SILENT: u8 = 0;
/// It has sent bytes.
const SPOKE: u8 = 1;
/// It was closed to make room (no longer counted).
const EVICTED: u8 = 2;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the listener and one connection share.
#[derive(Default)]
struct Slot {
    state: AtomicU8,
    /// The connection's read waiting for bytes.
    waker: Mutex<Option<Waker>>,
}

impl Slot {
    fn is(&self, state: u8) -> bool {
        self.state.load(Ordering::Acquire) == state
    }

    /// Marks a silent connection evicted and wakes its read; whether it was.
    fn evict(&self) -> bool {
        let evicted = self
            .state
            .compare_exchange(SILENT, EVICTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if evicted && let Some(waker) = lock(&self.waker).take() {
            waker.wake();
        }
        evicted
    }
}

impl Stream for Incoming {
    type Item = io::Result<Guarded>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_accept(cx)
            .map(|accepted| Some(accepted.map(|(io, _)| io)))
    }
}

impl axum::serve::Listener for Incoming {
    type Io = Guarded;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Guarded, SocketAddr) {
        loop {
            match std::future::poll_fn(|cx| self.poll_accept(cx)).await {
                Ok(accepted) => return accepted,
                // Out of descriptors, or a connection reset before it was
                // taken: a moment, then on.
                Err(e) => {
                    tracing::debug!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// An accepted connection: counted while open, and failing its reads once
/// it carried nothing for `idle` ([`IDLE`]).
pub struct Guarded {
    stream: TcpStream,
    live: Arc<AtomicUsize>,
    slot: Arc<Slot>,
    idle: Duration,
    quiet_until: Pin<Box<Sleep>>,
}

impl Guarded {
    fn new(stream: TcpStream, live: Arc<AtomicUsize>, idle: Duration) -> Self {
        Self {
            stream,
            live,
            slot: Arc::default(),
            idle,
            quiet_until: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // An evicted connection was uncounted then.
        if self.slot.state.swap(EVICTED, Ordering::AcqRel) != EVICTED {
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let closed = |why: String| Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)));
        if self.slot.is(EVICTED) {
            return closed("closed to make room: it had sent nothing".into());
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(read) => {
                if buf.filled().len() > before {
                    let until = Instant::now() + self.idle;
                    self.quiet_until.as_mut().reset(until);
                    // Spoken: never evicted (a race with an eviction
                    // leaves it evicted, and its next read fails).
                    let _ = self.slot.state.compare_exchange(
                        SILENT,
                        SPOKE,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                Poll::Ready(read)
            }
            Poll::Pending => {
                if self.slot.is(SILENT) {
                    *lock(&self.slot.waker) = Some(cx.waker().clone());
                    if self.slot.is(EVICTED) {
                        return closed("closed to make room: it had sent nothing".into());
                    }
                }
                ready!(self.quiet_until.as_mut().poll(cx));
                closed(format!(
                    "the connection carried nothing for {:?}",
                    self.idle
                ))
            }
        }
    }
}

impl AsyncWrite for Guarded {
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

impl Connected for Guarded {
    // The TCP connection's own: the TLS layer's peer certificates are
    // found by it.
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn silent_connections_make_room_then_go_quiet_and_one_past_the_most_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Incoming::new(listener, 1).with_idle(Duration::from_millis(300));
        let mut accept = async || std::future::poll_fn(|cx| incoming.poll_accept(cx)).await;
        let _silent = TcpStream::connect(addr).await.unwrap();
        let mut first = accept().await.unwrap().0;
        // A connection that never spoke gives its place to a new one.
        let mut speaking = TcpStream::connect(addr).await.unwrap();
        let mut second = accept().await.unwrap().0;
        let mut byte = [0u8; 1];
        let evicted = first.read(&mut byte).await.unwrap_err();
        assert!(evicted.to_string().contains("make room"), "{evicted}");
        drop(first);
        speaking.write_all(b"x").await.unwrap();
        assert_eq!(second.read(&mut byte).await.unwrap(), 1);
        // One that spoke keeps it: the next is closed at once.
        let mut refused = TcpStream::connect(addr).await.unwrap();
        tokio::select! {
            _ = accept() => panic!("a connection past the most was accepted"),
            read = refused.read(&mut byte) => assert_eq!(read.unwrap(), 0, "closed"),
        }
        // Then silence closes it.
        let quiet = Instant::now();
        let read = second.read(&mut byte).await;
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert!(quiet.elapsed() >= Duration::from_millis(250));
        drop(second);
        assert_eq!(incoming.live.load(Ordering::Relaxed), 0);
    }
}
