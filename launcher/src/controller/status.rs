//! What the controller says about the job: `ductile status` and the JSON report.

use super::{Ctl, Ending, Event};
use crate::report::{NodeReport, Report};
use std::time::Instant;
use tokio::sync::mpsc;

impl Ctl {
    /// Takes in the agents whose remote shells started, or which got their handoff, as
    /// the job ended, so that they are told to abort and reaped like the others.
    pub(super) fn late_agents(&mut self, events: &mut mpsc::UnboundedReceiver<Event>) {
        while let Ok(ev) = events.try_recv() {
            match ev {
                Event::ShellStarted(a, child) => {
                    self.agents[a].pid = child.id().unwrap_or(0);
                    self.agents[a].child = Some(child);
                }
                Event::HandedOff(a, Ok((rx, tx, pid))) => {
                    self.agents[a].reader = Some(super::watch(&self.events, a, rx));
                    self.agents[a].tx = Some(tx);
                    self.agents[a].host_pid = Some(pid);
                }
                _ => {}
            }
        }
    }

    /// What `ductile status` prints: the job's size, its changes, and where every rank
    /// runs now.
    pub(super) fn status(&self) -> String {
        let ranks = &self.state.ranks;
        let count = |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let mut s = format!(
            "job {}: {}, {} on {}, epoch {}, {} done",
            self.job,
            self.spec.program.display(),
            count(ranks.len(), "process", "processes"),
            count(self.state.node_count() as usize, "node", "nodes"),
            self.state.epoch,
            count(self.done.len(), "change", "changes")
        );
        if self.flight.is_some() {
            s.push_str("; a change is under way");
        }
        if let Some(r) = self.recovery_status() {
            s.push_str("; ");
            s.push_str(&r);
        }
        if self.queued.is_some() {
            s.push_str("; a resize is queued");
        }
        for a in self.agents.iter().filter(|a| a.released_epoch.is_none() && !a.done && !a.abandoned) {
            let mut placed: Vec<(usize, u32)> = a
                .started
                .iter()
                .filter(|r| a.live.contains(&r.id))
                .filter_map(|r| Some((ranks.iter().position(|x| *x == r.id)?, r.pid)))
                .collect();
            placed.sort_unstable();
            // Live processes without a rank: leaving in a shrink, or joining in a growth.
            let unranked = a.started.iter().filter(|r| a.live.contains(&r.id) && !ranks.contains(&r.id));
            let leaving = unranked.clone().filter(|r| self.flight.as_ref().is_some_and(|f| f.is_leaving(r.id))).count();
            let joining = unranked.count() - leaving;
            let list = |f: &dyn Fn(&(usize, u32)) -> String| placed.iter().map(f).collect::<Vec<_>>().join(", ");
            let plural = if placed.len() == 1 { "" } else { "s" };
            let mut parts = Vec::new();
            if !placed.is_empty() {
                let (ranks, pids) = (list(&|p| p.0.to_string()), list(&|p| p.1.to_string()));
                parts.push(format!("rank{plural} {ranks} (pid{plural} {pids})"));
            }
            for (n, what) in [(joining, "joining"), (leaving, "leaving")] {
                if n > 0 {
                    parts.push(format!("{n} {what}"));
                }
            }
            if a.started.is_empty() {
                parts.push("starting".into());
            }
            let on = self.host_name(a.node).map(|h| format!(" on {h}")).unwrap_or_default();
            let pid = a.host_pid.unwrap_or(a.pid);
            s.push_str(&format!("\n  {}{on} (agent pid {pid}): {}", a.node, parts.join(", ")));
        }
        s.push('\n');
        s
    }

    pub(super) fn report(&self, code: i32, started: Instant) -> Report {
        Report {
            job: self.job.to_string(),
            control_socket: self.socket.display().to_string(),
            program: self.spec.program.display().to_string(),
            size: self.spec.layout.size(),
            final_size: self.state.ranks.len() as u32,
            exit_code: code,
            failure: self.ending.as_ref().map(Ending::describe),
            wall_ms: started.elapsed().as_secs_f64() * 1e3,
            nodes: self
                .agents
                .iter()
                .map(|a| NodeReport {
                    node: a.node.0,
                    host: self.host_name(a.node),
                    agent_pid: a.host_pid.unwrap_or(a.pid),
                    ranks: a.started.iter().map(|r| r.id.0).collect(),
                    pids: a.started.iter().map(|r| r.pid).collect(),
                    joined_epoch: a.joined_epoch,
                    released_epoch: a.released_epoch,
                })
                .collect(),
            reconfigurations: self.done.clone(),
            failed_growths: self.failed_growths.clone(),
        }
    }
}
