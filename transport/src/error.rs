//! Errors of the transport layer.

use crate::ids::{Rank, Tag};
use std::time::Duration;

/// Why a frame header was rejected. Checked before anything is allocated.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    /// The first bytes are not a ductile frame.
    #[error("bad frame magic {0:#06x}")]
    BadMagic(u16),
    /// A protocol version this build does not speak.
    #[error("unsupported frame version {0}")]
    BadVersion(u8),
    /// A frame kind this build does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The length prefix is larger than the configured cap.
    #[error("frame payload of {len} bytes exceeds the cap of {cap} bytes")]
    TooLarge {
        /// Announced payload length.
        len: u64,
        /// Configured cap.
        cap: u64,
    },
    /// The frame claims a source other than the authenticated peer.
    #[error("frame claims source {claimed} on a connection authenticated as {peer}")]
    WrongSource {
        /// Source written in the frame.
        claimed: Rank,
        /// Rank proven in the handshake.
        peer: Rank,
    },
    /// A frame kind that must not carry a payload did, or reserved bits are set.
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
}

/// Why a connection's handshake failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthError {
    /// The peer did not speak the handshake protocol.
    #[error("not a ductile handshake (bad magic)")]
    BadMagic,
    /// The peer belongs to another job.
    #[error("peer is in job {0:016x}, not ours")]
    WrongJob(u64),
    /// The peer's proof of the job key did not verify.
    #[error("peer failed to prove the job key")]
    BadProof,
    /// The peer claimed a rank that is not in the job.
    #[error("peer claims {0}, which is not a member")]
    UnknownRank(Rank),
    /// We reached a peer other than the one we dialed.
    #[error("dialed {expected} but reached {found}")]
    WrongPeer {
        /// Rank we meant to reach.
        expected: Rank,
        /// Rank that answered.
        found: Rank,
    },
}

/// Errors of sends, receives and connections.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// An I/O error on the connection with a peer.
    #[error("I/O error with {peer}: {source}")]
    Io {
        /// The peer.
        peer: Rank,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Binding the local endpoint failed.
    #[error("cannot bind the {transport} endpoint on {addr}: {source}")]
    Bind {
        /// Transport name.
        transport: &'static str,
        /// Address tried.
        addr: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// No address is known for this rank.
    #[error("no address is known for {0}")]
    UnknownPeer(Rank),
    /// A peer's address could not be parsed.
    #[error("{transport}: bad address {addr:?} for {peer}")]
    BadAddress {
        /// Transport name.
        transport: &'static str,
        /// The peer.
        peer: Rank,
        /// The text that failed to parse.
        addr: String,
    },
    /// The handshake with a peer failed.
    #[error("authentication with {peer} failed: {source}")]
    Auth {
        /// The peer.
        peer: Rank,
        /// Why.
        #[source]
        source: AuthError,
    },
    /// A peer sent a bad frame; the connection was closed.
    #[error("bad frame from {peer}: {source}")]
    Frame {
        /// The peer.
        peer: Rank,
        /// Why.
        #[source]
        source: FrameError,
    },
    /// A wait ran out of time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What we were waiting for, naming the peer.
        what: String,
        /// How long we waited.
        after: Duration,
    },
    /// The peer's connection ended without a goodbye (crash or network loss).
    #[error("{0} is gone: its connection ended without a goodbye")]
    PeerLost(Rank),
    /// The peer closed its endpoint; it will send nothing more.
    #[error("{0} has closed its endpoint")]
    PeerClosed(Rank),
    /// A message of another size than the receive into a part waited for; the
    /// message is consumed.
    #[error("{peer} sent {got} bytes to a receive of {expected} bytes")]
    SizeMismatch {
        /// The sender.
        peer: Rank,
        /// The receive's size.
        expected: u64,
        /// The message's size.
        got: u64,
    },
    /// A message larger than the frame cap.
    #[error("message of {len} bytes to {peer} exceeds the frame cap of {cap} bytes")]
    MessageTooLarge {
        /// The destination.
        peer: Rank,
        /// Message length.
        len: usize,
        /// Configured cap.
        cap: u64,
    },
    /// The tag is outside the application's tag space.
    #[error("{0} is reserved for the runtime")]
    ReservedTag(Tag),
    /// The operation is not offered by this backend.
    #[error("{transport} does not support {what}")]
    Unsupported {
        /// Transport name.
        transport: &'static str,
        /// The missing capability.
        what: &'static str,
    },
    /// A one-sided read failed at or because of the window's owner (unknown window,
    /// range outside it, or a malformed reply).
    #[error("get from {peer} failed: {what}")]
    Window {
        /// The window's owner.
        peer: Rank,
        /// Why.
        what: String,
    },
    /// This endpoint was closed.
    #[error("the endpoint is closed")]
    Closed,
    /// The receive was interrupted: processes of the job failed, and the job recovers
    /// from it at the next checkpoint (see `Mailbox::interrupt`).
    #[error("interrupted: {0}")]
    Interrupted(String),
}

impl TransportError {
    /// Wraps an I/O error with the peer it happened with.
    #[must_use]
    pub fn io(peer: Rank, source: std::io::Error) -> Self {
        Self::Io { peer, source }
    }

    /// The peer this error is about, if it names one.
    #[must_use]
    pub fn peer(&self) -> Option<Rank> {
        match self {
            Self::Io { peer, .. }
            | Self::BadAddress { peer, .. }
            | Self::Auth { peer, .. }
            | Self::Frame { peer, .. }
            | Self::SizeMismatch { peer, .. }
            | Self::MessageTooLarge { peer, .. }
            | Self::Window { peer, .. } => Some(*peer),
            Self::UnknownPeer(peer) | Self::PeerLost(peer) | Self::PeerClosed(peer) => Some(*peer),
            _ => None,
        }
    }
}
