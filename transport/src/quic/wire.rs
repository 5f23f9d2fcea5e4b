//! Reading frames off quinn streams, and what quinn's errors mean for a peer.

use crate::error::{FrameError, TransportError};
use crate::frame::{FrameHeader, FrameLimits, HEADER_LEN};
use crate::ids::Rank;
use bytes::{Bytes, BytesMut};
use quinn::{ConnectionError, ReadError, ReadExactError, RecvStream, VarInt, WriteError};
use std::io;

/// Application close codes, sent with a connection's CONNECTION_CLOSE. quinn itself
/// closes with code 0 when the last handle of a connection is dropped; like every code
/// but [`BYE`], that means the peer went away without a goodbye.
pub(super) mod close {
    /// The endpoint closed after saying goodbye.
    pub(crate) const BYE: u32 = 1;
    /// The job-key handshake failed.
    pub(crate) const AUTH: u32 = 2;
    /// The peer sent a frame that failed validation.
    pub(crate) const BAD_FRAME: u32 = 3;
    /// The endpoint was dropped without closing.
    pub(crate) const DROPPED: u32 = 4;
}

/// What a connection's end means for the peer at its other end.
pub(super) fn conn_error(peer: Rank, e: &ConnectionError) -> TransportError {
    match e {
        ConnectionError::ApplicationClosed(c) if c.error_code == VarInt::from_u32(close::BYE) => {
            TransportError::PeerClosed(peer)
        }
        ConnectionError::ApplicationClosed(c) if c.error_code == VarInt::from_u32(close::AUTH) => {
            let why = format!("{peer} refused the job-key authentication");
            TransportError::io(peer, io::Error::new(io::ErrorKind::PermissionDenied, why))
        }
        ConnectionError::ApplicationClosed(_)
        | ConnectionError::ConnectionClosed(_)
        | ConnectionError::Reset
        | ConnectionError::TimedOut => TransportError::PeerLost(peer),
        ConnectionError::LocallyClosed => TransportError::Closed,
        ConnectionError::VersionMismatch | ConnectionError::TransportError(_) | ConnectionError::CidsExhausted => {
            TransportError::io(peer, io::Error::other(format!("QUIC connection failed: {e}")))
        }
    }
}

/// A failed stream read.
pub(super) fn read_error(peer: Rank, e: ReadError) -> TransportError {
    match e {
        ReadError::ConnectionLost(c) => conn_error(peer, &c),
        other => TransportError::io(peer, io::Error::other(format!("QUIC stream: {other}"))),
    }
}

/// A failed stream write.
pub(super) fn write_error(peer: Rank, e: WriteError) -> TransportError {
    match e {
        WriteError::ConnectionLost(c) => conn_error(peer, &c),
        WriteError::Stopped(_) => TransportError::PeerLost(peer),
        other => TransportError::io(peer, io::Error::other(format!("QUIC stream: {other}"))),
    }
}

fn ended_early(peer: Rank) -> TransportError {
    TransportError::io(peer, io::Error::new(io::ErrorKind::UnexpectedEof, "QUIC stream ended inside a frame"))
}

/// A failed `read_exact`; `at_start`: no frame had begun.
fn exact_error(peer: Rank, e: ReadExactError, at_start: bool) -> TransportError {
    match e {
        // The stream ended between frames without a goodbye: the peer's writer is gone.
        ReadExactError::FinishedEarly(0) if at_start => TransportError::PeerLost(peer),
        ReadExactError::FinishedEarly(_) => ended_early(peer),
        ReadExactError::ReadError(e) => read_error(peer, e),
    }
}

/// Reads one frame header and validates it before anything else is read.
pub(super) async fn read_header(recv: &mut RecvStream, limits: FrameLimits) -> Result<FrameHeader, TransportError> {
    let peer = limits.peer;
    let mut raw = [0u8; HEADER_LEN];
    recv.read_exact(&mut raw).await.map_err(|e| exact_error(peer, e, true))?;
    FrameHeader::decode(&raw, limits).map_err(|source| TransportError::Frame { peer, source })
}

/// Reads a payload whose header was validated straight into `into` (of its length).
pub(super) async fn read_payload_into(
    recv: &mut RecvStream,
    peer: Rank,
    into: &mut [u8],
) -> Result<(), TransportError> {
    recv.read_exact(into).await.map_err(|e| exact_error(peer, e, false))
}

/// Reads a payload of `len` bytes whose header was validated. A payload that arrives in
/// one piece is returned as quinn's own buffer, without a copy.
pub(super) async fn read_payload(recv: &mut RecvStream, peer: Rank, len: u64) -> Result<Bytes, TransportError> {
    let (first, rest) = read_pieces(recv, peer, len).await?;
    if rest.is_empty() {
        return Ok(first);
    }
    let mut whole = BytesMut::with_capacity(first.len() + rest.iter().map(Bytes::len).sum::<usize>());
    whole.extend_from_slice(&first);
    rest.iter().for_each(|piece| whole.extend_from_slice(piece));
    Ok(whole.freeze())
}

/// The shortest piece [`read_pieces`] expects after the first (about a datagram).
const MIN_PIECE: usize = 1200;
/// The most pieces [`read_pieces`] reserves room for at once.
const MAX_RESERVED: usize = 4096;

/// Reads a payload of `len` bytes whose header was validated, as quinn's own buffers
/// (no copy): the first piece and the others in order.
pub(super) async fn read_pieces(
    recv: &mut RecvStream,
    peer: Rank,
    len: u64,
) -> Result<(Bytes, Vec<Bytes>), TransportError> {
    let len = usize::try_from(len).map_err(|_| TransportError::Frame {
        peer,
        source: FrameError::Malformed("payload larger than the address space"),
    })?;
    let mut first = Bytes::new();
    let mut rest = Vec::new();
    let mut got = 0;
    while got < len {
        let chunk = recv.read_chunk(len - got, true).await.map_err(|e| read_error(peer, e))?;
        let bytes = chunk.ok_or_else(|| ended_early(peer))?.bytes;
        got += bytes.len();
        if first.is_empty() {
            // The other pieces are likely about as long as the first, which may be short
            // (what was left of a datagram after the header): a bounded guess.
            rest.reserve((len - got).div_ceil(bytes.len().max(MIN_PIECE)).min(MAX_RESERVED));
            first = bytes;
        } else {
            rest.push(bytes);
        }
    }
    Ok((first, rest))
}
