//! What `--dry-run` prints: the node map, and for a `steps:` policy (or `fixed` with a
//! preferred count above the start) every planned change (who starts which node world
//! in which step, which nodes a shrink releases), computed with the same policy state
//! machine and pure planners the controller uses.

use crate::controller::JobSpec;
use crate::membership::JobState;
use crate::plan::resize::{plan_resize, Resize, Target};
use crate::plan::spawn::plan_expansion;
use crate::policy::{self, PolicySpec};
use crate::proto::{NodeStarted, RankStarted, Token};
use ductile_transport::{EndpointAddr, NodeId};
use std::fmt::Write as _;

/// The node map and the planned changes.
#[must_use]
pub fn preview(spec: &JobSpec) -> String {
    let host = |i: usize| spec.hosts.as_ref().and_then(|h| h.names.get(i)).map(|h| format!(" ({h})"));
    let mut s = format!(
        "{} ranks on {} {} (pool of {}); program {}\n",
        spec.layout.size(),
        spec.layout.nodes.len(),
        match (spec.hosts.is_some(), spec.layout.nodes.len() == 1) {
            (true, true) => "host",
            (true, false) => "hosts",
            (false, true) => "simulated node",
            (false, false) => "simulated nodes",
        },
        spec.slots.len(),
        spec.program.display()
    );
    for n in &spec.layout.nodes {
        let last = n.ranks.end.saturating_sub(1);
        let on = host(n.node.0 as usize).unwrap_or_default();
        let _ = writeln!(s, "  {}{on}: {} slots, ranks {}..={}", n.node, n.slots, n.ranks.start, last);
    }
    if let Some(pool) = spec.hosts.as_ref().filter(|_| spec.slots.len() > spec.layout.nodes.len()) {
        let rest = &pool.names[spec.layout.nodes.len()..spec.slots.len().min(pool.names.len())];
        let _ = writeln!(s, "  hosts the job may grow onto: {}", rest.join(", "));
    }
    // The change points a schedule that ends can use.
    let points = match &spec.policy {
        PolicySpec::Steps(steps) => steps.len() as u64,
        PolicySpec::Fixed => 1,
        _ => return s,
    };
    let nodes: Vec<NodeId> = spec.layout.nodes.iter().flat_map(|n| n.ranks.clone().map(move |_| n.node)).collect();
    let addrs = vec![EndpointAddr(String::new()); nodes.len()];
    let mut state = JobState::initial(nodes, addrs, spec.slots.clone());
    let mut rm = policy::build(&spec.policy, spec.period, spec.bounds);
    for cp in (1..=points).map(|k| k * spec.period.max(1)) {
        let Some(t) = rm.decide(cp, state.node_count()) else {
            if matches!(spec.policy, PolicySpec::Steps(_)) {
                let _ = writeln!(s, "checkpoint {cp}: {} nodes: no change", state.node_count());
            }
            continue;
        };
        let _ = write!(s, "checkpoint {cp}: {} -> {t} nodes: ", state.node_count());
        match plan_resize(&state.allocation(), Target::Nodes(t), &spec.bounds) {
            Err(e) => {
                let _ = writeln!(s, "refused ({e})");
            }
            Ok(Resize::Same) => s.push_str("no change\n"),
            Ok(Resize::Shrink(p)) => {
                let released: Vec<u32> = p.released_nodes.iter().map(|&n| n as u32).collect();
                let _ = writeln!(
                    s,
                    "shrink, release nodes {released:?}, {} processes exit, new rank 0 is old rank {}",
                    p.exiting.len(),
                    p.new_root
                );
                state = state.after_shrink(&p).1;
            }
            Ok(Resize::Grow { running, target }) => {
                let plan = match plan_expansion(spec.method, spec.strategy, &running, &target) {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = writeln!(s, "refused ({e})");
                        continue;
                    }
                };
                let _ = writeln!(s, "grow, {} steps", plan.step_count());
                for a in &plan.actions {
                    let _ = writeln!(
                        s,
                        "  step {}: spawner {} starts node {} ({} processes)",
                        a.step, a.spawner, a.node, a.procs
                    );
                }
                let tokens = vec![Token([0; 32]); plan.actions.len()];
                let orders = state.grow_orders(&plan, &tokens);
                let started: Vec<NodeStarted> = orders
                    .group_ids
                    .iter()
                    .zip(&orders.group_nodes)
                    .map(|(ids, n)| NodeStarted {
                        node: *n,
                        agent_pid: 0,
                        ranks: ids
                            .iter()
                            .map(|id| RankStarted { id: *id, pid: 0, addr: EndpointAddr(String::new()) })
                            .collect(),
                    })
                    .collect();
                match state.after_growth(&plan, &orders, &started) {
                    Ok((_, next)) => state = next,
                    Err(e) => {
                        let _ = writeln!(s, "  cannot follow the plan: {e}");
                        return s;
                    }
                }
            }
        }
    }
    s
}
