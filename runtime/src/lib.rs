//! # ductile
//!
//! What an application links to run as a malleable parallel program.
//!
//! A **job** is a set of processes started by the `ductile` launcher (or one process
//! started alone). Each process has a **rank**; the processes of one node and its agent
//! form a **node world**. A [`Group`] is an ordered set of ranks with a private
//! communication context; [`Session::world`] is the group of every process. Groups offer
//! point-to-point messages (plain-old-data slices, `bytes::Bytes`, serde values) and
//! collectives (barrier, broadcast, reduce, allreduce, gather, allgather, alltoallv).
//! Every operation is documented as `# Collective` (all members call it, in the same
//! order) or `# Local`.
//!
//! The blocking API is for SPMD code; [`AsyncGroup`] is the async core underneath, driven
//! by a progress thread that also serves the transport.
//!
//! ```no_run
//! fn main() -> Result<(), ductile::Error> {
//!     let session = ductile::init()?;
//!     let world = session.world();
//!     let sum = world.allreduce(&[world.rank() as u64], ductile::ReduceOp::Sum)?;
//!     println!("rank {} of {}: sum of ranks {}", world.rank(), world.size(), sum[0]);
//!     session.finalize()
//! }
//! ```

mod anon;
mod block;
mod blocking;
pub mod bootstrap;
mod collectives;
pub mod env;
mod error;
mod group;
mod launch;
mod pages;
mod pod;
pub mod pset;
mod redistribute;
mod reduce;
mod registry;
mod session;

pub use collectives::{PIPELINE_MIN, RING_MIN, SEGMENT};
pub use ductile_redistrib::block_range;
pub use ductile_transport::{JobId, Landing, NodeId, Part, WindowId};
pub use error::{Error, Result};
pub use group::{AsyncGroup, Group, Status};
pub use launch::{Launch, LaunchError, LaunchStatus, LAUNCHER_ENV, LAUNCH_TIMEOUT_EXIT, MAX_LAUNCH_SECS};
pub use pset::ProcessSet;
pub use redistribute::Method;
pub use reduce::{ReduceOp, Reducible};
pub use session::{init, Checkpoint, JobInfo, MoveHandle, Recovery, Resize, Session};
pub use {bytemuck, bytes};
