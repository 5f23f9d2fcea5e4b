//! The listening side of the QUIC backend: accepting connections, authenticating the
//! dialer, reading its messages, and serving its gets.

use super::wire::{self, close};
use super::{tls, Inner};
use crate::auth;
use crate::error::{FrameError, TransportError};
use crate::frame::{FrameHeader, FrameKind, FrameLimits};
use crate::ids::Rank;
use crate::matching::{Envelope, PeerEnd};
use crate::sys;
use crate::window::{self, GetRequest, REQUEST_LEN};
use bytes::Bytes;
use quinn::{Connection, Incoming, RecvStream, SendStream};
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::timeout;

/// Accepts connections until the endpoint closes, each served by its own task.
pub(super) async fn accept_loop(inner: Arc<Inner>) {
    while let Some(incoming) = inner.endpoint.accept().await {
        let task = tokio::spawn(serve_connection(inner.clone(), incoming));
        inner.track(task.abort_handle());
    }
}

/// Serves one inbound connection: authenticates the dialer, then delivers the frames of
/// its message stream until its goodbye or the connection's end.
async fn serve_connection(inner: Arc<Inner>, incoming: Incoming) {
    let me = inner.me.rank;
    let from = incoming.remote_address();
    let (conn, peer, recv) = match authenticate(&inner, incoming).await {
        Ok(accepted) => accepted,
        Err(why) => {
            if !inner.is_closed() {
                tracing::error!("{me}: rejected a QUIC connection from {from}: {why}");
            }
            return;
        }
    };
    tracing::debug!("{me}: {peer} connected from {from}");
    inner.mailbox.peer_connected(peer);
    // How many data frames the message stream has delivered, which flushes wait for.
    let (read, reads) = watch::channel(0u64);
    let gets = tokio::spawn(serve_gets(inner.clone(), conn.clone(), peer, reads));
    inner.track(gets.abort_handle());
    let how = match read_messages(&inner, peer, recv, &read).await {
        Ok(()) | Err(TransportError::PeerClosed(_)) => PeerEnd::Closed,
        Err(_) if inner.is_closed() => return,
        Err(e) => {
            // A peer that dies is named by what waits on it, and by the launcher; a peer
            // that breaks the protocol only here.
            if matches!(e, TransportError::Frame { .. }) {
                conn.close(close::BAD_FRAME.into(), b"bad frame");
                tracing::error!("{me}: connection from {peer} dropped: {e}");
            } else {
                tracing::info!("{me}: connection from {peer} dropped: {e}");
            }
            PeerEnd::Lost
        }
    };
    inner.mailbox.peer_ended(peer, how);
}

/// Completes the TLS handshake and the job-key handshake on the dialer's first stream;
/// returns the connection, the dialer's rank, and the stream its frames come on.
async fn authenticate(inner: &Inner, incoming: Incoming) -> Result<(Connection, Rank, RecvStream), String> {
    let connect = inner.cfg.get_connect_timeout();
    let mut server = inner.server.clone();
    server.transport_config(tls::transport_config(sys::route_mtu(incoming.remote_address()))?);
    let connecting = incoming.accept_with(Arc::new(server)).map_err(|e| format!("TLS handshake failed: {e}"))?;
    let conn = match timeout(connect, connecting).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(format!("TLS handshake failed: {e}")),
        Err(_) => return Err(format!("no TLS handshake within {connect:?}")),
    };
    let t = inner.cfg.get_handshake_timeout();
    let (send, recv) = match timeout(t, conn.accept_bi()).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(format!("no stream opened: {e}")),
        Err(_) => {
            conn.close(close::AUTH.into(), b"no handshake");
            return Err(format!("no stream opened within {t:?}"));
        }
    };
    let me = inner.me.rank;
    // Any endpoint of the job may connect, including ones that joined in a resize and
    // are not in our table yet: holding the job key is what makes a peer a member.
    let member = |r: Rank| r.0 <= Rank::MAX_ID && r != me;
    let mut stream = tokio::io::join(recv, send);
    match auth::accept(&mut stream, &inner.me, member, t).await {
        Ok(peer) => {
            let (recv, mut send) = stream.into_inner();
            // The dialer's frames come on `recv`; nothing more goes back this way.
            let _ = send.finish();
            Ok((conn, peer, recv))
        }
        Err(e) => {
            // A dialer that gives up (a wrong key) closes the connection: say how.
            let why = match (&e, conn.close_reason()) {
                (auth::HandshakeError::Io(_), Some(reason)) => reason.to_string(),
                _ => e.to_string(),
            };
            conn.close(close::AUTH.into(), b"authentication failed");
            Err(format!("authentication failed: {why}"))
        }
    }
}

/// Payloads above this many bytes may be read into a receive's memory in place.
const LARGE: u64 = 64 * 1024;

/// Delivers the frames of an authenticated message stream, counting data frames in
/// `read`; `Ok` on a goodbye.
async fn read_messages(
    inner: &Inner,
    peer: Rank,
    mut recv: RecvStream,
    read: &watch::Sender<u64>,
) -> Result<(), TransportError> {
    let limits = FrameLimits { max_payload: inner.cfg.get_max_payload(), peer };
    loop {
        let h = wire::read_header(&mut recv, limits).await?;
        match h.kind {
            // A large payload goes straight into the receiver's memory if a receive waits
            // for it there. Otherwise it is delivered in the pieces quinn read it in,
            // which the receiver joins on its own thread: this task is on the progress
            // thread that all of the process's traffic goes through.
            FrameKind::Data if h.len > LARGE => match inner.mailbox.claim(peer, h.ctx, h.tag, h.len) {
                Some(mut claim) => {
                    wire::read_payload_into(&mut recv, peer, claim.bytes_mut()).await?;
                    inner.mailbox.complete_claim(claim);
                }
                None => {
                    let (payload, rest) = wire::read_pieces(&mut recv, peer, h.len).await?;
                    inner.mailbox.deliver_pieces(Envelope { src: peer, ctx: h.ctx, tag: h.tag, payload }, rest);
                }
            },
            FrameKind::Data => {
                let payload = wire::read_payload(&mut recv, peer, h.len).await?;
                inner.mailbox.deliver(Envelope { src: peer, ctx: h.ctx, tag: h.tag, payload });
            }
            FrameKind::Bye => return Ok(()),
            FrameKind::GetRequest | FrameKind::GetReply | FrameKind::GetRefusal => {
                let source = FrameError::Malformed("a get frame on the message stream");
                return Err(TransportError::Frame { peer, source });
            }
            FrameKind::Flush | FrameKind::Flushed => {
                let source = FrameError::Malformed("a flush frame on the message stream");
                return Err(TransportError::Frame { peer, source });
            }
        }
        // A data frame, delivered: a flush waiting for it may answer.
        read.send_modify(|n| *n += 1);
    }
}

/// Accepts the peer's get and flush streams, each served by its own task on tokio
/// (never on the application thread that owns the window), until the connection ends.
/// `reads` counts the data frames the connection's message stream delivered.
async fn serve_gets(inner: Arc<Inner>, conn: Connection, peer: Rank, reads: watch::Receiver<u64>) {
    while let Ok((send, recv)) = conn.accept_bi().await {
        let task = tokio::spawn(serve_get(inner.clone(), conn.clone(), peer, (send, recv), reads.clone()));
        inner.track(task.abort_handle());
    }
}

/// Answers one get: reads the request, looks the range up, and sends back a slice of
/// the window (no copy) or the refusal. Or answers a flush, once the message stream
/// has delivered as many data frames as it names.
async fn serve_get(
    inner: Arc<Inner>,
    conn: Connection,
    peer: Rank,
    (mut send, mut recv): (SendStream, RecvStream),
    mut reads: watch::Receiver<u64>,
) {
    let me = inner.me.rank;
    let cap = inner.cfg.get_max_payload();
    let t = inner.cfg.get_handshake_timeout();
    let req = match timeout(t, read_request(&mut recv, FrameLimits { max_payload: cap, peer })).await {
        Ok(Ok(Request::Get(req))) => req,
        Ok(Ok(Request::Flush(count))) => {
            // Unbounded: the flusher gives up by itself, and then resets the stream.
            if reads.wait_for(|&n| n >= count).await.is_err() {
                tracing::debug!("{me}: the message stream of {peer} ended before its flush");
                return;
            }
            let header = FrameHeader::get(FrameKind::Flushed, me, count, 0).encode();
            if send.write_all(&header).await.is_ok() {
                let _ = send.finish();
            }
            return;
        }
        Ok(Err(e @ TransportError::Frame { .. })) => {
            tracing::error!("{me}: closing the connection from {peer}: {e}");
            conn.close(close::BAD_FRAME.into(), b"bad frame");
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!("{me}: a get by {peer} ended early: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!("{me}: {peer} sent no get request within {t:?}");
            return;
        }
    };
    let reply = inner.windows.read_capped(req, cap);
    let (kind, payload) = match reply {
        Ok(bytes) => (FrameKind::GetReply, bytes),
        Err(why) => {
            tracing::warn!("{me}: refused a get by {peer}: {why}");
            (FrameKind::GetRefusal, Bytes::from(window::encode_refusal(&why)))
        }
    };
    let header = FrameHeader::get(kind, me, 0, payload.len() as u64).encode();
    let mut chunks = [Bytes::copy_from_slice(&header), payload];
    if let Err(e) = send.write_all_chunks(&mut chunks).await {
        tracing::debug!("{me}: cannot answer a get by {peer}: {e}");
        return;
    }
    // Only fails if the stream is already finished or reset, which it is not.
    let _ = send.finish();
}

/// What a stream beside the message stream asks.
enum Request {
    Get(GetRequest),
    /// A flush, of that many data frames.
    Flush(u64),
}

/// Reads a get request (a validated get-request header and the request itself) or a
/// flush.
async fn read_request(recv: &mut RecvStream, limits: FrameLimits) -> Result<Request, TransportError> {
    let peer = limits.peer;
    let h = wire::read_header(recv, limits).await?;
    let malformed = |what| TransportError::Frame { peer, source: FrameError::Malformed(what) };
    match h.kind {
        FrameKind::GetRequest => {
            let body = wire::read_payload(recv, peer, REQUEST_LEN as u64).await?;
            GetRequest::decode(&body).map(Request::Get).ok_or_else(|| malformed("get request"))
        }
        FrameKind::Flush => Ok(Request::Flush(h.request_id())),
        _ => Err(malformed("neither a get request nor a flush on a get stream")),
    }
}
