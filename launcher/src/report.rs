//! The JSON report of `ductile run --report FILE.json`, and the table of
//! reconfigurations printed at the end of a job that changed size.

use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// One node world of the job (an agent and its ranks), over the job's life.
#[derive(Clone, Debug, Serialize)]
pub struct NodeReport {
    /// Node id.
    pub node: u32,
    /// Its agent's pid.
    pub agent_pid: u32,
    /// Endpoint ids of the ranks it ran.
    pub ranks: Vec<u32>,
    /// Their pids, in the same order.
    pub pids: Vec<u32>,
    /// Epoch in which it joined (0: at start).
    pub joined_epoch: u64,
    /// Epoch of the change that released it, if one did.
    pub released_epoch: Option<u64>,
}

/// Phase durations of one reconfiguration, ms.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Phases {
    /// From the checkpoint reaching the controller to the decision.
    pub decide: f64,
    /// Starting the new node worlds until every new process is bound (growth).
    pub spawn: f64,
    /// Installing the new membership in the ranks and handing over replicated state.
    pub connect: f64,
    /// Moving registered data (the slowest process); with `--background`, the part at
    /// the switch.
    pub redistribute: f64,
    /// With `--background`: moving the constant items while the application computed.
    pub background: f64,
    /// From the switch until every released process and agent is gone (shrink).
    pub release: f64,
    /// From the checkpoint reaching the controller to the end of the change.
    pub total: f64,
}

/// One reconfiguration.
#[derive(Clone, Debug, Serialize)]
pub struct Reconfiguration {
    /// Sequence number (1, 2, ...).
    pub seq: u32,
    /// The epoch it led to.
    pub epoch: u64,
    /// `grow` or `shrink`.
    pub kind: &'static str,
    /// What asked for it: `policy`, `resize` (the control socket) or `application`.
    pub trigger: &'static str,
    /// `merge` or `baseline` (growth).
    pub method: Option<&'static str>,
    /// `parallel` or `single` (growth).
    pub strategy: Option<&'static str>,
    /// Spawn steps (growth).
    pub spawn_steps: u32,
    /// Processes before.
    pub procs_before: u32,
    /// Processes after.
    pub procs_after: u32,
    /// Nodes before.
    pub nodes_before: u32,
    /// Nodes after.
    pub nodes_after: u32,
    /// Nodes that joined.
    pub added_nodes: Vec<u32>,
    /// Nodes released back to the pool.
    pub released_nodes: Vec<u32>,
    /// Whether rank 0 left and another process took over.
    pub root_takeover: bool,
    /// Phase durations.
    pub phases_ms: Phases,
}

/// The report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Job id.
    pub job: String,
    /// The job's control socket (for `ductile resize`).
    pub control_socket: String,
    /// Program run.
    pub program: String,
    /// Ranks at start.
    pub size: u32,
    /// Ranks at the end.
    pub final_size: u32,
    /// Exit code of `ductile run`.
    pub exit_code: i32,
    /// Why the job ended early, if it did.
    pub failure: Option<String>,
    /// Wall time, ms.
    pub wall_ms: f64,
    /// Node worlds with pids.
    pub nodes: Vec<NodeReport>,
    /// Reconfigurations, in order.
    pub reconfigurations: Vec<Reconfiguration>,
    /// Growths that failed before their switch (a new node world or process failed or
    /// did not come up), and why: the job went on without them.
    pub failed_growths: Vec<String>,
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

impl Reconfiguration {
    /// One line: what changed and what it cost.
    #[must_use]
    pub fn summary(&self) -> String {
        let p = &self.phases_ms;
        format!(
            "resize {}: {} -> {} nodes, {} -> {} processes ({}) in {:.1} ms",
            self.seq, self.nodes_before, self.nodes_after, self.procs_before, self.procs_after, self.kind, p.total
        )
    }
}

/// The reconfigurations as a text table.
#[must_use]
pub fn table(rs: &[Reconfiguration]) -> String {
    let mut s = String::from(
        " #  kind    trigger      nodes    procs     how                    decide   spawn  connect  redist  release    total (ms)\n",
    );
    for r in rs {
        let p = &r.phases_ms;
        let how = match (r.method, r.strategy) {
            (Some(m), Some(st)) => format!("{m}/{st}, {} st", r.spawn_steps),
            _ => "terminate".to_string(),
        };
        let _ = writeln!(
            s,
            "{:>2}  {:<6}  {:<11} {:>3}->{:<3}  {:>3}->{:<4} {:<22} {:>6.1}  {:>6.1}  {:>7.1}  {:>6.1}  {:>7.1}  {:>7.1}",
            r.seq,
            r.kind,
            r.trigger,
            r.nodes_before,
            r.nodes_after,
            r.procs_before,
            r.procs_after,
            how,
            p.decide,
            p.spawn,
            p.connect,
            p.redistribute,
            p.release,
            p.total
        );
    }
    s
}
