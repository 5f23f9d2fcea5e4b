//! Helpers shared by the workspace's examples, integration tests and benches.

pub mod bench;
pub mod paths;
pub mod plot;
