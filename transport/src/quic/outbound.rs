//! The dialing side of the QUIC backend: one connection per peer, opened by the first
//! send or get to it, with a writer task that owns the message stream; and the
//! requesting side of gets.

use super::wire::{self, close};
use super::{lock, tls, Inner};
use crate::auth::{self, HandshakeError};
use crate::error::{FrameError, TransportError};
use crate::frame::{FrameHeader, FrameKind, FrameLimits, HEADER_LEN};
use crate::ids::Rank;
use crate::landing::Part;
use crate::sys;
use crate::window::{self, GetRequest, Got, REFUSAL_LEN, REQUEST_LEN};
use bytes::Bytes;
use quinn::{Connection, ConnectionError, SendStream, WriteError};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout, timeout_at, Instant};

/// What the writer task is asked to do, in order.
enum Job {
    /// Write one frame (header and payload), then say how it went.
    Frame([Bytes; 2], oneshot::Sender<Result<(), WriteError>>),
    /// Write the goodbye frame, finish the stream, and wait (until the deadline) for the
    /// peer to acknowledge everything.
    Bye([u8; HEADER_LEN], Instant, oneshot::Sender<()>),
    /// Say how many frames were written before this job.
    Count(oneshot::Sender<u64>),
}

/// Our authenticated connection to one peer.
pub(super) struct Outbound {
    peer: Rank,
    conn: Connection,
    jobs: mpsc::UnboundedSender<Job>,
}

impl Outbound {
    /// Wraps an authenticated connection and starts the writer task of its message
    /// stream, and a task that forgets the connection once it has ended: held on to, a
    /// closed connection keeps its state (some 200 KiB), one per process that ever left.
    fn start(inner: &Inner, peer: Rank, conn: Connection, send: SendStream) -> Arc<Self> {
        let (jobs, rx) = mpsc::unbounded_channel();
        inner.track(tokio::spawn(write_frames(send, rx)).abort_handle());
        let (out, departed, watched) = (inner.out.clone(), inner.departed.clone(), conn.clone());
        inner.track(
            tokio::spawn(async move {
                let reason = watched.closed().await;
                let Some(slot) = lock(&out).get(&peer).cloned() else { return };
                let mut held = slot.lock().await;
                if held.as_ref().is_some_and(|o| o.conn.stable_id() == watched.stable_id()) {
                    if matches!(wire::conn_error(peer, &reason), TransportError::PeerClosed(_)) {
                        lock(&departed).insert(peer);
                    }
                    // The slot itself stays: a send waiting on it must not open a second
                    // connection beside the next one (its messages could overtake).
                    *held = None;
                }
            })
            .abort_handle(),
        );
        Arc::new(Self { peer, conn, jobs })
    }

    /// Why this connection can carry nothing more, if it cannot.
    pub(super) fn ended(&self) -> Option<TransportError> {
        match self.conn.close_reason() {
            Some(e) => Some(wire::conn_error(self.peer, &e)),
            None if self.jobs.is_closed() => Some(TransportError::PeerLost(self.peer)),
            None => None,
        }
    }

    /// Sends one frame. Completes once quinn has taken the bytes (its flow control makes
    /// this wait); a dropped send still goes out whole, so the stream stays framed.
    pub(super) async fn send(&self, header: [u8; HEADER_LEN], payload: Bytes) -> Result<(), TransportError> {
        let (tx, rx) = oneshot::channel();
        let job = Job::Frame([Bytes::copy_from_slice(&header), payload], tx);
        if self.jobs.send(job).is_err() {
            return Err(self.ended().unwrap_or(TransportError::PeerLost(self.peer)));
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(wire::write_error(self.peer, e)),
            Err(_) => Err(self.ended().unwrap_or(TransportError::PeerLost(self.peer))),
        }
    }

    /// Completes once the peer has read every frame written before the call. quinn's
    /// send completes when quinn has the bytes, which go with this process if it dies:
    /// the peer confirms, on a stream of its own, once its reader is past that many
    /// frames of the message stream.
    pub(super) async fn flush(&self, me: Rank) -> Result<(), TransportError> {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send(Job::Count(tx)).is_err() {
            return Err(self.ended().unwrap_or(TransportError::PeerLost(self.peer)));
        }
        let Ok(count) = rx.await else { return Err(self.ended().unwrap_or(TransportError::PeerLost(self.peer))) };
        if count == 0 {
            return Ok(());
        }
        let dst = self.peer;
        let confirmed = async {
            let (mut send, mut recv) = self.conn.open_bi().await.map_err(|e| wire::conn_error(dst, &e))?;
            let header = FrameHeader::get(FrameKind::Flush, me, count, 0).encode();
            send.write_all(&header).await.map_err(|e| wire::write_error(dst, e))?;
            // Only fails if the stream is already finished or reset, which it is not.
            let _ = send.finish();
            let h = wire::read_header(&mut recv, FrameLimits { max_payload: 0, peer: dst }).await?;
            if h.kind != FrameKind::Flushed || h.request_id() != count {
                return Err(TransportError::Frame { peer: dst, source: FrameError::Malformed("not a flush's answer") });
            }
            Ok(())
        };
        confirmed.await
    }

    /// Says goodbye after the frames already queued, waits until `deadline` at most for
    /// the peer to have them all, and closes the connection.
    pub(super) async fn goodbye(&self, header: [u8; HEADER_LEN], deadline: Instant) {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send(Job::Bye(header, deadline, tx)).is_ok() {
            let _ = timeout_at(deadline, rx).await;
        }
        self.conn.close(close::BYE.into(), b"goodbye");
    }
}

/// The writer task: writes queued frames in order until the stream fails, the goodbye
/// is written, or the connection is dropped.
async fn write_frames(mut send: SendStream, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut written = 0u64;
    while let Some(job) = jobs.recv().await {
        match job {
            Job::Frame(mut chunks, ack) => {
                let res = send.write_all_chunks(&mut chunks).await;
                let failed = res.is_err();
                let _ = ack.send(res);
                if failed {
                    return;
                }
                written += 1;
            }
            Job::Count(reply) => {
                let _ = reply.send(written);
            }
            Job::Bye(header, deadline, done) => {
                if send.write_all(&header).await.is_ok() && send.finish().is_ok() {
                    let _ = timeout_at(deadline, send.stopped()).await;
                }
                let _ = done.send(());
                return;
            }
        }
    }
}

impl Inner {
    /// The connection to `dst`, opened and authenticated on first use, and again after
    /// it was lost. A peer that said goodbye is not dialed again.
    pub(super) async fn outbound(&self, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
        if lock(&self.departed).contains(&dst) {
            return Err(TransportError::PeerClosed(dst));
        }
        let slot = lock(&self.out).entry(dst).or_default().clone();
        let mut slot = slot.lock().await;
        // Its watcher may have let the connection go meanwhile, the peer having left.
        if lock(&self.departed).contains(&dst) {
            return Err(TransportError::PeerClosed(dst));
        }
        if let Some(o) = slot.as_ref() {
            match o.ended() {
                None => return Ok(o.clone()),
                Some(e @ TransportError::PeerClosed(_)) => return Err(e),
                Some(e) => tracing::debug!("{}: reconnecting to {dst}: {e}", self.me.rank),
            }
        }
        if self.is_closed() {
            return Err(TransportError::Closed);
        }
        let o = self.connect(dst).await?;
        *slot = Some(o.clone());
        Ok(o)
    }

    /// Opens and authenticates a connection to `dst`; a failed dial to a peer known
    /// to have ended fails as lost ([`crate::Mailbox::dial_error`]).
    async fn connect(&self, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
        self.dial(dst).await.map_err(|e| self.mailbox.dial_error(dst, e))
    }

    async fn dial(&self, dst: Rank) -> Result<Arc<Outbound>, TransportError> {
        let peer = {
            let peers = self.peers.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            peers.get(dst.index()).copied().flatten().ok_or(TransportError::UnknownPeer(dst))?
        };
        let setup_err = |e: String| TransportError::io(dst, std::io::Error::other(e));
        let transport = tls::transport_config(sys::route_mtu(peer.addr)).map_err(setup_err)?;
        let client = tls::client_config(peer.fingerprint, transport).map_err(setup_err)?;
        let connecting = self
            .endpoint
            .connect_with(client, peer.addr, tls::SERVER_NAME)
            .map_err(|e| setup_err(format!("cannot connect to {}: {e}", peer.addr)))?;
        let t = self.cfg.get_connect_timeout();
        let conn = match timeout(t, connecting).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(handshake_error(dst, peer.addr, &e)),
            Err(_) => {
                return Err(TransportError::Timeout {
                    what: format!("a connection to {dst} at {}", peer.addr),
                    after: t,
                })
            }
        };
        let send = match self.authenticate(&conn, dst).await {
            Ok(send) => send,
            Err(e) => {
                conn.close(close::AUTH.into(), b"authentication failed");
                return Err(e);
            }
        };
        tracing::debug!("{}: connected to {dst} at {}", self.me.rank, peer.addr);
        Ok(Outbound::start(self, dst, conn, send))
    }

    /// Runs the job-key handshake on the first stream, which then carries our frames.
    async fn authenticate(&self, conn: &Connection, dst: Rank) -> Result<SendStream, TransportError> {
        let t = self.cfg.get_handshake_timeout();
        let (send, recv) = match timeout(t, conn.open_bi()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(wire::conn_error(dst, &e)),
            Err(_) => return Err(TransportError::Timeout { what: format!("a stream to {dst}"), after: t }),
        };
        let mut stream = tokio::io::join(recv, send);
        match auth::dial(&mut stream, &self.me, dst, t).await {
            Ok(()) => Ok(stream.into_inner().1),
            Err(HandshakeError::Auth(source)) => Err(TransportError::Auth { peer: dst, source }),
            Err(HandshakeError::Io(e)) => Err(match conn.close_reason() {
                Some(reason) => wire::conn_error(dst, &reason),
                None => TransportError::io(dst, e),
            }),
        }
    }

    /// Reads a range of `dst`'s window: the request and its reply travel on a fresh
    /// bidirectional stream of our connection to `dst`.
    /// Asks `dst` for `req`'s range and reads the reply, into `into` (of the request's
    /// length) if given.
    pub(super) async fn remote_get(
        &self,
        dst: Rank,
        req: GetRequest,
        into: Option<Part>,
    ) -> Result<Got, TransportError> {
        let out = self.outbound(dst).await?;
        let (mut send, mut recv) = out.conn.open_bi().await.map_err(|e| wire::conn_error(dst, &e))?;
        let header = FrameHeader::get(FrameKind::GetRequest, self.me.rank, 0, REQUEST_LEN as u64).encode();
        let mut chunks = [Bytes::copy_from_slice(&header), Bytes::copy_from_slice(&req.encode())];
        send.write_all_chunks(&mut chunks).await.map_err(|e| wire::write_error(dst, e))?;
        // Only fails if the stream is already finished or reset, which it is not.
        let _ = send.finish();
        let limits = FrameLimits { max_payload: self.cfg.get_max_payload(), peer: dst };
        let reply = async {
            let h = wire::read_header(&mut recv, limits).await?;
            match h.kind {
                FrameKind::GetReply if h.len == req.len => match into {
                    Some(mut part) => {
                        wire::read_payload_into(&mut recv, dst, part.as_mut_slice()).await?;
                        Ok(Got::Landed(part))
                    }
                    None => wire::read_payload(&mut recv, dst, h.len).await.map(Got::Bytes),
                },
                FrameKind::GetReply => Err(TransportError::Window {
                    peer: dst,
                    what: format!("replied with {} bytes to a get of {}", h.len, req.len),
                }),
                FrameKind::GetRefusal => {
                    let b = wire::read_payload(&mut recv, dst, REFUSAL_LEN as u64).await?;
                    let why = window::decode_refusal(&b)
                        .ok_or(TransportError::Frame { peer: dst, source: FrameError::Malformed("get refusal") })?;
                    Err(TransportError::Window { peer: dst, what: why.to_string() })
                }
                _ => Err(TransportError::Frame { peer: dst, source: FrameError::Malformed("not a get reply") }),
            }
        };
        let res = reply.await;
        if let Err(e @ TransportError::Frame { .. }) = &res {
            tracing::error!("{}: closing the connection to {dst}: {e}", self.me.rank);
            out.conn.close(close::BAD_FRAME.into(), b"bad frame");
        }
        res
    }
}

/// Why a connection could not be opened.
fn handshake_error(dst: Rank, addr: SocketAddr, e: &ConnectionError) -> TransportError {
    match e {
        ConnectionError::TimedOut => {
            TransportError::Timeout { what: format!("a QUIC handshake with {dst} at {addr}"), after: tls::IDLE_TIMEOUT }
        }
        ConnectionError::TransportError(_) | ConnectionError::ConnectionClosed(_) => {
            // A TLS failure (such as a certificate that is not the pinned one), or an
            // endpoint that refuses connections because it is closing.
            let kind = match e {
                ConnectionError::TransportError(_) => std::io::ErrorKind::PermissionDenied,
                _ => std::io::ErrorKind::ConnectionRefused,
            };
            let why = format!("QUIC handshake with {dst} at {addr} failed: {e}");
            TransportError::io(dst, std::io::Error::new(kind, why))
        }
        other => wire::conn_error(dst, other),
    }
}
