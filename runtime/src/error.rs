//! Errors of the runtime API.

use ductile_transport::TransportError;

/// Errors of ductile calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A transport failure (I/O, timeout naming the peer, peer gone, ...).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A transport failure about a peer, with where that peer is: the transport names
    /// endpoints, which are not the group's ranks once the job has changed size or the
    /// group was built from a process set.
    #[error("{error} ({whereabouts})")]
    Peer {
        /// The transport's error.
        #[source]
        error: TransportError,
        /// The peer's rank in the group that saw the error, and its node: `on node 1`,
        /// or `rank 5 is rank 2 of this group, on node 1`.
        whereabouts: String,
    },
    /// Joining the job failed.
    #[error("bootstrap failed: {0}")]
    Bootstrap(String),
    /// A group rank outside the group.
    #[error("rank {rank} is not in this group of {size}")]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The group's size.
        size: usize,
    },
    /// A tag outside the application's tag space.
    #[error("tag {0:#x} is reserved for the runtime (application tags are 0..=0x7fffffff)")]
    ReservedTag(u32),
    /// A payload that is not a whole number of elements of the expected type.
    #[error("a message of {len} bytes from rank {src} is not a whole number of {elem}-byte elements")]
    Misaligned {
        /// Payload length.
        len: usize,
        /// Element size.
        elem: usize,
        /// Sender (group rank).
        src: usize,
    },
    /// A message with an unexpected number of elements.
    #[error("{what}: expected {expected} elements from rank {src}, got {got}")]
    LengthMismatch {
        /// Which operation.
        what: &'static str,
        /// Expected element count.
        expected: usize,
        /// Received element count.
        got: usize,
        /// Sender (group rank).
        src: usize,
    },
    /// A value that did not decode.
    #[error("cannot decode a value from rank {src}: {source}")]
    Decode {
        /// Sender (group rank).
        src: usize,
        /// Why.
        #[source]
        source: postcard::Error,
    },
    /// A value that did not encode.
    #[error("cannot encode a value: {0}")]
    Encode(#[source] postcard::Error),
    /// A reconfiguration failed (the controller, a peer, or the ranks' registrations).
    #[error("reconfiguration failed: {0}")]
    Reconfigure(String),
    /// A child job could not be launched (see [`crate::Group::launch`]).
    #[error("launch failed: {0}")]
    Launch(#[from] crate::launch::LaunchError),
    /// A call with arguments that make no sense (documented per call).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A group of an earlier membership of the job: a checkpoint has since switched the
    /// job to another, or released this process. Groups do not follow the job; the
    /// current one is [`crate::Session::world`] (or a group built again from a process
    /// set of the current membership).
    #[error(
        "this group belongs to an earlier membership of the job, which a checkpoint ended; \
         take the current one from Session::world (or build the group again)"
    )]
    StaleGroup,
}

impl Error {
    /// Whether the error comes from the failure of another process of the job: it is
    /// gone, or the launcher said that processes failed and interrupted this one's
    /// waits. In a job run with `ductile run --on-failure shrink`, the application goes
    /// on by calling [`crate::Session::checkpoint`], which then returns
    /// [`crate::Checkpoint::Recovered`].
    #[must_use]
    pub fn is_failure(&self) -> bool {
        let t = match self {
            Error::Transport(t) | Error::Peer { error: t, .. } => t,
            _ => return false,
        };
        matches!(t, TransportError::Interrupted(_) | TransportError::PeerLost(_) | TransportError::Io { .. })
    }

    /// The process that said goodbye, if the error is that one did.
    pub(crate) fn closed_by(&self) -> Option<ductile_transport::Rank> {
        match self {
            Error::Transport(TransportError::PeerClosed(r))
            | Error::Peer { error: TransportError::PeerClosed(r), .. } => Some(*r),
            _ => None,
        }
    }
}

/// Result of ductile calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;
