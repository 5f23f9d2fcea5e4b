//! # ductile-transport
//!
//! The bottom layer of ductile: how ranks reach each other.
//!
//! - [`ids`]: the numbers (rank, tag, context, job id, node id) and the job key.
//! - [`frame`]: the wire frame of stream backends, validated before allocation.
//! - [`auth`]: the mutual HMAC-SHA256 challenge-response run on every connection.
//! - [`matching`]: the (context, source, tag) matching engine every backend delivers into.
//! - [`transport`]: the object-safe [`Transport`] trait, the backend registry
//!   ([`bind`]) and the [`Endpoint`] the runtime uses.
//! - [`window`]: memory exposed for one-sided reads (gets), shared by the backends.
//! - [`landing`]: the receiver's memory lent in parts, which gets and receives fill in
//!   place (no intermediate buffer, no copy on backends that read payloads themselves).
//! - [`tcp`]: the default backend on tokio; [`mem`]: an in-process backend for tests.
//!
//! Terms: a *rank* is a process's index in its job's endpoint table; a *context*
//! separates the traffic of different groups or epochs; a *tag* is chosen by the sender
//! and matched by the receiver, with the top half of the tag space kept for the runtime.

// Module docs link to private items too, for readers of `cargo doc
// --document-private-items`, where those links resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub mod auth;
pub mod config;
pub mod error;
#[cfg(feature = "fabric")]
pub mod fabric;
pub mod frame;
pub mod ids;
pub mod landing;
pub mod matching;
pub mod mem;
#[cfg(feature = "quic")]
pub mod quic;
pub mod shm_regions;
mod sys;
pub mod tcp;
pub mod transport;
pub mod window;

pub use config::TransportConfig;
pub use error::{AuthError, FrameError, TransportError};
pub use ids::{Context, JobId, JobKey, NodeId, Rank, Tag};
pub use landing::{populate, Landing, Part};
pub use matching::{Envelope, Landed, Mailbox, Pattern, PeerEnd, Posting, SrcMatch, TagMatch};
pub use transport::{
    bind, BoxFuture, Capabilities, Endpoint, EndpointAddr, PendingRecv, Received, Transport, TransportSetup,
};
pub use window::{WindowError, WindowId};
