//! The JSON report of `ductile run --report FILE.json`.

use serde::Serialize;
use std::path::Path;

/// One node of the job.
#[derive(Clone, Debug, Serialize)]
pub struct NodeReport {
    /// Node id.
    pub node: u32,
    /// Its agent's pid.
    pub agent_pid: u32,
    /// Ranks it ran.
    pub ranks: Vec<u32>,
    /// Their pids, in the same order.
    pub pids: Vec<u32>,
}

/// One reconfiguration (filled by resizes).
#[derive(Clone, Debug, Serialize)]
pub struct Reconfiguration {
    /// Processes before.
    pub procs_before: u32,
    /// Processes after.
    pub procs_after: u32,
}

/// The report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Job id.
    pub job: String,
    /// Program run.
    pub program: String,
    /// Ranks at start.
    pub size: u32,
    /// Exit code of `ductile run`.
    pub exit_code: i32,
    /// Why the job ended early, if it did.
    pub failure: Option<String>,
    /// Wall time, ms.
    pub wall_ms: f64,
    /// Node layout with pids.
    pub nodes: Vec<NodeReport>,
    /// Reconfigurations, in order.
    pub reconfigurations: Vec<Reconfiguration>,
}

impl Report {
    /// Writes the report as pretty JSON.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }
}
