//! Helpers shared by the workspace's examples, integration tests and benches.

pub mod paths;
