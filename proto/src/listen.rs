//! Listeners kept from losing their descriptors to connections that
//! never speak (the controller's gRPC and HTTP ports, a stage's HTTP
//! port): each holds at most so many connections at once, and a
//! connection that carried nothing for [`IDLE`] is closed. A live gRPC
//! connection answers the server's keepalive pings (every [`KEEPALIVE`]
//! without traffic), so the ones closed never began their TLS handshake
//! or HTTP/2 preface, or went silent: a few hundred such connections used
//! to take every descriptor of a controller, and with them stage sessions,
//! `sluicectl` and `/healthz`.
//!
//! A listener that holds as many as it may makes room by closing the
//! oldest connection not yet established: one that has not answered the
//! server (sent [`ANSWERED`] bytes after the server first wrote to it).
//! A client that sends a byte now and then, never finishing its TLS
//! handshake, HTTP/2 preface or HTTP/1 request head, is never answered by
//! the server, and so can always be closed for another; counting any byte
//! as speech let such trickles hold every place. With none to close, the
//! new connection is closed (said once a minute).

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

/// How many bytes a client sends after the server's first write to it
/// before its connection is established (no longer closed to make room):
/// the length of the HTTP/2 client preface, less than a TLS client's
/// handshake finish or any HTTP request.
pub const ANSWERED: usize = 24;

/// One listener's accepted connections, each [`Guarded`].
pub struct Incoming {
    listener: TcpListener,
    live: Arc<AtomicUsize>,
    most: usize,
    idle: Duration,
    /// The connections accepted that were not established yet, oldest
    /// first.
    opening: VecDeque<Weak<Slot>>,
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
            opening: VecDeque::new(),
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
                self.evict_opening();
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
                        "connections refused: the listener holds as many as it may, all of them established (a share of the descriptor limit; raise `ulimit -n`, or look for a client that opens connections and leaves them)"
                    );
                    self.said = Some(Instant::now());
                    self.refused = 0;
                }
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.live.fetch_add(1, Ordering::Relaxed);
            let guarded = Guarded::new(stream, Arc::clone(&self.live), self.idle);
            if self.opening.len() >= self.most {
                self.opening
                    .retain(|slot| slot.upgrade().is_some_and(|s| s.is(OPENING)));
            }
            self.opening.push_back(Arc::downgrade(&guarded.slot));
            return Poll::Ready(Ok((guarded, peer)));
        }
    }

    /// Closes the oldest connection not established, if any.
    fn evict_opening(&mut self) {
        while let Some(slot) = self.opening.pop_front() {
            if let Some(slot) = slot.upgrade()
                && slot.evict()
            {
                self.live.fetch_sub(1, Ordering::Relaxed);
                return;
            }
        }
    }
}

/// A connection has not answered the server yet.
const OPENING: u8 = 0;
/// It has: it is never closed to make room.
const ESTABLISHED: u8 = 1;
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

    /// Marks a connection not established evicted and wakes its read;
    /// whether it was.
    fn evict(&self) -> bool {
        let evicted = self
            .state
            .compare_exchange(OPENING, EVICTED, Ordering::AcqRel, Ordering::Acquire)
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
    /// Bytes read since the server first wrote (`None`: it has not).
    answered: Option<usize>,
}

impl Guarded {
    fn new(stream: TcpStream, live: Arc<AtomicUsize>, idle: Duration) -> Self {
        Self {
            stream,
            live,
            slot: Arc::default(),
            idle,
            quiet_until: Box::pin(tokio::time::sleep(idle)),
            answered: None,
        }
    }

    /// Notes the server's write: bytes read from here on answer it.
    fn wrote(&mut self, written: &io::Result<usize>) {
        if self.answered.is_none() && matches!(written, Ok(n) if *n > 0) {
            self.answered = Some(0);
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
        let evicted = || closed("closed to make room: it had not answered the server".into());
        if self.slot.is(EVICTED) {
            return evicted();
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(read) => {
                let read_now = buf.filled().len() - before;
                if read_now > 0 {
                    let until = Instant::now() + self.idle;
                    self.quiet_until.as_mut().reset(until);
                    if let Some(answered) = &mut self.answered {
                        let had = *answered;
                        *answered = had.saturating_add(read_now);
                        if had < ANSWERED && *answered >= ANSWERED {
                            // Never evicted now (a race with an eviction
                            // leaves it evicted, and its next read fails).
                            let _ = self.slot.state.compare_exchange(
                                OPENING,
                                ESTABLISHED,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            );
                        }
                    }
                }
                Poll::Ready(read)
            }
            Poll::Pending => {
                if self.slot.is(OPENING) {
                    *lock(&self.slot.waker) = Some(cx.waker().clone());
                    if self.slot.is(EVICTED) {
                        return evicted();
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
        let written = ready!(Pin::new(&mut self.stream).poll_write(cx, buf));
        self.wrote(&written);
        Poll::Ready(written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = ready!(Pin::new(&mut self.stream).poll_write_vectored(cx, bufs));
        self.wrote(&written);
        Poll::Ready(written)
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
    async fn connections_not_established_make_room_then_go_quiet_and_one_past_the_most_is_refused()
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Incoming::new(listener, 1).with_idle(Duration::from_millis(300));
        let mut accept = async || std::future::poll_fn(|cx| incoming.poll_accept(cx)).await;
        let make_room = |e: io::Error| assert!(e.to_string().contains("make room"), "{e}");
        let _silent = TcpStream::connect(addr).await.unwrap();
        let mut first = accept().await.unwrap().0;
        // A connection that never spoke gives its place to a new one.
        let mut trickle = TcpStream::connect(addr).await.unwrap();
        let mut second = accept().await.unwrap().0;
        let mut byte = [0u8; 64];
        make_room(first.read(&mut byte).await.unwrap_err());
        drop(first);
        // So does one that sends a byte now and then, the server never
        // answering (an unfinished handshake or request head).
        for _ in 0..ANSWERED * 2 {
            trickle.write_all(b"x").await.unwrap();
            assert_eq!(second.read(&mut byte).await.unwrap(), 1);
        }
        let mut speaking = TcpStream::connect(addr).await.unwrap();
        let mut third = tokio::time::timeout(Duration::from_secs(5), accept())
            .await
            .expect("the trickling connection made no room")
            .unwrap()
            .0;
        make_room(second.read(&mut byte).await.unwrap_err());
        drop(second);
        // One that answered the server keeps its place: the next is closed
        // at once.
        speaking.write_all(b"hello").await.unwrap();
        assert_eq!(third.read(&mut byte).await.unwrap(), 5);
        third.write_all(b"settings").await.unwrap();
        assert_eq!(speaking.read(&mut byte).await.unwrap(), 8);
        speaking.write_all(&[7; ANSWERED]).await.unwrap();
        third.read_exact(&mut byte[..ANSWERED]).await.unwrap();
        let mut refused = TcpStream::connect(addr).await.unwrap();
        tokio::select! {
            _ = accept() => panic!("a connection past the most was accepted"),
            read = refused.read(&mut byte) => assert_eq!(read.unwrap(), 0, "closed"),
        }
        // Then silence closes it.
        let quiet = Instant::now();
        let read = third.read(&mut byte).await;
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert!(quiet.elapsed() >= Duration::from_millis(250));
        drop(third);
        assert_eq!(incoming.live.load(Ordering::Relaxed), 0);
    }
}
