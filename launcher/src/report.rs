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
    /// Its host, for a job on `--hosts`/`--hostfile` (the ranks' pids are that host's).
    pub host: Option<String>,
    /// Its agent's pid (on its host).
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
    /// Old ranks that failed (`trigger: failure`, `--on-failure shrink`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<u32>,
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
    /// One line: what changed, where, and what it cost.
    #[must_use]
    pub fn summary(&self) -> String {
        let p = &self.phases_ms;
        let mut moved = Vec::new();
        if !self.added_nodes.is_empty() {
            moved.push(format!("{} {}", node_list(&self.added_nodes), verb(&self.added_nodes, "join")));
        }
        if !self.released_nodes.is_empty() {
            moved.push(format!("{} {}", node_list(&self.released_nodes), verb(&self.released_nodes, "leave")));
        }
        if !self.failed.is_empty() {
            let list: Vec<String> = self.failed.iter().map(u32::to_string).collect();
            let (s, verb) = if self.failed.len() == 1 { ("", "s") } else { ("s", "") };
            moved.insert(0, format!("rank{s} {} fail{verb}", list.join(", ")));
        }
        let mut how = self.kind.to_string();
        for m in moved {
            let _ = write!(how, "; {m}");
        }
        format!(
            "resize {}: {} -> {} nodes, {} -> {} processes ({how}) in {:.1} ms",
            self.seq, self.nodes_before, self.nodes_after, self.procs_before, self.procs_after, p.total
        )
    }

    /// The nodes that joined (`+1-3`) or left (`-4,6`), for the table.
    fn where_text(&self) -> String {
        let mut s = String::new();
        for (sign, nodes) in [('+', &self.added_nodes), ('-', &self.released_nodes)] {
            if !nodes.is_empty() {
                let _ = write!(s, "{}{sign}{}", if s.is_empty() { "" } else { " " }, ids(nodes));
            }
        }
        s
    }
}

/// `join` for several nodes, `joins` for one.
fn verb(nodes: &[u32], plural: &str) -> String {
    if nodes.len() == 1 {
        format!("{plural}s")
    } else {
        plural.to_string()
    }
}

/// `node 3` or `nodes 1-3, 5`.
fn node_list(nodes: &[u32]) -> String {
    format!("{} {}", if nodes.len() == 1 { "node" } else { "nodes" }, ids(nodes).replace(',', ", "))
}

/// Node ids with runs of consecutive ids shortened: `1-3,5`.
fn ids(nodes: &[u32]) -> String {
    let mut sorted = nodes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for n in sorted {
        match runs.last_mut() {
            Some((_, end)) if n == *end + 1 => *end = n,
            _ => runs.push((n, n)),
        }
    }
    let text: Vec<String> =
        runs.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
    text.join(",")
}

/// The reconfigurations as a text table.
#[must_use]
pub fn table(rs: &[Reconfiguration]) -> String {
    let mut s = String::from(
        " #  kind    trigger      nodes    procs     how                    decide   spawn  connect  redist  release    total (ms)  nodes joined (+) / left (-)\n",
    );
    for r in rs {
        let p = &r.phases_ms;
        let how = match (r.method, r.strategy) {
            (Some(m), Some(st)) => format!("{m}/{st}, {} st", r.spawn_steps),
            _ if !r.failed.is_empty() => {
                let list: Vec<String> = r.failed.iter().map(u32::to_string).collect();
                format!("failed: {}", list.join(","))
            }
            _ => "terminate".to_string(),
        };
        let row = format!(
            "{:>2}  {:<6}  {:<11} {:>3}->{:<3}  {:>3}->{:<4} {:<22} {:>6.1}  {:>6.1}  {:>7.1}  {:>6.1}  {:>7.1}  {:>7.1}       {}",
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
            p.total,
            r.where_text()
        );
        let _ = writeln!(s, "{}", row.trim_end());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(kind: &'static str, nodes: (u32, u32), added: &[u32], released: &[u32]) -> Reconfiguration {
        Reconfiguration {
            seq: 2,
            epoch: 2,
            kind,
            trigger: "policy",
            method: None,
            strategy: None,
            spawn_steps: 0,
            procs_before: nodes.0 * 2,
            procs_after: nodes.1 * 2,
            nodes_before: nodes.0,
            nodes_after: nodes.1,
            added_nodes: added.to_vec(),
            released_nodes: released.to_vec(),
            failed: Vec::new(),
            root_takeover: false,
            phases_ms: Phases { total: 4.25, ..Phases::default() },
        }
    }

    #[test]
    fn node_ids_are_sorted_and_runs_shortened() {
        assert_eq!(ids(&[]), "");
        assert_eq!(ids(&[3]), "3");
        assert_eq!(ids(&[7, 1, 2, 3, 5, 6, 2]), "1-3,5-7");
        assert_eq!(node_list(&[4]), "node 4");
        assert_eq!(node_list(&[4, 9, 5]), "nodes 4-5, 9");
    }

    #[test]
    fn a_summary_and_the_table_say_which_nodes_joined_and_left() {
        let grow = change("grow", (1, 4), &[1, 2, 3], &[]);
        assert_eq!(grow.summary(), "resize 2: 1 -> 4 nodes, 2 -> 8 processes (grow; nodes 1-3 join) in 4.2 ms");
        let shrink = change("shrink", (4, 2), &[], &[3, 2]);
        assert_eq!(shrink.summary(), "resize 2: 4 -> 2 nodes, 8 -> 4 processes (shrink; nodes 2-3 leave) in 4.2 ms");
        // A baseline growth starts new nodes and releases the old ones.
        let baseline = change("grow", (1, 2), &[1, 2], &[0]);
        assert!(baseline.summary().contains("(grow; nodes 1-2 join; node 0 leaves)"), "{}", baseline.summary());
        let within = change("shrink", (2, 2), &[], &[]);
        assert!(within.summary().contains("processes (shrink) in"), "{}", within.summary());
        let t = table(&[grow, shrink]);
        let rows: Vec<&str> = t.lines().collect();
        assert!(rows[0].ends_with("nodes joined (+) / left (-)"), "{t}");
        assert!(rows[1].ends_with(" +1-3") && rows[2].ends_with(" -2-3"), "{t}");
    }
}
