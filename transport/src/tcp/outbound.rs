//! The outbound side of the TCP backend: one queue of frames per peer.
//!
//! A send writes straight to the socket when nothing is queued (one `sendmsg` of header
//! and payload, no copy); what does not fit is queued as `Bytes` and flushed by
//! whoever comes first: a waiting application thread polling ([`Outbound::flush`]), or
//! the connection's writer task when the socket becomes writable. A send made by a
//! thread inside a blocking call (which polls until the call ends, see
//! [`crate::transport::thread_polls`]) leaves its queue to that thread and wakes the
//! writer task only when the thread stops polling, so no other thread is woken for
//! the data to flow. A send completes
//! once its frame is written or queued (payloads are immutable `Bytes`, so the caller
//! may reuse nothing it could corrupt); it waits while more than [`HIGH_WATER`] bytes
//! are queued, so a fast sender cannot exhaust memory.

use super::lock;
use crate::error::TransportError;
use crate::frame::HEADER_LEN;
use crate::ids::Rank;
use bytes::{Buf, Bytes};
use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;

/// A send waits while more than this many bytes are queued for its peer.
pub(super) const HIGH_WATER: usize = 16 << 20;
/// Polling rounds a full socket is left alone.
const FULL_BACKOFF: u32 = 8;
/// Most buffers handed to one `sendmsg`.
const MAX_IOV: usize = 32;

#[derive(Default)]
struct OutState {
    queue: VecDeque<Bytes>,
    queued: usize,
    /// The first write error; the connection is unusable after it.
    error: Option<String>,
}

/// One authenticated outbound connection.
pub(super) struct Outbound {
    peer: Rank,
    fd: AsyncFd<TcpStream>,
    state: Mutex<OutState>,
    has_data: Notify,
    space: Notify,
    /// Polling rounds to skip after finding the socket full.
    backoff: AtomicU32,
    /// Bytes queued on all of the endpoint's connections (see [`Outbound::new`]).
    pending: Arc<AtomicUsize>,
}

impl Outbound {
    /// Wraps a connected, authenticated socket. Needs a tokio runtime (for the
    /// writability notifications of the writer task). `pending` counts the bytes queued
    /// on all of an endpoint's connections, so that a polling thread looks at them only
    /// when there is something to flush: going through every connection on every poll
    /// cost 0.5 µs of 8-byte one-way latency with 30 idle peers (docs/BENCHMARKS.md).
    pub(super) fn new(peer: Rank, stream: TcpStream, pending: Arc<AtomicUsize>) -> std::io::Result<Arc<Self>> {
        stream.set_nonblocking(true)?;
        // SAFETY: the TcpStream owns its descriptor, which stays open and unchanged until
        // the AsyncFd (which owns the stream) is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(stream, Interest::WRITABLE | Interest::READABLE) }
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Arc::new(Self {
            peer,
            fd,
            state: Mutex::new(OutState::default()),
            has_data: Notify::new(),
            space: Notify::new(),
            backoff: AtomicU32::new(0),
            pending,
        }))
    }

    fn broken(&self, why: &str) -> TransportError {
        TransportError::io(self.peer, std::io::Error::new(std::io::ErrorKind::BrokenPipe, why.to_string()))
    }

    /// Writes or queues one frame, then waits while the queue is over [`HIGH_WATER`].
    pub(super) async fn send(&self, header: [u8; HEADER_LEN], payload: Bytes) -> Result<(), TransportError> {
        {
            let mut st = lock(&self.state);
            if let Some(why) = &st.error {
                return Err(self.broken(why));
            }
            let total = HEADER_LEN + payload.len();
            let written = if st.queue.is_empty() {
                match crate::sys::send_vectored_nonblocking(
                    self.raw(),
                    &[IoSlice::new(&header), IoSlice::new(&payload)],
                ) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
                    Err(e) => {
                        st.error = Some(e.to_string());
                        return Err(TransportError::io(self.peer, e));
                    }
                }
            } else {
                0
            };
            if written == total {
                return Ok(());
            }
            if written < HEADER_LEN {
                st.queue.push_back(Bytes::copy_from_slice(&header[written..]));
                if !payload.is_empty() {
                    st.queue.push_back(payload);
                }
            } else {
                st.queue.push_back(payload.slice(written - HEADER_LEN..));
            }
            st.queued += total - written;
            self.pending.fetch_add(total - written, Ordering::AcqRel);
        }
        if !crate::transport::thread_polls() {
            self.has_data.notify_one();
        }
        loop {
            let notified = self.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = lock(&self.state);
                if let Some(why) = &st.error {
                    return Err(self.broken(why));
                }
                if st.queued <= HIGH_WATER {
                    return Ok(());
                }
            }
            notified.await;
        }
    }

    fn raw(&self) -> std::os::fd::RawFd {
        self.fd.get_ref().as_raw_fd()
    }

    /// Writes queued data until the queue is empty or the socket is full. Returns
    /// whether anything was written.
    fn flush_locked(&self, st: &mut OutState) -> bool {
        let mut wrote = false;
        while !st.queue.is_empty() && st.error.is_none() {
            let slices: Vec<IoSlice<'_>> = st.queue.iter().take(MAX_IOV).map(|b| IoSlice::new(b)).collect();
            match crate::sys::send_vectored_nonblocking(self.raw(), &slices) {
                Ok(mut n) => {
                    wrote = true;
                    st.queued -= n;
                    self.pending.fetch_sub(n, Ordering::AcqRel);
                    while n > 0 {
                        let Some(front) = st.queue.front_mut() else { break };
                        if front.len() <= n {
                            n -= front.len();
                            st.queue.pop_front();
                        } else {
                            front.advance(n);
                            n = 0;
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::error!("connection to {} failed: {e}", self.peer);
                    st.error = Some(e.to_string());
                    st.queue.clear();
                    self.pending.fetch_sub(std::mem::take(&mut st.queued), Ordering::AcqRel);
                }
            }
        }
        wrote
    }

    /// Flushes what it can without blocking (for polling threads). True if it wrote.
    /// After the socket was found full, the next few calls skip the attempt: retrying
    /// `sendmsg` on a full socket at full speed contends for the socket lock with the
    /// receiver's acknowledgements that would make room.
    pub(super) fn flush(&self) -> bool {
        if self.backoff.load(Ordering::Relaxed) > 0 {
            self.backoff.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        let Ok(mut st) = self.state.try_lock() else { return false };
        if st.queue.is_empty() {
            return false;
        }
        let wrote = self.flush_locked(&mut st);
        if !st.queue.is_empty() {
            self.backoff.store(FULL_BACKOFF, Ordering::Relaxed);
        }
        drop(st);
        if wrote {
            self.space.notify_waiters();
        }
        wrote
    }

    /// Hands queued data to the writer task (the polling thread is leaving).
    pub(super) fn wake_writer(&self) {
        if !lock(&self.state).queue.is_empty() {
            self.has_data.notify_one();
        }
    }

    /// Whether the connection has failed.
    pub(super) fn failed(&self) -> bool {
        lock(&self.state).error.is_some()
    }

    /// The writer task: flushes the queue whenever the socket can take more.
    /// Returns when the connection fails or its peer closes it.
    pub(super) async fn writer(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.has_data.notified() => {}
                why = self.peer_closed() => {
                    lock(&self.state).error.get_or_insert(why);
                    self.space.notify_waiters();
                    return;
                }
            }
            loop {
                let mut ready = match self.fd.writable().await {
                    Ok(r) => r,
                    Err(e) => {
                        lock(&self.state).error = Some(e.to_string());
                        self.space.notify_waiters();
                        return;
                    }
                };
                let (empty, failed) = {
                    let mut st = lock(&self.state);
                    self.flush_locked(&mut st);
                    (st.queue.is_empty(), st.error.is_some())
                };
                self.space.notify_waiters();
                if failed {
                    return;
                }
                if empty {
                    break;
                }
                // The queue is not empty only because the socket was full.
                ready.clear_ready();
            }
        }
    }

    /// Resolves once the peer has closed the connection (or it broke), with why. The
    /// peer never writes on it after the handshake, so whatever makes it readable is its
    /// end.
    async fn peer_closed(&self) -> String {
        loop {
            let mut ready = match self.fd.readable().await {
                Ok(r) => r,
                Err(e) => return e.to_string(),
            };
            let mut byte = [0u8; 1];
            match ready.try_io(|s| s.get_ref().peek(&mut byte)) {
                Ok(Ok(0)) => return format!("{} closed the connection", self.peer),
                Ok(Ok(_)) => return format!("{} wrote on a connection it may only read", self.peer),
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return e.to_string(),
                // Readiness cleared; wait for the next.
                Err(_would_block) => {}
            }
        }
    }

    /// Queues a goodbye, waits (up to `limit`) for everything to be written, and shuts
    /// the connection down for writing.
    pub(super) async fn finish(&self, bye: [u8; HEADER_LEN], limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        if let Err(e) = tokio::time::timeout_at(deadline, self.send(bye, Bytes::new())).await.unwrap_or(Ok(())) {
            tracing::debug!("goodbye to {} failed: {e}", self.peer);
        }
        if tokio::time::timeout_at(deadline, self.drained()).await.is_err() {
            tracing::debug!("goodbye to {} timed out with data queued", self.peer);
        }
        let _ = self.fd.get_ref().shutdown(std::net::Shutdown::Write);
    }

    /// Resolves once nothing is queued, every frame written to the kernel (which
    /// delivers it even if this process dies), or the connection has failed (taking
    /// what was queued with it).
    pub(super) async fn drained(&self) {
        if !crate::transport::thread_polls() {
            self.wake_writer();
        }
        loop {
            let notified = self.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = lock(&self.state);
                if st.queue.is_empty() || st.error.is_some() {
                    return;
                }
            }
            notified.await;
        }
    }
}

impl Drop for Outbound {
    fn drop(&mut self) {
        // A connection dropped with data still queued takes it out of the count.
        let queued = std::mem::take(&mut lock(&self.state).queued);
        self.pending.fetch_sub(queued, Ordering::AcqRel);
    }
}
